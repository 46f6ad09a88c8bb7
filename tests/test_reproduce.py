"""Runs that reproduce: every experiment (``fullband experiment --help`` lists them) and ``fullband quickstart``, run
twice at its quick size into fresh directories (nothing reused between the two), give the same ``results.json``
field by field, bit for bit, except the keys that hold timings, load, dates, the platform and provenance
(:data:`fullband.utils.provenance.UNREPRODUCIBLE_KEYS`); and every ``results.json`` says what produced it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from fullband import cli
from fullband.utils.provenance import UNREPRODUCIBLE_KEYS, drift, first_difference, provenance_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the smallest settings the experiment tests run (tests/test_experiments.py, test_recipe.py, test_depth.py,
# test_state.py, test_programs_experiment.py, test_train.py), ``{data}``: the conftest corpus
COMMANDS = {
    "quickstart": ["quickstart", "--no-progress", "--quiet", "--preset", "micro", "--steps", "4", "--batch-size", "2",
                   "--seq-len", "32", "--vocab-size", "300", "--eval-rows", "2", "--samples", "1",
                   "--sample-tokens", "4", "--prompt-tokens", "4", "--state-steps", "2", "--state-test-rows", "3"],
    "data-efficiency": ["experiment", "data-efficiency", "--no-progress", "--quiet", "--preset", "micro", "--steps",
                        "4", "--batch-size", "2", "--seq-len", "32", "--vocab-size", "300", "--data", "{data}",
                        "--multipliers", "0.5,1,1.5", "--eval-rows", "2", "--feedback-start", "0.5"],
    "reasoning": ["experiment", "reasoning", "--quick", "--no-progress", "--quiet"],
    "recipe": ["experiment", "recipe", "--quick", "--no-progress", "--arms", "shipped,residual-warm",
               "--trunk-steps", "3", "--branch-steps", "2", "--eval-rows", "2", "--seeds", "0"],
    "depth": ["experiment", "depth", "--quick", "--arms", "baseline-L,fbt-L"],
    "state": ["experiment", "state", "--quick", "--no-cost", "--arms", "baseline-L,fbt-L-glu"],
    "programs": ["experiment", "programs", "--quick"],
}


def _choices(parser) -> dict:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_experiment_is_covered():
    """The experiments ``fullband experiment --help`` lists, and the quickstart: each has a command here."""
    experiments = _choices(_choices(cli.build_parser())["experiment"])
    assert set(experiments) | {"quickstart"} == set(COMMANDS)


def _run(argv: list[str], where, capsys) -> dict:
    """``argv`` with ``--out exp`` inside ``where`` (the same relative paths in both runs); its results.json."""
    os.makedirs(where)
    cwd = os.getcwd()
    os.chdir(where)
    try:
        assert cli.main([*argv, "--out", "exp"]) == 0, capsys.readouterr().err
    finally:
        os.chdir(cwd)
    with open(os.path.join(where, "exp", "results.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_run_twice_gives_the_same_results(name, data, tmp_path, capsys):
    argv = [a.replace("{data}", data) for a in COMMANDS[name]]
    first = _run(argv, tmp_path / "a", capsys)
    second = _run(argv, tmp_path / "b", capsys)
    assert first_difference(first, second) is None, f"{name}: {first_difference(first, second)}"
    p = first["provenance"]
    assert p["command"] == sys.argv and p["threads"] >= 1 and p["torch"] and p["date"]
    report = (tmp_path / "a" / "exp" / "report.md").read_text()
    assert report.rstrip().endswith(provenance_line(p))


def test_first_difference_names_the_path():
    a = {"table": [{"acc": 0.5, "seconds": 1.0}], "seconds": 3, "provenance": {"date": "x"}, "nan": float("nan")}
    b = {"table": [{"acc": 0.5, "seconds": 2.0}], "seconds": 4, "provenance": {"date": "y"}, "nan": float("nan")}
    assert first_difference(a, b) is None  # timings and provenance skipped at any depth; NaN equals NaN
    b["table"][0]["acc"] = 0.5000000000000001  # one ulp is a difference
    assert first_difference(a, b) == "/table[0]/acc: 0.5 vs 0.5000000000000001"
    assert first_difference({"x": [1, 2]}, {"x": [1]}) == "/x: 2 vs 1 entries"
    assert first_difference({"x": 1}, {"x": 1.0}) == "/x: 1 vs 1.0"
    assert {"seconds", "load_average", "platform", "provenance"} <= UNREPRODUCIBLE_KEYS


def test_drift_counts_and_ranks_what_differs():
    """drift (benchmarks/thread_drift.py: another thread count): the numbers compared (booleans and skipped keys
    not counted), how many differ, the largest absolute and relative differences with their paths, and what differs
    that is not a pair of numbers."""
    a = {"loss": [4.0, 2.0, 1.0], "ok": True, "name": "x", "seconds": 1.0, "t": {"acc": 0.5}}
    b = {"loss": [4.0, 2.2, 1.2], "ok": False, "name": "x", "seconds": 9.0, "t": {"acc": 0.5, "new": 1}}
    d = drift(a, b)
    assert d["numbers"] == 4 and d["numbers_differing"] == 2
    assert d["max_abs"] == pytest.approx(0.2) and d["max_rel"] == pytest.approx(0.2 / 1.2)
    assert [x["path"] for x in d["largest_rel"]] == ["/loss[2]", "/loss[1]"]
    assert d["other_differences"] == ["/ok: True vs False", "/t/new: only in the second"] and d["other_differing"] == 2
    same = drift(a, a)
    assert same["numbers_differing"] == 0 and same["max_rel"] == 0.0 and same["other_differing"] == 0


def test_provenance_names_the_checkout(tmp_path):
    """The commit and dirtiness come from the checkout the package lives in, as git itself says."""
    from fullband.utils.provenance import provenance, source_checkout  # noqa: PLC0415

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                            text=True).stdout
    p = provenance(["fullband", "experiment", "reasoning", "--out", "a b"])
    assert p["git_commit"] == head.stdout.strip() and p["git_dirty"] == bool(status.strip())
    assert provenance_line(p).startswith(f"Produced by `fullband experiment reasoning --out 'a b'` at commit "
                                         f"{head.stdout.strip()[:12]}")
    assert source_checkout(str(tmp_path)) == {"git_commit": None, "git_dirty": None}  # not a checkout
    # the CPU the float kernels were picked for: two CPUs give different results from one command and seed
    cpuinfo = open("/proc/cpuinfo", encoding="utf-8").read() if os.path.exists("/proc/cpuinfo") else ""
    models = [ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")]
    if models:
        assert p["cpu"] == models[0]
        assert f", {models[0]} ({torch.backends.cpu.get_cpu_capability()})," in provenance_line(p)
    assert p["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert {"cpu", "cpu_capability"} <= UNREPRODUCIBLE_KEYS


def test_provenance_names_the_commit_a_run_started_from(tmp_path):
    """A run that outlives a commit: after :func:`note_start`, the provenance names the commit and dirtiness the run
    started from and says what the checkout was at its end (a throwaway repository, committed to mid-run); with no
    change in between, no ``checkout_at_end``. Bug caught: the commit read when the results are written."""
    from fullband.utils import provenance as prov  # noqa: PLC0415

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    first = git("rev-parse", "HEAD")
    repo = str(tmp_path)
    prov.note_start(repo)
    assert "checkout_at_end" not in prov.provenance(["fullband"], path=repo)
    (tmp_path / "a.py").write_text("x = 2\n")  # edited while the run goes on ...
    mid = prov.provenance(["fullband"], path=repo)
    assert (mid["git_commit"], mid["git_dirty"]) == (first, False)
    assert mid["checkout_at_end"] == {"git_commit": first, "git_dirty": True}
    git("commit", "-qam", "two")  # ... and committed
    p = prov.provenance(["fullband", "experiment", "depth"], path=repo)
    assert (p["git_commit"], p["git_dirty"]) == (first, False)
    assert p["checkout_at_end"] == {"git_commit": git("rev-parse", "HEAD"), "git_dirty": False} != first
    assert f"at commit {first[:12]} (the checkout changed while it ran: at its end commit " in prov.provenance_line(p)
    prov._AT_START.pop(repo)


def test_quickstart_gives_the_same_results_in_one_process_and_in_two(data, tmp_path, capsys):
    """``fullband quickstart`` trains its independent runs in ``--jobs`` one-thread processes and scores them at one
    thread: the same results.json with ``--jobs 1`` (every run here, in turn) and ``--jobs 2`` (spawned workers), and
    the caller's thread count is left as it was."""
    threads = torch.get_num_threads()
    one = _run([*COMMANDS["quickstart"], "--jobs", "1"], tmp_path / "one", capsys)
    two = _run([*COMMANDS["quickstart"], "--jobs", "2"], tmp_path / "two", capsys)
    assert (one.pop("jobs"), two.pop("jobs")) == (1, 2)
    assert first_difference(one, two) is None, first_difference(one, two)
    assert one["threads"] == two["threads"] == 1 and torch.get_num_threads() == threads
