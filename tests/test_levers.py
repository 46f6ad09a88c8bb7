"""The memory and speed levers of ``fullband train``: chunked cross-entropy and the z-loss (against plain torch on
full logits), activation checkpointing (same losses and gradients, fewer saved activations) and ``--compile``
(same per-step losses as eager, and compiled graphs really ran)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import random_ids, tiny_model

from fullband import cli
from fullband.model.lm_loss import chunked_lm_loss, z_loss_from_logits
from fullband.training.config import TrainConfig
from fullband.training.engine import prepare_layers
from fullband.utils.io import read_jsonl


def _reference(head, hidden, labels, num_items=None, z=0.0):
    """Plain torch on full logits: position t predicts label t+1; -100 ignored; sum / num_items or mean."""
    logits = head(hidden).float()[:, :-1].reshape(-1, head.out_features)
    target = labels[:, 1:].reshape(-1)
    keep = target != -100
    ce_sum = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
    lse = torch.log(torch.exp(logits.double()).sum(-1)).float()  # log Z by its definition
    z_sum = (lse[keep] ** 2).sum()
    denom = keep.sum() if num_items is None else num_items
    return ce_sum / denom, z * z_sum / denom


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("num_items", [None, torch.tensor(31.0)])
def test_chunked_loss_and_gradients_match_full_logits(num_items):
    """B·T = 26 positions in chunks of 7 (a ragged last chunk of 5), labels with -100 in the middle and at the end
    of a row, and gradient-accumulation normalisation. Bugs caught: a missing shift, -100 counted in the mean, the
    last ragged chunk dropped, num_items_in_batch ignored, a chunk's gradient lost in the recompute."""
    torch.manual_seed(0)
    B, T, d, V = 2, 13, 16, 37
    head = torch.nn.Linear(d, V, bias=False)
    hidden = torch.randn(B, T, d, requires_grad=True)
    labels = torch.randint(0, V, (B, T))
    labels[0, 3:6] = -100
    labels[1, -2:] = -100
    ce, z = chunked_lm_loss(head, hidden, labels, 7, num_items_in_batch=num_items, z_loss=1e-2)
    ref_ce, ref_z = _reference(head, hidden, labels, num_items, z=1e-2)
    torch.testing.assert_close(ce, ref_ce, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z, ref_z, rtol=1e-5, atol=1e-7)
    for got, want in zip(_grads(ce + z, hidden, head.weight), _grads(ref_ce + ref_z, hidden, head.weight)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # without a z-loss the term is absent; without gradient the value is the same
    ce0, z0 = chunked_lm_loss(head, hidden, labels, 7, num_items_in_batch=num_items)
    assert z0 is None
    with torch.no_grad():
        torch.testing.assert_close(chunked_lm_loss(head, hidden, labels, 5, num_items_in_batch=num_items)[0], ce0)
    # the z-loss of materialised logits (the unchunked path) is the same term
    torch.testing.assert_close(z_loss_from_logits(head(hidden), labels, 1e-2, num_items), ref_z, rtol=1e-5, atol=1e-7)


def test_model_chunked_loss_equals_hf_loss_over_k_passes(family):
    """The K-pass forward with --loss-chunk: same loss, per-pass losses and gradients as the backbone's own loss on
    full logits (with ``num_items_in_batch``), for every backbone family; no logits are returned. With --z-loss the
    pass losses stay the cross-entropies and loss - combine(pass losses) is the reported z term."""
    ids = random_ids(2, 11, seed=3)
    labels = ids.clone()
    labels[1, :4] = -100
    runs = {}
    for chunk in (0, 6):
        model = tiny_model(family, fusion="residual").train()
        torch.manual_seed(7)  # the same jitter in both runs
        out = model(input_ids=ids, labels=labels, num_passes=2, loss_chunk=chunk,
                    num_items_in_batch=torch.tensor(23.0))  # gradient accumulation's normaliser
        out.loss.backward()
        runs[chunk] = (out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (full, g_full), (chunked, g_chunk) = runs[0], runs[6]
    assert full.logits is not None and chunked.logits is None
    torch.testing.assert_close(chunked.loss, full.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked.pass_losses, full.pass_losses, rtol=1e-6, atol=1e-6)
    assert g_full.keys() == g_chunk.keys()
    for n in g_full:
        torch.testing.assert_close(g_chunk[n], g_full[n], rtol=1e-4, atol=1e-6, msg=n)

    model = tiny_model(family, fusion="residual").eval()
    with torch.no_grad():
        plain = model(input_ids=ids, labels=labels, num_passes=2)
        for chunk in (0, 4):
            out = model(input_ids=ids, labels=labels, num_passes=2, loss_chunk=chunk, z_loss=1e-3)
            torch.testing.assert_close(out.pass_losses, plain.pass_losses, rtol=1e-6, atol=1e-6)
            lam = model.config.feedback_weight
            want = plain.pass_losses[0] + lam * plain.pass_losses[1]
            torch.testing.assert_close(out.loss - out.z_loss, want, rtol=1e-6, atol=1e-6)
            # the z term by hand: c · mean(logsumexp^2) of pass 1's logits (a K = 1 forward) and pass 2's (the
            # plain forward's last pass), combined as the losses are
            sup = labels[:, 1:] != -100
            z1, z2 = (1e-3 * (torch.logsumexp(lg[:, :-1], -1)[sup] ** 2).mean()
                      for lg in (model(input_ids=ids, num_passes=1).logits, plain.logits))
            torch.testing.assert_close(out.z_loss, z1 + lam * z2, rtol=1e-5, atol=1e-8)


def test_chunked_loss_refuses_post_processed_logits():
    model = tiny_model("llama")
    model.config.text_config.final_logit_softcapping = 30.0
    ids = random_ids(1, 5)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        model(input_ids=ids, labels=ids, loss_chunk=4)
    with pytest.raises(ValueError, match="loss_chunk"):
        model(input_ids=ids, labels=ids, loss_chunk=-1)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saved for the backward while ``fn`` ran (parameters excluded)."""
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def test_activation_checkpointing_same_losses_and_gradients_fewer_saved_activations():
    """HF activation checkpointing through prepare_layers: the K-pass loss and every gradient are the same as
    without (bitwise: the recomputation replays the same ops), and the tensors saved for the backward outside the
    checkpointed layers shrink (the layers' insides are recomputed)."""
    ids = random_ids(2, 16, seed=5)
    results = {}
    for ckpt in (False, True):
        model = tiny_model("llama", fusion="residual").train()
        prepare_layers(model, checkpointing=ckpt)
        torch.manual_seed(11)
        out, saved = _saved_bytes(lambda: model(input_ids=ids, labels=ids, num_passes=3))
        out.loss.backward()
        results[ckpt] = (out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}, saved)
    (l0, g0, s0), (l1, g1, s1) = results[False], results[True]
    assert torch.equal(l0, l1)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    assert s1 < 0.5 * s0, (s0, s1)


def test_bad_lever_values_are_one_line_errors(capsys):
    for flag, value in (("--loss-chunk", "-1"), ("--z-loss", "-0.1")):
        rc = cli.main(["train", "--dry-run", "--preset", "micro", flag, value])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and flag in err[0], err
    fields = {f: TrainConfig.__dataclass_fields__[f].metadata for f in
              ("compile", "activation_checkpointing", "loss_chunk", "z_loss")}
    # float rounding only: the memory/speed levers may change on --resume; the z-loss changes the objective
    assert [fields[f]["traj"] for f in fields] == [False, False, False, True]


MICRO = ["train", "--preset", "micro", "--steps", "4", "--seed", "0", "--vocab-size", "300", "--seq-len", "32",
         "--batch-size", "4", "--no-progress", "--no-tensorboard", "--no-plot", "--feedback-start", "0.5",
         "--eval-every", "4", "--eval-rows", "4"]


def _train_rows(out):
    return [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("split") == "train"]


def _same_losses(a, b, rel):
    assert [r["num_passes"] for r in a] == [r["num_passes"] for r in b] == [1, 1, 2, 2]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=rel), (x["step"], x["loss"], y["loss"])
        assert y["pass_losses"] == pytest.approx(x["pass_losses"], rel=rel)


def test_fsdp2_with_checkpointing_and_chunked_loss_trains_like_fsdp2_without(data, tmp_path):
    """FSDP2 over 2 processes with --activation-checkpointing (applied before fully_shard) and --loss-chunk (the
    LM head's chunks recomputed in the backward, under FSDP2's unsharding) logs the losses of the same FSDP2 run
    without them (to 1e-6: the chunked sum's order)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
              "fullband.cli", *MICRO, "--data", data, "--parallel", "fsdp"]
    for name, levers in (("plain", []), ("levers", ["--activation-checkpointing", "--loss-chunk", "24"])):
        p = subprocess.run([*launch, "--out", str(tmp_path / name), *levers], env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
    _same_losses(_train_rows(tmp_path / "plain"), _train_rows(tmp_path / "levers"), 1e-6)


def test_compile_checkpointing_and_chunked_loss_train_like_eager(data, tmp_path):
    """Four micro-preset steps (K = 1, 1, 2, 2) of `fullband train` with --compile --activation-checkpointing
    --loss-chunk against the eager run: per-step losses equal to 1e-5 relative, and inductor really compiled
    graphs (a compile that silently ran eager would pass the loss check alone)."""
    from torch._dynamo.utils import counters

    assert cli.main([*MICRO, "--data", data, "--out", str(tmp_path / "eager")]) == 0
    counters.clear()
    assert cli.main([*MICRO, "--data", data, "--out", str(tmp_path / "levers"), "--compile",
                     "--activation-checkpointing", "--loss-chunk", "48"]) == 0
    assert counters["stats"]["unique_graphs"] >= 3  # attention, MLP and norm graphs at least
    _same_losses(_train_rows(tmp_path / "eager"), _train_rows(tmp_path / "levers"), 1e-5)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset needs Linux")
def test_bench_train_memory_row_shows_the_chunked_loss():
    """`fullband bench train --memory` at a 20k vocabulary (the logits dominate a micro model's step: 256 tokens x
    20,000 x 4 B = 20 MB per fp32 logits tensor): the chunked loss's step peaks at well under half of the
    full-logits step. Bug caught: a chunked path that still materialises [tokens, V] logits somewhere."""
    # a fresh process, as the benchmark is run: inside the test session the allocator's state left by earlier tests
    # (arenas, freed blocks kept resident) blurs a step's peak resident set (seen: 33-40 MB vs 61-82 MB)
    cmd = [sys.executable, "-m", "fullband.cli", "bench", "train", "--preset", "micro", "--batch-size", "4",
           "--seq-len", "64", "--vocab-size", "20000", "--steps", "3", "--warmup", "1", "--threads", "1",
           "--memory", "--loss-chunk", "32", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads(done.stdout)
    peak = {k: r["peak_step_bytes_all"] for k, r in res["results"].items()}
    assert max(peak["K2_chunk"]) < 0.5 * min(peak["K2"]), peak
