"""The state experiment's rows: the held-out test and validation rows, the training corpora (their positions and
length curriculum, both part of a run's data identity) and the recipe that labels them.

Owns what :mod:`fullband.experiments.state` trains and scores on: :class:`HeldOut` (each task's test rows at T, 2T and
4T and its validation rows at T, drawn first; training draws skip them and token rows are checked against them),
:func:`training_corpus` (fresh rows of the tasks of :mod:`fullband.eval.state_tasks`, none of them held out),
:class:`StateCorpus` (the rows, ``--random-positions``' range and ``--length-curriculum``), :func:`random_positions`
(Ruoss et al., 2023), :func:`curriculum_length` and :class:`StateRecipe` (the dense labels, cut to the curriculum's
length; the randomized position ids).
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from ..data.corpus import Corpus
from ..eval.state_tasks import IGNORE, LabelTable, dense_labels, encode_state_rows, make_state_problems, problem_key
from ..training.pretrain import PretrainRecipe, rows_fingerprint

MULTIPLES = (1, 2, 4)  # the test lengths, x T
CURRICULUM_START = 8  # --curriculum-start's default


@dataclasses.dataclass
class StateCorpus(Corpus):
    """The training rows, and how their positions are drawn (``position_range``: 0 = contiguous, else
    :func:`random_positions` in ``[0, position_range)``); both are the run's data identity (``fingerprint``: a run
    trained on other positions is not reused)."""

    position_range: int = 0
    curriculum: tuple = ()  # (start, fraction) of a length curriculum (:func:`curriculum_length`); () for none

    @property
    def fingerprint(self) -> str:
        rows = rows_fingerprint(self.train_rows, self.val_rows)
        if self.position_range:
            rows = hashlib.sha256(f"{rows} random positions {self.position_range}".encode()).hexdigest()
        if self.curriculum:
            rows = hashlib.sha256(f"{rows} length curriculum {tuple(self.curriculum)}".encode()).hexdigest()
        return rows


def curriculum_length(step: int, steps: int, length: int, curriculum: tuple = ()) -> int:
    """The inputs labelled at (0-based) ``step`` of ``steps`` under a length curriculum ``(start, fraction)``:
    ``start`` at step 0, growing linearly to ``length`` over the first ``fraction`` of the steps, ``length`` from
    then on (and without a curriculum)."""
    if not curriculum:
        return length
    start, fraction = curriculum
    ramp = fraction * steps
    if step >= ramp:
        return length
    return min(length, start + int((length - start + 1) * step / ramp))


def random_positions(batch: int, length: int, limit: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch, length]`` position ids: 0 first (BOS), then a sorted random subset of ``1 .. limit - 1`` per row (the
    randomized positional encodings of Ruoss et al., 2023). A constant offset per row would be no control: RoPE
    attends by relative distance, so the logits would not change (tests/test_state_evidence.py)."""
    rest = torch.rand(batch, limit - 1, generator=generator).argsort(1)[:, :length - 1].sort(1).values + 1
    return torch.cat([torch.zeros(batch, 1, dtype=torch.long), rest], 1)


class StateRecipe(PretrainRecipe):
    """Pre-training on running-state rows with a label at every input position (:func:`dense_labels`); with a
    corpus of randomized positions, each micro-batch's ``position_ids`` (seeded by the run's seed and the step); with
    a length curriculum, labels only at the first :func:`curriculum_length` inputs of each row."""

    def batch(self, step, num_passes, generator, env):
        sb = super().batch(step, num_passes, generator, env)
        table = getattr(self, "_table", None) or LabelTable(self.tokenizer)
        self._table = table
        limit = getattr(self.corpus, "position_range", 0)
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step) if limit else None
        curriculum = getattr(self.corpus, "curriculum", ())
        for mb in sb.micro:
            mb["labels"] = dense_labels(mb["input_ids"], table)
            if curriculum:  # labels[:, i + 1] is input i's: inputs past n unlabelled (a causal model: length-n rows)
                n = curriculum_length(step, self.cfg.steps, mb["input_ids"].shape[1] - 2, curriculum)
                mb["labels"][:, n + 2:] = IGNORE
            if limit:  # an explicit all-ones mask: gapped ids without one may be read as packed samples' starts
                ids = mb["input_ids"]
                mb["position_ids"] = random_positions(*ids.shape, limit, g).to(ids.device)
                mb["attention_mask"] = torch.ones_like(ids)
        return sb


