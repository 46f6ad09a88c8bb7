"""The decode cache: the backbone's KV cache plus the fed-back state.

Owns :class:`FeedbackCache` / :class:`FeedbackStaticCache` (a ``DynamicCache`` / ``StaticCache`` that also carries
the last final hidden state of each row, moved with the KV entries by beam reordering, batch expansion and
selection), :func:`row_cache` (the token-by-token recurrence's cache: a ``DynamicCache`` whose full-attention
layers write into buffers allocated ahead, :class:`GrowingLayer`) and :func:`cache_bytes`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer


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


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` (attention and mask over the tokens written so far, padding masks as for a
    ``DynamicCache``) that writes each step's keys and values into a buffer allocated ahead for ``capacity``
    tokens, doubled when full, instead of concatenating every layer's whole history at every token (O(T^2)
    copying: 4-18 % of a token-by-token pass at T = 256 on CPU). A ``StaticCache`` avoids the copying too but
    attends over its whole length at every step, the empty tail masked (twice the attention work of a row on
    average, and no mask-free attention path). ``keys`` / ``values`` are views of the filled prefix; whatever
    replaces them (cropping, beam reordering, batch selection: ``DynamicLayer``'s own methods) is copied into a
    fresh buffer at the next write."""

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = capacity
        self._key_buffer = self._value_buffer = self._view = None

    def _reseat(self, n: int, need: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New buffers for at least ``need`` tokens, the ``n`` held so far copied in."""
        size = max(self.capacity, need, 2 * n)
        B, H = key_states.shape[:2]
        keys = key_states.new_empty((B, H, size, key_states.shape[-1]))
        values = value_states.new_empty((B, H, size, value_states.shape[-1]))
        if n:
            keys[:, :, :n] = self.keys
            values[:, :, :n] = self.values
        self._key_buffer, self._value_buffer = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.get_seq_length(), key_states.shape[-2]
        if self._view is not self.keys or n + q > self._key_buffer.shape[-2]:
            self._reseat(n, n + q, key_states, value_states)
        self._key_buffer[:, :, n:n + q] = key_states
        self._value_buffer[:, :, n:n + q] = value_states
        self.keys, self.values = self._key_buffer[:, :, :n + q], self._value_buffer[:, :, :n + q]
        self._view = self.keys
        return self.keys, self.values


def row_cache(config, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` (sliding-window and other special layers as ``DynamicCache`` builds them)
    whose full-attention layers are :class:`GrowingLayer` s with room for ``capacity`` tokens: the cache of a
    token-by-token pass over rows of ``capacity`` tokens (it grows past that if fed more)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


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
