"""Checkpoints: the ``latest`` pointer is read only as a plain step name inside the run directory, and re-saving a
step never leaves the run without a complete, loadable checkpoint, whatever point a crash hits."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import tiny_model

from fullband import cli
from fullband.training import checkpoint as C
from fullband.training.distributed import DistEnv


class Crash(Exception):
    pass


def _save(out, step, model, optimizer, marker: float, keep: int = 1):
    with torch.no_grad():
        model.feedback.out_norm.weight.fill_(marker)  # tells the checkpoints apart
    return C.save_checkpoint(str(out), step, DistEnv(), model, optimizer, torch.Generator().manual_seed(0),
                             {"tokens": 0, "elapsed": 0.0, "config": {"marker": marker}, "guard": {}}, keep=keep)


def _marker(path) -> float:
    loaded = C.load_checkpoint(path)  # every file read back, safely
    return float(loaded["model"]["feedback.out_norm.weight"][0])


@pytest.fixture
def model_and_optimizer():
    model = tiny_model("llama")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


# ----------------------------------------------------------------------------------------------- latest


@pytest.mark.parametrize("content", ["../../etc", "/etc", "step-0000002/../../..", "step-2", "..", "",
                                     "step-0000002\nstep-0000003", "checkpoints/step-0000002"])
def test_a_tampered_latest_is_a_one_line_error(tmp_path, model_and_optimizer, content):
    _save(tmp_path, 2, *model_and_optimizer, 0.5)
    (tmp_path / "checkpoints" / "latest").write_text(content + "\n")
    with pytest.raises(ValueError, match="not a step name") as err:
        C.find_checkpoint(str(tmp_path))
    assert "\n" not in str(err.value)


def test_latest_pointing_outside_is_not_followed_even_to_a_complete_checkpoint(tmp_path, model_and_optimizer):
    """A ``latest`` of ``../other/checkpoints/step-...`` leads to a complete checkpoint of another run: refused,
    not loaded."""
    model, opt = model_and_optimizer
    _save(tmp_path / "other", 5, model, opt, 0.9)
    _save(tmp_path / "run", 2, model, opt, 0.5)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("../../other/checkpoints/step-0000005\n")
    with pytest.raises(ValueError, match="not a step name"):
        C.find_checkpoint(str(tmp_path / "run"))


def test_resume_with_a_tampered_latest_exits_2_with_one_line(data, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--preset", "micro", "--steps", "4", "--out", str(out), "--data", data, "--vocab-size", "300",
            "--seq-len", "32", "--batch-size", "2", "--no-progress", "--no-tensorboard", "--no-plot"]
    assert cli.main(argv + ["--stop-after", "2"]) == 0
    (out / "checkpoints" / "latest").write_text(str(tmp_path) + "\n")  # an absolute path
    before = sorted(os.listdir(out))
    capsys.readouterr()
    assert cli.main(argv + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert "not a step name" in err and err.strip().count("\n") == 0
    assert sorted(os.listdir(out)) == before and (out / "checkpoints" / "step-0000002").is_dir()


def test_a_plain_step_name_whose_checkpoint_is_gone_falls_back_to_the_newest_complete(tmp_path, model_and_optimizer):
    model, opt = model_and_optimizer
    _save(tmp_path, 2, model, opt, 0.5)
    (tmp_path / "checkpoints" / "latest").write_text("step-0000009\n")
    assert C.find_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoints" / "step-0000002")


# ----------------------------------------------------------------------------------------------- re-saving a step


def _crash_on(monkeypatch, func_name: str, n: int):
    """Make the ``n``-th call (from 1) of ``os.replace`` / ``shutil.rmtree`` inside the checkpoint module raise,
    as a process killed at that point would stop; returns the call counter."""
    calls = {"n": 0}
    module = os if func_name == "replace" else shutil
    real = getattr(module, func_name)

    def fake(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise Crash(f"{func_name} #{n}")
        return real(*args, **kwargs)

    monkeypatch.setattr(C.os if module is os else C.shutil, func_name, fake)
    return calls


def test_resaving_a_step_swaps_the_new_one_in(tmp_path, model_and_optimizer):
    model, opt = model_and_optimizer
    _save(tmp_path, 3, model, opt, 0.25)
    path = _save(tmp_path, 3, model, opt, 0.75)
    assert path == str(tmp_path / "checkpoints" / "step-0000003")
    assert C.find_checkpoint(str(tmp_path)) == path and _marker(path) == 0.75
    assert sorted(n for n in os.listdir(tmp_path / "checkpoints") if not n.startswith(".step-0000003.")) == [
        "latest", "step-0000003"]
    assert not [n for n in os.listdir(tmp_path / "checkpoints") if n.startswith(".")]  # no leftovers


# the swap's steps in order, and which checkpoint a crash at each leaves: moving the old one aside, renaming the
# new one in, pointing `latest` at it (an atomic write: a rename too), removing the old one
@pytest.mark.parametrize("func_name, n, left", [("replace", 1, 0.25), ("replace", 2, 0.25), ("replace", 3, 0.75),
                                                ("rmtree", 1, 0.75)])
def test_a_crash_while_resaving_a_step_leaves_a_complete_checkpoint(tmp_path, monkeypatch, model_and_optimizer,
                                                                    func_name, n, left):
    """With --keep-checkpoints 1 the re-saved step is the only checkpoint: a crash at any rename or removal of the
    swap leaves the old one or the new one, complete and loadable, found by find_checkpoint; the next save then
    completes normally and leaves nothing behind."""
    model, opt = model_and_optimizer
    _save(tmp_path, 3, model, opt, 0.25)
    _crash_on(monkeypatch, func_name, n)
    with pytest.raises(Crash):
        _save(tmp_path, 3, model, opt, 0.75)
    monkeypatch.undo()
    found = C.find_checkpoint(str(tmp_path))
    assert found is not None, f"no checkpoint after a crash at {func_name} #{n}"
    assert _marker(found) == left
    path = _save(tmp_path, 3, model, opt, 0.5)
    assert C.find_checkpoint(str(tmp_path)) == path and _marker(path) == 0.5
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step-0000003"]


@pytest.mark.parametrize("older", [False, True], ids=["only-step", "older-step-kept"])
def test_a_crash_renaming_the_new_checkpoint_in_leaves_the_old_one_found(tmp_path, monkeypatch, model_and_optimizer,
                                                                          older):
    """The crash the old code could not survive: it removed the old directory before the rename. Here the rename
    of the new directory onto the step's name fails, whatever came before it: the old one, kept aside, is found and
    ``--resume`` continues from it; with ``--keep-checkpoints 2`` and an older step still there, the interrupted
    re-save is preferred to the older step."""
    model, opt = model_and_optimizer
    for step, marker in ((4, 0.125), (6, 0.25)) if older else ((6, 0.25),):
        _save(tmp_path, step, model, opt, marker, keep=2)
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if str(src).endswith(".tmp") and os.path.basename(str(dst)) == "step-0000006":
            raise Crash("killed while renaming the new checkpoint in")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(C.os, "replace", replace)
    with pytest.raises(Crash):
        _save(tmp_path, 6, model, opt, 0.375, keep=2)
    monkeypatch.undo()
    assert not (tmp_path / "checkpoints" / "step-0000006").exists()  # the crash hit inside the swap
    found = C.find_checkpoint(str(tmp_path))
    assert os.path.basename(found) == ".step-0000006.old" and _marker(found) == 0.25
    assert C.prepare_out(str(tmp_path), resume=True, overwrite=False) == found  # --resume continues from it


# ----------------------------------------------------------------------------------------------- RNG on resharding


def test_a_rank_the_saving_run_did_not_have_gets_the_shared_stream_and_its_own_seed(tmp_path, model_and_optimizer):
    """Resuming on more processes than saved: rank 0's prefix-mixing stream (the same on every rank), and the
    rank's own streams seeded from (seed, rank, step): reproducible, and unlike rank 0's and other ranks'."""
    model, opt = model_and_optimizer
    gen = torch.Generator().manual_seed(3)
    torch.rand(5, generator=gen)
    path = C.save_checkpoint(str(tmp_path), 4, DistEnv(), model, opt, gen,
                             {"tokens": 0, "elapsed": 0.0, "config": {}, "guard": {}})
    assert C.load_checkpoint(path, rank=0)["rng"].keys() >= {"torch", "python", "numpy", "prefix"}
    draws = {}
    for rank in (0, 1, 2, 1):
        rng = C.load_checkpoint(path, rank=rank)["rng"]
        assert rank == 0 or set(rng) == {"prefix"}
        g = torch.Generator()
        C.set_rng_state(rng, g, seed=C.fallback_seed(0, rank, 4))
        draw = (torch.rand(3, generator=g).tolist(), torch.rand(3).tolist())
        assert draws.setdefault(rank, draw) == draw  # the same rank: the same streams
    assert draws[0][0] == draws[1][0] == draws[2][0] == torch.rand(3, generator=gen).tolist()  # shared stream
    assert len({tuple(d[1]) for d in draws.values()}) == 3  # own streams differ
