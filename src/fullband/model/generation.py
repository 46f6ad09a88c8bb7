"""Decoding with latent feedback: the decode modes, Hugging Face ``generate()``, and a lean loop of our own.

Owns
* the decode modes (:data:`MODES`), i.e. how the *prompt* is treated before generation starts; every generated
  token is fused with the final hidden state of the step before it in all modes but ``standard``:

  - ``standard``: no feedback at all; a feedback-trained model runs as a plain LM (== its backbone);
  - ``soft``: the prompt is prefilled plainly (one ordinary pass), then each generated token is fused;
  - ``fused``: the prompt is run once plainly, then ``prefill_passes`` Jacobi passes over it (pass k fuses pass
    k-1's states, each pass with a fresh cache: only the last pass fills the KV cache), then as ``soft``;
  - ``exact``: the prompt itself goes through the exact token-by-token recurrence, then as ``soft`` -- prompt and
    generated tokens are treated alike, so the result equals :meth:`FullBandwidthForCausalLM.recurrent_forward`
    on the whole sequence.

  Padding (left padding) never fuses and never feeds a state; a document start (BOS, ``config.doc_start_token_id``)
  is never fused, generated or not -- the same rules as :func:`fullband.feedback.build_feedback_mask`.
* :class:`FeedbackCache` / :class:`FeedbackStaticCache`: the backbone's KV cache plus the fed-back state (the last
  final hidden state per row), which follows beam reordering, batch expansion and selection with the KV entries;
* :class:`FeedbackGenerationMixin`, the ``GenerationMixin`` hooks through which
  ``model.generate(..., feedback_mode=..., prefill_passes=...)`` works with every Hugging Face decoding strategy
  that uses a cache and no assistant: greedy, sampling, ``num_return_sequences``, beam search, EOS / stop strings,
  streamers. (Assisted / prompt-lookup decoding, ``use_cache=False``, static or chunked-prefill caches and
  continuing from a filled cache are refused with a ``ValueError`` in the feedback modes.)
* when a decode call looks the gate up: ``sigmoid(W_G norm(e_t))`` depends on the token alone, so a call that
  fuses at least ``vocab`` tokens (batch x new tokens, plus the prompt in ``fused`` / ``exact``) builds a
  per-vocabulary table for its own duration (:meth:`~fullband.model.modeling.FullBandwidthForCausalLM.gate_table_scope`)
  and per token only ``W_U h_{t-1}``, a multiply and a norm remain; a smaller call computes the gate per token
  (``d^2`` more multiply-adds, cheaper than building the table). No table outlives the call, so training between
  calls can never leave one stale;
* :func:`generate`, a lean decode loop for throughput (a preallocated static cache where the backbone supports it
  on an accelerator, nothing per step that need not be there) with the same semantics, used by
  ``fullband generate`` and ``fullband bench decode``; and :func:`score`, the teacher-forced log-probabilities of
  a continuation under a decode mode (the ``fullband generate`` command is :mod:`fullband.commands.generate`).

The default mode of a feedback model (``config.default_feedback_mode``) is ``fused`` with one prefill pass
(``prefill_passes=1``), chosen from the measurements below. With the current training recipe
(``fullband experiment recipe``, arm ``residual-warm``, 2 seeds, 6,144 held-out continuation tokens after a 32-token
prompt; see the README) the modes score standard 4.7871, soft 4.7798, fused 4.7785, exact 4.7785 nats/token: every
feedback mode beats ``standard``, and ``fused`` ties ``exact`` at a fraction of its prompt latency.

Evidence (CPU, this repository, held-out text; continuation NLL in nats/token from :func:`score`, i.e. the
teacher-forced decode of a 64-token continuation after a 64-token prompt; "vs fused" is the paired per-window mean
difference and its standard error over 256 windows):

====================================================  ========  ======  =======  =======  =====================
model                                                 standard  soft    fused    exact    soft vs fused
====================================================  ========  ======  =======  =======  =====================
byte-level llama d128 L4, K=3 passes, 1500 steps      1.1965    1.1901  1.1811   1.1813   +0.0090 +- 0.0013
byte-level llama d128 L4, K=2 passes, 1500 steps      1.2122    1.3368  1.3181   1.3243   +0.0187 +- 0.0033
``fullband train --preset tiny`` (BPE 4096,           5.0533    5.0980  5.0881   5.0913   +0.0100 +- 0.0026
400 steps, feedback from step 200, K=2 + 10% K=4)
====================================================  ========  ======  =======  =======  =====================

(The byte-level models were trained on vim's documentation with the K-pass objective; more prefill passes did not
help: fused with 2 or 4 passes equalled exact, 1.0737 / 1.0739 vs 1.0730 for one pass on the K=3 model's first
96-window sample.) Among the feedback modes ``fused`` is the best or tied best on every model: it matches
``exact`` (K=3: +0.0002 +- 0.0003) and beats ``soft`` by 4-7 standard errors, most of that in the first tokens
(K=3, first 8 tokens: soft 1.268, fused 1.228), where a soft decode conditions on a prompt whose KV entries come
from a plain pass the model never saw next to fused tokens. Cost (``fullband bench decode``, gpt2 d768 L12,
32-token prompt, 64 new tokens, CPU time): decode speed is the same in every mode (decode-only fused / standard
0.95-1.00); the extra prompt pass costs 0.91-0.92 end to end (prefill FLOPs x2, but parallel), whereas ``exact``
runs the prompt token by token (0.70-0.78 end to end, and it grows with the prompt). So ``fused`` buys ``exact``'s
quality at a fraction of its latency, and ``soft`` stays the choice when prefill compute is the constraint.
Caveat, equally measured: on the two models whose training fed back only states of plain-pass positions (K=2,
little or no K>2), ``standard`` decoding beat every feedback mode (-0.035 to -0.11 nats vs fused); feedback
decoding pays off once training feeds back states of fused positions (K=3 above: every feedback mode beats
``standard``, fused by 0.0154 +- 0.0032).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from transformers import GenerationMixin

from .cache import FeedbackCache, FeedbackStateMixin, FeedbackStaticCache
from .configuration import DECODE_MODES, has_feedback
from .feedback import max_positions
from .feedback import positions as position_ids_for
from .lean import LeanDecoder
from .outputs import FullBandwidthOutput

MODES = DECODE_MODES  # ("standard", "soft", "fused", "exact"), one list with the config's validation

# ------------------------------------------------------------------------------------------------ modes


def resolve_mode(model, mode: str | None) -> str:
    """The decode mode to use: ``mode``, else the model's ``config.default_feedback_mode`` (``standard`` for a
    plain model). Raises ``ValueError`` for an unknown mode or a feedback mode on a model without fusion."""
    if mode is None:
        mode = getattr(model.config, "default_feedback_mode", None) if has_feedback(model) else "standard"
        mode = mode or "standard"
    if mode not in MODES:
        raise ValueError(f"unknown decode mode {mode!r}: choose one of {', '.join(MODES)}")
    if mode != "standard" and not has_feedback(model):
        raise ValueError(f"decode mode {mode!r} needs a model with latent feedback (a fullband model); "
                         f"{type(model).__name__} has no fusion module -- use mode 'standard'")
    return mode


def _check_prefill_passes(prefill_passes) -> int:
    if not isinstance(prefill_passes, int) or isinstance(prefill_passes, bool) or prefill_passes < 1:
        raise ValueError(f"prefill_passes must be an integer >= 1, got {prefill_passes!r}")
    return prefill_passes


def _check_length(model, prompt_length: int, max_new_tokens: int) -> None:
    config = model.config.text_config if has_feedback(model) else model.config
    limit = max_positions(config)
    if limit is not None and prompt_length + max_new_tokens > limit:
        raise ValueError(f"a prompt of {prompt_length} tokens plus up to {max_new_tokens} new tokens exceeds the "
                         f"backbone's {limit} positions; shorten the prompt or lower max_new_tokens")


def fused_tokens(mode: str, batch: int, prompt_len: int, new_tokens: int, prefill_passes: int = 1) -> int:
    """How many tokens one decode call fuses: every new token in a feedback mode, plus the prompt once per prefill
    pass in ``fused`` and once in ``exact``."""
    if mode == "standard":
        return 0
    prompt = {"fused": prefill_passes, "exact": 1}.get(mode, 0) * prompt_len
    return batch * (new_tokens + prompt)


def _hf_fused_tokens(model, args, kwargs, mode: str, prefill_passes: int) -> int:
    """An estimate of :func:`fused_tokens` for ``model.generate(*args, **kwargs)`` (rows x beams or returned
    sequences; ``max_new_tokens`` or ``max_length``); it only decides whether a gate table pays."""
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return 0
    config = kwargs.get("generation_config") or model.generation_config

    def value(name):
        return kwargs.get(name, getattr(config, name, None))

    rows = ids.shape[0] * max(value("num_beams") or 1, value("num_return_sequences") or 1)
    new = value("max_new_tokens")
    if new is None:
        new = max((value("max_length") or 0) - ids.shape[1], 0)
    return fused_tokens(mode, rows, ids.shape[1], new, prefill_passes)


# ------------------------------------------------------------------------------------------------ prefill (HF path)


def prefill_forward(model, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.LongTensor | None, cache, mode: str, prefill_passes: int = 1):
    """Run the prompt through ``model`` (a fullband model) as ``mode`` says, filling the empty ``cache``.

    Returns a :class:`~fullband.FullBandwidthOutput` with the last position's logits ``[B, 1, V]`` and final hidden
    state ``[B, 1, d]`` (the state the first generated token is fused with), and the cache.
    """
    if mode in ("standard", "soft", "fused"):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                    use_cache=True, num_passes=1 + prefill_passes if mode == "fused" else 1, logits_to_keep=1)
    elif mode == "exact":
        out = model.recurrent_forward(input_ids, attention_mask, position_ids=position_ids, cache=cache)
    else:
        raise ValueError(f"unknown decode mode {mode!r}")
    return FullBandwidthOutput(logits=out.logits[:, -1:], last_hidden_state=out.last_hidden_state[:, -1:],
                               cache=out.cache)


# ------------------------------------------------------------------------------------------------ HF generate() glue


class FeedbackGenerationMixin(GenerationMixin):
    """``GenerationMixin`` with latent feedback: ``generate(..., feedback_mode=..., prefill_passes=1)``.

    How it hooks in: ``feedback_mode`` / ``prefill_passes`` travel as model kwargs; the cache is a
    :class:`FeedbackCache`; ``_prefill`` treats the prompt as the mode says; after every forward
    ``_update_model_kwargs_for_generation`` stores the last final hidden state in the cache; the next step's
    ``prepare_inputs_for_generation`` passes it as ``prev_hidden``, so the new token is fused with it. Beam search's
    ``cache.reorder_cache`` and batch expansion move the state with the KV entries.
    """

    def generate(self, *args, feedback_mode: str | None = None, prefill_passes: int = 1, **kwargs):
        mode = resolve_mode(self, feedback_mode)
        _check_prefill_passes(prefill_passes)
        if mode != "standard":
            if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
                raise ValueError(f"assisted / prompt-lookup decoding is not supported in decode mode {mode!r}; "
                                 "use feedback_mode='standard'")
            if kwargs.get("use_cache") is False:
                raise ValueError(f"decode mode {mode!r} needs use_cache=True: the cache carries the fed-back state")
            if kwargs.get("cache_implementation") not in (None, "dynamic"):
                raise ValueError(f"cache_implementation={kwargs['cache_implementation']!r} is not supported by "
                                 f"generate() in decode mode {mode!r}; use fullband.generation.generate() for a "
                                 "static cache")
            if kwargs.get("prefill_chunk_size") is not None:
                raise ValueError(f"chunked prefill is not supported in decode mode {mode!r}")
            with self.gate_table_scope(_hf_fused_tokens(self, args, kwargs, mode, prefill_passes)):
                return super().generate(*args, feedback_mode=mode, prefill_passes=prefill_passes, **kwargs)
        return super().generate(*args, feedback_mode=mode, prefill_passes=prefill_passes, **kwargs)

    def _validate_generated_length(self, generation_config, input_ids_length, has_default_max_length):
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
        if generation_config.max_length is not None:
            _check_length(self, input_ids_length, generation_config.max_length - input_ids_length)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        if (model_kwargs.get("feedback_mode", "standard") != "standard" and model_kwargs.get("cache") is None
                and generation_config.use_cache is not False
                and generation_config.cache_implementation in (None, "dynamic")):
            model_kwargs["cache"] = FeedbackCache(config=self.config.get_text_config(decoder=True))
            return
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                                     max_cache_length)

    def _prefill(self, input_ids, generation_config, model_kwargs, is_first_iteration=True):
        mode = model_kwargs.get("feedback_mode", "standard")
        if mode == "standard":
            return super()._prefill(input_ids, generation_config, model_kwargs, is_first_iteration)
        cache = model_kwargs.get("cache")
        if cache is None:
            raise ValueError(f"decode mode {mode!r} needs use_cache=True: the cache carries the fed-back state")
        if not isinstance(cache, FeedbackStateMixin):
            raise ValueError(f"decode mode {mode!r} needs a fullband.generation.FeedbackCache (got "
                             f"{type(cache).__name__}); pass none and generate() creates one")
        if int(cache.get_seq_length()):
            raise ValueError(f"decode mode {mode!r} cannot continue from a filled cache; start from the whole "
                             "sequence with an empty cache")
        if getattr(generation_config, "prefill_chunk_size", None) is not None:
            raise ValueError(f"chunked prefill is not supported in decode mode {mode!r}")
        if model_kwargs.get("inputs_embeds") is not None:
            raise ValueError(f"decode mode {mode!r} needs input_ids, not inputs_embeds")
        return prefill_forward(self, input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"),
                               cache, mode, model_kwargs.get("prefill_passes", 1))

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, feedback_mode="standard",
                                      prefill_passes=1, **kwargs):
        inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, cache=cache, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs)
        if feedback_mode != "standard":
            state = getattr(cache, "feedback_state", None)
            if state is None:
                raise ValueError(f"decode mode {feedback_mode!r}: the cache holds no fed-back state "
                                 "(was it cropped or replaced?)")
            inputs["prev_hidden"] = state
        return inputs

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False,
                                            num_new_tokens=1):
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder,
                                                                   num_new_tokens)
        cache = model_kwargs.get("cache")
        if model_kwargs.get("feedback_mode", "standard") != "standard" and isinstance(cache, FeedbackStateMixin):
            cache.set_state(outputs.last_hidden_state[:, -1].clone())
        return model_kwargs


# ------------------------------------------------------------------------------------------------ lean loop

_FAST_PATH: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Runner:
    """The parts of a model the lean loop calls, resolved once per call."""

    def __init__(self, model, mode: str, prefill_passes: int):
        self.model, self.mode, self.prefill_passes = model, mode, prefill_passes
        self.fullband = has_feedback(model)
        self.backbone = model.backbone if self.fullband else model
        self.embed = self.backbone.get_input_embeddings()
        self.head = self.backbone.get_output_embeddings()
        self.base = getattr(self.backbone, "base_model", None)
        self.fusion = model.feedback if self.fullband else None
        self.doc_start = model.config.doc_start_token_id if self.fullband else None
        self.fast = self._fast_path_ok()
        self.lean: LeanDecoder | None = None  # go_lean(): the decode steps through the lean token step

    def _fast_path_ok(self) -> bool:
        """Decode steps call the backbone's base model and LM head directly when that gives exactly what the full
        forward gives (head(final hidden state) == logits); checked once per backbone on a 2-token probe."""
        hit = _FAST_PATH.get(self.backbone)
        if hit is not None:
            return hit
        ok = False
        if self.base is not None and self.base is not self.backbone and self.head is not None:
            probe = torch.zeros(1, 2, dtype=torch.long, device=self.embed.weight.device)
            full = self.backbone(input_ids=probe, output_hidden_states=True, use_cache=False)
            h = getattr(self.base(input_ids=probe, use_cache=False), "last_hidden_state", None)
            ok = (h is not None and h.shape == full.hidden_states[-1].shape
                  and torch.allclose(h, full.hidden_states[-1], atol=1e-6, rtol=1e-5)
                  and torch.allclose(self.head(h), full.logits, atol=1e-5, rtol=1e-4))
        _FAST_PATH[self.backbone] = ok
        return ok

    def go_lean(self, cache, positions, full_mask, prompt: int) -> None:  # after the prefill, where it runs
        self.lean = LeanDecoder.make(self.backbone, getattr(self.model, "token_step", "auto"), cache, positions,
                                     full_mask, prompt)

    def forward(self, input_ids, inputs_embeds, attention_mask, position_ids, cache):
        """One backbone call; returns (last logits [B, V], last final hidden state [B, d])."""
        if self.lean is not None:
            return self.lean.forward(self.embed(input_ids) if inputs_embeds is None else inputs_embeds)
        if self.fast:
            h = self.base(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                          position_ids=position_ids, cache=cache, use_cache=True).last_hidden_state[:, -1]
            return self.head(h), h
        out = self.backbone(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                            position_ids=position_ids, cache=cache, use_cache=True, output_hidden_states=True,
                            logits_to_keep=1)
        return out.logits[:, -1], out.hidden_states[-1][:, -1]

    def fuse(self, state: torch.Tensor, tokens: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Input of tokens ``[B]`` that follow ``state`` ``[B, d]``: fused (the model's own fusion), except at
        document starts."""
        fused = self.model.fuse(state, tokens, embeds).to(embeds.dtype)
        if self.doc_start is None:
            return fused
        return torch.where((tokens != self.doc_start).unsqueeze(-1), fused, embeds)

    def step(self, tokens, state, attention_mask, position_ids, cache):
        """One decode step for the new ``tokens`` ``[B]`` that follow ``state``: (logits [B, V], new state)."""
        if self.mode == "standard":
            return self.forward(tokens[:, None], None, attention_mask, position_ids, cache)
        fused = self.fuse(state, tokens, self.embed(tokens))
        return self.forward(None, fused[:, None], attention_mask, position_ids, cache)

    def prefill(self, input_ids, attention_mask, position_ids, cache):
        B, P = input_ids.shape
        if self.mode == "fused":
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, use_cache=True, num_passes=1 + self.prefill_passes, logits_to_keep=1)
            return out.logits[:, -1], out.last_hidden_state[:, -1]
        if self.mode == "exact":
            out = self.model.recurrent_forward(input_ids, attention_mask, position_ids=position_ids, cache=cache)
            return out.logits[:, -1], out.last_hidden_state[:, -1]
        return self.forward(input_ids, None, attention_mask, position_ids, cache)


