"""The Feedback Transformer's algorithmic task (``fullband data make-programs``): targets, rules, seeds, splits, CLI,
for both grammars (``published``, the default, and the package's earlier ``fullband`` variant).

The targets are checked against interpreters written here from each grammar's description (they parse the emitted
words statement by statement and execute them), not against the generator's own bookkeeping.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from fullband import cli
from fullband.eval import program_tasks as P


def interpret(words, targets):
    """Execute the words of one program; return ``(printed values in order, the targets at the prints' positions,
    wrap events {"10++": n, "1--": n}, every target position)``. Asserts the layout while parsing."""
    assert len(words) == len(targets) and words[-1] == ";"
    env, printed, given, wraps, positions = {}, [], [], {"10++": 0, "1--": 0}, []

    def step(var, op, arg=None):
        if op == "=":
            value = int(arg)
            assert 1 <= value <= 10
            env[var] = value
        elif op == "++":
            wraps["10++"] += env[var] == 10
            env[var] = 1 if env[var] == 10 else env[var] + 1
        elif op == "--":
            wraps["1--"] += env[var] == 1
            env[var] = 10 if env[var] == 1 else env[var] - 1
        else:
            raise AssertionError(f"unknown operator {op!r}")

    i = 0
    while i < len(words):
        j = words.index(";", i)
        st = words[i:j]
        if st[0] == "print":
            assert len(st) == 3
            printed.append(env[st[1]])
            assert st[2] == str(env[st[1]])  # the value is the next input (teacher forcing)
            given.append(targets[i + 1])
            positions.append(i + 1)
        elif st[0] == "if":
            assert st[2] == "==" and st[4] == ":"
            if env[st[1]] == int(st[3]):
                step(*st[5:])
        else:
            step(*st)
        i = j + 1
    return printed, given, wraps, positions


def read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("num_vars", [3, 5])
def test_targets_are_the_printed_values_and_wrap_at_both_ends(num_vars):
    rng = random.Random(123)
    wraps = {"10++": 0, "1--": 0}
    kinds = set()
    for _ in range(200):
        p = P.make_program(rng, num_vars, 30)
        words, targets = list(p.inputs), list(p.targets)
        # the opening: one assignment per variable, in order
        assert [words[4 * k] for k in range(num_vars)] == list(P.VARIABLES[:num_vars])
        assert all(words[4 * k + 1] == "=" for k in range(num_vars))
        assert words.count(";") == 30
        printed, given, w, positions = interpret(words, targets)
        assert given == [str(v) for v in printed] and printed
        assert [t for t, x in enumerate(targets) if x is not None] == positions  # targets at the prints only
        assert words[-4] == "print"  # the last statement is a print
        for k in wraps:
            wraps[k] += w[k]
        kinds.update(s.split()[0] if s.split()[0] in ("if", "print") else s.split()[1]
                     for s in " ".join(words).split(";") if s.strip())
        row = p.row()
        assert row["input"].split() == words and len(row["target"].split()) == len(words)
    assert kinds == {"=", "++", "--", "if", "print"}
    assert wraps["10++"] > 0 and wraps["1--"] > 0  # both ends were exercised (a clipping generator fails here)
    assert (P.wrap(11), P.wrap(0), P.wrap(10), P.wrap(1)) == (1, 10, 10, 1)


def test_conditional_taken_about_if_true_of_the_time():
    rng, taken, total = random.Random(5), 0, 0
    for _ in range(60):
        words = list(P.make_program(rng, 3, 40, if_true=0.5).inputs)
        for i, w in enumerate(words):
            if w == "if":
                total += 1
                taken += _env_after(words[:i])[words[i + 1]] == int(words[i + 3])
    assert total > 100 and 0.4 < taken / total < 0.6


def _env_after(words):
    env = {}
    i = 0
    while i < len(words):
        j = words.index(";", i)
        st = words[i:j]
        if st[0] == "if":
            st = st[5:] if env[st[1]] == int(st[3]) else []
        if st and st[0] != "print":
            var, op = st[0], st[1]
            env[var] = int(st[2]) if op == "=" else P.wrap(env[var] + (1 if op == "++" else -1))
        i = j + 1
    return env


def make(out, *extra, rows=40, test_rows=10, statements=8, grammar="fullband"):
    return cli.main(["data", "make-programs", "--out", str(out), "--rows", str(rows), "--test-rows",
                     str(test_rows), "--statements", str(statements), "--grammar", grammar, *extra])


def test_seeded_deterministic_and_held_out_programs_never_in_training(tmp_path):
    assert make(tmp_path / "a", "--seed", "3") == 0 and make(tmp_path / "b", "--seed", "3") == 0
    assert make(tmp_path / "c", "--seed", "4") == 0
    for name in P.FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()
    # training rows do not depend on the number of test rows (unless a draw hit one of them)
    assert make(tmp_path / "d", "--seed", "3", test_rows=11) == 0
    assert read(tmp_path / "d" / "train.jsonl")[:5] == read(tmp_path / "a" / "train.jsonl")[:5]
    # one variable, three statements: few programs, so unchecked draws collide with the test rows
    assert make(tmp_path / "e", "--vars", "1", rows=300, test_rows=300, statements=3) == 0
    test = {r["input"] for r in read(tmp_path / "e" / "test.jsonl")}
    train = [r["input"] for r in read(tmp_path / "e" / "train.jsonl")]
    assert len(train) == 300 and not test & set(train)
    rng = P.split_rng(0, "train")
    raw = [" ".join(P.make_program(rng, 1, 3).inputs) for _ in range(300)]
    assert len(test & set(raw)) > 5  # the check above had something to catch
    info = json.load(open(tmp_path / "e" / "programs.json"))
    assert info["splits"]["train"]["targets"] >= 300 and info["variables"] == ["x"]


def test_longer_test_programs(tmp_path):
    assert make(tmp_path / "o", "--test-statements", "20", statements=6) == 0
    assert all(r["input"].split().count(";") == 20 for r in read(tmp_path / "o" / "test.jsonl"))
    assert all(r["input"].split().count(";") == 6 for r in read(tmp_path / "o" / "train.jsonl"))


@pytest.mark.parametrize("extra, message", [
    (["--vars", "6"], "argument --vars: must be an integer in [1, 5]"),
    (["--vars", "3", "--statements", "3"], "--statements must be at least --vars + 1 = 4"),
    (["--print-fraction", "0"], "argument --print-fraction: must be a number in (0, 1]"),
    (["--if-true", "1.5"], "argument --if-true: must be a number in [0, 1]"),
    (["--rows", "0"], "argument --rows: must be an integer >= 1"),
    (["--test-statements", "2"], "--test-statements must be at least"),
    (["--vars", "1", "--statements", "2", "--test-rows", "500"], "cover (almost) every program"),
])
def test_bad_values_are_one_line_errors_and_nothing_is_written(tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    assert cli.main(["data", "make-programs", "--out", str(out), "--rows", "5", "--statements", "8", "--grammar",
                     "fullband", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not out.exists()


def test_existing_files_are_kept_without_overwrite(tmp_path, capsys):
    assert make(tmp_path / "o") == 0
    before = {n: (tmp_path / "o" / n).read_bytes() for n in P.FILES}
    assert make(tmp_path / "o", "--seed", "1") == 2
    assert "--overwrite" in capsys.readouterr().err
    assert {n: (tmp_path / "o" / n).read_bytes() for n in P.FILES} == before
    assert sorted(os.listdir(tmp_path / "o")) == sorted([*P.FILES, P.SETTINGS])  # no temporary left
    assert make(tmp_path / "o", "--seed", "1", "--overwrite") == 0
    assert (tmp_path / "o" / "train.jsonl").read_bytes() != before["train.jsonl"]


def test_labelled_reader_trains_and_scores_the_files(tmp_path, capsys):
    data = tmp_path / "progs"
    assert make(data, rows=64, test_rows=8, statements=5) == 0
    info = json.load(open(data / "programs.json"))
    prep = tmp_path / "prep"
    assert cli.main(["data", "prepare", str(data / "train.jsonl"), "--labelled", "--out", str(prep)]) == 0
    manifest = json.load(open(prep / "manifest.json"))
    assert sum(s["targets"] for s in manifest["splits"].values()) == info["splits"]["train"]["targets"]
    assert sum(s["rows"] for s in manifest["splits"].values()) == 64
    # vocabulary: specials, 3 variables, 10 values, = ++ -- if == : ; print
    assert manifest["vocab_size"] == 3 + 3 + 10 + 8
    seq = str(max(s["max_length"] for s in info["splits"].values()) + 2)
    run = tmp_path / "run"
    assert cli.main(["train", "--data", str(data / "train.jsonl"), "--out", str(run), "--preset", "micro", "--steps",
                     "2", "--seq-len", seq, "--batch-size", "4", "--feedback-start", "0.5", "--exact-states",
                     "--grad-passes", "1", "--no-progress", "--no-tensorboard", "--no-plot"]) == 0
    capsys.readouterr()
    assert cli.main(["eval", "labelled", str(run), "--data", str(data / "test.jsonl"), "--modes", "standard,exact",
                     "--resamples", "50", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["overlap_check"]["train_rows_compared"] == 64
    assert [r["overall"]["targets"] for r in report["results"]] == [info["splits"]["test"]["targets"]] * 2


# ----------------------------------------------------------------------------------------------- the published grammar


def interpret_published(words, targets):
    """Execute one program of the published grammar, asserting its rules on the way (each variable assigned once,
    ++ / -- inside 1..10 whether or not a conditional's body takes effect, no nested if / print, the printed value
    never an input, END last); returns ``(printed values, targets at the prints' ';', kinds seen)``."""
    assert words[-1] == "END" and targets[-1] is None and len(words) == len(targets)
    env, printed, given, kinds = {}, [], [], set()

    def run(st, env, nested):
        if st[1] == "=":
            assert st[0] not in env and len(st) == 3 and 1 <= int(st[2]) <= 10  # introduced once
            env[st[0]] = int(st[2])
            return "="
        if st[1] in ("++", "--"):
            new = env[st[0]] + (1 if st[1] == "++" else -1)
            assert 1 <= new <= 10 and len(st) == 2  # never leaves 1..10
            env[st[0]] = new
            return st[1]
        assert not nested, st
        raise AssertionError(f"unknown statement {st}")

    i = 0
    while words[i] != "END":
        j = words.index(";", i)
        st = words[i:j]
        assert all(t is None for t in targets[i:j])
        if st[0] == "print":
            assert len(st) == 2
            printed.append(env[st[1]])
            given.append(targets[j])  # the label sits at the ';'
            kinds.add("print")
        elif st[0] == "if":
            assert st[2] in ("<", ">") and st[4] == ":" and st[5] not in ("if", "print")
            bound = env[st[3]] if st[3] in env else int(st[3])
            kinds.add("if-var" if st[3] in env else "if-number")
            holds = env[st[1]] < bound if st[2] == "<" else env[st[1]] > bound
            run(st[5:], env if holds else dict(env), nested=True)  # drawn in a copy when it does not hold
        else:
            assert targets[j] is None
            kinds.add(run(st, env, nested=False))
        i = j + 1
    return printed, given, kinds


@pytest.mark.parametrize("num_vars", [3, 5])
def test_published_grammar_follows_its_rules_and_labels_the_printed_value_at_the_semicolon(num_vars):
    rng, kinds, prints = random.Random(7), set(), 0
    for _ in range(100):
        p = P.make_published_program(rng, num_vars, 100)
        words, targets = list(p.inputs), list(p.targets)
        assert words.count(";") == 100 and words[1] == "="  # nothing but an assignment can come first
        assert set(words) <= set(P.grammar_words("published", num_vars))
        printed, given, k = interpret_published(words, targets)
        assert given == [str(v) for v in printed]
        assert [t for t in targets if t is not None] == given  # targets at the prints only
        kinds |= k
        prints += len(printed)
    assert kinds == {"=", "++", "--", "if-var", "if-number", "print"}
    assert 100 * 100 / 5 * 0.7 < prints < 100 * 100 / 5 * 1.3  # one kind in five (print is never redrawn once a
    # variable exists)


def test_published_is_the_default_and_its_files_and_refusals(tmp_path, capsys):
    out = tmp_path / "pub"
    assert cli.main(["data", "make-programs", "--out", str(out), "--rows", "30", "--test-rows", "10",
                     "--statements", "12", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["grammar"] == "published" and info["variables"] == ["x", "y", "z"] and "print_fraction" not in info
    rows = read(out / "train.jsonl")
    assert all(r["input"].split()[-1] == "END" and r["input"].split().count(";") == 12 for r in rows)
    test = {r["input"] for r in read(out / "test.jsonl")}
    assert not test & {r["input"] for r in rows}
    assert cli.main(["data", "make-programs", "--out", str(tmp_path / "x"), "--rows", "5", "--print-fraction",
                     "0.3"]) == 2
    assert "--print-fraction and --if-true belong to --grammar fullband" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_validation_programs_are_apart_from_test_and_training(tmp_path, capsys):
    """``--val-rows``: val.jsonl of the training length, none a test program, no training program one of them (on
    one variable and 3 statements, where unchecked draws collide); without it, no file and the same training rows."""
    out = tmp_path / "v"
    assert cli.main(["data", "make-programs", "--out", str(out), "--rows", "200", "--val-rows", "60", "--test-rows",
                     "60", "--vars", "1", "--statements", "3", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["splits"]["val"]["rows"] == 60 and info["splits"]["val"]["statements"] == 3
    train, val, test = ([r["input"] for r in read(out / f"{n}.jsonl")] for n in ("train", "val", "test"))
    assert len(val) == 60 and not set(val) & set(test) and not set(train) & (set(val) | set(test))
    rng = P.split_rng(0, "val")
    raw = [" ".join(P.make_published_program(rng, 1, 3).inputs) for _ in range(60)]
    assert set(raw) & set(test)  # the check above had something to catch
    assert cli.main(["data", "make-programs", "--out", str(tmp_path / "n"), "--rows", "30", "--test-rows", "10",
                     "--statements", "12"]) == 0
    assert cli.main(["data", "make-programs", "--out", str(tmp_path / "m"), "--rows", "30", "--test-rows", "10",
                     "--val-rows", "10", "--statements", "12"]) == 0
    assert not (tmp_path / "n" / "val.jsonl").exists()
    assert read(tmp_path / "n" / "train.jsonl") == read(tmp_path / "m" / "train.jsonl")  # 12 statements: no collision
    assert "10 validation programs" in capsys.readouterr().out
