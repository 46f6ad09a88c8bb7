"""The vLLM model class of a fullband checkpoint: latent feedback inside vLLM's own scheduler.

Owns
* :class:`FullBandwidthForCausalLMVLLM`, the class vLLM instantiates for ``architectures:
  ["FullBandwidthForCausalLM"]``: vLLM's own Llama / Qwen2 / Mistral model as ``backbone`` (weights
  ``backbone.*`` of ``save_pretrained`` load onto it unchanged, through its own weight loader), the fusion as
  ``feedback`` (weights ``feedback.*``), and the state layers (one used; as many as the backbone has layers);
* :class:`FeedbackStateLayer`, a Mamba-style state layer (vLLM's ``MambaBase``): its KV-cache spec
  (:class:`~fullband.serving.scheduling.FeedbackStateSpec`) gives every running request one state slot of
  ``hidden_size`` values (the fed-back final hidden state), in the same paged pool as the attention KV cache, so the
  hybrid KV-cache manager allocates, recycles and frees it with the request;
* :class:`FeedbackStateBackend` / :class:`FeedbackStateMetadataBuilder`: per step, the request -> token range
  (``query_start_loc``) and request -> slot (``state_indices``) maps, and which requests are *decoding* --
  taken from vLLM's ``is_prefilling`` (``num_computed_tokens < num_prompt_tokens``), not from the query length,
  because the last chunk of a chunked prefill can be one token long and is still prompt; a decode-only step (the
  steady state: one generated token per request) is recognised from vLLM's per-step integers and skips the masks
  and index tensors (rows 0..R-1 in request order);
* calling the startup checks of :mod:`fullband.serving.config` where vLLM builds the model (the engine config).
  The state's KV-cache spec and its manager, and the scheduler that keeps prefix caching and preemption exact, are
  in :mod:`fullband.serving.scheduling`.

Semantics. Decode mode ``soft`` (the default): the prompt is prefilled plainly, chunk by chunk; after every
forward the final hidden state of each request's last scheduled token is written to its slot; a decoding request's
token (position >= prompt length) enters as ``fusion(slot state, e_t)`` -- the plain embedding if it is the
document-start token. A new request never reads its slot before its own prefill wrote it, so nothing leaks between
requests sharing a slot over time. This equals ``model.generate(..., feedback_mode="soft")``. Mode ``fused``
(``--hf-overrides '{"serving_feedback_mode": "fused", "serving_prefill_passes": N}'``, i.e. ``fullband serve --mode
fused``): a step that holds prompt tokens runs the backbone 1 + N times over the whole batch, prompt tokens fused
with the previous pass's states (Jacobi passes); each pass rewrites the same KV slots, so the cache keeps the last
pass's entries; then as ``soft`` -- equal to ``generate(feedback_mode="fused", prefill_passes=N)``. It needs every
prompt in one step (chunked prefill off), checked at startup and per step.

These are vLLM internals (``MambaBase``, ``MambaSpec``, ``CommonAttentionMetadata.is_prefilling``, the forward
context); the extra pins the vLLM version they were written against.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.utils import AutoWeightsLoader, init_vllm_registered_model
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.attention.backends.linear_attn import LinearAttentionBackend
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

from .config import backbone_architecture, check_engine_config, serving_mode
from .scheduling import STATS_ENV, FeedbackStateSpec

STATE_LAYER = "feedback_state"  # the state layer's name in vLLM's forward context


def _text_config(vllm_config: VllmConfig):
    return vllm_config.model_config.hf_config.text_config


def _state_dtype(vllm_config: VllmConfig) -> torch.dtype:
    return vllm_config.model_config.dtype


def _vllm_rms_norm():
    """vLLM's RMSNorm kernel (``torch.ops._C.rms_norm(out, x, weight, eps)``; float32 accumulation), or ``None``
    where the vLLM build has none."""
    try:
        return torch.ops._C.rms_norm
    except (AttributeError, RuntimeError):
        return None


# ----------------------------------------------------------------------------------------------- state layer


class FeedbackStateBackend(LinearAttentionBackend):
    """The "attention backend" of the state layer: only a metadata builder; the state math is in the model."""

    @staticmethod
    def get_name() -> str:
        return "FULLBAND_FEEDBACK_STATE"

    @staticmethod
    def get_builder_cls() -> type["FeedbackStateMetadataBuilder"]:
        return FeedbackStateMetadataBuilder


Rows = torch.Tensor | slice  # token indices in the flattened batch; a slice in a decode-only step


@dataclass
class FeedbackStateMetadata:
    query_start_loc: torch.Tensor | None  # [R + 1] token range of each request (None: decode-only, one each)
    state_indices: torch.Tensor  # [R] the state slot of each request
    decoding: torch.Tensor | None  # [R] bool: its first token is a generated one (takes the fed-back state)
    active: torch.Tensor | None  # [R] bool: it has tokens this step (padding rows have none)
    num_reqs: int
    num_fused: int  # decoding requests (the rows below)
    fused_rows: Rows  # token index (in the flattened batch) of every decoding request's token
    fused_slots: torch.Tensor  # ... and the slot its state is read from
    last_rows: Rows  # token index of every active request's last token this step
    last_slots: torch.Tensor  # ... and the slot its final hidden state is written to
    jacobi_rows: torch.Tensor | None = None  # mode fused: prompt tokens after each prompt's first one
    starting: torch.Tensor | None = None  # test statistics only: [R] bool, the request's first step


class FeedbackStateMetadataBuilder(AttentionMetadataBuilder[FeedbackStateMetadata]):
    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.mode, _ = serving_mode(vllm_config.model_config.hf_config)
        self.stats = bool(os.environ.get(STATS_ENV))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FeedbackStateMetadata:
        m = common_attn_metadata
        if m.is_prefilling is None:
            raise RuntimeError("fullband: this vLLM build gives no is_prefilling per request; the serving plugin "
                               "needs it to tell a last prefill chunk from a decode (install the pinned vLLM)")
        n = m.num_reqs
        slots = mamba_get_block_table_tensor(m.block_table_tensor, m.seq_lens, self.kv_cache_spec,
                                             self.vllm_config.cache_config.mamba_cache_mode)[:n, 0].long()
        if m.max_query_len == 1 and m.num_actual_tokens == n and not bool(m.is_prefilling[:n].any()):
            # decode-only step (every request one generated token; the steady state): rows 0..n-1 in request
            # order, no masks, no index tensors -- the per-step cost is one slice of the block table
            rows = slice(0, n)
            return FeedbackStateMetadata(query_start_loc=None, state_indices=slots, decoding=None, active=None,
                                         num_reqs=n, num_fused=n, fused_rows=rows, fused_slots=slots,
                                         last_rows=rows, last_slots=slots)
        qsl = m.query_start_loc[:n + 1].long()
        qlen = qsl[1:] - qsl[:-1]
        active = qlen > 0
        decoding = active & ~m.is_prefilling[:n].to(active.device)
        jacobi = None
        if self.mode == "fused":
            prefill = active & ~decoding
            if bool((prefill & (m.seq_lens[:n].long().to(qlen.device) != qlen)).any()):
                raise RuntimeError("fullband: decode mode 'fused' got a prompt split over steps (chunked prefill, "
                                   "prefix caching or preemption); it needs each prompt prefilled in one step")
            token_req = torch.repeat_interleave(torch.arange(n, device=qsl.device), qlen)
            first = torch.zeros_like(token_req, dtype=torch.bool)
            first[qsl[:-1][active]] = True
            jacobi = torch.nonzero(prefill[token_req] & ~first).squeeze(1)
        starting = active & (m.seq_lens[:n].long().to(qlen.device) == qlen) if self.stats else None
        fused_rows = qsl[:-1][decoding]
        return FeedbackStateMetadata(query_start_loc=qsl, state_indices=slots, decoding=decoding, active=active,
                                     num_reqs=n, num_fused=fused_rows.numel(), fused_rows=fused_rows,
                                     fused_slots=slots[decoding],
                                     last_rows=qsl[1:][active] - 1, last_slots=slots[active], jacobi_rows=jacobi,
                                     starting=starting)


class FeedbackStateLayer(MambaBase):
    """One state vector (the last final hidden state) per running request, kept by vLLM's hybrid KV-cache manager
    exactly like a Mamba layer's state."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.hidden_size, self.dtype, self.prefix = hidden_size, dtype, prefix
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> FeedbackStateSpec:
        """One page per request (:class:`~fullband.serving.scheduling.FeedbackStateManager`), out of prefix caching,
        with the attention block size (so the prefix-cache granularity stays the attention block's); vLLM pads the
        page to the attention page size when it groups the layers."""
        return FeedbackStateSpec(shapes=self.get_state_shape(), dtypes=self.get_state_dtype(),
                                 block_size=vllm_config.cache_config.block_size, mamba_type=self.mamba_type,
                                 mamba_cache_mode="none")

    def get_state_shape(self) -> tuple[tuple[int, ...]]:
        return ((self.hidden_size,),)

    def get_state_dtype(self) -> tuple[torch.dtype]:
        return (self.dtype,)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR

    def get_attn_backend(self):
        return FeedbackStateBackend


