"""Running-state tasks with a label at every position: the state experiment's data.

Owns the generators, their fixed word-level vocabulary, the row format and the dense labels of
``fullband experiment state``. Each task is a stream of T input tokens ``x_1..x_T``; the label at position i is a
function of the whole prefix ``x_1..x_i`` (a running state that one more step updates):

* ``s3`` / ``s5`` -- the word problem of the symmetric group S3 / S5: each ``x_i`` is a permutation (tokens
  ``g0..g5`` / ``p0..p119``, the elements of :func:`fullband.eval.depth_tasks.permutations_of` in that order); the
  label is the running product ``x_1 x_2 ... x_i`` (apply ``x_1`` first) as an element token of the same group. S5
  is not solvable, so no fixed-depth transformer computes it at every length;
* ``parity`` -- bits ``b0`` / ``b1``; the label is the parity of the prefix as ``b0`` / ``b1``;
* ``vars`` -- variable tracking (after the Feedback Transformer's algorithmic task): three variables ``x y z``
  start at 0; each step is one instruction token, ``x+`` (increment mod 5) or ``x=y`` (copy), over every
  variable; the label is the value the instruction wrote, ``v0..v4``. The state is all three values.

The input vocabularies are disjoint, so a row says which task it is. A row is ``<bos> x_1 .. x_T <eos>`` (length
``T + 2``); the logits at position i (the position of ``x_i``) predict label i, so in Hugging Face's shifted
convention ``labels[:, i + 1] = y_i`` (:func:`dense_labels`, computed from the tokens alone, -100 elsewhere). The
tokenizer (:func:`state_tokenizer`) is a ``tokenizers`` WordLevel model over the fixed vocabulary (nothing learned,
nothing downloaded). With ``K`` teacher-forced passes, pass k is exact at positions ``< k``, so ``K = T + 1``
passes give the exact recurrence on every labelled position (:func:`exact_passes`).
"""

from __future__ import annotations

import dataclasses
import random

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ..data.corpus import SPECIAL_TOKENS
from .depth_tasks import compose_two, permutations_of

TASKS = ("s3", "s5", "parity", "vars")
IGNORE = -100
VARIABLES = ("x", "y", "z")
MODULUS = 5
GROUPS = {"s3": ("g", 3), "s5": ("p", 5)}
CHANCE = {"s3": 1 / 6, "s5": 1 / 120, "parity": 1 / 2, "vars": 1 / MODULUS}


@dataclasses.dataclass(frozen=True)
class StateProblem:
    """One stream: ``inputs`` (``x_1..x_T``) and ``outputs`` (the running state after each, one word each)."""

    task: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def length(self) -> int:
        return len(self.inputs)


# ----------------------------------------------------------------------------------------------- generators


def group_problem(rng: random.Random, length: int, task: str = "s3") -> StateProblem:
    prefix, m = GROUPS[task]
    group = permutations_of(m)
    where = {g: i for i, g in enumerate(group)}
    idx = [rng.randrange(len(group)) for _ in range(length)]
    acc, outs = tuple(range(m)), []
    for i in idx:
        acc = compose_two(acc, group[i])
        outs.append(f"{prefix}{where[acc]}")
    return StateProblem(task, tuple(f"{prefix}{i}" for i in idx), tuple(outs))


def parity_problem(rng: random.Random, length: int) -> StateProblem:
    bits = [rng.randrange(2) for _ in range(length)]
    outs, p = [], 0
    for b in bits:
        p ^= b
        outs.append(f"b{p}")
    return StateProblem("parity", tuple(f"b{b}" for b in bits), tuple(outs))


def vars_instructions() -> list[str]:
    """Every instruction: increments first, then copies, in a fixed order."""
    return [f"{v}+" for v in VARIABLES] + [f"{a}={b}" for a in VARIABLES for b in VARIABLES if a != b]


def vars_problem(rng: random.Random, length: int) -> StateProblem:
    ops = vars_instructions()
    values = dict.fromkeys(VARIABLES, 0)
    words, outs = [], []
    for _ in range(length):
        op = rng.choice(ops)
        target = op[0]
        values[target] = (values[target] + 1) % MODULUS if op.endswith("+") else values[op[2]]
        words.append(op)
        outs.append(f"v{values[target]}")
    return StateProblem("vars", tuple(words), tuple(outs))


def state_problem(task: str, rng: random.Random, length: int) -> StateProblem:
    if task in GROUPS:
        return group_problem(rng, length, task)
    if task == "parity":
        return parity_problem(rng, length)
    if task == "vars":
        return vars_problem(rng, length)
    raise ValueError(f"unknown state task {task!r}: choose from {', '.join(TASKS)}")


MAX_REDRAWS = 10_000  # consecutive draws that all fell on held-out rows: the held-out rows cover (almost) the task


