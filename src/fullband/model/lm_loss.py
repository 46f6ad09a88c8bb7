"""The language-model loss of one pass without its ``[B, T, V]`` logits: chunked cross-entropy and the z-loss.

Owns :func:`chunked_lm_loss` (the causal-LM cross-entropy computed chunk by chunk from the final hidden states
through the LM head, each chunk's logits recomputed in the backward by ``torch.utils.checkpoint``, so that at
most one chunk of fp32 logits is alive at a time), :func:`z_loss_from_logits` (the same z-loss term from logits
that are already there) and :func:`check_chunkable` (backbones whose logits are not just ``lm_head(h)`` are
refused). Both follow Hugging Face's ``ForCausalLMLoss`` exactly: labels shifted left by one (position t predicts
label t+1, the last position predicts nothing), ``-100`` ignored, the sum divided by ``num_items_in_batch`` when
it is given (gradient accumulation over micro-batches) and by the number of supervised tokens otherwise.

The z-loss (PaLM, Chowdhery et al. 2022, section 5) is ``coefficient * log(Z)^2`` averaged over the supervised
tokens, ``log Z`` being the logsumexp of a position's logits: it keeps the softmax normaliser near 1 (logits
from drifting), and is returned as its own term so that it can be reported apart from the cross-entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100

# config attributes of backbones whose logits are post-processed after the LM head (Gemma 2/3 soft-capping,
# Cohere's logit scale, Granite's scaling): the chunked path computes lm_head(h) only, so it refuses them
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_chunkable(text_config) -> None:
    """``ValueError`` when the backbone's logits are not ``lm_head(hidden)`` (the chunked loss would be wrong)."""
    for name in _LOGIT_TRANSFORMS:
        value = getattr(text_config, name, None)
        if value not in (None, 1, 1.0):
            raise ValueError(f"the chunked loss (--loss-chunk) computes lm_head(h) only, but this backbone "
                             f"post-processes its logits ({name}={value}); train it with --loss-chunk 0")


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The target of each position: the next position's label, ``-100`` after the last (as ``ForCausalLMLoss``)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _z_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed ``logsumexp^2`` over the supervised rows of fp32 ``logits`` ``[N, V]``."""
    return torch.where(targets != IGNORE_INDEX, torch.logsumexp(logits, dim=-1).square(), 0.0).sum()


def _chunk_sums(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, with_z: bool):
    """Summed cross-entropy (and ``logsumexp^2``) of one chunk of positions, its logits computed here."""
    logits = head(hidden).float()
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return ce, (_z_sum(logits, targets) if with_z else ce.new_zeros(()))


def _normaliser(targets: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    if num_items_in_batch is None:
        return (targets != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        return num_items_in_batch.to(targets.device)
    return torch.tensor(num_items_in_batch, device=targets.device)


def chunked_lm_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk: int,
                    num_items_in_batch=None, z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(cross-entropy, z-loss or None)`` of final hidden states ``hidden`` ``[B, T, d]`` for ``labels`` ``[B, T]``
    through ``head`` (the backbone's LM head), ``chunk`` positions at a time.

    With gradient enabled each chunk runs under ``torch.utils.checkpoint`` (non-reentrant): its forward keeps
    nothing but its inputs (views of ``hidden``) and its backward recomputes the chunk's logits, so the loss's
    memory is one chunk's ``chunk x V`` fp32 logits (and their gradient) instead of ``B·T x V``. Under autocast
    the recomputation runs under the same autocast state. The value equals ``ForCausalLMLoss`` up to the order of
    the summation."""
    if chunk < 1:
        raise ValueError(f"loss chunk must be >= 1 positions, got {chunk}")
    targets = shift_labels(labels).reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    with_z = z_loss > 0
    ce_sum = z_sum = None
    # split: views whose gradients the backward concatenates once (slicing would add a full-size zero tensor per
    # chunk)
    for h, t in zip(flat.split(chunk), targets.split(chunk)):
        if torch.is_grad_enabled():
            ce, z = checkpoint(_chunk_sums, head, h, t, with_z, use_reentrant=False)
        else:
            ce, z = _chunk_sums(head, h, t, with_z)
        ce_sum, z_sum = (ce, z) if ce_sum is None else (ce_sum + ce, z_sum + z)
    denom = _normaliser(targets, num_items_in_batch)
    return ce_sum / denom, (z_loss * z_sum / denom) if with_z else None


def z_loss_from_logits(logits: torch.Tensor, labels: torch.Tensor, z_loss: float,
                       num_items_in_batch=None) -> torch.Tensor:
    """The z-loss term of logits ``[B, T, V]`` that are already materialised (same normalisation as the
    cross-entropy: ``num_items_in_batch``, else the supervised tokens)."""
    targets = shift_labels(labels).reshape(-1)
    z_sum = _z_sum(logits.reshape(-1, logits.shape[-1]).float(), targets)
    return z_loss * z_sum / _normaliser(targets, num_items_in_batch)