# ----------------------------------------------------------------------------------------------- fusion


class ServingFusion(nn.Module):
    """The fusions of :mod:`fullband` with the checkpoint's parameter names, computed in the model's dtype with the
    operations, in the order, ``generate()`` runs them (:meth:`FullBandwidthForCausalLM.fuse`), except the output
    RMSNorm: vLLM's own ``rms_norm`` kernel where the build has one (the same math with float32 accumulation, in
    about a quarter of ``F.rms_norm``'s time on a decode step's few rows; docs/experiments/benchmarks.md). The GLU
    gate ``sigmoid(W_G norm(e))`` depends on the token alone and is looked up in a per-vocabulary table (model
    dtype, ``vocab x hidden``), built by :meth:`build_gate_table` when the weights are loaded -- inside vLLM's model
    loading, so its memory counts as model memory, never allocated later next to a full KV cache."""

    def __init__(self, kind: str, hidden_size: int, embed_dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.kind, self.eps, self.embed_dim = kind, eps, embed_dim
        if kind in ("glu", "residual"):
            self.gate_proj = nn.Linear(embed_dim, embed_dim, bias=False, dtype=dtype)
            self.value_proj = nn.Linear(hidden_size, embed_dim, bias=False, dtype=dtype)
            self.out_norm = nn.RMSNorm(embed_dim, eps=eps, dtype=dtype)
            self._rms_kernel = _vllm_rms_norm()
        elif kind == "concat":
            self.proj = nn.Linear(embed_dim + hidden_size, embed_dim, bias=False, dtype=dtype)
        elif kind == "add":
            self.proj = nn.Linear(hidden_size, embed_dim, bias=False, dtype=dtype)
        else:
            raise ValueError(f"fullband: unknown fusion {kind!r} in the checkpoint's config")
        self.gate_table: torch.Tensor | None = None

    @property
    def needs_gate_table(self) -> bool:
        return self.kind in ("glu", "residual")

    @torch.no_grad()
    def build_gate_table(self, embedding_weight: torch.Tensor, chunk: int = 4096) -> None:
        """``sigmoid(W_G rms_norm(E))`` for every vocabulary entry, in ``W_G``'s dtype (chunks of ``chunk`` rows)."""
        if not self.needs_gate_table:
            return
        self.gate_table = None  # a rebuild must not hold two tables at once
        w = self.gate_proj.weight
        table = torch.empty(embedding_weight.shape[0], self.embed_dim, dtype=w.dtype, device=w.device)
        for start in range(0, embedding_weight.shape[0], chunk):
            e = F.rms_norm(embedding_weight[start:start + chunk].to(w.dtype), (self.embed_dim,), eps=self.eps)
            table[start:start + chunk] = torch.sigmoid(F.linear(e, w))
        self.gate_table = table

    def forward(self, h: torch.Tensor, e: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        h = h.to(e.dtype)
        if self.needs_gate_table:
            v = F.linear(h, self.value_proj.weight) * F.embedding(tokens, self.gate_table)
            if self._rms_kernel is None:
                u = F.rms_norm(v, (self.embed_dim,), self.out_norm.weight, eps=self.eps)
            else:
                u = torch.empty_like(v)
                self._rms_kernel(u, v, self.out_norm.weight, self.eps)
            return e + u if self.kind == "residual" else u
        if self.kind == "concat":
            return F.linear(torch.cat([e, h], dim=-1), self.proj.weight)
        return e + F.linear(h, self.proj.weight)


# ----------------------------------------------------------------------------------------------- model


class FullBandwidthForCausalLMVLLM(nn.Module):
    """vLLM model for ``FullBandwidthForCausalLM`` checkpoints (decode modes ``soft``, the default, and ``fused``)."""

    # Not vLLM's ``IsHybrid``, although the model has attention layers and a Mamba-style state: vLLM would then
    # switch a hybrid model's Mamba cache to mode 'align' with prefix caching (per-block state snapshots, copied
    # between pages by the worker) and size the state pages by its rules; the state spec here sets its own (one page
    # per request, out of prefix caching) and vLLM pads its page to the attention page when it groups the layers.
    is_hybrid = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        check_engine_config(vllm_config)
        hf = vllm_config.model_config.hf_config
        text = hf.text_config
        self.config = hf
        self.backbone = init_vllm_registered_model(vllm_config, hf_config=text, prefix=_join(prefix, "backbone"),
                                                   architectures=[backbone_architecture(text)])
        self.hidden_size = int(text.hidden_size)
        eps = float(getattr(text, "rms_norm_eps", None) or 1e-6)
        dtype = vllm_config.model_config.dtype
        self.feedback = ServingFusion(hf.fusion, self.hidden_size, self.hidden_size, eps, dtype)
        # One state layer per backbone layer, though only the first is read and written: vLLM's hybrid KV-cache
        # manager groups layers in equal numbers, so L attention layers next to a single state layer would become L
        # attention groups (L block tables and L attention-metadata builds per step); with L state layers they stay
        # one attention group plus one state group. The cost is L - 1 unused state pages per running request.
        # vLLM orders KV caches by the one integer in a layer's name: the state layers come after the backbone's.
        layers = int(text.num_hidden_layers)
        names = [_join(prefix, f"{STATE_LAYER}.{layers + i}") for i in range(layers)]
        self.state_layers = [FeedbackStateLayer(self.hidden_size, _state_dtype(vllm_config), name, vllm_config)
                             for name in names]  # no parameters; vLLM finds them through its forward context
        self.state_layer_name = names[0]
        self.doc_start = hf.doc_start_token_id
        self.mode, self.prefill_passes = serving_mode(hf)
        self._stats_path = os.environ.get(STATS_ENV) or None
        self._stats = {"steps": 0, "mixed_steps": 0, "prefill_chunks": 0, "one_token_prefill_chunks": 0,
                       "fused_tokens": 0, "max_requests_in_step": 0, "slots_seen": [], "request_slots": [],
                       "decode_only_steps": 0}
        self.make_empty_intermediate_tensors = getattr(self.backbone, "make_empty_intermediate_tensors", None)

    # ---------------------------------------------------------------- hybrid-model interface

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...]]:
        return ((int(_text_config(vllm_config).hidden_size),),)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype]:
        return (_state_dtype(vllm_config),)

    @classmethod
    def get_mamba_state_copy_func(cls):
        raise NotImplementedError("fullband: mamba cache mode 'align' is not supported (refused at startup)")

    # ---------------------------------------------------------------- vLLM model interface

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embed_input_ids(input_ids)

    def _metadata(self) -> FeedbackStateMetadata | None:
        try:
            attn = get_forward_context().attn_metadata
        except AssertionError:
            return None
        if isinstance(attn, dict):
            return attn.get(self.state_layer_name)
        return None

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        meta = self._metadata()
        given_embeds = inputs_embeds is not None
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        state = self.state_layers[0].kv_cache[0] if meta is not None else None
        if meta is not None and state.numel():
            rows = meta.fused_rows
            if meta.num_fused:
                tokens = input_ids[rows]  # never None: prompt embeddings are refused at startup
                e = inputs_embeds[rows]
                fused = self.feedback(state.index_select(0, meta.fused_slots), e, tokens)
                if self.doc_start is not None:
                    doc = tokens == self.doc_start  # a generated document start enters plainly (rare; on CPU a
                    if not doc.is_cpu or bool(doc.any()):  # check costs less than the where, on a GPU a sync more)
                        fused = torch.where(doc.unsqueeze(-1), e, fused)
                if meta.num_fused == inputs_embeds.shape[0]:  # every token fused (a decode-only step): no copy
                    inputs_embeds = fused
                else:
                    if given_embeds:
                        inputs_embeds = inputs_embeds.clone()
                    inputs_embeds[rows] = fused
        hidden = self.backbone.model(None, positions, intermediate_tensors, inputs_embeds)
        if meta is not None and meta.jacobi_rows is not None and meta.jacobi_rows.numel():
            hidden = self._jacobi_passes(meta.jacobi_rows, input_ids, positions, intermediate_tensors,
                                         inputs_embeds, hidden)
        if meta is not None and state.numel():
            state.index_copy_(0, meta.last_slots, hidden[meta.last_rows].to(state.dtype))
            if self._stats_path:
                self._record(meta)
        return hidden

    def _jacobi_passes(self, rows, input_ids, positions, intermediate_tensors, inputs_embeds, hidden):
        """Mode ``fused``: ``prefill_passes`` more passes over the whole batch, each prompt token after a prompt's
        first one fused with the previous pass's final hidden state of the token before it (the plain embedding at a
        document start). Every pass rewrites the same KV-cache slots, so the cache ends up holding the last pass's
        entries, as ``generate(feedback_mode="fused")`` does; decode tokens get the same input in every pass."""
        tokens = input_ids[rows]
        e = inputs_embeds[rows]
        doc = (tokens == self.doc_start).unsqueeze(-1) if self.doc_start is not None else None
        for _ in range(self.prefill_passes):
            fused = self.feedback(hidden[rows - 1], e, tokens)
            if doc is not None:
                fused = torch.where(doc, e, fused)
            x = inputs_embeds.clone()
            x[rows] = fused
            hidden = self.backbone.model(None, positions, intermediate_tensors, x)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.backbone.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = AutoWeightsLoader(self).load_weights(weights)
        self.feedback.build_gate_table(self.backbone.model.embed_tokens.weight)
        if self._stats_path:
            table = self.feedback.gate_table
            self._stats["gate_table_at_load"] = None if table is None else [list(table.shape), str(table.dtype)]
        return loaded

    # ---------------------------------------------------------------- test statistics

    def _record(self, meta: FeedbackStateMetadata) -> None:
        s = self._stats
        n = meta.num_reqs
        if meta.query_start_loc is None:  # decode-only step: one generated token per request
            qsl, decoding, active = list(range(n + 1)), [True] * n, [True] * n
        else:
            qsl, decoding, active = meta.query_start_loc.tolist(), meta.decoding.tolist(), meta.active.tolist()
        prefills = [i for i in range(n) if active[i] and not decoding[i]]
        s["steps"] += 1
        s["decode_only_steps"] += int(meta.query_start_loc is None)
        s["mixed_steps"] += int(bool(prefills) and any(decoding))
        s["prefill_chunks"] += len(prefills)
        s["one_token_prefill_chunks"] += sum(1 for i in prefills if qsl[i + 1] - qsl[i] == 1)
        s["fused_tokens"] += sum(decoding)
        s["max_requests_in_step"] = max(s["max_requests_in_step"], sum(active))
        slots = meta.state_indices[:n].tolist()
        s["slots_seen"] = sorted(set(s["slots_seen"]) | {slot for slot, a in zip(slots, active) if a})
        if meta.starting is not None:
            s["request_slots"] += meta.state_indices[meta.starting].tolist()  # each request's slot, in start order
        tmp = self._stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(s, f)
        os.replace(tmp, self._stats_path)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