def make_state_problems(tasks, n: int, seed: int, length: int, exclude=frozenset()) -> list[StateProblem]:
    """``n`` streams of ``length`` inputs cycling over ``tasks``, seeded (test sets use other seeds). A stream whose
    :func:`problem_key` is in ``exclude`` (held-out rows) is redrawn, so none of the returned streams is one of them;
    a one-line error when the held-out rows leave (almost) no stream of a task to draw."""
    tasks = list(tasks)
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"unknown state task(s) {bad}: choose from {', '.join(TASKS)}")
    if length < 1:
        raise ValueError(f"the stream length must be >= 1, got {length}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        for _ in range(MAX_REDRAWS):
            p = state_problem(task, rng, length)
            if problem_key(p) not in exclude:
                break
        else:
            raise ValueError(f"the held-out rows cover (almost) every {task} stream of length {length}: raise "
                             "--length or lower --test-rows")
        out.append(p)
    return out


def problem_key(p: StateProblem) -> tuple:
    """What makes two streams the same row: the task and the inputs (the labels follow from them)."""
    return (p.task, p.inputs)


# ----------------------------------------------------------------------------------------------- vocabulary


def state_vocabulary() -> list[str]:
    """Every word any generator writes (specials first), in a fixed order."""
    words = list(SPECIAL_TOKENS.values())
    for prefix, m in GROUPS.values():
        words += [f"{prefix}{i}" for i in range(len(permutations_of(m)))]
    words += ["b0", "b1"] + vars_instructions() + [f"v{i}" for i in range(MODULUS)]
    return list(dict.fromkeys(words))


def state_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level ``PreTrainedTokenizerFast`` over :func:`state_vocabulary` (whitespace-split; no BOS added)."""
    vocab = {w: i for i, w in enumerate(state_vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["pad_token"]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 30, **SPECIAL_TOKENS)


def exact_passes(length: int) -> int:
    """K that makes the K-pass forward the exact recurrence on every labelled position of a row of ``length``
    inputs (``<bos>`` at 0, ``x_i`` at i: pass k is exact at positions < k)."""
    return length + 1


def encode_state_rows(tokenizer, problems: list[StateProblem]) -> torch.Tensor:
    """``[N, T + 2]`` rows ``<bos> x_1 .. x_T <eos>`` (every problem of one length)."""
    lengths = {p.length for p in problems}
    if len(lengths) != 1:
        raise ValueError(f"encode problems of one length at a time, got lengths {sorted(lengths)}")
    vocab = tokenizer.get_vocab()
    bos, eos = (vocab[SPECIAL_TOKENS[k]] for k in ("bos_token", "eos_token"))
    try:
        return torch.tensor([[bos] + [vocab[w] for w in p.inputs] + [eos] for p in problems], dtype=torch.long)
    except KeyError as err:
        raise ValueError(f"word {err} is not in the state vocabulary") from None


# ----------------------------------------------------------------------------------------------- labels


class LabelTable:
    """The state of every task as integers, read from token ids alone: what :func:`dense_labels` runs."""

    def __init__(self, tokenizer):
        vocab = tokenizer.get_vocab()
        self.size = max(vocab.values()) + 1
        self.groups = {}
        for task, (prefix, m) in GROUPS.items():
            group = permutations_of(m)
            ids = torch.tensor([vocab[f"{prefix}{i}"] for i in range(len(group))])
            table = torch.tensor([[group.index(compose_two(a, b)) for b in group] for a in group])
            self.groups[task] = (ids, table, group.index(tuple(range(m))))
        self.bits = torch.tensor([vocab["b0"], vocab["b1"]])
        self.ops = [(vocab[op], VARIABLES.index(op[0]), None if op.endswith("+") else VARIABLES.index(op[2]))
                    for op in vars_instructions()]
        self.values = torch.tensor([vocab[f"v{i}"] for i in range(MODULUS)])

    def _index(self, ids: torch.Tensor) -> torch.Tensor:
        """``[size]``: the element index of each token id of the stream (-1 elsewhere)."""
        out = torch.full((self.size,), -1, dtype=torch.long)
        out[ids] = torch.arange(len(ids))
        return out

    def labels(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.cpu()
        B, T = rows.shape
        out = torch.full_like(rows, IGNORE)
        for task, (ids, table, identity) in self.groups.items():
            elem = self._index(ids)[rows]
            acc = torch.full((B,), identity, dtype=torch.long)
            for i in range(1, T - 1):
                here = elem[:, i] >= 0
                acc = torch.where(here, table[acc, elem[:, i].clamp_min(0)], acc)
                out[:, i + 1] = torch.where(here, ids[acc], out[:, i + 1])
        bit = self._index(self.bits)[rows]
        par = torch.zeros(B, dtype=torch.long)
        for i in range(1, T - 1):
            here = bit[:, i] >= 0
            par = torch.where(here, par ^ bit[:, i].clamp_min(0), par)
            out[:, i + 1] = torch.where(here, self.bits[par], out[:, i + 1])
        values = torch.zeros(B, len(VARIABLES), dtype=torch.long)
        for i in range(1, T - 1):
            for op_id, target, source in self.ops:
                here = rows[:, i] == op_id
                if not bool(here.any()):
                    continue
                new = (values[:, target] + 1) % MODULUS if source is None else values[:, source]
                values[:, target] = torch.where(here, new, values[:, target])
                out[:, i + 1] = torch.where(here, self.values[values[:, target]], out[:, i + 1])
        return out


def dense_labels(rows: torch.Tensor, table: LabelTable) -> torch.Tensor:
    """Labels ``[B, T + 2]`` of rows ``<bos> x_1 .. x_T <eos>``: ``labels[:, i + 1]`` = the state after ``x_i``
    (Hugging Face's shifted convention: the logits at ``x_i``'s position predict it); -100 at positions 0 and 1."""
    return table.labels(rows).to(rows.device)


def predicted_states(logits: torch.Tensor, rows: torch.Tensor, table: LabelTable) -> torch.Tensor:
    """``[B, T]`` 1/0: whether the argmax at each input position ``x_1..x_T`` is its label."""
    labels = dense_labels(rows, table)[:, 2:]
    return (logits[:, 1:-1].argmax(-1) == labels).long()