class HeldOut:
    """The rows no arm may train on: every test row (each task at T, 2T, 4T) and the validation rows (each task at
    T, drawn apart from the test rows; the LR sweep chooses on them). ``keys`` (:func:`problem_key`) keep training
    draws off them; :meth:`refuse` checks token rows against them, independently of how the rows were drawn."""

    def __init__(self, test: dict, val: dict, keys: set):
        self.test, self.val, self.keys = test, val, keys
        self._rows = {tuple(r) for sets in (test, val) for rows in sets.values() for r in rows.tolist()}

    def overlap(self, rows: torch.Tensor, chunk: int = 65536) -> int:
        return sum(tuple(r) in self._rows for i in range(0, rows.shape[0], chunk) for r in rows[i:i + chunk].tolist())

    def refuse(self, rows: torch.Tensor, what: str) -> int:
        """A ``RuntimeError`` when a row of ``rows`` is a held-out row (nothing is scored on rows trained on); else
        the number of rows checked."""
        n = self.overlap(rows)
        if n:
            raise RuntimeError(f"{what}: {n} training rows are held-out (test or validation) rows; the experiment "
                               "refuses to score rows it trained on")
        return rows.shape[0]


def held_out(args, tokenizer) -> HeldOut:
    """The test rows ``{(task, length): rows}`` of each task at T, 2T and 4T (seeds other than training's) and the
    validation rows at T (other seeds, none of them a test row)."""
    test, val, keys = {}, {}, set()
    for j, task in enumerate(args.tasks_list):
        for m in MULTIPLES:
            probs = make_state_problems([task], args.test_rows, args.seed + 1_000_003 * (1 + m) + 101 * j,
                                        args.length * m)
            test[(task, args.length * m)] = encode_state_rows(tokenizer, probs)
            keys |= {problem_key(p) for p in probs}
    for j, task in enumerate(args.tasks_list):
        probs = make_state_problems([task], args.test_rows, args.seed + 7_000_003 + 101 * j, args.length,
                                    exclude=keys)
        val[(task, args.length)] = encode_state_rows(tokenizer, probs)
        keys |= {problem_key(p) for p in probs}
    return HeldOut(test, val, keys)


def position_range(args) -> int:
    """0 (contiguous positions) or, with ``--random-positions``, 4T + 2: the longest test row's positions."""
    return (MULTIPLES[-1] * args.length + 2) if args.random_positions else 0


def curriculum_of(args) -> tuple:
    """``(start, fraction)`` of ``--length-curriculum`` (``()`` without one)."""
    fraction = getattr(args, "length_curriculum", None)
    return () if fraction is None else (getattr(args, "curriculum_start", CURRICULUM_START), fraction)


def training_corpus(args, tokenizer, steps: int, seed: int, held: HeldOut) -> StateCorpus:
    """``steps`` batches of fresh training rows, none of them a held-out row (drawn apart, then checked), with the
    run's positions and length curriculum."""
    rows = encode_state_rows(tokenizer, make_state_problems(args.tasks_list, steps * args.batch_size, seed,
                                                            args.length, exclude=held.keys))
    held.refuse(rows, "the training rows")
    return StateCorpus(tokenizer, rows, torch.empty(0, rows.shape[1], dtype=torch.long), ["state-train"], [],
                       position_range=position_range(args), curriculum=curriculum_of(args))
