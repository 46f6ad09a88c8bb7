"""The decode cache: the backbone's KV cache plus the fed-back state.

Owns :class:`FeedbackCache` / :class:`FeedbackStaticCache` (a ``DynamicCache`` / ``StaticCache`` that also carries
the last final hidden state of each row, moved with the KV entries by beam reordering, batch expansion and
selection) and :func:`cache_bytes`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache


class FeedbackStateMixin:
    """Adds the fed-back state to a KV cache: ``feedback_state`` ``[batch, hidden]`` is the final hidden state of the
    last cached position of each row. Beam reordering, batch expansion and selection move it with the KV entries;
    cropping one step restores the previous state (kept for that), cropping further forgets it."""

    feedback_state: torch.Tensor | None = None
    _previous_state: torch.Tensor | None = None

    def set_state(self, state: torch.Tensor) -> None:
        self._previous_state = self.feedback_state
        self.feedback_state = state

    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        if self.feedback_state is not None:
            self.feedback_state = self.feedback_state.index_select(0, beam_idx.to(self.feedback_state.device))
        self._previous_state = None

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        if self.feedback_state is not None:
            self.feedback_state = self.feedback_state.repeat_interleave(repeats, dim=0)
        self._previous_state = None

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        if self.feedback_state is not None:
            self.feedback_state = self.feedback_state[indices.to(self.feedback_state.device)]
        self._previous_state = None

    def crop(self, tokens_to_remove: int) -> None:
        before = int(self.get_seq_length())
        super().crop(tokens_to_remove)
        removed = before - int(self.get_seq_length())
        if removed == 1 and self._previous_state is not None:
            self.feedback_state, self._previous_state = self._previous_state, None
        elif removed:
            self.feedback_state = self._previous_state = None

    def reset(self):
        super().reset()
        self.feedback_state = self._previous_state = None


class FeedbackCache(FeedbackStateMixin, DynamicCache):
    """A ``DynamicCache`` that also carries the fed-back state (see :class:`FeedbackStateMixin`)."""


class FeedbackStaticCache(FeedbackStateMixin, StaticCache):
    """A preallocated ``StaticCache`` that also carries the fed-back state (see :class:`FeedbackStateMixin`)."""


def cache_bytes(cache) -> dict:
    """Bytes held by a cache: ``kv`` (keys and values of all layers) and ``state`` (the fed-back state)."""
    kv = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                kv += t.numel() * t.element_size()
    state = getattr(cache, "feedback_state", None)
    return {"kv": kv, "state": state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0}
