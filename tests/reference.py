"""References written from the equations, for tests: the GLU fusion from raw weights, the hand-made feedback mask,
the K-pass forward and the exact recurrence, each re-running the backbone on ``inputs_embeds`` built here (no
package helper on the way: not ``model.fuse``, ``model.feedback``, ``gate_table`` nor ``recurrent_forward``); and the
FLOPs of scoring a row in a mode, from the parameter counts of a saved model (:func:`scoring_flops`).

    gate  = sigmoid(W_G · e / rms(e))                   (paper Eq. 4's token gate)
    glu   = g ⊙ v / rms(v),   v = (W_U · h) ⊙ gate       (g = the output norm's gain)
    u     = glu (fusion "glu"),  e + glu (fusion "residual")
"""

from __future__ import annotations

import math
import os
import re

import torch
import torch.nn.functional as F
from safetensors import safe_open


def _rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def fuse(model, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``u = fusion(h, e)`` from the fusion's raw weights (glu or residual)."""
    f = model.feedback
    w_g, w_u, gain, eps = f.gate_proj.weight, f.value_proj.weight, f.out_norm.weight, f.out_norm.eps
    gate = torch.sigmoid(_rms_normalise(e, eps) @ w_g.T)
    glu = gain * _rms_normalise((h @ w_u.T) * gate, eps)
    if model.config.fusion == "glu":
        return glu
    assert model.config.fusion == "residual", model.config.fusion
    return e + glu


def feedback_mask(ids: torch.Tensor, bos: int | None) -> torch.Tensor:
    """Unpadded rows: every position but the first and the document starts (BOS) takes the previous state."""
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, 0] = False
    if bos is not None:
        mask &= ids != bos
    return mask


def _final(model, inputs_embeds):
    out = model.backbone(inputs_embeds=inputs_embeds, output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1], out.logits


@torch.no_grad()
def k_pass_logits(model, ids: torch.Tensor, num_passes: int) -> torch.Tensor:
    """The K-pass teacher-forced forward: pass k+1 fuses pass k's final states shifted right by one."""
    e = model.backbone.get_input_embeddings().weight[ids]
    mask = feedback_mask(ids, model.config.doc_start_token_id).unsqueeze(-1)
    u = e
    for k in range(num_passes):
        h, logits = _final(model, u)
        prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        u = torch.where(mask, fuse(model, prev, e), e)
    return logits


@torch.no_grad()
def recurrence_logits(model, ids: torch.Tensor, state_hook=None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The exact recurrence, from scratch at every position (no KV cache): ``u_t = fusion(h_{t-1}, e_t)`` where
    ``mask`` (default :func:`feedback_mask`) allows. ``state_hook(t, h_prev)`` replaces the state fused at t."""
    e = model.backbone.get_input_embeddings().weight[ids]
    if mask is None:
        mask = feedback_mask(ids, model.config.doc_start_token_id)
    mask = mask.unsqueeze(-1)
    inputs, logits, prev = [], [], None
    for t in range(ids.shape[1]):
        u = e[:, t:t + 1]
        if prev is not None:
            state = prev if state_hook is None else state_hook(t, prev)
            u = torch.where(mask[:, t:t + 1], fuse(model, state, u), u)
        inputs.append(u)
        h, lg = _final(model, torch.cat(inputs, dim=1))
        prev = h[:, -1:]
        logits.append(lg[:, -1:])
    return torch.cat(logits, dim=1)


def recurrence_states(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The recurrence's final hidden states (with the graph, for gradient references): position t's input is
    ``fusion(h_{t-1}, e_t)`` where ``mask`` (batch x T) allows, each h recomputed from scratch on the inputs so far."""
    e = model.backbone.get_input_embeddings()(ids)
    inputs, states = [], []
    for t in range(ids.shape[1]):
        u = e[:, t:t + 1]
        if states:
            u = torch.where(mask[:, t:t + 1, None], fuse(model, states[-1], u), u)
        inputs.append(u)
        h, _ = _final(model, torch.cat(inputs, 1))
        states.append(h[:, -1:])
    return torch.cat(states, 1)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy over every position of every row."""
    return float(F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), ids[:, 1:].flatten()))


def scoring_flops(model_dir, row_tokens: int, mode: str, num_passes: int = 2) -> float:
    """Forward FLOPs of scoring one row of ``row_tokens`` tokens in ``mode`` (``standard``, ``passes``, ``exact``),
    written from the parameter counts of the saved weights (``model.safetensors``; not the package's FLOP helpers):
    a token through the body costs 2 FLOPs per weight outside the embedding table and the LM head (norm gains
    included), a position's logits 2 per LM-head weight, a (query, key) pair 4·L·d (scores and weighted sum over the
    layers; causal: query t sees t + 1 keys), a fused token 2 per fusion weight. ``passes``: K passes over the row,
    passes 2..K fused at every position, the logits of the earlier passes at their last position only; ``exact``:
    the row token by token over a KV cache (one pass's work) with every position but the first fused."""
    counts = {"body": 0, "head": 0, "fusion": 0}
    layers, hidden = set(), None
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            n = math.prod(shape)
            if name.startswith("feedback."):
                counts["fusion"] += n
            elif name.endswith("lm_head.weight"):
                counts["head"] += n
            elif name.endswith("embed_tokens.weight"):
                hidden = shape[1]
            else:
                counts["body"] += n
                layers.update(re.findall(r"layers\.(\d+)\.", name))
    T, K, L = row_tokens, num_passes, len(layers)
    pairs = T * (T + 1) / 2
    body, head, pair, fuse = 2 * counts["body"], 2 * counts["head"], 4 * L * hidden, 2 * counts["fusion"]
    if mode == "standard":
        return T * body + T * head + pairs * pair
    if mode == "passes":
        return K * T * body + (T + K - 1) * head + K * pairs * pair + (K - 1) * T * fuse
    assert mode == "exact", mode
    return T * body + T * head + pairs * pair + (T - 1) * fuse