def _select(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float,
            generator: torch.Generator | None) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(-1)
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        probs = sorted_scores.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p (>= 1 token)
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(1)


@dataclass
class GenerationResult:
    """Output of :func:`generate`: ``sequences`` ``[B, P + n]`` (prompt then new tokens, pad after EOS),
    ``new_tokens`` ``[B, n]``, the per-step ``logits`` ``[B, n, V]`` (fp32) when asked for, timings (wall-clock
    seconds and this process's CPU seconds; the prefill includes the first token's logits) and the cache (KV
    entries and the fed-back state)."""

    sequences: torch.LongTensor
    new_tokens: torch.LongTensor
    logits: torch.Tensor | None
    mode: str
    prefill_seconds: float
    decode_seconds: float
    cache: object = None
    prefill_cpu_seconds: float = 0.0
    decode_cpu_seconds: float = 0.0

    @property
    def num_new_tokens(self) -> int:
        return self.new_tokens.shape[1]


def _gate_scope(model, mode: str, batch: int, prompt_len: int, new_tokens: int, prefill_passes: int):
    """The gate-table scope of one lean-loop call (:func:`fused_tokens` decides; plain models have none)."""
    if not has_feedback(model):
        return contextlib.nullcontext()
    return model.gate_table_scope(fused_tokens(mode, batch, prompt_len, new_tokens, prefill_passes))


