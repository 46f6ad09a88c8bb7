"""Latent feedback itself: the fusion modules, the masks that say where to fuse, and the fed-back state.

Owns
* the fusion of the previous position's final hidden state ``h_{t-1}`` with the token embedding ``e_t``
  (``glu`` = the paper's Eq. 4; ``residual`` = ``e_t + glu`` with the output gain at 0, the token-preserving
  default; the ``concat`` and ``add`` ablations), all with one call signature
  ``fusion(prev_hidden, token_embeds) -> inputs_embeds``, and the per-vocabulary gate table (:func:`gate_table`, a
  snapshot of the live weights; who may hold one, for how long: :func:`gate_table_pays` and the model's
  ``frozen_gate_table()``);
* the feedback mask (where a position has a previous state: never at position 0, a document start / BOS,
  a packed sample's start (its position id restarts), or padding, nor right after padding), per-document prefix
  mixing, and document segmentation;
* shifting a pass's hidden states right by one and the training-time jitter on the fed-back state;
* position ids that skip padding, and the backbone's position limit.

Scale. A pretrained backbone's token embeddings are far from RMS 1 (a random Llama init has RMS 0.02, GPT-2
about 0.14). Every fusion is therefore initialised so that its output has the RMS of the backbone's own
embedding matrix (``embed_rms``, measured once when the model is built and stored in the config): the ``glu``
fusion ends in an RMSNorm whose gain is initialised to ``embed_rms`` (so RMS(u_t) == embed_rms exactly at
init; training re-measures it when feedback switches on); ``residual`` starts as ``u_t = e_t``; ``concat`` starts as the identity on ``e`` plus a small ``W h`` term and ``add`` as ``e + W h`` with
``W h`` about a tenth of ``embed_rms``.
"""

from __future__ import annotations

import hashlib

import math
import warnings

import torch
from torch import nn

FUSIONS = ("glu", "residual", "concat", "add")


