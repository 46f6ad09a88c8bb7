"""The Feedback Transformer's algorithmic task: programs over a few variables, scored on the values they print.

Owns the seeded program generator, its token layout and targets, and the writer of its labelled jsonl files
(``fullband data make-programs``: ``DIR/train.jsonl`` / ``DIR/test.jsonl`` in :mod:`fullband.data.labelled`'s row
format, ``DIR/programs.json`` with the settings and counts), after the task of Fan et al. (2020), *Addressing some
limitations of transformers with feedback memory*, implemented from its description:

* variables: the first V of ``x y z u v`` (V = 3 or 5 in the paper), values ``1`` .. ``10`` (one word each);
* a program of N statements opens with one assignment per variable in order (``x = 7 ; y = 2 ; z = 10 ;``, each
  value uniform in 1..10), so every variable has a value before it is read; the last statement is always a
  ``print`` (every row has a target); each statement between is a ``print`` with probability ``print_fraction``,
  else one of the four others with equal probability:

  - assignment ``x = 5 ;``;
  - increment / decrement ``x ++ ;`` / ``x -- ;``, wrapping within 1..10: ``10 ++`` is ``1``, ``1 --`` is ``10``
    (:func:`wrap`);
  - conditional ``if x == 4 : y ++ ;``: the condition compares one variable with a value, the body is one
    assignment / increment / decrement (equal probability) of any variable; the value compared is the
    variable's current value with probability ``if_true`` (so the branch is taken about that often), else uniform
    over the nine others;
  - ``print x 4 ;``: the printed value is the input after the variable. The target is that value, at the
    position of the variable after ``print`` (the model at input t predicts target t, so it predicts the value
    just before reading it, and teacher forcing then feeds it the true value); ``_`` everywhere else.

Every choice is drawn from ``random.Random`` seeded by a string of the seed and the split (:func:`split_rng`):
the same seed gives the same files on every machine, and the training rows do not depend on the test rows' count.
Held-out programs never occur in training: the test rows are drawn first and a training program whose
:func:`fullband.data.labelled.row_key` (of its whole input) is one of theirs is drawn again -- the key ``fullband
eval labelled`` checks. The rows are streamed to disk (memory holds the test keys, not the rows) and both files
appear at once, or neither (temporary files renamed at the end).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import tempfile

from ..data.labelled import NO_TARGET, row_key

VARIABLES = ("x", "y", "z", "u", "v")
LOW, HIGH = 1, 10
VALUES = tuple(str(v) for v in range(LOW, HIGH + 1))
BODY_KINDS = ("assign", "inc", "dec")
KINDS = ("assign", "inc", "dec", "if", "print")
FILES = ("train.jsonl", "test.jsonl")
SETTINGS = "programs.json"
MAX_REDRAWS = 10_000  # consecutive training draws that all fell on held-out programs: the task is (almost) covered


def wrap(value: int) -> int:
    """``value`` wrapped into 1..10 (``11`` -> ``1``, ``0`` -> ``10``): what ``++`` / ``--`` write."""
    return (value - LOW) % (HIGH - LOW + 1) + LOW


@dataclasses.dataclass(frozen=True)
class Program:
    """One program's input words and its targets (``None`` where there is none; one per input word)."""

    inputs: tuple[str, ...]
    targets: tuple[str | None, ...]

    def row(self) -> dict:
        """The row in :mod:`fullband.data.labelled`'s format (whitespace-separated strings, ``_`` = no target)."""
        return {"input": " ".join(self.inputs), "target": " ".join(NO_TARGET if t is None else t for t in self.targets)}

    def key(self) -> bytes:
        return row_key(self.inputs)


def check_options(num_vars: int, statements: int, print_fraction: float = 0.2, if_true: float = 0.5) -> None:
    """One-line ``ValueError``s naming the flag to fix."""
    if not 1 <= num_vars <= len(VARIABLES):
        raise ValueError(f"--vars must be in 1..{len(VARIABLES)} (variables {' '.join(VARIABLES)}), got {num_vars}")
    if statements < num_vars + 1:
        raise ValueError(f"--statements must be at least --vars + 1 = {num_vars + 1} (one assignment per variable, "
                         f"then at least one print), got {statements}")
    if not 0.0 < print_fraction <= 1.0:
        raise ValueError(f"--print-fraction must be in (0, 1], got {print_fraction}")
    if not 0.0 <= if_true <= 1.0:
        raise ValueError(f"--if-true must be in [0, 1], got {if_true}")


def _simple(rng: random.Random, kind: str, names, values: dict, apply: bool = True) -> list[str]:
    """The words of an assignment / increment / decrement of a random variable; applied to ``values`` if
    ``apply``."""
    var = rng.choice(names)
    if kind == "assign":
        new = rng.randint(LOW, HIGH)
        words = [var, "=", str(new)]
    else:
        new, words = wrap(values[var] + (1 if kind == "inc" else -1)), [var, "++" if kind == "inc" else "--"]
    if apply:
        values[var] = new
    return words


