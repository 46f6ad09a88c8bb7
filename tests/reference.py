"""References written from the equations, for tests: the GLU fusion from raw weights, the hand-made feedback mask,
the K-pass forward and the exact recurrence, each re-running the backbone on ``inputs_embeds`` built here (no
package helper on the way: not ``model.fuse``, ``model.feedback``, ``gate_table`` nor ``recurrent_forward``).

    gate  = sigmoid(W_G · e / rms(e))                   (paper Eq. 4's token gate)
    glu   = g ⊙ v / rms(v),   v = (W_U · h) ⊙ gate       (g = the output norm's gain)
    u     = glu (fusion "glu"),  e + glu (fusion "residual")
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy over every position of every row."""
    return float(F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), ids[:, 1:].flatten()))
