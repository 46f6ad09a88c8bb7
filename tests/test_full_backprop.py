"""Full backpropagation through the token-by-token recurrence (``full_backprop=True``, ``--full-backprop``): its
loss and gradient against a reference written here from the raw weights (the recurrence recomputed from scratch at
every position with autograd on, no KV cache, the fusion from its weight tensors) and against the last pass of
K = T + 1 teacher-forced passes with gradient through all of them; rows of T = 11 in blocks of 4 (a block
boundary inside a document, a last block shorter than the others), document starts inside the rows, left padding;
the engine's step, DDP, the CLI, the FLOP records and the refusals."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import reference as R
from conftest import BOS, random_ids, tiny_model
from fullband import cli
from fullband.eval.flops import flop_parameters, training_flops
from fullband.training import distributed as D
from fullband.training.config import TrainConfig
from fullband.training.engine import forward_backward, prepare_layers, trained_loss
from fullband.training.hf_trainer import PassSchedule
from fullband.training.optimizer import build_optimizer, set_learning_rates
from fullband.utils.io import read_jsonl


def trained_looking(fusion: str = "residual", seed: int = 0):
    model = tiny_model(fusion=fusion, jitter=0.0, seed=seed).train()
    with torch.no_grad():  # the residual entry's output gain starts at 0 (no state at all): move it
        model.feedback.out_norm.weight.fill_(0.7)
    return model


def reference_ce_sum(model, ids: torch.Tensor, mask: torch.Tensor):
    """Summed next-token cross-entropy of the recurrence over unpadded rows ``ids`` (with the graph) and the count:
    position t's input is ``fusion(h_{t-1}, e_t)`` where ``mask`` allows, h recomputed from scratch on the inputs
    so far."""
    logits = model.backbone.get_output_embeddings()(R.recurrence_states(model, ids, mask))
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    return ce, ids[:, 1:].numel()


def grads_of(model, loss) -> dict:
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def assert_grads_close(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        err = (got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)
        assert err < 1e-4, (k, float(err))


def last_of_t_plus_1_passes(model, ids, attention_mask=None, labels=None):
    """The last pass's next-token loss of K = T + 1 passes, every pass with gradient (on ``labels``, default
    ``ids``; -100: not scored)."""
    T = ids.shape[1]
    out = model(input_ids=ids, attention_mask=attention_mask, num_passes=T + 1)
    targets = (ids if labels is None else labels)[:, 1:]
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)


@pytest.mark.parametrize("fusion,chunk", [("residual", 4), ("glu", 4), ("residual", 0)])
def test_full_backprop_equals_the_reference_and_the_last_of_t_plus_1_passes(fusion, chunk):
    """T = 11 in blocks of 4 (boundaries at 4 and 8, a last block of 3), BOS at 5 in every row and at 9 in one;
    fp32. Bugs caught: the state fed one position late or early, a state across a BOS, a block boundary that drops
    the carried state or the earlier blocks' keys and values (or their gradient), the gradient cut at the state."""
    model = trained_looking(fusion)
    ids = random_ids(3, 11, seed=4)
    ids[:, 5] = BOS
    ids[1, 9] = BOS
    mask = R.feedback_mask(ids, model.config.doc_start_token_id)
    ce, n = reference_ce_sum(model, ids, mask)
    ref_grads = grads_of(model, ce / n)
    out = model(input_ids=ids, labels=ids, full_backprop=True, backprop_chunk=chunk)
    assert out.pass_losses.shape == (1,) and out.passes_run == 1 and out.grad_passes_run == 1
    torch.testing.assert_close(out.loss.detach(), (ce / n).detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.pass_losses[0], out.loss.detach(), rtol=0, atol=0)
    grads = grads_of(model, out.loss)
    assert_grads_close(grads, ref_grads)
    slow = last_of_t_plus_1_passes(model, ids)
    torch.testing.assert_close(out.loss.detach(), slow.detach(), rtol=1e-5, atol=0)
    assert_grads_close(grads, grads_of(model, slow))


def test_every_backbone_family_equals_the_last_of_t_plus_1_passes(family):
    """Llama, GPT-2, Qwen2, Mistral: their caches read back block by block (blocks of 3 over T = 7)."""
    model = tiny_model(family, fusion="residual", jitter=0.0).train()
    with torch.no_grad():
        model.feedback.out_norm.weight.fill_(0.7)
    ids = random_ids(2, 7, seed=3)
    ids[0, 4] = BOS
    out = model(input_ids=ids, labels=ids, full_backprop=True, backprop_chunk=3)
    slow = last_of_t_plus_1_passes(model, ids)
    torch.testing.assert_close(out.loss.detach(), slow.detach(), rtol=1e-5, atol=0)
    assert_grads_close(grads_of(model, out.loss), grads_of(model, slow))


