"""A run the stability guard stops: its spike test needs an absolute rise, its last good step is saved and resumed
bitwise, and inside an experiment the stop is one line (exit 2) with the finished arms kept and the stopped one
resumed by the same command."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from fullband import cli
from fullband.experiments import synthetic
from fullband.training.checkpoint import find_checkpoint, load_trainer_state
from fullband.training.config import TrainConfig
from fullband.training.metrics import SPIKE_MIN_NATS, Guard
from fullband.training.pretrain import PretrainRecipe, run_to_end, stopped_checkpoint
from fullband.training.schedule import lr_at
from fullband.utils.errors import TrainingStopped
from fullband.utils.io import read_jsonl


def train_rows(out):
    return [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("split") == "train"]


def args(data, out, *extra):
    return ["train", "--preset", "micro", "--steps", "8", "--out", str(out), "--seed", "0", "--data", data,
            "--vocab-size", "300", "--seq-len", "32", "--batch-size", "4", "--no-progress", "--no-tensorboard",
            "--no-plot", "--feedback-start", "0.25", "--debug-nan-steps", "4,5,6", *extra]


def warmed(ema: float) -> Guard:
    g = Guard(spike_factor=3.0)
    for _ in range(g.warmup):
        g.good(ema)
    return g


def test_a_spike_must_also_rise_by_an_absolute_amount():
    # near zero loss the ratio alone fires on noise: 3e-4 is 3x a running 1e-4, but no spike
    assert warmed(1e-4).check(3e-4, 3e-4, None) is None
    assert warmed(0.02).check(0.1, 0.1, None) is None  # 5x, but 0.08 nats above
    assert warmed(0.02).check(0.02 + SPIKE_MIN_NATS + 0.01, 0.13, None).startswith("loss spike")
    assert warmed(2.0).check(6.5, 6.5, None).startswith("loss spike")
    assert warmed(2.0).check(5.9, 5.9, None) is None  # under 3x
    assert warmed(1e-4).check(float("nan"), float("nan"), None) == "non-finite loss"


def test_a_second_spike_in_a_row_is_trained_on():
    """The first finite spike is skipped (a bad batch, maybe); a second one in a row, on the same weights, is trained
    on (skipping cannot repair weights); not after a non-finite step, and never a non-finite one."""
    g = warmed(2.0)
    spike = g.check(8.6, 8.6, None)
    assert spike.startswith(Guard.SPIKE) and not g.trains_through(spike)
    g.bad(8.6)
    assert g.trains_through(g.check(8.5, 8.5, None))
    g = warmed(2.0)
    g.bad(float("nan"), finite_gradient=False)
    assert not g.trains_through(g.check(8.5, 8.5, None))
    assert not g.trains_through("non-finite loss")


def test_a_stopped_run_saves_its_last_good_step_and_resumes_it_bitwise(data, tmp_path, capsys):
    """Steps 4-6 are NaN (``--debug-nan-steps``), ``--max-bad-steps 3``: the run stops at step 6 with no periodic
    checkpoint, saving step 3 (tagged ``guard_stop``), equal file for file to the checkpoint of a run paused after
    step 3 (``--stop-after 3``: the state an unstopped run had there, RNG streams and guard included), though the
    skipped steps advanced the RNG, guard and token count. Resumed with ``--max-bad-steps 10`` it logs the same
    steps, bitwise, as a run that never stopped."""
    stopped, paused, whole = tmp_path / "stopped", tmp_path / "paused", tmp_path / "whole"
    assert cli.main(args(data, stopped, "--max-bad-steps", "3")) == 3
    err = capsys.readouterr().err
    assert "stopped after 3 bad steps in a row at step 6" in err and "step-0000003" in err and "(step 3)" in err
    ckpt = find_checkpoint(str(stopped))
    assert ckpt.endswith("step-0000003")
    state = load_trainer_state(ckpt)
    assert state["guard_stop"]["step"] == 6 and state["guard_stop"]["reason"] == "non-finite loss"
    assert state["guard_stop"]["data_sha256"]
    assert state["guard"]["bad_in_row"] == 0 and state["guard"]["skipped"] == 0 and state["tokens"] == 3 * 4 * 32

    assert cli.main(args(data, paused, "--max-bad-steps", "3", "--stop-after", "3")) == 0
    ref = find_checkpoint(str(paused))
    assert ref.endswith("step-0000003")
    want = load_trainer_state(ref)
    for key in ("tokens", "guard", "data_position", "schedule", "embed_rms"):
        assert state[key] == want[key], key
    a, b = load_file(os.path.join(ckpt, "model.safetensors")), load_file(os.path.join(ref, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rng_a = torch.load(os.path.join(ckpt, "rng-rank0.pt"), weights_only=True)
    rng_b = torch.load(os.path.join(ref, "rng-rank0.pt"), weights_only=True)
    assert torch.equal(rng_a["torch"], rng_b["torch"]) and torch.equal(rng_a["prefix"], rng_b["prefix"])
    assert rng_a["python"] == rng_b["python"]
    opt_a = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    opt_b = torch.load(os.path.join(ref, "optimizer.pt"), weights_only=True)
    assert opt_a["state"].keys() == opt_b["state"].keys()
    assert all(torch.equal(opt_a["state"][k][n], opt_b["state"][k][n])
               for k in opt_a["state"] for n in ("exp_avg", "exp_avg_sq"))

    assert cli.main(["train", "--resume", "--out", str(stopped), "--max-bad-steps", "10", "--debug-nan-steps", "4,5,6",
                     "--no-progress"]) == 0
    assert cli.main(args(data, whole, "--max-bad-steps", "10")) == 0
    def key(r):
        return r["step"], r["loss"], r["pass_losses"], r["grad_norm"], r["tokens"], r.get("skipped")

    assert [key(r) for r in train_rows(stopped)] == [key(r) for r in train_rows(whole)]
    assert len(train_rows(whole)) == 8


def test_an_experiment_arm_the_guard_stops_is_one_line_and_the_rerun_reuses_and_resumes(tmp_path, capsys,
                                                                                         monkeypatch):
    """``fullband experiment state``: fbt-L's steps 3-5 are NaN and it may skip 3 in a row (a test hook on the arm's
    config), so the guard stops it at step 5 after baseline-L finished: one line on stderr naming the arm, its run
    directory and the step, exit 2, no traceback. The same command again reuses baseline-L (not a file rewritten)
    and resumes fbt-L from its last good step 2 (its logged steps 1-2 kept as they were), which stops again."""
    make = synthetic.arm_config

    def arm_config(a, arm, corpus):
        cfg = make(a, arm, corpus)
        if arm.name == "fbt-L":
            cfg.debug_nan_steps, cfg.max_bad_steps = [3, 4, 5], 3
        return cfg

    monkeypatch.setattr(synthetic, "arm_config", arm_config)
    out = tmp_path / "state"
    cmd = ["experiment", "state", "--quick", "--no-cost", "--arms", "baseline-L,fbt-L", "--out", str(out)]
    assert cli.main(cmd) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("fullband experiment")]
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("fullband experiment: stopped: fbt-L (") and "stopped training at step 5" in line
    assert "last good step, 2," in line and "step-0000002" in line and "the same command resumes" in line
    runs = out / "seed0" / "runs"
    assert json.loads((runs / "baseline-L" / "summary.json").read_text())["status"] == "done"
    assert not (runs / "fbt-L" / "summary.json").exists()
    stamps = {p: p.stat().st_mtime_ns for p in (runs / "baseline-L").rglob("*") if p.is_file()}
    first = train_rows(runs / "fbt-L")

    assert cli.main(cmd) == 2
    err = capsys.readouterr().err
    assert "state: training baseline-L" not in err and "state: training fbt-L" in err
    assert [ln for ln in err.splitlines() if ln.startswith("fullband experiment")] == [line]
    assert {p: p.stat().st_mtime_ns for p in (runs / "baseline-L").rglob("*") if p.is_file()} == stamps
    again = train_rows(runs / "fbt-L")
    assert again[:2] == first[:2]  # resumed after step 2: steps 1-2 not retrained (their timings kept)
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5] and all(r.get("skipped") for r in again[2:])


def test_the_stopped_checkpoint_is_resumed_only_by_the_same_run(data, tmp_path, capsys):
    """The last good step the guard saves is a cache keyed as finished runs are (options, data, initial model:
    :func:`fullband.training.pretrain.stopped_checkpoint`): the stopped run's own configuration finds it; the same
    run at another LR, through the real path (``run_to_end``, what an experiment's re-run calls), does not resume it
    but trains from step 1 at its own LR (its log starts over: the first step's LR is the new schedule's)."""
    out = tmp_path / "stopped"
    assert cli.main(args(data, str(out), "--max-bad-steps", "3")) == 3
    capsys.readouterr()
    same = TrainConfig(**load_trainer_state(find_checkpoint(str(out)))["config"])
    assert stopped_checkpoint(same).endswith("step-0000003")
    old_first = train_rows(out)[0]
    other = dataclasses.replace(same, lr=same.resolved_lr() / 2)
    assert stopped_checkpoint(other) is None
    with pytest.raises(TrainingStopped) as err:  # steps 4-6 are NaN again: stopped again, at step 6
        run_to_end(PretrainRecipe(other, None, "other-lr"))
    assert err.value.step == 6
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[0]["lr"] == pytest.approx(lr_at(0, other)) and rows[0]["lr"] != old_first["lr"]
