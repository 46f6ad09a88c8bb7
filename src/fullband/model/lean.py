"""The lean token step: one position of every row through the backbone's own decoder layers, without the
backbone's per-call machinery (mask building, rotary tables, output objects, the cache classes).

Owns :func:`lean_stack` (whether a backbone runs lean, checked once per backbone on a probe against its own
forward; a family it cannot run lean gets ``None`` and one log line), :class:`LeanCache` (the keys and values of a
token pass in buffers allocated once, written by the backbone's own attention modules through ``update``, as they
write a ``transformers`` cache), :class:`TokenPass` (the recurrence's step: fusion, the decoder layers, the final
norm; eager over the filled prefix, or static-shaped and compiled with ``torch.compile``) and
:func:`resolve_token_step` (what ``--token-step auto`` means on a device). The recurrence that drives it is
:mod:`fullband.model.recurrence`; its decoder layers, attention projections, RoPE, MLP and norms are the backbone's
modules, so every family the probe accepts runs through its own code.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import output_capturing

from .feedback import fuse_where

log = logging.getLogger("fullband")

TOKEN_STEPS = ("auto", "lean", "compiled", "off")
_PROBE: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()  # backbone -> (key, stack)
_WARNED: set = set()


@dataclass
class LeanStack:
    """The parts of a backbone a lean step calls: its decoder layers, final norm, rotary table and LM head."""

    layers: list
    norm: nn.Module
    rotary: nn.Module
    head: nn.Module
    kv_heads: int
    head_dim: int


def resolve_token_step(choice: str, device: torch.device) -> str:
    """``auto`` on a device: ``lean`` (eager) on CPU, where compiling each new model or configuration costs seconds
    that tests and short runs never earn back (what each costs: ``fullband bench token``,
    ``docs/results/bench-token-step``), ``compiled`` on CUDA (CUDA graphs: the per-token pass is launch-bound
    there; not measured). Anything else is returned as it is."""
    if choice not in TOKEN_STEPS:
        raise ValueError(f"unknown token step {choice!r}: choose one of {', '.join(TOKEN_STEPS)}")
    if choice != "auto":
        return choice
    return "compiled" if torch.device(device).type == "cuda" else "lean"


def _why_not(backbone) -> tuple[object, str | None]:
    """The backbone's inner model (decoder layers, norm, rotary table), or the reason it cannot run lean."""
    inner = getattr(backbone, "model", None)
    config = getattr(backbone, "config", None)
    if inner is None or not all(hasattr(inner, n) for n in ("layers", "norm", "rotary_emb")):
        return None, "no Llama-style decoder (model.layers, model.norm, model.rotary_emb)"
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"} or getattr(config, "sliding_window", None) not in (None, 0) and getattr(
            config, "use_sliding_window", True):
        return None, "layers other than full attention (sliding windows)"
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return None, f"attention implementation {config._attn_implementation!r}"
    return inner, None


def lean_stack(backbone) -> LeanStack | None:
    """The :class:`LeanStack` of ``backbone``, or ``None`` (with one log line per family) when it cannot run lean:
    no Llama-style decoder, sliding-window layers, or a probe on which the lean step's final hidden states or
    logits differ from the backbone's own forward (e.g. a model that scales its input embeddings). Checked once
    per backbone object and what the answer depends on: its decoder-layer, norm and head modules (wrapped or
    replaced, e.g. by compilation or checkpointing, they are probed again) and its attention implementation."""
    key = _probe_key(backbone)
    if backbone in _PROBE and _PROBE[backbone][0] == key:
        return _PROBE[backbone][1]
    inner, reason = _why_not(backbone)
    stack = None
    if reason is None:
        config = backbone.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        stack = LeanStack(list(inner.layers), inner.norm, inner.rotary_emb, backbone.get_output_embeddings(),
                          kv, head_dim)
        reason = _probe(backbone, stack)
        stack = stack if reason is None else None
    if reason is not None and type(backbone).__name__ not in _WARNED:
        _WARNED.add(type(backbone).__name__)
        log.info("%s runs the token-by-token pass through its full forward (no lean step: %s)",
                 type(backbone).__name__, reason)
    _PROBE[backbone] = (key, stack)
    return stack


