"""Every numeric option of every command: one shared type with a range (``fullband.utils.argtypes``), so a value
out of range is argparse's one-line error naming the option, exit 2, before anything runs. The test walks the real
parser (``fullband.cli.build_parser``), every sub-command and nested sub-command, so a new option with a bare
``int`` / ``float`` fails here."""

from __future__ import annotations

import argparse

import pytest

from fullband import cli
from fullband.utils.argtypes import FRACTION, NONNEG_INT, OPEN_FRACTION, POSITIVE_INT, Number


def commands(parser: argparse.ArgumentParser, path: tuple = ()):
    """``(argv prefix, parser)`` of every sub-command, nested ones included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from commands(sub, (*path, name))


def numeric_options():
    out = []
    for path, parser in commands(cli.build_parser()):
        for action in parser._actions:
            if action.option_strings and (isinstance(action.type, Number) or action.type in (int, float)):
                out.append((path, action))
    return out


OPTIONS = numeric_options()


def test_every_numeric_option_takes_a_shared_type():
    bare = [f"{' '.join(path)} {action.option_strings[0]}" for path, action in OPTIONS
            if not isinstance(action.type, Number)]
    assert not bare, f"bare int/float options (use fullband.utils.argtypes): {bare}"
    assert len(OPTIONS) > 150  # every command's, train's and sft's config options among them
    by_name = {(path, a.option_strings[0]): a.type for path, a in OPTIONS}
    assert by_name[(("eval", "labelled"), "--batch-size")] is POSITIVE_INT
    assert by_name[(("train",), "--val-fraction")] is OPEN_FRACTION
    assert by_name[(("train",), "--grad-passes")] is NONNEG_INT
    assert by_name[(("sft",), "--feedback-start")] is FRACTION


@pytest.mark.parametrize("path,action", OPTIONS, ids=[f"{' '.join(p)} {a.option_strings[0]}" for p, a in OPTIONS])
def test_an_out_of_range_value_is_one_line_naming_the_option(path, action, capsys):
    flag = action.option_strings[0]
    assert cli.main([*path, flag, action.type.bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"argument {flag}" in err[0] and action.type.bad in err[0], err


@pytest.mark.parametrize("typ,good,bad", [
    (POSITIVE_INT, ["1", "7"], ["0", "-1", "1.5", "x"]),
    (NONNEG_INT, ["0", "3"], ["-1", "2.0"]),
    (FRACTION, ["0", "0.5", "1"], ["-0.1", "1.01", "nan", "inf"]),
    (OPEN_FRACTION, ["0", "0.99"], ["1", "-0.5"]),
    (Number(float, 0, 1, lo_open=True), ["1", "1e-9"], ["0", "1.5"]),
])
def test_the_types_accept_their_range_only(typ, good, bad):
    for text in good:
        assert typ(text) == typ.kind(text)
    for text in [*bad, typ.bad]:
        with pytest.raises(argparse.ArgumentTypeError, match="must be"):
            typ(text)


def test_eval_labelled_batch_size_zero_is_refused_before_anything_runs(tmp_path, capsys):
    """The audit's case: ``--batch-size 0`` used to end in 'range() arg 3 must not be zero' after loading."""
    assert cli.main(["eval", "labelled", str(tmp_path / "missing"), "--data", "x.jsonl", "--batch-size", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("fullband eval labelled: error: argument --batch-size: must be an "
                                               "integer >= 1, got '0'")