def _make_cache(runner: _Runner, implementation: str, max_len: int):
    """The lean loop's KV cache. ``auto``: a preallocated static cache where the backbone supports one and the
    model is on an accelerator (no reallocation per step; what torch.compile / CUDA graphs need); a dynamic one on
    CPU, where eager decoding measured faster with it (the static cache's per-step attention mask spans the whole
    preallocated length: gpt2 d256 L4, vocab 2048, 32 + 64 tokens, CPU time per step, best of 6: batch 1 3.37 ms
    dynamic vs 3.66 ms static, batch 16 6.97 vs 7.36 ms)."""
    if implementation not in ("auto", "static", "dynamic"):
        raise ValueError(f"unknown cache implementation {implementation!r}: choose auto, static or dynamic")
    config = runner.backbone.config
    static_ok = bool(getattr(runner.backbone, "_can_compile_fullgraph", False))
    if implementation == "static" and not static_ok:
        raise ValueError(f"{type(runner.backbone).__name__} does not support a static cache; use 'dynamic'")
    on_accelerator = runner.embed.weight.device.type not in ("cpu", "meta")
    if implementation == "static" or (implementation == "auto" and static_ok and on_accelerator):
        return FeedbackStaticCache(config=config, max_cache_len=max_len)
    return FeedbackCache(config=config)