def test_padding_is_never_fed_back_and_activation_checkpointing_keeps_the_cache():
    """Left-padded rows (3 pads, then a token that is not a BOS) equal the reference on the rows without their pads and the last of
    K = T + 1 passes under the same mask (scored: the predictions of real tokens from real tokens; a pad's
    prediction of the BOS after it is not one); with HF's activation checkpointing on (which drops a layer's cache
    in training) the loss and gradient are the same."""
    model = trained_looking("glu")
    ids = random_ids(2, 10, seed=8)
    attn = torch.ones_like(ids)
    attn[1, :3] = 0
    ids[1, :3] = 0  # and no BOS after the pads: only the mask keeps the pad's state out of the first token
    ids[0, 6] = BOS
    labels = ids.masked_fill(attn == 0, -100)
    labels[1, 3] = -100
    ce0, n0 = reference_ce_sum(model, ids[:1], R.feedback_mask(ids[:1], BOS))
    ce1, n1 = reference_ce_sum(model, ids[1:, 3:], R.feedback_mask(ids[1:, 3:], BOS))
    ref = (ce0 + ce1) / (n0 + n1)
    ref_grads = grads_of(model, ref)
    out = model(input_ids=ids, attention_mask=attn, labels=labels, full_backprop=True, backprop_chunk=3)
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-5, atol=0)
    grads = grads_of(model, out.loss)
    assert_grads_close(grads, ref_grads)
    assert_grads_close(grads, grads_of(model, last_of_t_plus_1_passes(model, ids, attn, labels)))
    prepare_layers(model, checkpointing=True)
    again = model(input_ids=ids, attention_mask=attn, labels=labels, full_backprop=True, backprop_chunk=3)
    torch.testing.assert_close(again.loss.detach(), out.loss.detach(), rtol=1e-6, atol=0)
    assert_grads_close(grads_of(model, again.loss), grads)
    assert all(layer.gradient_checkpointing for layer in model.backbone.model.layers)  # switched back on after


def test_the_chunked_loss_and_the_z_loss_apply_to_the_recurrence():
    """``loss_chunk`` (no logits in the blocks: the loss from the final states, chunk by chunk) gives the loss and
    gradient of the full logits, z-loss included; the z-loss is ``c·mean(logsumexp^2)`` of the recurrence's
    logits (from the reference's final states through the LM head)."""
    model = trained_looking("glu")
    ids = random_ids(2, 9, seed=5)
    full = model(input_ids=ids, labels=ids, full_backprop=True, backprop_chunk=4, z_loss=0.01)
    chunked = model(input_ids=ids, labels=ids, full_backprop=True, backprop_chunk=4, z_loss=0.01, loss_chunk=5)
    assert chunked.logits is None and full.logits.shape == (2, 9, 97)
    lse = torch.logsumexp(full.logits[:, :-1].detach().double(), -1)
    assert float(full.z_loss) == pytest.approx(0.01 * float(lse.square().mean()), rel=1e-5)
    torch.testing.assert_close(chunked.loss.detach(), full.loss.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(chunked.z_loss, full.z_loss, rtol=1e-5, atol=0)
    assert_grads_close(grads_of(model, chunked.loss), grads_of(model, full.loss))
    ce, n = reference_ce_sum(model, ids, R.feedback_mask(ids, BOS))
    torch.testing.assert_close(full.pass_losses[0], (ce / n).detach(), rtol=1e-5, atol=0)


def test_the_recomputed_blocks_draw_the_forwards_jitter():
    """With jitter on (training), blocks recomputed in the backward draw the same noise as their forward: the
    gradient in blocks of 4 equals the one without recomputation from the same seed. Bug caught: a recomputation
    that draws fresh noise (a gradient of another forward than the one whose loss is reported)."""
    model = tiny_model(fusion="residual", jitter=0.5).train()
    with torch.no_grad():
        model.feedback.out_norm.weight.fill_(0.7)
    ids = random_ids(2, 11, seed=2)
    runs = []
    for chunk in (4, 0):
        torch.manual_seed(7)
        out = model(input_ids=ids, labels=ids, full_backprop=True, backprop_chunk=chunk)
        runs.append((out.loss.detach(), grads_of(model, out.loss)))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-6, atol=0)
    assert_grads_close(runs[0][1], runs[1][1])
    torch.manual_seed(8)
    other = model(input_ids=ids, labels=ids, full_backprop=True).loss.detach()
    assert float(other) != pytest.approx(float(runs[0][0]), rel=1e-6)  # the jitter is really on