def _probe_key(backbone) -> tuple:
    """What :func:`lean_stack`'s answer depends on besides the backbone object (module identities, by ``id``)."""
    inner = getattr(backbone, "model", None)
    layers = tuple(map(id, getattr(inner, "layers", ()) or ()))
    parts = tuple(id(getattr(inner, n, None)) for n in ("norm", "rotary_emb"))
    head = backbone.get_output_embeddings() if hasattr(backbone, "get_output_embeddings") else None
    return layers, parts, id(head), getattr(getattr(backbone, "config", None), "_attn_implementation", None)


@torch.no_grad()
def _probe(backbone, stack: LeanStack) -> str | None:
    """``None`` when the lean step over a 3-token probe gives the backbone's own final hidden states and logits."""
    training = [(m, m.training) for m in backbone.modules()]
    backbone.eval()
    try:
        emb = backbone.get_input_embeddings()
        ids = torch.arange(3, device=emb.weight.device).view(1, 3) % emb.num_embeddings
        x = emb(ids)
        ref = backbone(inputs_embeds=x, output_hidden_states=True, use_cache=False)
        step = TokenPass(stack, 1, 3, x.dtype, x.device, compiled=False)
        step.prepare(torch.arange(3, device=x.device).view(1, 3), None, None)
        h = torch.cat([step.layers_only(x[:, t:t + 1], t) for t in range(3)], 1)
        want = ref.hidden_states[-1]
        # the two paths attend through different kernels (a prefix against a causal mask): fp32 agrees to ~1e-6,
        # bf16 / fp16 to a few units of their precision; a forward that does more (a scale) is off by O(1)
        tol = max(1e-4, 8 * torch.finfo(x.dtype).eps)
        if h.shape != want.shape or float((h - want).abs().max() / want.abs().max().clamp_min(1e-6)) > tol:
            return "its forward does more than its decoder layers (probe)"
        logits = stack.head(h)
        if logits.shape != ref.logits.shape or float((logits - ref.logits).abs().max()
                                                     / ref.logits.abs().max().clamp_min(1e-6)) > tol:
            return "its logits are not its LM head's product with the final hidden state (probe)"
    except Exception as err:  # a layer that needs more of the backbone's machinery than the lean step gives
        return f"{type(err).__name__} in the probe: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        for m, mode in training:
            m.training = mode
    return None


class LeanCache:
    """Keys and values of a token pass, per layer a buffer ``[B, kv_heads, capacity, head_dim]`` allocated once.
    The backbone's attention modules call :meth:`update` as they call a ``transformers`` cache's: eager, it writes
    position ``length`` and returns the filled prefix; static (``index`` a ``[1]`` tensor), it writes position
    ``index`` and returns the whole buffers (the mask hides the rest): fixed shapes and addresses, as
    ``torch.compile`` and CUDA graphs need."""

    def __init__(self, keys: list, values: list, index: torch.Tensor | None = None):
        self.keys, self.values, self.index, self.length = keys, values, index, 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.index is not None:
            k.index_copy_(2, self.index, key_states)
            v.index_copy_(2, self.index, value_states)
            return k, v
        n = self.length
        k[:, :, n:n + 1] = key_states
        v[:, :, n:n + 1] = value_states
        return k[:, :, :n + 1], v[:, :, :n + 1]


def _run_layers(stack: LeanStack, x, cos, sin, mask, cache) -> torch.Tensor:
    for layer in stack.layers:
        x = layer(x, attention_mask=mask, position_embeddings=(cos, sin), cache=cache, use_cache=True)
        if isinstance(x, tuple):
            x = x[0]
    return stack.norm(x)


