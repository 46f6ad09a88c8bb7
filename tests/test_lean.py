"""The lean token step (:mod:`fullband.model.lean`) against the recurrence written from the equations
(:mod:`reference`: every position recomputed from scratch on raw weights, no KV cache, no package helper), on every
family, with document starts inside rows, left padding and packed rows; its compiled form; the families it refuses."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, CohereConfig, GemmaConfig

import fullband
import reference as R
from conftest import BOS, VOCAB, random_ids, reorder_rtol, tiny_model
from fullband.model import lean

HIDDEN, MLP = 32, 64


def assert_close(got, want):
    # fp32 sums over the hidden and MLP widths in another order (the cached pass against a full recomputation)
    rtol = reorder_rtol(HIDDEN, MLP, VOCAB)
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()))


def rows_with_document_starts(batch=3, length=18, seed=0):
    ids = random_ids(batch, length, seed)
    ids[0, length // 2] = BOS  # a document start inside a row: the state is reset there
    ids[-1, length - 4] = BOS
    return ids


@pytest.mark.parametrize("step", ["lean", "off"])
def test_token_pass_matches_the_equations(family, step):
    model = tiny_model(family)
    model.token_step = step
    ids = rows_with_document_starts()
    out = model.recurrent_forward(ids)
    assert_close(out.logits, R.recurrence_logits(model, ids))


def test_lean_runs_on_the_families_it_can_and_gpt2_falls_back(family):
    model = tiny_model(family)
    assert (lean.lean_stack(model.backbone) is None) == (family == "gpt2")


def test_left_padded_rows_match_each_row_alone(family):
    model = tiny_model(family)
    ids = rows_with_document_starts(3, 16, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ids[1, 5], ids[2, 2] = BOS, BOS
    got = model.recurrent_forward(ids, attention_mask=mask).logits
    for b in range(3):
        real = mask[b].bool()
        assert torch.isfinite(got[b]).all()  # padding positions too: they attend to themselves, never to nothing
        assert_close(got[b:b + 1, real], R.recurrence_logits(model, ids[b:b + 1, real]))


def test_packed_rows_run_together_and_match_each_sample_alone(family):
    model = tiny_model(family)
    ids = random_ids(2, 20, seed=2, bos=False)
    cuts = [(0, 6), (6, 15), (15, 20)]  # three packed samples a row, no BOS: the position ids restart
    position_ids = torch.cat([torch.arange(e - s) for s, e in cuts]).expand(2, 20)
    got = model.recurrent_forward(ids, position_ids=position_ids).logits
    for s, e in cuts:
        sample = ids[:, s:e]
        mask = torch.ones_like(sample, dtype=torch.bool)
        mask[:, 0] = False
        assert_close(got[:, s:e], R.recurrence_logits(model, sample, mask=mask))


def test_the_packed_pass_is_one_batched_pass_not_a_loop_over_samples(monkeypatch):
    model = tiny_model("llama")
    calls = []
    real = lean.TokenPass.step
    monkeypatch.setattr(lean.TokenPass, "step", lambda self, *a: calls.append(self.B) or real(self, *a))
    ids = random_ids(4, 12, seed=3, bos=False)
    position_ids = torch.cat([torch.arange(5), torch.arange(7)]).expand(4, 12)
    model.recurrent_forward(ids, position_ids=position_ids)
    assert calls == [4] * 12  # 12 steps of all 4 rows, not 4 x 2 samples one at a time


def test_state_hook_and_cache_run_lean_and_fill_the_decode_cache():
    model = tiny_model("llama")
    ids = rows_with_document_starts(2, 10)
    zero = lambda t, h: torch.zeros_like(h)  # noqa: E731
    assert_close(model.recurrent_forward(ids, state_hook=zero).logits, R.recurrence_logits(model, ids, zero))
    model.token_step = "off"
    want = model.recurrent_forward(ids, cache=fullband.model.cache.FeedbackCache(config=model.backbone.config))
    model.token_step = "lean"
    got = model.recurrent_forward(ids, cache=fullband.model.cache.FeedbackCache(config=model.backbone.config))
    for a, b in zip(got.cache.layers, want.cache.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


def test_compiled_step_matches_the_equations():
    model = tiny_model("llama")
    model.token_step = "compiled"
    ids = rows_with_document_starts(2, 12)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, 3] = BOS
    got = model.recurrent_forward(ids, attention_mask=mask).logits
    assert_close(got[0:1], R.recurrence_logits(model, ids[0:1]))
    assert_close(got[1:2, 3:], R.recurrence_logits(model, ids[1:2, 3:]))
    # a per-vocabulary gate table taken by the compiled step (not baked into its graph): a later table, after W_G has
    # changed, is the one used
    for _ in range(2):
        with torch.no_grad(), model.frozen_gate_table():
            got = model.recurrent_forward(ids[0:1]).logits
        assert_close(got, R.recurrence_logits(model, ids[0:1]))
        with torch.no_grad():
            model.feedback.gate_proj.weight.mul_(-3.0)


def _wrapped(config):
    torch.manual_seed(0)
    backbone = AutoModelForCausalLM.from_config(config).eval()
    return fullband.FullBandwidthForCausalLM.from_backbone(backbone).eval()


SMALL = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=BOS, eos_token_id=2, pad_token_id=0)


def test_gemma_runs_lean_its_embedding_scale_inside_its_embedding_module():
    model = _wrapped(GemmaConfig(head_dim=8, **SMALL))
    assert lean.lean_stack(model.backbone) is not None
    ids = rows_with_document_starts(2, 10)
    got = model.recurrent_forward(ids).logits
    model.token_step = "off"  # (the reference reads raw embedding rows: Gemma's embedding module also scales them)
    assert_close(got, model.recurrent_forward(ids).logits)


def test_a_backbone_whose_forward_does_more_than_its_layers_is_refused_by_the_probe(caplog):
    model = _wrapped(CohereConfig(logit_scale=0.0625, **SMALL))  # Cohere scales its logits after the LM head
    with caplog.at_level(logging.INFO, logger="fullband"):
        assert lean.lean_stack(model.backbone) is None
        assert lean.lean_stack(model.backbone) is None  # asked again: no second line
        ids = rows_with_document_starts(2, 8)
        assert_close(model.recurrent_forward(ids).logits, R.recurrence_logits(model, ids))
    lines = [r.getMessage() for r in caplog.records if "no lean step" in r.getMessage()]
    assert len(lines) == 1 and "CohereForCausalLM" in lines[0] and "logits" in lines[0], lines


def test_token_step_names_are_checked():
    with pytest.raises(ValueError, match="unknown token step 'fast'"):
        lean.resolve_token_step("fast", torch.device("cpu"))
    assert lean.resolve_token_step("auto", torch.device("cpu")) == "lean"
    assert lean.resolve_token_step("auto", torch.device("cuda")) == "compiled"


@pytest.mark.parametrize("mode", ["standard", "soft", "fused", "exact"])
def test_decode_steps_run_lean_and_give_the_full_forward_loop_s_tokens_logits_and_cache(mode, monkeypatch):
    from fullband.model.generation import generate

    model = tiny_model("llama")
    prompt = random_ids(2, 9, seed=4)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # left padding
    model.token_step = "off"
    want = generate(model, prompt, mask, mode=mode, max_new_tokens=6, output_logits=True)
    steps = []
    real = lean.LeanDecoder.forward
    monkeypatch.setattr(lean.LeanDecoder, "forward", lambda self, x: steps.append(x.shape) or real(self, x))
    model.token_step = "lean"
    got = generate(model, prompt, mask, mode=mode, max_new_tokens=6, output_logits=True)
    assert steps == [torch.Size([2, 1, HIDDEN])] * 5  # every decode step after the first token went lean
    assert torch.equal(got.sequences, want.sequences)
    assert_close(got.logits, want.logits)
    for a, b in zip(got.cache.layers, want.cache.layers):
        real_keys = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], 1).bool()[:, None, :, None]
        assert_close(a.keys * real_keys, b.keys * real_keys)  # padding positions' keys are never read
    if mode != "standard":
        assert_close(got.cache.feedback_state, want.cache.feedback_state)


def test_the_static_step_cuda_graphs_compile_gives_the_eager_step_s_states():
    """What CUDA runs (``TokenPass.static_step``: whole buffers, the position a tensor, the unwritten tail masked),
    here uncompiled on CPU, against the eager step, with padding and packed segments."""
    model = tiny_model("llama")
    stack = lean.lean_stack(model.backbone)
    B, T = 3, 14
    ids = random_ids(B, T, seed=5)
    embeds = model.get_input_embeddings()(ids)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[2, :4] = False
    segments = torch.zeros(B, T, dtype=torch.long)
    segments[1, 6:] = 1  # row 1: two packed samples
    fuse_mask = valid.clone()
    fuse_mask[:, 0] = fuse_mask[1, 6] = fuse_mask[2, 4] = False
    positions = torch.arange(T).expand(B, T).clone()
    positions[1, 6:] -= 6
    states = {}
    for static in (False, True):
        tp = lean.TokenPass(stack, B, T, embeds.dtype, embeds.device, compiled=False)
        if static:
            tp.static, tp._graph = True, lean._traced("static_step")
        tp.prepare(positions, valid, segments)
        prev, out = None, []
        with torch.no_grad():
            for t in range(T):
                _, h = tp.step(model, t, prev, ids, embeds, fuse_mask)
                out.append(h.clone())
                prev = out[-1]
        states[static] = torch.cat(out, 1)
    assert_close(states[True][valid], states[False][valid])


def test_the_probe_is_taken_again_when_the_layers_or_the_attention_change():
    model = tiny_model("llama")
    first = lean.lean_stack(model.backbone)
    assert lean.lean_stack(model.backbone) is first  # asked again: the cached answer
    layers = model.backbone.model.layers
    torch.manual_seed(9)
    layers[0] = type(layers[0])(model.backbone.config, 0)  # replaced (other weights): the old stack would miss it
    again = lean.lean_stack(model.backbone)
    assert again is not first and again.layers[0] is layers[0]
    model.backbone.config._attn_implementation = "eager"
    assert lean.lean_stack(model.backbone) is not again  # another attention implementation: probed again
    ids = rows_with_document_starts(2, 8)
    assert_close(model.recurrent_forward(ids).logits, R.recurrence_logits(model, ids))
