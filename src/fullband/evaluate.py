"""Held-out language-model loss of a model, per decode mode.

Owns :func:`evaluate_loss`: mean next-token cross-entropy (nats per predicted token) over packed rows, for a plain
Hugging Face causal LM or a fullband model in one of the modes

* ``standard`` — no feedback (one ordinary pass);
* ``passes`` — the K-pass teacher-forced forward used in training (``num_passes=K``);
* ``exact`` — the true token-by-token recurrence (:meth:`FullBandwidthForCausalLM.recurrent_forward`), which is
  what decoding runs; K-pass figures need not carry over to it, so report both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MODES = ("standard", "passes", "exact")


def _is_fullband(model) -> bool:
    from .modeling import FullBandwidthForCausalLM

    return isinstance(model, FullBandwidthForCausalLM)


def _nll_sum(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")


@torch.no_grad()
def evaluate_loss(model, rows: torch.Tensor, mode: str = "standard", num_passes: int = 2, batch_size: int = 16,
                  max_rows: int | None = None, progress: bool = False) -> dict:
    """``{"loss", "perplexity", "tokens", "mode", "num_passes"}`` over ``rows`` ``[N, T]`` (all positions predicted)."""
    if mode not in MODES:
        raise ValueError(f"unknown evaluation mode {mode!r}: choose one of {', '.join(MODES)}")
    if mode != "standard" and not _is_fullband(model):
        raise ValueError(f"mode {mode!r} needs a fullband model (one with latent feedback); this one has none")
    if rows.dim() != 2 or rows.shape[1] < 2 or rows.shape[0] == 0:
        raise ValueError(f"need at least one evaluation row of >= 2 tokens, got shape {tuple(rows.shape)}")
    if max_rows is not None:
        rows = rows[:max_rows]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    starts = range(0, rows.shape[0], batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=f"eval {mode}", unit="batch", leave=False)
    try:
        for i in starts:
            ids = rows[i:i + batch_size].to(device)
            if mode == "exact":
                logits = model.recurrent_forward(ids).logits
            elif _is_fullband(model):
                logits = model(ids, num_passes=num_passes if mode == "passes" else 1).logits
            else:
                logits = model(input_ids=ids).logits
            total += float(_nll_sum(logits, ids))
            count += ids[:, 1:].numel()
    finally:
        model.train(was_training)
    loss = total / count
    return {"mode": mode, "num_passes": num_passes if mode == "passes" else (1 if mode == "standard" else None),
            "loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}
