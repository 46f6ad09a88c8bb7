"""The programs experiment's data: one seed's test programs of each length, its validation programs and its training
programs, drawn apart and checked apart (:class:`SeedData`), as labelled rows built in memory
(:func:`program_data`: what ``fullband train``'s labelled recipe reads), and the refusals that keep a test or
validation program out of every arm's training rows (:func:`refuse_held_out`, on the rows themselves).

The streams are :func:`fullband.eval.program_tasks.split_rng`'s: ``test`` (and ``test-{n}`` for the other lengths),
``val``, ``train``, ``fresh`` (the FLOPs control's); drawn in that order, each excluding the keys drawn before it, so
seed S's ``train`` / ``val`` / ``test`` are exactly ``fullband data make-programs --val-rows M ... --seed S``'s
``train.jsonl`` / ``val.jsonl`` / ``test.jsonl``."""

from __future__ import annotations

import array
import hashlib
import json
import math
import os

import numpy as np
import torch

from ..data.labelled import LabelledData, LabelledRows, encode_row, labelled_tokenizer, row_key
from ..eval.program_tasks import (HIGH, LOW, MAX_REDRAWS, PUBLISHED_VARIABLES, VARIABLES, grammar_program,
                                  grammar_words, split_rng)
from ..utils.io import atomic_write_json, rewrite_jsonl

POSITIONS = 2048  # the backbones' position limit (the synthetic experiments' 256 would not hold 100 statements)


def program_tokenizer(num_vars: int, grammar: str = "published"):
    """The one vocabulary of every arm and corpus of a run (the specials, the variables, the operators, the values),
    fixed, not read from the rows: the fresh programs of the FLOPs control must not reorder it."""
    return labelled_tokenizer(grammar_words(grammar, num_vars))


def draw_programs(seed: int, split: str, count: int, num_vars: int, statements: int, exclude=frozenset(),
                  grammar: str = "published") -> list:
    """``count`` programs of the stream ``split`` (:func:`fullband.eval.program_tasks.split_rng`), a program whose key
    is in ``exclude`` drawn again."""
    rng, out = split_rng(seed, split), []
    for _ in range(count):
        for _ in range(MAX_REDRAWS):
            p = grammar_program(grammar, rng, num_vars, statements)
            if p.key() not in exclude:
                break
        else:
            raise ValueError(f"the test and validation programs cover (almost) every program of {statements} "
                             "statements: raise --statements or lower --test-rows / --val-rows")
        out.append(p)
    return out


class ProgramData(LabelledData):
    """Labelled rows built in memory from programs (one vocabulary: :func:`program_tokenizer`): training rows and
    the validation programs (the runs' periodic held-out loss); ``train_rows`` is what
    :func:`fullband.experiments.synthetic.arm_config` reads of a corpus (its shape: rows x ``info["seq_len"]``, the
    runs' ``--seq-len``), a tensor without storage."""

    @property
    def train_rows(self) -> torch.Tensor:
        return torch.empty(len(self.train), self.info["seq_len"], device="meta")


def _rows(programs: list, vocab: dict, what: str) -> tuple[LabelledRows, dict]:
    ids, labels, offsets = array.array("i"), array.array("i"), array.array("q", [0])
    longest = targets = 0
    for i, p in enumerate(programs):
        x, y = encode_row(p.inputs, p.targets, vocab, f"{what} {i}")
        ids.extend(x)
        labels.extend(y)
        offsets.append(offsets[-1] + len(x))
        longest, targets = max(longest, len(p.inputs)), targets + sum(t is not None for t in p.targets)
    rows = LabelledRows(*(np.frombuffer(a, t) for a, t in ((ids, np.int32), (labels, np.int32), (offsets, np.int64))))
    return rows, {"rows": len(programs), "ids": len(ids), "max_length": longest, "targets": targets}


def program_data(programs: list, tokenizer, what: str, seq_len: int = 0, val: list = ()) -> ProgramData:
    """The training rows of ``programs`` and the validation rows of ``val`` with their fingerprint (the vocabulary
    and every id and label of both: the identity of the data a run reads); ``seq_len``: the longest row's ids, or
    ``seq_len`` when that is more (the FLOPs control's programs take their baseline's, so that both count a step's
    tokens alike)."""
    vocab = tokenizer.get_vocab()
    train, tr = _rows(programs, vocab, what)
    held, va = _rows(list(val), vocab, "validation program")
    h = hashlib.sha256(json.dumps(sorted(vocab.items())).encode())
    for a in (train.ids, train.labels, train.offsets, held.ids, held.labels, held.offsets):
        h.update(a.tobytes())
    info = {"format": "fullband-programs", "source": what, "vocab_size": len(tokenizer),
            "seq_len": max(seq_len, tr["max_length"] + 2, va["max_length"] + 2), "splits": {"train": tr, "val": va}}
    return ProgramData(tokenizer, train, held, h.hexdigest(), info)


def row_keys(data: LabelledData) -> list[bytes]:
    """:func:`fullband.data.labelled.row_key` of every training row, read back from its ids (not from the programs
    it was built from)."""
    words = {i: w for w, i in data.tokenizer.get_vocab().items()}
    return [row_key([words[int(t)] for t in data.train.row(i)[0][1:-1]]) for i in range(len(data.train))]


