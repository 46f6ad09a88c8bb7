"""The token-by-token recurrence, written once: position t takes ``fusion(h_{t-1}, e_t)`` wherever the feedback mask
allows (the plain embedding elsewhere), ``h_{t-1}`` being the final hidden state this very recurrence produced one
step earlier.

Owns :func:`run_recurrence` (the body of :meth:`fullband.FullBandwidthForCausalLM.recurrent_forward`). Each step
runs through the lean token step (:mod:`fullband.model.lean`: the backbone's own decoder layers, keys and values in
buffers allocated once, eager or compiled, packed samples of all rows batched together) where the backbone takes
one, else through the backbone's full forward with its KV cache (:func:`fullband.model.cache.row_cache`), packed
samples one at a time. ``model.token_step`` chooses (``auto``, ``lean``, ``compiled``, ``off``).
"""

from __future__ import annotations

import torch

from .cache import row_cache
from .feedback import build_feedback_mask, fuse_where, position_restarts, positions
from .lean import TokenPass, lean_stack, resolve_token_step
from .outputs import FullBandwidthOutput
from .sharding import is_sharded


def run_recurrence(model, input_ids, attention_mask, feedback_mask, position_ids, cache, state_hook,
                   output_hidden_states, need_logits) -> FullBandwidthOutput:
    """:meth:`~fullband.FullBandwidthForCausalLM.recurrent_forward`'s body (the modules already in evaluation
    mode, no gradient)."""
    model.check_inputs(input_ids, attention_mask, None, feedback_mask)
    B, T = input_ids.shape
    device = input_ids.device
    if feedback_mask is None:
        feedback_mask = build_feedback_mask(input_ids, attention_mask, model.doc_start_token_id,
                                            position_ids=position_ids)
    feedback_mask = feedback_mask.bool().to(device)
    restarts = None
    if position_ids is not None and attention_mask is None:
        restarts = position_restarts(position_ids.to(device), B, T)
        restarts[:, 0] = False
        if not restarts.any():
            restarts = None
        elif cache is not None or state_hook is not None:
            raise ValueError("packed rows (position_ids that restart) take no cache and no state_hook in "
                             "recurrent_forward: run each packed sample on its own for those")
    kind = resolve_token_step(getattr(model, "token_step", "auto"), device)
    stack = None
    if kind != "off" and not output_hidden_states and not is_sharded(model):
        stack = lean_stack(model.backbone)
    if stack is None and restarts is not None:
        return _packed_one_by_one(model, input_ids, feedback_mask, position_ids, restarts, output_hidden_states,
                                  need_logits)
    if position_ids is None:
        position_ids = positions(attention_mask, B, T, device)
    position_ids = position_ids.to(device).reshape(-1, T).expand(B, T)
    token_embeds = model.get_input_embeddings()(input_ids)
    if stack is not None:
        return _lean(model, stack, kind == "compiled" and state_hook is None, input_ids, token_embeds,
                     attention_mask, feedback_mask, position_ids, restarts, cache, state_hook, need_logits)
    return _full_forward(model, input_ids, token_embeds, attention_mask, feedback_mask, position_ids, cache,
                         state_hook, output_hidden_states, need_logits)


def _lean(model, stack, compiled, input_ids, token_embeds, attention_mask, feedback_mask, position_ids, restarts,
          cache, state_hook, need_logits) -> FullBandwidthOutput:
    """The recurrence through :class:`~fullband.model.lean.TokenPass`: packed samples as segments of their rows
    (attention kept inside a segment, the state reset at its start), the LM head once over every position."""
    B, T, d = token_embeds.shape
    segments = None
    if restarts is not None:
        segments = restarts.long().cumsum(1)
        feedback_mask = feedback_mask & ~restarts
    tp = TokenPass(stack, B, T, token_embeds.dtype, token_embeds.device, compiled)
    tp.prepare(position_ids, attention_mask.bool() if attention_mask is not None else None, segments)
    hidden, inputs = torch.empty_like(token_embeds), torch.empty_like(token_embeds)
    prev = None
    for t in range(T):
        if prev is not None and state_hook is not None:
            prev = state_hook(t, prev)
        inp, h = tp.step(model, t, prev, input_ids, token_embeds, feedback_mask)
        hidden[:, t:t + 1] = h
        inputs[:, t:t + 1] = inp
        prev = hidden[:, t:t + 1]  # a tensor of ours, not the step's output buffer (a CUDA graph reuses that)
    if cache is not None:
        for i, (k, v) in enumerate(tp.kv(T)):
            cache.update(k, v, i)
    return FullBandwidthOutput(logits=model.get_output_embeddings()(hidden) if need_logits else None,
                               last_hidden_state=hidden, cache=cache, inputs_embeds=inputs)


def _full_forward(model, input_ids, token_embeds, attention_mask, feedback_mask, position_ids, cache, state_hook,
                  output_hidden_states, need_logits) -> FullBandwidthOutput:
    """The recurrence through the backbone's full forward, one position a call, with its KV cache."""
    B, T = input_ids.shape
    if cache is None:
        cache = row_cache(model.backbone.config, T)
    no_logits = torch.empty(0, dtype=torch.long, device=input_ids.device)
    all_logits, all_hidden, inputs, layers, prev = [], [], [], None, None
    for t in range(T):
        inp = token_embeds[:, t:t + 1]
        if prev is not None:
            state = state_hook(t, prev) if state_hook is not None else prev
            inp = fuse_where(feedback_mask[:, t:t + 1], model.fuse(state, input_ids[:, t:t + 1], inp), inp)
        logits, prev, cache, hs = model._backbone_pass(
            inp, attention_mask[:, :t + 1] if attention_mask is not None else None,
            position_ids[:, t:t + 1], cache=cache, use_cache=True, output_hidden_states=output_hidden_states,
            logits_to_keep=0 if need_logits else no_logits)
        all_logits.append(logits)
        all_hidden.append(prev)
        inputs.append(inp)
        if hs is not None:
            layers = [[] for _ in hs] if layers is None else layers
            for store, h in zip(layers, hs):
                store.append(h)
    return FullBandwidthOutput(
        logits=torch.cat(all_logits, 1) if need_logits else None, last_hidden_state=torch.cat(all_hidden, 1),
        cache=cache, inputs_embeds=torch.cat(inputs, 1),
        hidden_states=tuple(torch.cat(store, 1) for store in layers) if layers is not None else None)


def _packed_one_by_one(model, input_ids, feedback_mask, position_ids, restarts, output_hidden_states, need_logits):
    """Packed rows through the full forward: every packed sample of every row on its own, stitched back."""
    B, T = input_ids.shape
    position_ids = position_ids.to(input_ids.device).reshape(-1, T).expand(B, T)
    rows = []
    for b in range(B):
        cuts = [0, *restarts[b].nonzero().flatten().tolist(), T]
        rows.append([run_recurrence(model, input_ids[b:b + 1, s:e], None, feedback_mask[b:b + 1, s:e],
                                    position_ids[b:b + 1, s:e], None, None, output_hidden_states, need_logits)
                     for s, e in zip(cuts, cuts[1:])])

    def stitch(get):
        return torch.cat([torch.cat([get(o) for o in row], 1) for row in rows], 0)

    return FullBandwidthOutput(
        logits=stitch(lambda o: o.logits) if need_logits else None,
        last_hidden_state=stitch(lambda o: o.last_hidden_state),
        inputs_embeds=stitch(lambda o: o.inputs_embeds),
        hidden_states=tuple(stitch(lambda o, i=i: o.hidden_states[i]) for i in range(len(rows[0][0].hidden_states)))
        if output_hidden_states else None)