def test_an_engine_step_equals_the_step_from_the_reference_gradient():
    """``--full-backprop`` through the engine: the config's pass options and step passes, two accumulated
    micro-batches (loss weight 1/2), the package's AdamW (fusion at 10x the LR) for two steps; the same optimizer
    fed the reference's gradient (the mean of the two micro-batches') gives the same weights. The guard's loss is
    the recurrence's."""
    cfg = TrainConfig(out="x", full_backprop=True, backprop_chunk=4, num_passes=2, lr=1e-3, fusion_lr_mult=10.0)
    cfg.validate()
    assert cfg.step_passes(2) == 1 and cfg.step_passes(1) == 1
    assert cfg.pass_options() == {"full_backprop": True, "backprop_chunk": 4}
    assert cfg.fed_back_evaluation() == ("exact", "exact")
    engine, ref = trained_looking("residual"), trained_looking("residual")
    start = [p.detach().clone() for p in ref.parameters()]
    micro = []
    for seed in (1, 2):
        ids = random_ids(2, 9, seed=seed)
        ids[0, 6] = BOS
        micro.append({"input_ids": ids, "labels": ids})
    opt_e = build_optimizer(engine, cfg, torch.device("cpu"))
    opt_r = build_optimizer(ref, cfg, torch.device("cpu"))
    for opt in (opt_e, opt_r):
        set_learning_rates(opt, 1e-3, 1e-2)
    for _ in range(2):
        loss, passes = forward_backward(engine, micro, cfg.step_passes(2), contextlib.nullcontext, 0.5,
                                        **cfg.loss_options(), **cfg.pass_options())
        terms = [reference_ce_sum(ref, m["input_ids"], R.feedback_mask(m["input_ids"], BOS)) for m in micro]
        ref_loss = sum(ce / n for ce, n in terms) / 2
        ref.zero_grad(set_to_none=True)
        ref_loss.backward()
        assert float(loss) / 2 == pytest.approx(float(ref_loss.detach()), rel=1e-5)
        assert trained_loss(passes.tolist(), len(passes)) == pytest.approx(float(loss), rel=1e-6)
        assert_grads_close({k: p.grad for k, p in engine.named_parameters()},
                           {k: p.grad for k, p in ref.named_parameters()})
        for opt in (opt_e, opt_r):
            opt.step()
            opt.zero_grad(set_to_none=True)
    # compared as updates: AdamW normalizes each element's gradient by its running RMS, so an element whose gradient
    # is near zero turns the 1e-6-relative rounding difference of the two gradients into a visible part of its step
    # (seen: 1.2e-6 of a 2e-3 step on one element of one machine, 0 on another); a wrong gradient moves most
    # elements by O(lr). Per tensor: the largest element's difference within 1% of the largest step, the norm of
    # the difference within 0.1% of the step's norm.
    for (name, a), b, w in zip(engine.named_parameters(), ref.parameters(), start):
        got, want = (a - w).detach(), (b - w).detach()
        assert (got - want).abs().max() <= 1e-2 * want.abs().max(), name
        assert (got - want).norm() <= 1e-3 * want.norm(), name
    assert not torch.equal(engine.feedback.value_proj.weight, trained_looking().feedback.value_proj.weight)


def test_flop_records_count_one_pass_and_its_recomputation():
    """A ``full_backprop`` record: one fused pass with gradient plus its recomputed forward (with the LM head),
    written from the parameter counts; without recomputation (``backprop_chunk`` 0) one fused pass."""
    fp = flop_parameters(tiny_model())
    N, L, d, Nf, T = fp["matmul_params"], fp["layers"], fp["hidden"], fp["fusion_params"], 16
    plain = 6 * N + 6 * L * T * d
    got = training_flops([{"num_passes": 2, "full_backprop": True, "backprop_chunk": 4}], T, T, fp)
    assert got["flops"] == pytest.approx(T * (plain + 6 * Nf + 2 * N + 2 * L * T * d + 2 * Nf), rel=1e-12)
    assert got["passes"] == 1
    flat = training_flops([{"num_passes": 2, "full_backprop": True, "backprop_chunk": 0}], T, T, fp)
    assert flat["flops"] == pytest.approx(T * (plain + 6 * Nf), rel=1e-12)


