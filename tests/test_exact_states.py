"""The exact recurrence at linear cost (``exact_states=True``): the token-by-token states, then N teacher-forced
gradient passes, against a reference written here from the raw weights (the recurrence recomputed from scratch at
every position, no KV cache; the gradient passes re-run on ``inputs_embeds`` built here) and against the K-pass
forward with ``K = T + 1 + N, grad_passes = N``, which reaches the same states by brute force."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as G

import reference as R
from conftest import BOS, random_ids, reorder_rtol, tiny_backbone_config, tiny_model
from transformers import AutoModelForCausalLM

from fullband import FullBandwidthForCausalLM
from fullband.training import distributed as D
from fullband.training.engine import prepare_layers


def shift(h: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)


@torch.no_grad()
def exact_hidden(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The recurrence's final states, each position recomputed from scratch on the inputs fused so far."""
    return R.recurrence_states(model, ids, mask)


def reference_step(model, ids: torch.Tensor, n: int, mask: torch.Tensor):
    """N gradient passes from the exact states: pass 1 fuses them shifted right by one, pass k the output of pass
    k - 1; the loss is the mean of the passes' next-token cross-entropies. Returns (pass losses, loss, grads)."""
    model.zero_grad(set_to_none=True)
    h = exact_hidden(model, ids, mask)
    e = model.backbone.get_input_embeddings()(ids)
    losses = []
    for _ in range(n):
        u = torch.where(mask[..., None], R.fuse(model, shift(h), e), e)
        h, logits = R._final(model, u)
        losses.append(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return torch.stack(losses).detach(), loss.detach(), grads


def package_step(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    return out, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, want: dict, scale: float = 1.0) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        w = want[k] * scale
        err = (got[k] - w).abs().max() / w.abs().max().clamp_min(1e-12)
        assert err < 1e-4, (k, float(err))


@pytest.mark.parametrize("fusion", ["glu", "residual"])
@pytest.mark.parametrize("n", [1, 2])
def test_exact_states_then_n_gradient_passes_equal_the_reference(fusion, n):
    """Rows of 12 with a document start inside (BOS at 5 and 9: the state must not cross it); fp32. Bugs caught:
    the exact states not shifted (or shifted twice), a state across a BOS, the first gradient pass fed something
    other than the exact states (its loss would not be the recurrence's), the gradient cut at the wrong pass."""
    model = tiny_model(fusion=fusion, jitter=0.0).train()
    with torch.no_grad():  # a trained-looking fusion (the residual entry's gain starts at 0: no state at all)
        model.feedback.out_norm.weight.fill_(0.7)
    ids = random_ids(3, 12, seed=4)
    ids[:, 5] = BOS
    ids[1, 9] = BOS
    mask = R.feedback_mask(ids, model.config.doc_start_token_id)
    ref_losses, ref_loss, ref_grads = reference_step(model, ids, n, mask)
    out, grads = package_step(model, ids, num_passes=n, exact_states=True)
    assert out.pass_losses.shape == (n,) and out.passes_run == n and out.grad_passes_run == n
    torch.testing.assert_close(out.pass_losses, ref_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(out.loss.detach(), ref_loss, rtol=1e-5, atol=0)
    # the first gradient pass's loss is the exact recurrence's (its logits, from the package's own recurrence)
    exact_loss = R.next_token_loss(R.recurrence_logits(model, ids), ids)
    assert float(out.pass_losses[0]) == pytest.approx(exact_loss, rel=reorder_rtol(3 * 11, 32, 64, 97))
    assert_grads_close(grads, ref_grads)


def test_the_state_pass_runs_without_dropout_and_the_gradient_passes_with_it():
    """A GPT-2 backbone with its dropout (0.1, built from config), in training mode: the token-by-token pass gives
    the states of the reference recurrence computed in evaluation mode (no dropout masks) and leaves every module in
    training mode; the gradient pass from them is the reference pass run in training mode with the same RNG
    (so the state pass drew no random numbers), and two draws of it differ (dropout still on there)."""
    cfg = tiny_backbone_config("gpt2")
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.1
    torch.manual_seed(0)
    backbone = AutoModelForCausalLM.from_config(cfg)
    torch.manual_seed(1)
    model = FullBandwidthForCausalLM.from_backbone(backbone, fusion="glu", jitter=0.0).eval()
    with torch.no_grad():
        model.feedback.out_norm.weight.fill_(0.7)
    ids = random_ids(2, 10, seed=3)
    mask = R.feedback_mask(ids, model.config.doc_start_token_id)
    want = exact_hidden(model, ids, mask)  # evaluation mode: no dropout
    model.train()
    got = model.recurrent_forward(ids, need_logits=False).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # dropout would move them by ~0.1
    assert all(m.training for m in model.modules())

    def reference_loss(seed):
        torch.manual_seed(seed)
        e = model.backbone.get_input_embeddings()(ids)
        _, logits = R._final(model, torch.where(mask[..., None], R.fuse(model, shift(want), e), e))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    losses = []
    for seed in (5, 6):
        torch.manual_seed(seed)
        losses.append(model(input_ids=ids, labels=ids, exact_states=True, num_passes=1).loss.detach())
        torch.testing.assert_close(losses[-1], reference_loss(seed).detach(), rtol=1e-5, atol=0)
    assert abs(float(losses[0] - losses[1])) > 1e-3  # the gradient pass draws its dropout masks


def test_exact_states_equal_t_plus_1_plus_n_passes_with_n_gradient_passes():
    """The brute-force form: K = T + 1 + N passes, the last N with gradient (the loss's λ/(K - 1) undone)."""
    model = tiny_model(fusion="residual", jitter=0.0).train()
    with torch.no_grad():
        model.feedback.out_norm.weight.fill_(0.7)
    ids, T, n = random_ids(2, 10, seed=6), 10, 2
    ids[0, 4] = BOS
    fast, fast_grads = package_step(model, ids, num_passes=n, exact_states=True)
    K = T + 1 + n
    slow, slow_grads = package_step(model, ids, num_passes=K, grad_passes=n)
    torch.testing.assert_close(fast.pass_losses, slow.pass_losses[-n:], rtol=1e-5, atol=0)
    assert torch.isnan(slow.pass_losses[:-n]).all()  # the passes without gradient are not scored
    # slow's loss is λ·(sum of the N gradient terms)/(K - 1): its gradient, rescaled, is the mean's
    assert_grads_close(fast_grads, slow_grads, scale=(K - 1) / (model.config.feedback_weight * n))


def test_padding_is_never_fed_back_and_checkpointing_keeps_the_cache():
    """Left-padded rows (the pad's state is not fed back) equal the brute-force K-pass form; with HF's activation
    checkpointing on, the token-by-token pass still reads its KV cache (it runs without gradient)."""
    model = tiny_model(fusion="glu", jitter=0.0).train()
    ids = random_ids(2, 9, seed=8)
    attn = torch.ones_like(ids)
    attn[1, :3] = 0
    ids[1, :3] = 0
    ids[1, 3] = BOS
    n, K = 1, 9 + 1 + 1
    fast, fast_grads = package_step(model, ids, attention_mask=attn, num_passes=n, exact_states=True)
    slow, slow_grads = package_step(model, ids, attention_mask=attn, num_passes=K, grad_passes=n)
    torch.testing.assert_close(fast.pass_losses, slow.pass_losses[-n:], rtol=1e-5, atol=0)
    assert_grads_close(fast_grads, slow_grads, scale=(K - 1) / (model.config.feedback_weight * n))
    prepare_layers(model, checkpointing=True)
    again, again_grads = package_step(model, ids, attention_mask=attn, num_passes=n, exact_states=True)
    torch.testing.assert_close(again.pass_losses, fast.pass_losses, rtol=1e-6, atol=0)
    assert_grads_close(again_grads, fast_grads)


def test_exact_states_refuse_what_they_cannot_take():
    model = tiny_model(fusion="glu").train()
    ids = random_ids(1, 6)
    for bad in ({"grad_passes": 1}, {"pass_tol": 0.1}, {"use_cache": True}):
        with pytest.raises(ValueError, match="exact_states"):
            model(input_ids=ids, labels=ids, num_passes=1, exact_states=True, **bad)


def _fsdp_worker(rank: int, root: str) -> None:
    """Rank ``rank`` of 2 (gloo, FSDP2): an exact-states step on its half of 4 rows; its loss, the full gradients
    and the number of all-gathers the forward ran."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=2)
    env = D.DistEnv(rank=rank, world_size=2, backend="gloo")
    try:
        model = tiny_model(fusion="residual", jitter=0.0).train()
        with torch.no_grad():
            model.feedback.out_norm.weight.fill_(0.7)
        model = D.wrap_model(model, env, "fsdp")
        calls = []
        real = G.foreach_all_gather
        G.foreach_all_gather = lambda *a, **k: calls.append(1) or real(*a, **k)
        ids = random_ids(4, 12, seed=4)[2 * rank:2 * rank + 2]
        out = model(input_ids=ids, labels=ids, num_passes=2, exact_states=True)
        gathers = len(calls)
        G.foreach_all_gather = real
        out.loss.backward()
        grads = {n: p.grad.full_tensor().tolist() for n, p in model.named_parameters() if p.grad is not None}
        with open(f"{root}/rank{rank}.json", "w") as f:
            json.dump({"loss": float(out.loss), "gathers": gathers, "grads": grads}, f)
    finally:
        D.shutdown(env)


def test_exact_states_under_fsdp_gather_each_layer_once_and_follow_one_process(tmp_path):
    """Two FSDP2 ranks (2 rows each) give one process's loss and gradients on the 4 rows (to the error of sums in
    another order), and the forward all-gathers each decoder layer once for the whole token-by-token pass (plus
    once per gradient pass), not once per token: 2 layers x (1 + 2 passes) + the root's, against 2 x (12 + 2) + 1."""
    mp.spawn(_fsdp_worker, args=(str(tmp_path),), nprocs=2, join=True)
    got = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert [g["gathers"] for g in got] == [2 * 3 + 1] * 2
    model = tiny_model(fusion="residual", jitter=0.0).train()
    with torch.no_grad():
        model.feedback.out_norm.weight.fill_(0.7)
    ids = random_ids(4, 12, seed=4)
    out, grads = package_step(model, ids, num_passes=2, exact_states=True)
    rtol = reorder_rtol(4 * 11, 32, 64, 97)
    assert (got[0]["loss"] + got[1]["loss"]) / 2 == pytest.approx(float(out.loss), rel=rtol)
    # FSDP averages the two ranks' gradients: the mean over 4 rows, as one process's
    assert_grads_close({k: torch.tensor(v) for k, v in got[0]["grads"].items()}, grads)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_row_cache_equals_a_dynamic_cache_through_growth_crop_and_selection(family):
    """The token pass's cache (:func:`fullband.model.cache.row_cache`) against transformers' ``DynamicCache`` on
    the plain backbone: a prefill, token steps past its capacity (the buffer doubles), a crop, a batch selection
    and more steps, each step's logits equal; with padding (the mask over the tokens written, not over the
    buffer's empty tail)."""
    from transformers import DynamicCache
    from fullband.model.cache import GrowingLayer, row_cache
    backbone = tiny_model(family).backbone
    ids = random_ids(3, 14, seed=4)
    attn = torch.ones_like(ids)
    attn[1, :3] = 0  # left padding in row 1
    caches = [row_cache(backbone.config, 4), DynamicCache(config=backbone.config)]
    assert all(isinstance(layer, GrowingLayer) for layer in caches[0].layers)

    def step(cache, start, end, rows=slice(None)):
        return backbone(input_ids=ids[rows, start:end], attention_mask=attn[rows, :end], cache=cache,
                        use_cache=True).logits

    with torch.no_grad():
        for rows, (s, e) in [(slice(None), (0, 3))] + [(slice(None), (t, t + 1)) for t in range(3, 9)]:
            got, want = (step(c, s, e, rows) for c in caches)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # dropout would move them by ~0.1
        assert caches[0].layers[0]._key_buffer.shape[-2] >= 9 > 4  # it grew past its capacity
        for c in caches:
            c.crop(-2)  # 9 tokens -> 7
            c.batch_select_indices(torch.tensor([0, 2]))
        for t in range(7, 12):
            got, want = (step(c, t, t + 1, [0, 2]) for c in caches)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # dropout would move them by ~0.1
        assert caches[0].get_seq_length() == caches[1].get_seq_length() == 12


def test_row_cache_keeps_sliding_window_layers():
    from transformers import MistralConfig
    from transformers.cache_utils import DynamicSlidingWindowLayer
    from fullband.model.cache import row_cache
    cfg = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=4, vocab_size=64)
    assert all(type(layer) is DynamicSlidingWindowLayer for layer in row_cache(cfg, 16).layers)