class TokenPass:
    """A token pass over ``B`` rows of ``capacity`` positions through a :class:`LeanStack`: :meth:`prepare` takes
    the rows' positions and their key masks (padding, packed samples) once, then :meth:`step` runs one position
    of every row, written once (:meth:`eager_step`) and run one of three ways:

    - eager: attention over the filled prefix, no mask where every key is visible;
    - compiled on CPU: that same step through ``torch.compile`` (inductor, C++ wrapper) with dynamic shapes, so one
      graph serves every position and row count;
    - compiled on CUDA: :meth:`static_step`, every shape fixed and the position a tensor, through ``torch.compile``
      with ``mode="reduce-overhead"`` (CUDA graphs: buffers at fixed addresses, the unwritten tail masked)."""

    def __init__(self, stack: LeanStack, batch: int, capacity: int, dtype, device, compiled: bool):
        self.stack, self.B, self.cap = stack, batch, capacity
        shape = (batch, stack.kv_heads, capacity, stack.head_dim)
        n = len(stack.layers)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.cache = LeanCache(self.keys, self.values)
        self.static = compiled and torch.device(device).type == "cuda"
        self._graph = _compiled(self.static) if compiled else None

    def prepare(self, position_ids: torch.Tensor, valid: torch.Tensor | None, segments: torch.Tensor | None):
        """``position_ids`` ``[B, T]``; ``valid`` ``[B, T]`` bool (False at padding) or ``None``; ``segments``
        ``[B, T]`` (the packed sample each position belongs to) or ``None``. A position attends to the positions
        up to it that are valid and in its segment, and always to itself (a padding position: only itself)."""
        probe = self.keys[0]
        cos, sin = self.stack.rotary(probe, position_ids)
        self.cos, self.sin = cos.expand(self.B, -1, -1).contiguous(), sin.expand(self.B, -1, -1).contiguous()
        T = position_ids.shape[1]
        self.valid = valid if valid is None or not bool(valid.all()) else None
        self.segments = segments
        self.masked = self.valid is not None or segments is not None
        if self.static:
            dev = probe.device
            self.key_pos = torch.arange(self.cap, device=dev)
            self.valid_full = torch.ones(self.B, self.cap, dtype=torch.bool, device=dev)
            self.seg_full = torch.zeros(self.B, self.cap, dtype=torch.long, device=dev)
            if self.valid is not None:
                self.valid_full[:, :T] = self.valid
            if segments is not None:
                self.seg_full[:, :T] = segments
            self.indices = torch.arange(T, device=dev).view(T, 1)

    def _mask(self, t: int) -> torch.Tensor | None:
        if not self.masked:
            return None
        mask = torch.ones(self.B, t + 1, dtype=torch.bool, device=self.keys[0].device)
        if self.valid is not None:
            mask &= self.valid[:, :t + 1]
        if self.segments is not None:
            mask &= self.segments[:, :t + 1] == self.segments[:, t:t + 1]
        mask[:, t] = True
        return mask[:, None, None, :]

    def layers_only(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """Position ``t`` (eager): input ``x`` ``[B, 1, d]`` through the layers; its final hidden state."""
        self.cache.length = t
        return _run_layers(self.stack, x, self.cos[:, t:t + 1], self.sin[:, t:t + 1], self._mask(t), self.cache)

    def step(self, model, t: int, prev, ids, embeds, fuse_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ``t`` of every row: the input fused from ``prev`` ``[B, 1, d]`` (``None`` at t = 0) where
        ``fuse_mask`` ``[B, T]`` allows, the plain embedding elsewhere; returns ``(input, final hidden state)``,
        each ``[B, 1, d]``. ``ids`` / ``embeds``: the rows' tokens ``[B, T]`` and embeddings ``[B, T, d]``."""
        if self.static:
            if prev is None:  # no state yet: zeros, never fused (the feedback mask is False at every row's start)
                prev = embeds.new_zeros(self.B, 1, embeds.shape[-1])
            return self._graph(self, model, prev, ids, embeds, fuse_mask, self.indices[t])
        if self._graph is not None and prev is not None:
            return self._graph(self, model, t, prev, ids, embeds, fuse_mask)
        return self.eager_step(model, t, prev, ids, embeds, fuse_mask)

    def eager_step(self, model, t: int, prev, ids, embeds, fuse_mask):
        """:meth:`step`, eager (or traced with ``t`` symbolic)."""
        inp = embeds[:, t:t + 1]
        if prev is not None:
            inp = fuse_where(fuse_mask[:, t:t + 1], model.fuse(prev, ids[:, t:t + 1], inp), inp)
        return inp, self.layers_only(inp, t)

    def static_step(self, model, prev, ids, embeds, fuse_mask, index):
        """:meth:`step` with every shape fixed and the position a ``[1]`` tensor (CUDA graphs)."""
        inp = embeds.index_select(1, index)
        fused = model.fuse(prev, ids.index_select(1, index), inp)
        inp = fuse_where(fuse_mask.index_select(1, index), fused, inp)
        seg_t = self.seg_full.index_select(1, index)
        mask = ((self.key_pos <= index) & self.valid_full & (self.seg_full == seg_t)) | (self.key_pos == index)
        cos, sin = self.cos.index_select(1, index), self.sin.index_select(1, index)
        cache = LeanCache(self.keys, self.values, index)
        return inp, _run_layers(self.stack, inp, cos, sin, mask[:, None, None, :], cache)

    def kv(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values of the first ``length`` positions."""
        return [(k[:, :, :length], v[:, :, :length]) for k, v in zip(self.keys, self.values)]


def _traced(method: str):
    """``TokenPass.<method>`` as a plain function for ``torch.compile``. transformers' output-capturing hooks read
    a ``ContextVar``, which dynamo cannot trace; set inside the graph it becomes the plain variable transformers
    uses for its own compiled forwards (``None``: nothing to capture)."""

    def run(tp: TokenPass, *args):
        collector = getattr(output_capturing, "_active_collector", None)
        token = collector.set(None) if collector is not None else None
        try:
            return getattr(tp, method)(*args)
        finally:
            if collector is not None:
                collector.reset(token)

    return run


_COMPILED: dict = {}


def _compiled(static: bool):
    """The compiled step, once per process: static with CUDA graphs, or dynamic-shaped through inductor's C++
    wrapper (on CPU the wrapper's lower per-call overhead measured faster than the Python one)."""
    if static not in _COMPILED:
        if static:
            _COMPILED[static] = torch.compile(_traced("static_step"), mode="reduce-overhead", dynamic=False)
        else:
            _COMPILED[static] = torch.compile(_traced("eager_step"), dynamic=True, options={"cpp_wrapper": True})
    return _COMPILED[static]


class LeanDecoder:
    """The lean decode loop's steps through a :class:`TokenPass` (eager): the prompt's keys and values copied in once
    from the cache the prefill filled, then one lean step per new position; :meth:`finish` appends what the steps
    wrote to that cache, so the call hands back the cache it always did."""

    def __init__(self, stack: LeanStack, cache, positions: torch.Tensor, full_mask: torch.Tensor | None, prompt: int):
        layers = cache.layers
        B, cap = positions.shape
        self.tp = TokenPass(stack, B, cap, layers[0].keys.dtype, layers[0].keys.device, compiled=False)
        for i, layer in enumerate(layers):
            self.tp.keys[i][:, :, :prompt] = layer.keys[:, :, :prompt]
            self.tp.values[i][:, :, :prompt] = layer.values[:, :, :prompt]
        self.tp.prepare(positions, full_mask.bool() if full_mask is not None else None, None)
        self.head, self.prompt, self.t = stack.head, prompt, prompt

    @classmethod
    def make(cls, backbone, token_step: str, cache, positions, full_mask, prompt: int) -> "LeanDecoder | None":
        """A decoder, or ``None`` where the loop keeps the backbone's forward: ``token_step`` ``off``, a backbone
        without a lean step, or a cache whose layers do not hold the prompt's keys and values as tensors."""
        if resolve_token_step(token_step, positions.device) == "off":
            return None
        stack = lean_stack(backbone)
        layers = getattr(cache, "layers", None)
        if stack is None or not layers or len(layers) != len(stack.layers) or any(
                not isinstance(getattr(layer, "keys", None), torch.Tensor)
                or layer.keys.shape[-2] < prompt for layer in layers):
            return None
        return cls(stack, cache, positions, full_mask, prompt)

    def forward(self, inputs_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next position's input ``[B, 1, d]`` through the layers: ``(logits [B, V], final hidden state [B, d])``."""
        h = self.tp.layers_only(inputs_embeds, self.t)[:, -1]
        self.t += 1
        return self.head(h), h

    def finish(self, cache) -> None:
        """Append the decoded positions' keys and values to ``cache`` (the prefill's)."""
        for i, (k, v) in enumerate(self.tp.kv(self.t)):
            if self.t > self.prompt:
                cache.update(k[:, :, self.prompt:], v[:, :, self.prompt:], i)