@torch.inference_mode()
def _run(model, input_ids, attention_mask, *, mode, max_new_tokens, prefill_passes, **kwargs):
    """:func:`_decode` inside the call's gate-table scope (a table only where it pays: :func:`fused_tokens`)."""
    mode = resolve_mode(model, mode)
    rows, prompt = input_ids.shape if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else (0, 0)
    new = max_new_tokens if isinstance(max_new_tokens, int) else 0
    with _gate_scope(model, mode, rows, prompt, new, prefill_passes if isinstance(prefill_passes, int) else 1):
        return _decode(model, input_ids, attention_mask, mode=mode, max_new_tokens=max_new_tokens,
                       prefill_passes=prefill_passes, **kwargs)


def _decode(model, input_ids, attention_mask, *, mode, max_new_tokens, prefill_passes, do_sample, temperature,
         top_k, top_p, generator, eos_token_id, pad_token_id, stopping, streamer, cache_implementation,
         output_logits, forced=None):
    mode = resolve_mode(model, mode)
    _check_prefill_passes(prefill_passes)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError("input_ids must be an integer tensor [batch, prompt_len]")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if do_sample and (temperature <= 0 or not 0 < top_p <= 1 or top_k < 0):
        raise ValueError("sampling needs temperature > 0, 0 < top_p <= 1 and top_k >= 0")
    B, P = input_ids.shape
    if P == 0:
        raise ValueError("the prompt is empty: give at least one token (e.g. BOS)")
    _check_length(model, P, max_new_tokens)
    device = input_ids.device
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (B, P):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {(B, P)}")
        if bool(attention_mask[:, -1].eq(0).any()):
            raise ValueError("right padding detected: pad prompts on the left for decoding")
        if bool(attention_mask.bool().all()):
            attention_mask = None  # no padding: let the backbone use its plain causal path
    runner = _Runner(model, mode, prefill_passes)
    N = max_new_tokens
    if attention_mask is not None:
        prompt_pos = position_ids_for(attention_mask, B, P, device)
        positions = torch.cat([prompt_pos, prompt_pos[:, -1:] + 1 + torch.arange(N, device=device)], dim=1)
        full_mask = torch.cat([attention_mask, attention_mask.new_ones(B, N)], dim=1)
    else:
        positions = torch.arange(P + N, device=device).expand(B, P + N)
        full_mask = None
    cache = _make_cache(runner, cache_implementation, P + N)
    eos = None
    if eos_token_id is not None:
        eos = torch.as_tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id),
                              device=device, dtype=torch.long)
        if pad_token_id is None:
            pad_token_id = int(eos[0])
    if streamer is not None:
        streamer.put(input_ids.cpu())

    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    logits, state = runner.prefill(input_ids, attention_mask, positions[:, :P], cache)
    runner.go_lean(cache, positions, full_mask, P)
    _sync(device)
    t1, c1 = time.perf_counter(), time.process_time()
    new = torch.empty(B, N, dtype=torch.long, device=device)
    kept = [] if output_logits or forced is not None else None
    finished = torch.zeros(B, dtype=torch.bool, device=device) if (eos is not None or stopping) else None
    feedback = mode != "standard"
    n = 0
    for i in range(N):
        if kept is not None:
            kept.append(logits.float())
        tok = forced[:, i] if forced is not None else _select(logits, do_sample, temperature, top_k, top_p, generator)
        if finished is not None:
            tok = torch.where(finished, torch.full_like(tok, pad_token_id if pad_token_id is not None else 0), tok)
        new[:, i] = tok
        n = i + 1
        if streamer is not None:
            streamer.put(tok.cpu())
        if finished is not None:
            if eos is not None:
                finished |= torch.isin(tok, eos)
            if stopping is not None:
                finished |= stopping(torch.cat([input_ids, new[:, :n]], dim=1), None).to(device)
            if bool(finished.all()):
                break
        if i == N - 1:
            break
        pos = positions[:, P + i:P + i + 1]
        mask = full_mask[:, :P + i + 1] if full_mask is not None else None
        logits, state = runner.step(tok, state, mask, pos, cache)
    _sync(device)
    t2, c2 = time.perf_counter(), time.process_time()
    if runner.lean is not None:
        runner.lean.finish(cache)
    if feedback:
        cache.set_state(state)
    if streamer is not None:
        streamer.end()
    new = new[:, :n]
    return GenerationResult(sequences=torch.cat([input_ids, new], dim=1), new_tokens=new,
                            logits=torch.stack(kept, dim=1) if kept else None, mode=mode, prefill_seconds=t1 - t0,
                            decode_seconds=t2 - t1, cache=cache, prefill_cpu_seconds=c1 - c0,
                            decode_cpu_seconds=c2 - c1)


