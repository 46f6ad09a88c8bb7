"""The Feedback Transformer's algorithmic task: programs over a few variables, scored on the values they print.

Owns the seeded program generators of two grammars, their token layout and targets, and the writer of their
labelled jsonl files (``fullband data make-programs``: ``DIR/train.jsonl`` / ``DIR/test.jsonl`` in
:mod:`fullband.data.labelled`'s row format, ``DIR/programs.json`` with the settings and counts).

Grammar ``published`` (the default; :func:`make_published_program`): the task as Fan et al. (2020), *Addressing
some limitations of transformers with feedback memory*, published it with its data generator (``gen_data_algo_seq.py``
of facebookresearch/transformer-sequential, read, not copied; ``algorithmic_3var.sh``: 100 statements, 10,000
training, 1,000 validation and 1,000 test programs):

* variables: the first V of ``x y z p r`` (its names), values ``1`` .. ``10``;
* each statement is one of five kinds with equal weight; a kind that cannot be drawn in the current state is drawn
  again (the whole statement): ``x = 7 ;`` only for a variable not yet assigned (each variable is introduced once);
  ``x ++ ;`` / ``x -- ;`` of an assigned variable, never leaving 1..10; ``print x ;`` of an assigned variable;
  ``if x < c : S`` / ``if x > c : S`` (``<`` or ``>`` with equal probability) where ``c`` is, half the time,
  another assigned variable (its current value is compared) and otherwise a number 1..10, and ``S`` a statement of
  the first three kinds drawn by the same rules (no nested ``if``, no ``print``) that takes effect only when the
  condition holds (drawn in a copy of the state otherwise);
* ``END`` closes the program (no target); the target of ``print x ;`` is x's value at its ``;`` (the model at input t
  predicts target t, so it reads ``print x ;`` and says the value, which is never an input). One departure: a
  program without any print is drawn again (a labelled row needs a target); at 100 statements that is a chance of
  about 1e-10, only short test programs meet it.

Grammar ``fullband`` (:func:`make_program`; ``--grammar fullband``), the package's earlier variant, kept as a named
option, implemented from the paper's description before the generator was read:

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
OPERATORS = ("=", "++", "--", "if", "==", ":", "print", ";")
FILES = ("train.jsonl", "test.jsonl")
VAL_FILE = "val.jsonl"  # with --val-rows
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


GRAMMARS = ("published", "fullband")
PUBLISHED_VARIABLES = ("x", "y", "z", "p", "r")  # the published generator's names
PUBLISHED_KINDS = ("=", "++", "--", "if", "print")  # drawn with equal weight
PUBLISHED_OPERATORS = ("=", "++", "--", "if", "<", ">", ":", "print", ";", "END")


class _Redraw(Exception):
    """A statement kind that cannot be drawn in the current state: the whole statement is drawn again."""


def _published_statement(rng: random.Random, names, values: dict, nested: bool) -> tuple[list[str], str | None]:
    """The words (without ``;``) and the target of one statement of the published grammar; ``values`` (the assigned
    variables, in assignment order) updated by it."""
    while True:
        try:
            kind = rng.choice(PUBLISHED_KINDS)
            if kind == "=":
                free = [v for v in names if v not in values]
                if not free:
                    raise _Redraw
                var = rng.choice(free)
                values[var] = rng.randint(LOW, HIGH)
                return [var, "=", str(values[var])], None
            if not values or (nested and kind in ("if", "print")):
                raise _Redraw
            if kind in ("++", "--"):
                var = rng.choice(list(values))
                new = values[var] + (1 if kind == "++" else -1)
                if not LOW <= new <= HIGH:
                    raise _Redraw
                values[var] = new
                return [var, kind], None
            if kind == "print":
                var = rng.choice(list(values))
                return ["print", var], str(values[var])
            if rng.random() < 0.5:  # against another variable's current value
                if len(values) < 2:
                    raise _Redraw
                var, other = rng.sample(list(values), 2)
                bound, word = values[other], other
            else:  # against a number
                var = rng.choice(list(values))
                bound = rng.randint(LOW, HIGH)
                word = str(bound)
            op = "<" if rng.random() < 0.5 else ">"
            holds = values[var] < bound if op == "<" else values[var] > bound
            body, _ = _published_statement(rng, names, values if holds else dict(values), nested=True)
            return ["if", var, op, word, ":", *body], None
        except _Redraw:
            continue


def make_published_program(rng: random.Random, num_vars: int, statements: int) -> Program:
    """One program of the published grammar (the module's text): ``statements`` statements, then ``END``."""
    if not 1 <= num_vars <= len(PUBLISHED_VARIABLES):
        raise ValueError(f"--vars must be in 1..{len(PUBLISHED_VARIABLES)}, got {num_vars}")
    if statements < 1:
        raise ValueError(f"--statements must be >= 1, got {statements}")
    names = PUBLISHED_VARIABLES[:num_vars]
    while True:  # a program without a print has no target (a labelled row needs one): drawn again
        values: dict[str, int] = {}
        inputs: list[str] = []
        targets: list[str | None] = []
        for _ in range(statements):
            words, target = _published_statement(rng, names, values, nested=False)
            inputs += [*words, ";"]
            targets += [None] * len(words) + [target]
        if any(t is not None for t in targets):
            return Program((*inputs, "END"), (*targets, None))


def grammar_program(grammar: str, rng: random.Random, num_vars: int, statements: int, print_fraction: float = 0.2,
                    if_true: float = 0.5) -> Program:
    """One program of ``grammar`` (``published`` or ``fullband``; the options apply to ``fullband`` only)."""
    if grammar == "published":
        return make_published_program(rng, num_vars, statements)
    if grammar == "fullband":
        return make_program(rng, num_vars, statements, print_fraction, if_true)
    raise ValueError(f"unknown grammar {grammar!r}: choose one of {', '.join(GRAMMARS)}")


def grammar_words(grammar: str, num_vars: int) -> list[str]:
    """Every word programs of ``grammar`` over ``num_vars`` variables can use (a fixed vocabulary)."""
    if grammar == "published":
        return [*PUBLISHED_VARIABLES[:num_vars], *PUBLISHED_OPERATORS, *VALUES]
    return [*VARIABLES[:num_vars], *OPERATORS, *VALUES]


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
                        test_statements: int | None = None, print_fraction: float | None = None,
                        if_true: float | None = None, overwrite: bool = False, grammar: str = "published",
                        val_rows: int = 0) -> dict:
    """Write ``out/train.jsonl`` (``rows`` programs of ``statements``), ``out/test.jsonl`` (``test_rows`` programs
    of ``test_statements``, default ``statements``), with ``val_rows`` > 0 ``out/val.jsonl`` (validation programs of
    ``statements``, stream ``val``, none a test program; no training program is a test or validation program) and
    ``out/programs.json``; returns the settings and counts written to the latter. ``print_fraction`` / ``if_true``
    (default 0.2 / 0.5) belong to the ``fullband`` grammar only. The published split: ``rows`` 10,000, ``val_rows``
    and ``test_rows`` 1,000."""
    test_statements = statements if test_statements is None else test_statements
    if grammar not in GRAMMARS:
        raise ValueError(f"--grammar must be one of {', '.join(GRAMMARS)}, got {grammar!r}")
    if grammar == "published":
        if print_fraction is not None or if_true is not None:
            raise ValueError("--print-fraction and --if-true belong to --grammar fullband (the published grammar "
                             "draws its five statement kinds with equal weight)")
        make_published_program(random.Random(0), num_vars, min(statements, test_statements))  # the option checks
    else:
        print_fraction = 0.2 if print_fraction is None else print_fraction
        if_true = 0.5 if if_true is None else if_true
        check_options(num_vars, statements, print_fraction, if_true)
        if test_statements < num_vars + 1:
            raise ValueError(f"--test-statements must be at least --vars + 1 = {num_vars + 1}, got {test_statements}")
    if rows < 1 or test_rows < 1 or val_rows < 0:
        raise ValueError(f"--rows and --test-rows must be >= 1 and --val-rows >= 0, got {rows}, {test_rows} and "
                         f"{val_rows}")
    options = (print_fraction, if_true) if grammar == "fullband" else ()

    def test_programs():
        rng = split_rng(seed, "test")
        for _ in range(test_rows):
            p = grammar_program(grammar, rng, num_vars, test_statements, *options)
            held_out.add(p.key())
            yield p

    def apart(split: str, count: int, exclude: set):
        """``count`` programs of stream ``split``, one whose key is in ``exclude`` drawn again."""
        rng = split_rng(seed, split)
        for _ in range(count):
            for _ in range(MAX_REDRAWS):
                p = grammar_program(grammar, rng, num_vars, statements, *options)
                if p.key() not in exclude:
                    break
            else:
                raise ValueError(f"the {test_rows + val_rows} test and validation programs cover (almost) every "
                                 f"program of {statements} statements: raise --statements or lower --test-rows / "
                                 "--val-rows")
            assert p.key() not in exclude
            yield p

    def val_programs():
        test_keys = set(held_out)
        for p in apart("val", val_rows, test_keys):
            held_out.add(p.key())
            yield p

    held_out: set[bytes] = set()
    names = (*FILES, VAL_FILE) if val_rows else FILES
    with _files_at_once(out, (*names, SETTINGS), overwrite) as paths:
        with open(paths["test.jsonl"], "w", encoding="utf-8") as f:
            test = _write_rows(f, test_programs())
        if val_rows:
            with open(paths[VAL_FILE], "w", encoding="utf-8") as f:
                val = _write_rows(f, val_programs())
        with open(paths["train.jsonl"], "w", encoding="utf-8") as f:
            train = _write_rows(f, apart("train", rows, held_out))
        unknown = sorted(test[3] - train[3])
        if unknown:
            raise ValueError(f"the test programs use word(s) {' '.join(unknown)} that no training program has (the "
                             "model's vocabulary is the training file's): raise --rows")
        published = grammar == "published"
        info = {"task": "programs", "grammar": grammar,
                "variables": list((PUBLISHED_VARIABLES if published else VARIABLES)[:num_vars]),
                "values": [LOW, HIGH], "seed": seed,
                "wrap": "none: ++ / -- never leave 1..10" if published else "++ of 10 is 1, -- of 1 is 10"}
        if not published:
            info |= {"print_fraction": print_fraction, "if_true": if_true}
        info |= {
                "splits": {name: {"rows": c[0], "statements": st, "targets": c[1], "max_length": c[2]}
                           for name, c, st in (("train", train, statements), ("test", test, test_statements))
                           + ((("val", val, statements),) if val_rows else ())},
                "overlap": "no test or validation program's input equals a training program's, no validation "
                           "program's a test program's (row_key of the whole input)"}
        with open(paths[SETTINGS], "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2)
    return info