def test_full_backprop_refuses_what_it_cannot_take():
    model = tiny_model(fusion="glu").train()
    ids = random_ids(1, 6)
    for bad in ({"num_passes": 2}, {"grad_passes": 1}, {"pass_tol": 0.1}, {"use_cache": True},
                {"exact_states": True}, {"score_all_passes": True}, {"state_hook": lambda k, s: s}):
        with pytest.raises(ValueError, match="full_backprop"):
            model(input_ids=ids, labels=ids, full_backprop=True, **bad)
    with pytest.raises(ValueError, match="backprop_chunk"):
        model(input_ids=ids, labels=ids, full_backprop=True, backprop_chunk=-1)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with pytest.raises(ValueError, match="packed rows"):
        model(input_ids=ids, labels=ids, position_ids=packed, full_backprop=True)
    for extra, match in (({"exact_states": True, "grad_passes": 2}, "--exact-states"),
                         ({"grad_passes": 2}, "--grad-passes"), ({"pass_tol": 0.1}, "--pass-tol"),
                         ({"backprop_chunk": -1}, "--backprop-chunk")):
        with pytest.raises(ValueError, match=match):
            TrainConfig(out="x", full_backprop=True, **extra).validate()
    with pytest.raises(ValueError, match="FSDP2"):
        TrainConfig(out="x", full_backprop=True, parallel="fsdp").validate(world_size=2)
    assert PassSchedule.from_train_config(TrainConfig(out="x", full_backprop=True, backprop_chunk=5)).forward_options(
        2) == {"full_backprop": True, "backprop_chunk": 5}  # carried into the Trainer's schedule, not dropped
    for extra in ({"exact_states": True, "grad_passes": 2}, {"grad_passes": 2}, {"backprop_chunk": -1}):
        with pytest.raises(ValueError):
            PassSchedule(full_backprop=True, **extra)


def test_train_cli_runs_full_backprop_and_logs_it(tmp_path, data):
    """``fullband train --full-backprop``: the fed-back steps log one pass loss and the mode, and ``--dry-run``
    counts those steps as one pass and its recomputation."""
    out = tmp_path / "run"
    args = ["train", "--preset", "micro", "--steps", "2", "--out", str(out), "--seed", "0", "--data", data,
            "--vocab-size", "300", "--seq-len", "12", "--batch-size", "2", "--grad-accum", "2", "--no-progress",
            "--no-tensorboard", "--no-plot", "--feedback-start", "0.5", "--full-backprop", "--backprop-chunk", "5",
            "--eval-rows", "2"]
    assert cli.main(args) == 0
    train = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("split") == "train"]
    assert [r.get("full_backprop") for r in train] == [None, True]
    assert train[1]["backprop_chunk"] == 5 and len(train[1]["pass_losses"]) == 1
    assert train[1]["loss"] == pytest.approx(train[1]["pass_losses"][0], rel=1e-6)


def test_dry_run_prints_the_full_backprop_plan(capsys):
    assert cli.main(["train", "--dry-run", "--json", "--preset", "micro", "--seq-len", "64", "--steps", "10",
                     "--feedback-start", "0.5", "--deep-fraction", "0", "--full-backprop"]) == 0
    plan = json.loads(capsys.readouterr().out)
    per = plan["flops_per_step"]
    assert 1.2 < per["2"] / per["1"] < 1.45  # one pass with gradient, its recomputation: about 4/3 of plain
    assert plan["exact_states_pass"]["mode"] == "full_backprop"
    assert plan["exact_states_pass"]["sequential_token_steps"] == 5 * 64
    assert plan["passes_with_graph"] == 1


def _ddp_worker(rank: int, root: str) -> None:
    """Rank ``rank`` of 2 (gloo, DDP): a full-backprop step on its half of 4 rows, its loss and gradients."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=2)
    env = D.DistEnv(rank=rank, world_size=2, backend="gloo")
    try:
        model = D.wrap_model(trained_looking("residual"), env, "ddp")
        ids = random_ids(4, 11, seed=4)
        ids[:, 5] = BOS
        ids = ids[2 * rank:2 * rank + 2]
        out = model(input_ids=ids, labels=ids, full_backprop=True, backprop_chunk=4)
        out.loss.backward()
        grads = {n: p.grad.tolist() for n, p in D.unwrap(model).named_parameters() if p.grad is not None}
        with open(f"{root}/rank{rank}.json", "w") as f:
            json.dump({"loss": float(out.loss), "grads": grads}, f)
    finally:
        D.shutdown(env)


def test_full_backprop_under_ddp_follows_one_process(tmp_path):
    """Two DDP ranks (2 rows each, the blocks recomputed in the backward on each) all-reduce to one process's
    gradient on the 4 rows (to the error of sums in another order)."""
    mp.spawn(_ddp_worker, args=(str(tmp_path),), nprocs=2, join=True)
    got = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    model = trained_looking("residual")
    ids = random_ids(4, 11, seed=4)
    ids[:, 5] = BOS
    out = model(input_ids=ids, labels=ids, full_backprop=True, backprop_chunk=4)
    assert (got[0]["loss"] + got[1]["loss"]) / 2 == pytest.approx(float(out.loss), rel=1e-5)
    want = grads_of(model, out.loss)
    for g in got:
        assert_grads_close({k: torch.tensor(v) for k, v in g["grads"].items()}, want)