def generate(model, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, *,
             mode: str | None = None, max_new_tokens: int = 32, prefill_passes: int = 1, do_sample: bool = False,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             generator: torch.Generator | None = None, eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, ignore_eos: bool = False,
             stopping: Callable[[torch.LongTensor, None], torch.Tensor] | None = None, streamer=None,
             cache_implementation: str = "auto", output_logits: bool = False) -> GenerationResult:
    """Lean decoding with latent feedback (same semantics as ``model.generate(feedback_mode=...)``).

    ``model`` is a fullband model, or a plain Hugging Face causal LM (``mode='standard'`` only). ``input_ids``
    ``[B, P]`` with optional ``attention_mask`` (left padding). ``mode`` defaults to
    ``model.config.default_feedback_mode``. Greedy unless ``do_sample`` (``temperature``, ``top_k``, ``top_p``,
    draws from ``generator``). A row stops at ``eos_token_id`` (default: the model's generation config, none with
    ``ignore_eos``) or where ``stopping(sequences, None)`` -- e.g. a ``transformers.StopStringCriteria`` -- says
    so, and is padded with ``pad_token_id`` after that; decoding ends when every row has stopped or after
    ``max_new_tokens``. ``streamer`` gets ``put(prompt)``, ``put(tokens)`` per step and ``end()`` (any Hugging Face
    streamer). ``cache_implementation``: ``static`` (preallocated), ``dynamic`` or ``auto`` (static where the
    backbone supports it on an accelerator, dynamic on CPU where that measured faster; see :func:`_make_cache`).
    Runs under ``torch.inference_mode``; put the model in eval mode first.
    """
    if eos_token_id is None and not ignore_eos:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ignore_eos:
        eos_token_id = None
    if pad_token_id is None:
        pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    return _run(model, input_ids, attention_mask, mode=mode, max_new_tokens=max_new_tokens,
                prefill_passes=prefill_passes, do_sample=do_sample, temperature=temperature, top_k=top_k,
                top_p=top_p, generator=generator, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                stopping=stopping, streamer=streamer, cache_implementation=cache_implementation,
                output_logits=output_logits)