class GLUFusion(nn.Module):
    """Paper Eq. 4: ``u_t = norm(W_U h_{t-1} * sigmoid(W_G norm(e_t)))``.

    The hidden state is the value path; the token only enters through the sigmoid gate, which depends on the
    token alone and can therefore be precomputed once per vocabulary entry at inference (:meth:`gate`).
    """

    def __init__(self, hidden_size: int, embed_dim: int, eps: float = 1e-6):
        super().__init__()
        self.embed_norm = nn.RMSNorm(embed_dim, eps=eps, elementwise_affine=False)
        self.gate_proj = nn.Linear(embed_dim, embed_dim, bias=False)  # W_G
        self.value_proj = nn.Linear(hidden_size, embed_dim, bias=False)  # W_U
        self.out_norm = nn.RMSNorm(embed_dim, eps=eps)

    @torch.no_grad()
    def reset_parameters(self, embed_rms: float, generator: torch.Generator | None = None) -> None:
        nn.init.normal_(self.gate_proj.weight, std=1.0 / math.sqrt(self.gate_proj.in_features), generator=generator)
        nn.init.normal_(self.value_proj.weight, std=1.0 / math.sqrt(self.value_proj.in_features), generator=generator)
        nn.init.constant_(self.out_norm.weight, embed_rms)

    def gate(self, token_embeds: torch.Tensor) -> torch.Tensor:
        """``sigmoid(W_G norm(e))``: a function of the token alone."""
        return torch.sigmoid(self.gate_proj(self.embed_norm(token_embeds)))

    def fuse_gated(self, prev_hidden: torch.Tensor, gate: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """The per-token part once the gate is known: ``norm(W_U h * gate)`` (``token_embeds`` unused here)."""
        return self.out_norm(self.value_proj(prev_hidden) * gate)

    def forward(self, prev_hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        return self.fuse_gated(prev_hidden, self.gate(token_embeds), token_embeds)


class ResidualGLUFusion(GLUFusion):
    """Token-preserving entry: ``u_t = e_t + norm(W_U h_{t-1} * sigmoid(W_G norm(e_t)))``, where the output
    norm's gain starts at 0.

    The token embedding stays on the input path (the paper's GLU reaches the stack with the token only through the
    sigmoid gate); the fed-back term is the paper's GLU, added on top. With the gain at 0 the fused input equals
    ``e_t`` exactly, so switching feedback on does not change the model until training moves the gain. Same
    parameters (and names) as :class:`GLUFusion`.
    """

    @torch.no_grad()
    def reset_parameters(self, embed_rms: float, generator: torch.Generator | None = None) -> None:
        super().reset_parameters(embed_rms, generator)
        nn.init.zeros_(self.out_norm.weight)

    def fuse_gated(self, prev_hidden: torch.Tensor, gate: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        return token_embeds + super().fuse_gated(prev_hidden, gate, token_embeds).to(token_embeds.dtype)


class ConcatFusion(nn.Module):
    """Ablation: a linear map of ``[e; h]``, initialised to ``e + W_h h`` with a small ``W_h``."""

    def __init__(self, hidden_size: int, embed_dim: int, eps: float = 1e-6):
        super().__init__()
        self.proj = nn.Linear(embed_dim + hidden_size, embed_dim, bias=False)
        self.embed_dim = embed_dim

    @torch.no_grad()
    def reset_parameters(self, embed_rms: float, generator: torch.Generator | None = None) -> None:
        d, w = self.embed_dim, self.proj.weight
        w.zero_()
        w[:, :d].copy_(torch.eye(d, dtype=w.dtype, device=w.device))
        nn.init.normal_(w[:, d:], std=0.1 * embed_rms / math.sqrt(w.shape[1] - d), generator=generator)

    def forward(self, prev_hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([token_embeds, prev_hidden.to(token_embeds.dtype)], dim=-1))


class AddFusion(nn.Module):
    """Ablation: ``e + W h``, with ``W h`` about a tenth of the embeddings' RMS at init."""

    def __init__(self, hidden_size: int, embed_dim: int, eps: float = 1e-6):
        super().__init__()
        self.proj = nn.Linear(hidden_size, embed_dim, bias=False)

    @torch.no_grad()
    def reset_parameters(self, embed_rms: float, generator: torch.Generator | None = None) -> None:
        nn.init.normal_(self.proj.weight, std=0.1 * embed_rms / math.sqrt(self.proj.in_features), generator=generator)

    def forward(self, prev_hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        return token_embeds + self.proj(prev_hidden)


_FUSION_CLASSES = {"glu": GLUFusion, "residual": ResidualGLUFusion, "concat": ConcatFusion, "add": AddFusion}


def check_fusion_name(name: str) -> str:
    if name not in _FUSION_CLASSES:
        raise ValueError(f"unknown fusion {name!r}: choose one of {', '.join(FUSIONS)}")
    return name


def build_fusion(name: str, hidden_size: int, embed_dim: int, eps: float = 1e-6) -> nn.Module:
    return _FUSION_CLASSES[check_fusion_name(name)](hidden_size, embed_dim, eps)


# ----------------------------------------------------------------------------------------------- state


def shift_right(hidden: torch.Tensor) -> torch.Tensor:
    """``out[:, t] = hidden[:, t-1]``; position 0 gets zeros (it is never fused anyway)."""
    return torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)


def jitter(state: torch.Tensor, scale: float) -> torch.Tensor:
    """Add uniform noise in ``±scale · RMS(state)`` (RMS per vector, no gradient through it)."""
    if scale <= 0:
        return state
    rms = state.detach().float().pow(2).mean(-1, keepdim=True).sqrt().to(state.dtype)
    return state + (torch.rand_like(state) * 2 - 1) * (scale * rms)


def fuse_where(mask: torch.Tensor, fused: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
    """Fused input where ``mask`` is True, the plain embedding elsewhere."""
    return torch.where(mask.unsqueeze(-1), fused.to(token_embeds.dtype), token_embeds)


# ----------------------------------------------------------------------------------------------- masks


def position_restarts(position_ids: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Bool ``[batch, length]``: True where a new sequence starts by its position ids -- a position id 0, or one
    that is not its left neighbour's plus one. That is Hugging Face's own rule for packed, padding-free rows
    (``masking_utils.find_packed_sequence_indices``: a sample's attention ends there too), e.g. TRL's packing,
    whose position ids restart at 0 for every packed sample. ``position_ids``: ``[B, T]``, ``[1, T]`` or ``[T]``
    (multimodal ``[3, B, T]`` ids: the first, temporal, row)."""
    pos = position_ids[0] if position_ids.dim() == 3 else position_ids
    pos = pos.reshape(-1, pos.shape[-1])[:, -length:].expand(batch, length)
    restarts = pos == 0
    restarts[:, 1:] |= pos[:, 1:] - pos[:, :-1] != 1
    return restarts


def document_starts(input_ids: torch.Tensor, doc_start_token_id: int | None = None,
                    attention_mask: torch.Tensor | None = None, has_prev_state: bool = False,
                    position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[B, T]``: True where a position has no previous state to take.

    That is every ``doc_start_token_id`` (BOS), the first real token after padding, every start of a packed
    sample by ``position_ids`` when they are given (:func:`position_restarts`: packed rows without a BOS, as
    TRL's padding-free packing or a tokenizer that adds none, such as Qwen2's), and position 0 unless
    ``has_prev_state`` (a continuation whose previous position's state is known, as in cached decoding).
    ``attention_mask`` may be longer than ``input_ids`` (cached tokens first); its column just before the
    current tokens then says whether the previous position was real.
    """
    B, T = input_ids.shape
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    if doc_start_token_id is not None:
        starts |= input_ids == doc_start_token_id
    if position_ids is not None:
        starts |= position_restarts(position_ids.to(input_ids.device), B, T)
    if not has_prev_state:
        starts[:, 0] = True
    if attention_mask is not None:
        mask = attention_mask.bool()
        real = mask[:, -T:]
        starts[:, 1:] |= real[:, 1:] & ~real[:, :-1]
        if has_prev_state and mask.shape[1] > T:
            starts[:, 0] |= ~mask[:, -T - 1]
    return starts


def build_feedback_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        doc_start_token_id: int | None = None, has_prev_state: bool = False,
                        position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[B, T]``: where a position may take the previous position's state.

    False at position 0 (unless ``has_prev_state``), at document starts (BOS, and packed samples' starts by
    ``position_ids``), at padding and at the first token after padding, so no state ever crosses a document
    boundary or comes out of padding.
    """
    mask = ~document_starts(input_ids, doc_start_token_id, attention_mask, has_prev_state, position_ids)
    if attention_mask is not None:
        mask &= attention_mask[:, -input_ids.shape[1]:].bool()
    return mask


PREFIX_DRAWS = 2  # the layout of the prefix-mixing draws (2: per row, seeded by the row's place in the run)


def prefix_row_seeds(seed: int, step: int, rows, micro: int = 0) -> list[int]:
    """The seeds of the prefix-mixing draws of rows ``rows`` (their indices in the step's global batch) of training
    step ``step`` (and micro-batch ``micro``, for trainers that number them): each a function of ``(seed, step,
    micro, row)`` alone -- a 63-bit BLAKE2b digest, the same on every platform and process -- so a rank draws for
    its own rows only and N ranks mask exactly as one process holding the global batch, without building it."""
    return [int.from_bytes(hashlib.blake2b(f"fullband prefix mix {int(seed)} {int(step)} {int(micro)} {int(r)}"
                                           .encode(), digest_size=8).digest(), "big") >> 1 for r in rows]


def prefix_mixing_mask(doc_starts: torch.Tensor, probability: float, row_seeds) -> torch.Tensor:
    """Bool ``[B, T]``, True where a position keeps its plain embedding because of prefix mixing.

    Each document (a segment starting at a True of ``doc_starts``; position 0 always starts one) is chosen with
    ``probability``; a chosen document of length n keeps a plain prefix of length uniform in 1..n. Row i's draws
    come from a generator seeded with ``row_seeds[i]`` (:func:`prefix_row_seeds`), two uniforms per document in
    the row's order, so a row's mask depends on that row and its seed alone: not on the other rows of the batch,
    nor on padding added after it.
    """
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"prefix-mixing probability must be in [0, 1], got {probability}")
    B, T = doc_starts.shape
    row_seeds = list(row_seeds)
    if len(row_seeds) != B:
        raise ValueError(f"prefix_mixing_mask needs one seed per row: {len(row_seeds)} seeds for {B} rows")
    starts = doc_starts.detach().cpu().clone()
    starts[:, 0] = True
    seg = starts.long().cumsum(1) - 1  # document index within its row
    pos = torch.arange(T).expand(B, T)
    offset = pos - torch.where(starts, pos, torch.zeros_like(pos)).cummax(1).values
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, row_seed in enumerate(row_seeds):
        n = int(seg[i, -1]) + 1
        lengths = torch.bincount(seg[i], minlength=n)
        u = torch.rand(n, 2, generator=torch.Generator().manual_seed(row_seed), dtype=torch.float64)
        chosen = u[:, 0] < probability
        prefix = (u[:, 1] * lengths).floor().long() + 1
        mask[i] = chosen[seg[i]] & (offset[i] < prefix[seg[i]])
    return mask.to(doc_starts.device)


# ------------------------------------------------------------------------------------------------ gate table


def gate_table(fusion: GLUFusion, embedding: nn.Embedding, chunk: int = 4096) -> torch.Tensor:
    """``sigmoid(W_G norm(E))`` for every vocabulary entry, ``[vocab, embed_dim]``, from the weights as they are now.

    Nothing is cached here: the table is a snapshot that is only right while ``W_G`` and the embedding matrix do
    not change, so its owner must drop it before they can (see
    :meth:`fullband.model.modeling.FullBandwidthForCausalLM.frozen_gate_table`, whose lifetime is one call).
    Cost: ``vocab x embed_dim^2`` multiply-adds; memory: one more ``vocab x embed_dim`` matrix in the weights'
    dtype. Built in chunks, under ``no_grad``.
    """
    weight = embedding.weight
    with torch.no_grad():
        table = torch.empty(weight.shape[0], fusion.gate_proj.out_features, dtype=fusion.gate_proj.weight.dtype,
                            device=weight.device)
        for start in range(0, weight.shape[0], chunk):
            table[start:start + chunk] = fusion.gate(weight[start:start + chunk])
    return table


def gate_table_pays(vocab_size: int, fused_tokens: int) -> bool:
    """Whether one call that fuses ``fused_tokens`` tokens should build a gate table: the table costs
    ``vocab x d^2`` multiply-adds once and saves ``d^2`` per fused token (the gate's matmul), so it pays from
    ``vocab`` tokens on."""
    return fused_tokens >= vocab_size


def clear_gate_table(model=None) -> None:
    """Deprecated no-op: there is no gate table that outlives a call any more (the gate is computed from the live
    weights, or looked up in a table scoped to one call), so there is nothing to clear."""
    warnings.warn("fullband.model.feedback.clear_gate_table is a no-op: no gate table outlives a call any more",
                  DeprecationWarning, stacklevel=2)


# ----------------------------------------------------------------------------------------------- positions


def max_positions(config) -> int | None:
    """The backbone's hard position limit, where its config states one."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def position_ids_from_mask(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """Positions that skip padding (left padding starts at 0), for the last ``length`` columns of the mask."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)[:, -length:]


def positions(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """Position ids ``[batch, length]``: from the mask when there is one, else ``0..length-1``."""
    if attention_mask is not None:
        return position_ids_from_mask(attention_mask, length)
    return torch.arange(length, device=device).expand(batch, length)