def refuse_held_out(data: LabelledData, held_keys: set, what: str) -> int:
    """A one-line ``ValueError`` when a training row of ``data`` is a test or validation program (nothing is scored
    or chosen on programs an arm trained on); else the number of training rows checked."""
    keys = row_keys(data)
    n = sum(k in held_keys for k in keys)
    if n:
        raise ValueError(f"{what}: {n} of its {len(keys)} training programs are test or validation programs; the "
                         "experiment refuses to score programs an arm trained on")
    return len(keys)


def refuse_long(programs: list, what: str) -> None:
    """A one-line ``ValueError`` when a program's row (``<bos>`` + inputs + ``<eos>``) is past :data:`POSITIONS`."""
    longest = max(len(p.inputs) for p in programs) + 2
    if longest > POSITIONS:
        raise ValueError(f"{what}: a program is {longest} tokens (<bos> + inputs + <eos>), past the backbones' "
                         f"{POSITIONS} positions; use fewer statements")


class SeedData:
    """One seed's programs: the test programs of each length (drawn first), the validation programs (of the
    training length, none a test program), the training programs (none a test or validation program) and, on
    demand, the FLOPs control's fresh ones. Nothing is written until :meth:`write`."""

    def __init__(self, args, tokenizer):
        self.args, self.tokenizer = args, tokenizer
        self.tests, self.keys = {}, set()
        for n in args.test_lengths:
            split = "test" if n == args.statements else f"test-{n}"
            self.tests[n] = draw_programs(args.seed, split, args.test_rows, args.vars, n, grammar=args.grammar)
            refuse_long(self.tests[n], f"--test-statements {n}")
            self.keys |= {p.key() for p in self.tests[n]}
        self.val = draw_programs(args.seed, "val", args.val_rows, args.vars, args.statements, self.keys,
                                 args.grammar)
        val_keys = {p.key() for p in self.val}
        if val_keys & self.keys:
            raise ValueError("a validation program is a test program; the experiment refuses to choose on them")
        self.held = self.keys | val_keys  # what no arm may train on
        programs = draw_programs(args.seed, "train", args.rows, args.vars, args.statements, self.held, args.grammar)
        refuse_long(programs, f"--statements {args.statements}")
        self.train = program_data(programs, tokenizer, "training programs", val=self.val)
        self.checked = {id(self.train): refuse_held_out(self.train, self.held, "the training programs")}
        self._fresh = {}

    def fresh(self, a, steps: int) -> ProgramData:
        """The FLOPs control's fresh programs (stream ``fresh``, none a test or validation program), as many as make
        its ``steps`` steps read each one as often as baseline-L's ``--steps`` read baseline-L's ``--rows``; the
        same validation programs."""
        count = math.ceil(self.args.rows * steps / self.args.steps)
        if count not in self._fresh:  # one corpus per count (each LR of a search reads the same)
            programs = draw_programs(self.args.seed, "fresh", count, self.args.vars, self.args.statements,
                                     self.held, self.args.grammar)
            refuse_long(programs, "the fresh programs")
            data = program_data(programs, self.tokenizer, "fresh programs", self.train.info["seq_len"], self.val)
            self.checked[id(data)] = refuse_held_out(data, self.held, "the fresh programs")
            self._fresh[count] = data
        return self._fresh[count]

    def check(self, data: LabelledData, arm: str) -> int:
        """Before ``arm`` is scored: its training rows against every test and validation program (once per
        corpus)."""
        if id(data) not in self.checked:
            self.checked[id(data)] = refuse_held_out(data, self.held, arm)
        return self.checked[id(data)]

    def path(self, n: int | str) -> str:
        name = "val.jsonl" if n == "val" else "test.jsonl" if n == self.args.statements else f"test-{n}.jsonl"
        return os.path.join(self.args.out, "data", name)

    def write(self) -> None:
        """The test and validation programs as labelled jsonl (what ``fullband eval labelled RUN --data FILE``
        reads) and ``programs.json``: the settings, counts and the ``make-programs`` command of the training
        programs."""
        a = self.args
        for n, programs in self.tests.items():
            rewrite_jsonl(self.path(n), [p.row() for p in programs])
        rewrite_jsonl(self.path("val"), [p.row() for p in self.val])
        tr, va = self.train.info["splits"]["train"], self.train.info["splits"]["val"]
        atomic_write_json(os.path.join(a.out, "data", "programs.json"), {
            "grammar": a.grammar, "variables": list((PUBLISHED_VARIABLES if a.grammar == "published" else
                                                     VARIABLES)[:a.vars]), "values": [LOW, HIGH], "seed": a.seed,
            "train": {"rows": tr["rows"], "statements": a.statements, "targets": tr["targets"],
                      "max_length": tr["max_length"],
                      "command": f"fullband data make-programs --grammar {a.grammar} --vars {a.vars} --statements "
                                 f"{a.statements} --rows {a.rows} --val-rows {a.val_rows} --test-rows {a.test_rows} "
                                 f"--seed {a.seed} --out DIR (its train.jsonl and val.jsonl)"},
            "val": {"rows": va["rows"], "file": "val.jsonl", "targets": va["targets"], "max_length": va["max_length"]},
            "test": {str(n): {"rows": len(ps), "file": os.path.basename(self.path(n)),
                              "targets": sum(t is not None for p in ps for t in p.targets),
                              "max_length": max(len(p.inputs) for p in ps)} for n, ps in self.tests.items()}})