@torch.inference_mode()
def interleaved_decode_times(model, input_ids: torch.LongTensor, modes: Sequence[str], steps: int,
                             cache_implementation: str = "auto", clock: Callable[[], float] = time.process_time,
                             prefill_passes: int = 1) -> dict[str, list[float]]:
    """Per-step decode times of several modes run in lockstep on the same prompt (greedy, no padding): step i of
    every mode runs back to back, in an order that rotates every step, so a slow patch of a shared machine hits all
    modes alike. Returns ``{mode: [seconds per step]}``; the paired ratio of the medians is the decode cost of
    feedback, free of the noise that separate runs suffer."""
    B, P = input_ids.shape
    _check_length(model, P, steps + 1)
    positions = torch.arange(P + steps + 1, device=input_ids.device).expand(B, -1)
    # one table scope for the lanes, as large as the largest lane's call would open on its own
    mode = max(modes, key=lambda m: fused_tokens(resolve_mode(model, m), B, P, steps, prefill_passes))
    with _gate_scope(model, resolve_mode(model, mode), B, P, steps, prefill_passes):
        return _interleaved(model, input_ids, modes, steps, cache_implementation, clock, prefill_passes, positions)


def _interleaved(model, input_ids, modes, steps, cache_implementation, clock, prefill_passes, positions):
    P = input_ids.shape[1]
    lanes = []
    for mode in modes:
        runner = _Runner(model, resolve_mode(model, mode), prefill_passes)
        cache = _make_cache(runner, cache_implementation, P + steps + 1)
        logits, state = runner.prefill(input_ids, None, positions[:, :P], cache)
        runner.go_lean(cache, positions, None, P)
        lanes.append([runner, cache, logits, state])
    times = {mode: [] for mode in modes}
    for i in range(steps):
        pos = positions[:, P + i:P + i + 1]
        for k in range(len(lanes)):
            j = (i + k) % len(lanes)
            runner, cache, logits, state = lanes[j]
            _sync(input_ids.device)
            t = clock()
            tok = logits.argmax(-1)
            lanes[j][2], lanes[j][3] = runner.step(tok, state, None, pos, cache)
            _sync(input_ids.device)
            times[modes[j]].append(clock() - t)
    return times


def score(model, input_ids: torch.LongTensor, continuation_ids: torch.LongTensor,
          attention_mask: torch.Tensor | None = None, *, mode: str | None = None, prefill_passes: int = 1,
          cache_implementation: str = "auto") -> torch.Tensor:
    """Log-probabilities ``[B, N]`` of ``continuation_ids`` ``[B, N]`` after the prompt ``input_ids`` when decoding
    in ``mode`` (teacher-forced: each continuation token is fused with the state of the step before it, exactly as
    a generated token would be)."""
    if continuation_ids.dim() != 2 or continuation_ids.shape[0] != input_ids.shape[0]:
        raise ValueError("continuation_ids must be [batch, length] with the prompt's batch size")
    res = _run(model, input_ids, attention_mask, mode=mode, max_new_tokens=continuation_ids.shape[1],
               prefill_passes=prefill_passes, do_sample=False, temperature=1.0, top_k=0, top_p=1.0, generator=None,
               eos_token_id=None, pad_token_id=None, stopping=None, streamer=None,
               cache_implementation=cache_implementation, output_logits=False, forced=continuation_ids)
    return res.logits.log_softmax(-1).gather(-1, continuation_ids.unsqueeze(-1)).squeeze(-1)
