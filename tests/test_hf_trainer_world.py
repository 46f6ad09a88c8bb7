"""HF ``Trainer`` with the K-pass objective on 2 processes (gloo, CPU): one step equals the step on 1 process and
the package's own engine step on the same global batch -- loss, per-pass losses, gradient norm, clipped gradients
and weights after the step (the loss scaled as ``Trainer.compute_loss`` scales it for ``num_items_in_batch``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest
import torch

import hf_trainer_ranks as R
from fullband.training.config import TrainConfig
from fullband.training.engine import forward_backward
from fullband.training.optimizer import build_optimizer, clip_gradients, set_learning_rates
from fullband.model.feedback import prefix_row_seeds
from fullband.training.pretrain import feedback_mask_for

from test_train import subprocess_env

EPS = torch.finfo(torch.float32).eps
# a loss, or one gradient entry, is a reduction over the global batch's B x T positions: summed in another order
# (two processes' halves, then DDP's average) it may differ by up to that many roundings
REL = R.ROWS * R.T * EPS


def _two_processes(out) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(os.path.dirname(__file__), "hf_trainer_ranks.py"), str(out)]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:  # a hung rank: kill the launcher's group, and the ranks (their own sessions)
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if str(out).encode() in f.read():
                        os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        proc.communicate()
        raise AssertionError("the 2-process Trainer step did not finish in 240 s")
    assert proc.returncode == 0, err[-3000:]


def _engine_step(ids: torch.Tensor):
    """The package's engine on the global batch ``ids`` (in the order the trainer's sampler drew its rows): its own
    prefix-mixing draw (``feedback_mask_for`` over the global batch, each row seeded by its place in it at step 0,
    micro-batch 0, as the trainer documents), forward + backward, per-group clipping to ``max_grad_norm``, its
    AdamW with the fusion at 10x the LR."""
    model = R.initial_model().train()
    seeds = prefix_row_seeds(R.SCHEDULE["seed"], 0, range(ids.shape[0]))
    mask = feedback_mask_for(ids, model.config.doc_start_token_id, R.SCHEDULE["prefix_mix"], seeds)
    cfg = TrainConfig(out="x", lr=R.LR, weight_decay=0.1, beta1=0.9, beta2=0.95, fusion_lr_mult=10.0)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    set_learning_rates(opt, R.LR, R.LR)
    loss, passes = forward_backward(model, [{"input_ids": ids, "labels": ids, "feedback_mask": mask}], 2,
                                    contextlib.nullcontext,
                                    feedback_weight=R.SCHEDULE["feedback_weight"])
    fusion = [p for n, p in model.named_parameters() if n.startswith("feedback.")]
    backbone = [p for n, p in model.named_parameters() if not n.startswith("feedback.")]
    norms = clip_gradients(backbone, R.MAX_GRAD_NORM), clip_gradients(fusion, R.MAX_GRAD_NORM)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    return {"ids": ids, "mask": mask, "loss": float(loss), "passes": passes.tolist(), "norms": norms,
            "grads": grads, "weights": dict(model.named_parameters())}


def _adam_room(g: torch.Tensor, lr: float) -> torch.Tensor:
    """How far AdamW's first step ``lr * g / (|g| + 1e-8)`` (bias-corrected: m = g, v = g^2) can move for a gradient
    error of REL x max|g| (it is steep where |g| is near that error)."""
    d = REL * g.abs().max()
    u = lambda x: x / (x.abs() + 1e-8)  # noqa: E731
    return lr * ((u(g + d) - u(g)).abs().maximum((u(g - d) - u(g)).abs()))


def _same_step(got: dict, ref: dict, what: str) -> None:
    for name, g in ref["grads"].items():
        assert (got["grads"][name] - g).abs().max() <= REL * g.abs().max(), (what, name)
    for name, w in ref["weights"].items():
        lr = R.LR * (10.0 if name.startswith("feedback.") else 1.0)
        # plus the roundings of the step's few fp32 operations (two AdamW implementations: fused, foreach) on values
        # of the size of the new weight or of the LR
        room = _adam_room(ref["grads"][name], lr) + 4 * EPS * w.detach().abs().clamp_min(lr)
        assert ((got["weights"][name] - w.detach()).abs() <= room).all(), (what, name)


def test_two_process_trainer_step_equals_one_process_and_the_engine(tmp_path):
    """The trainer's loss on N processes is multiplied by N as ``Trainer.compute_loss`` does (``num_items_in_batch``
    counts every process's tokens; DDP averages the gradients): without it loss, per-pass losses and gradients are
    1/N of the truth and ``max_grad_norm`` clips N times too loosely. Clipping bites (both groups' norms above
    ``max_grad_norm``); prefix mixing is on and the engine draws its own mask, which the trainer's processes
    reproduce between them."""
    one = tmp_path / "one"
    one.mkdir()
    R.run(str(one))
    single = torch.load(one / "rank0.pt")
    assert sorted(single["rows"].tolist()) == sorted(R.global_batch().tolist())  # the 4 rows, in the sampler's order
    ref = _engine_step(single["rows"])
    assert min(ref["norms"]) > 2 * R.MAX_GRAD_NORM  # clipping bites on both groups
    two = tmp_path / "two"
    two.mkdir()
    _two_processes(two)
    ranks = [torch.load(two / f"rank{r}.pt") for r in range(2)]
    # the same global batch, and every process masks its rows as the engine masked them (its own draw)
    assert torch.equal(single["masks"], ref["mask"])
    assert torch.equal(torch.cat([r["rows"] for r in ranks]), single["rows"])
    assert torch.equal(torch.cat([r["masks"] for r in ranks]), single["masks"])
    assert not ref["mask"].all() and ref["mask"][:, 1:].sum() < ref["mask"].shape[0] * (R.T - 1) - 2  # mixing
    norm = float(torch.tensor(ref["norms"]).norm())
    for what, got in (("1 process", single), ("2 processes, rank 0", ranks[0]), ("2 processes, rank 1", ranks[1])):
        log = got["log"]
        assert log["loss"] == pytest.approx(ref["loss"], rel=REL), what
        assert [log["loss_pass1"], log["loss_pass2"]] == pytest.approx(ref["passes"], rel=REL), what
        assert log["grad_norm"] == pytest.approx(norm, rel=REL), what
        _same_step(got, ref, what)
