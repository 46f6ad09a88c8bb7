"""Full backpropagation through the token-by-token recurrence, in bounded memory (``full_backprop=True`` of the
K-pass forward, :meth:`fullband.model.modeling.FullBandwidthForCausalLM.forward`).

Owns :func:`full_backprop_forward`: the exact recurrence (position t fuses ``h_{t-1}``, the final hidden state the
recurrence itself produced one step earlier, through the backbone's KV cache) run **with** gradient, so that every
step's gradient flows through the fed-back state and through the keys and values every later step reads. As a
function of the weights its loss is the loss of the last of K = T + 1 teacher-forced passes (pass k is exact at
positions < k), so its gradient is that pass's gradient through all K passes, at the cost of one pass.

Memory. Run as it is, autograd keeps every step's attention inputs: step t's keys and values concatenated over the
t positions before it, O(T^2) per layer (measured 1.4x..4.3x a parallel pass at T = 16..128). Here the row runs in
blocks of ``chunk`` = C tokens, each block under ``torch.utils.checkpoint`` (non-reentrant): a block keeps only
what it hands on -- its final hidden states (the carried state is the last of them) and the new keys and values
of its C positions (per layer, one copy: the next blocks read them as a list, concatenated inside their own
checkpoint, never stored concatenated) -- and its insides are recomputed in the backward, one block at a time. So
the memory kept between forward and backward grows as T x (d + 2·L·d_kv) (plus the logits, as any pass keeps
them, or none with ``loss_chunk``), and the backward of one block adds C steps' insides over a past of <= T
positions: C x T x 2·L·d_kv. ``chunk = 0``: one block, nothing recomputed (the quadratic form). Compute: one
forward, one recomputed forward and one backward, 4/3 of a plain training pass (without recomputation, 1).

Hugging Face's activation checkpointing (a per-layer wrapper that drops the cache in training) is switched off
inside the blocks: their own recomputation replaces it, and the layers must read their cache.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from .feedback import build_feedback_mask, fuse_where, jitter, position_restarts, positions
from .outputs import FullBandwidthOutput
from .sharding import is_sharded


@contextlib.contextmanager
def layer_checkpointing_off(model: torch.nn.Module):
    """Hugging Face's per-layer activation checkpointing (``gradient_checkpointing`` on its layers) off for the
    scope, back as it was after: a checkpointed layer runs without its KV cache in training."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True


def check_full_backprop(model, chunk, position_ids, attention_mask, T: int) -> None:
    """``ValueError`` (one line) for what full backpropagation cannot take."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
        raise ValueError(f"backprop_chunk must be an integer >= 0 tokens (0: one block, no recomputation), "
                         f"got {chunk!r}")
    if is_sharded(model):
        raise ValueError("full_backprop does not run under FSDP2 (its blocks recompute sharded layers in the "
                         "backward): train it with --parallel ddp")
    if position_ids is not None and attention_mask is None:
        restarts = position_restarts(position_ids, position_ids.shape[0] if position_ids.dim() == 2 else 1, T)
        if restarts[:, 1:].any():
            raise ValueError("full_backprop takes no packed rows (position_ids that restart): give one sample per "
                             "row, padded with an attention_mask")


def full_backprop_forward(model, input_ids, attention_mask, labels, feedback_mask, position_ids, chunk: int,
                          loss_kwargs: dict, **kwargs) -> FullBandwidthOutput:
    """The recurrence over ``input_ids`` ``[B, T]`` with gradient, in checkpointed blocks of ``chunk`` tokens (see
    the module docstring); ``loss`` is the recurrence's next-token loss on ``labels`` (plus the z-loss of
    ``loss_kwargs``), ``pass_losses`` its one entry. In training mode the fed-back state gets the jitter of
    ``config.jitter`` and, with ``config.detach_state``, no gradient (the keys and values still carry one), and the
    backbone's dropout applies: this recurrence is the gradient pass (the recomputed blocks draw the same masks)."""
    B, T = input_ids.shape
    device = input_ids.device
    check_full_backprop(model, chunk, position_ids, attention_mask, T)
    if feedback_mask is None:
        feedback_mask = build_feedback_mask(input_ids, attention_mask, model.doc_start_token_id,
                                            position_ids=position_ids)
    feedback_mask = feedback_mask.bool().to(device)
    if position_ids is None:
        position_ids = positions(attention_mask, B, T, device)
    position_ids = position_ids.to(device).reshape(-1, T).expand(B, T)
    token_embeds = model.get_input_embeddings()(input_ids)
    chunked = bool(loss_kwargs.get("loss_chunk"))
    keep = torch.empty(0, dtype=torch.long, device=device) if chunked else 0  # no logits with a chunked loss
    noise = model.config.jitter if model.training else 0.0
    detach = model.config.detach_state

    def block(start: int, end: int, state, past: tuple):
        """Steps ``start..end-1`` after ``state`` (``h_{start-1}``, ``None`` at 0) and the blocks ``past`` (each a
        tuple of per-layer ``(keys, values)``): ``(hidden [B, C, d], logits or None, new (keys, values) per layer)``."""
        with layer_checkpointing_off(model):
            cache = DynamicCache(config=model.backbone.config)
            for layer, kv in enumerate(zip(*past)):
                cache.update(torch.cat([k for k, _ in kv], -2), torch.cat([v for _, v in kv], -2), layer)
            hidden, logits, new = [], [], None
            for t in range(start, end):
                inp = token_embeds[:, t:t + 1]
                if state is not None:
                    fed = jitter(state, noise)
                    fed = fed.detach() if detach else fed
                    inp = fuse_where(feedback_mask[:, t:t + 1], model.fuse(fed, input_ids[:, t:t + 1], inp), inp)
                lg, state, cache, _ = model._backbone_pass(
                    inp, attention_mask[:, :t + 1] if attention_mask is not None else None,
                    position_ids[:, t:t + 1], cache=cache, use_cache=True, logits_to_keep=keep, **kwargs)
                hidden.append(state)
                logits.append(lg)
                step_kv = [(layer.keys[:, :, -1:], layer.values[:, :, -1:]) for layer in cache.layers]
                new = [[kv] for kv in step_kv] if new is None else [n + [kv] for n, kv in zip(new, step_kv)]
            # fresh tensors (not views of the cache's concatenation, which would keep it alive)
            kv_out = tuple((torch.cat([k for k, _ in n], -2), torch.cat([v for _, v in n], -2)) for n in new)
            return torch.cat(hidden, 1), (None if chunked else torch.cat(logits, 1)), kv_out

    recompute = chunk > 0 and torch.is_grad_enabled()
    size = chunk if chunk > 0 else T
    hidden, logits, past, state = [], [], (), None
    for start in range(0, T, size):
        end = min(start + size, T)
        if recompute:
            h, lg, kv = checkpoint(block, start, end, state, past, use_reentrant=False)
        else:
            h, lg, kv = block(start, end, state, past)
        hidden.append(h)
        logits.append(lg)
        past = past + (kv,)
        state = h[:, -1:]
    hidden = torch.cat(hidden, 1)
    logits = None if chunked else torch.cat(logits, 1)
    loss = pass_losses = z = None
    if labels is not None:
        ce, z = model._pass_loss(logits, hidden, labels, **loss_kwargs)
        loss = ce if z is None else ce + z
        pass_losses = ce.detach().float().view(1)
    return FullBandwidthOutput(loss=loss, logits=logits, last_hidden_state=hidden, pass_losses=pass_losses,
                               z_loss=None if z is None else z.detach(), passes_run=1,
                               grad_passes_run=1 if torch.is_grad_enabled() else 0)