def make_program(rng: random.Random, num_vars: int, statements: int, print_fraction: float = 0.2,
                 if_true: float = 0.5) -> Program:
    """One program of ``statements`` statements over the first ``num_vars`` variables (the module docstring)."""
    check_options(num_vars, statements, print_fraction, if_true)
    names = VARIABLES[:num_vars]
    values: dict[str, int] = {}
    inputs: list[str] = []
    targets: list[str | None] = []

    def emit(words, target_at=None, target=None):
        for i, w in enumerate(words):
            inputs.append(w)
            targets.append(target if i == target_at else None)
        inputs.append(";")
        targets.append(None)

    for var in names:
        value = rng.randint(LOW, HIGH)
        values[var] = value
        emit([var, "=", str(value)])
    for s in range(num_vars, statements):
        last = s == statements - 1
        kind = "print" if last or rng.random() < print_fraction else rng.choice(KINDS[:4])
        if kind == "print":
            var = rng.choice(names)
            emit(["print", var, str(values[var])], target_at=1, target=str(values[var]))
        elif kind == "if":
            cond = rng.choice(names)
            if rng.random() < if_true:
                k = values[cond]
            else:
                k = rng.choice([v for v in range(LOW, HIGH + 1) if v != values[cond]])
            taken = values[cond] == k
            body = _simple(rng, rng.choice(BODY_KINDS), names, values, apply=taken)
            emit(["if", cond, "==", str(k), ":", *body])
        else:
            emit(_simple(rng, kind, names, values))
    return Program(tuple(inputs), tuple(targets))


def split_rng(seed: int, split: str) -> random.Random:
    """The generator of one split's rows (a string seed: the same stream on every machine and Python run)."""
    return random.Random(f"fullband-programs:{seed}:{split}")


def _write_rows(f, programs) -> tuple[int, int, int, set]:
    """Stream ``programs`` as jsonl rows to ``f``: ``(rows, targets, longest input, words used)``."""
    n = n_targets = longest = 0
    words: set[str] = set()
    for p in programs:
        f.write(json.dumps(p.row()) + "\n")
        n += 1
        n_targets += sum(t is not None for t in p.targets)
        longest = max(longest, len(p.inputs))
        words.update(p.inputs)
    return n, n_targets, longest, words


@contextlib.contextmanager
def _files_at_once(out: str, names, overwrite: bool):
    """``with _files_at_once(DIR, names, overwrite) as paths:`` write ``paths[name]`` (temporary files in DIR); on
    success every file is renamed into place, on an exception none is (and a DIR made here is removed)."""
    exists = [n for n in names if os.path.lexists(os.path.join(out, n))]
    if exists and not overwrite:
        raise ValueError(f"--out {out!r} already holds {', '.join(exists)}; pass --overwrite to replace them, or "
                         "choose another --out")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} is a file, not a directory")
    made = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".make-programs.", suffix=".tmp", dir=out)
    try:
        yield {n: os.path.join(tmp, n) for n in names}
        for n in names:
            with open(os.path.join(tmp, n), "rb") as f:
                os.fsync(f.fileno())
        for n in names:
            os.replace(os.path.join(tmp, n), os.path.join(out, n))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made:
            shutil.rmtree(out, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)


def write_program_files(out: str, num_vars: int, statements: int, rows: int, test_rows: int, seed: int = 0,
                        test_statements: int | None = None, print_fraction: float = 0.2, if_true: float = 0.5,
                        overwrite: bool = False) -> dict:
    """Write ``out/train.jsonl`` (``rows`` programs of ``statements``), ``out/test.jsonl`` (``test_rows`` programs
    of ``test_statements``, default ``statements``; none of them a training program) and ``out/programs.json``;
    returns the settings and counts written to the latter."""
    test_statements = statements if test_statements is None else test_statements
    check_options(num_vars, statements, print_fraction, if_true)
    if test_statements < num_vars + 1:
        raise ValueError(f"--test-statements must be at least --vars + 1 = {num_vars + 1}, got {test_statements}")
    if rows < 1 or test_rows < 1:
        raise ValueError(f"--rows and --test-rows must be >= 1, got {rows} and {test_rows}")
    options = (print_fraction, if_true)

    def test_programs():
        rng = split_rng(seed, "test")
        for _ in range(test_rows):
            p = make_program(rng, num_vars, test_statements, *options)
            held_out.add(p.key())
            yield p

    def train_programs():
        rng = split_rng(seed, "train")
        for _ in range(rows):
            for _ in range(MAX_REDRAWS):
                p = make_program(rng, num_vars, statements, *options)
                if p.key() not in held_out:
                    break
            else:
                raise ValueError(f"the {test_rows} test programs cover (almost) every program of {statements} "
                                 "statements: raise --statements or lower --test-rows")
            assert p.key() not in held_out
            yield p

    held_out: set[bytes] = set()
    with _files_at_once(out, (*FILES, SETTINGS), overwrite) as paths:
        with open(paths["test.jsonl"], "w", encoding="utf-8") as f:
            test = _write_rows(f, test_programs())
        with open(paths["train.jsonl"], "w", encoding="utf-8") as f:
            train = _write_rows(f, train_programs())
        unknown = sorted(test[3] - train[3])
        if unknown:
            raise ValueError(f"the test programs use word(s) {' '.join(unknown)} that no training program has (the "
                             "model's vocabulary is the training file's): raise --rows")
        info = {"task": "programs", "variables": list(VARIABLES[:num_vars]), "values": [LOW, HIGH],
                "wrap": "++ of 10 is 1, -- of 1 is 10", "seed": seed, "print_fraction": print_fraction,
                "if_true": if_true,
                "splits": {name: {"rows": c[0], "statements": st, "targets": c[1], "max_length": c[2]}
                           for name, c, st in (("train", train, statements), ("test", test, test_statements))},
                "overlap": "no test program's input equals a training program's (row_key of the whole input)"}
        with open(paths[SETTINGS], "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2)
    return info
