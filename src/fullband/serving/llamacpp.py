"""Decoding an exported model (:mod:`.gguf_export`) through llama.cpp: :class:`LlamaCppEngine`.

Owns the llama.cpp decode engine (``fullband generate --engine llama.cpp``). llama.cpp runs the backbone (its
attention, its KV cache, its threads, its quantized kernels); this module does what llama.cpp does not know about,
with llama-cpp-python's low-level API:

* the fed-back state is llama.cpp's own per-token output embedding: a context with ``embeddings`` on and pooling
  ``none`` returns, for every output token, the final normed hidden state beside the logits -- the state the LM head
  reads, the one the PyTorch model feeds back;
* the fusion (two ``d x d`` products, outside llama.cpp's graph) is the package's own fusion module
  (:func:`fullband.model.feedback.build_fusion`) with the sidecar's weights, applied to that state and the token's
  embedding as llama.cpp stores it (the GGUF's ``token_embd``, dequantized); the fused vector goes into llama.cpp
  through ``llama_batch.embd`` in place of a token id;
* the decode modes, with the rules of :mod:`fullband.model.generation`: ``standard`` (no feedback: token ids only),
  ``soft`` (the prompt in one plain pass, each generated token fused), ``fused`` (a plain pass, then
  ``prefill_passes`` Jacobi passes over the prompt, each on a cleared cache so only the last fills it; then as soft),
  ``exact`` (the prompt token by token through the recurrence; then as soft). A document start (the model's BOS) is
  never fused and has no previous state; position 0 neither;
* several sequences at once, each a llama.cpp sequence of its own (no padding: each has its own positions), one
  ``llama_decode`` per step for all of them.

Exactness: llama.cpp's float32 arithmetic differs from PyTorch's (another summation order, its own kernels): about
1e-4 relative on the final hidden state. ``fullband`` measures that error per decode step against
:func:`fullband.model.generation.generate` (tests/test_llamacpp.py; the guide's page); with an f32 GGUF and an f32 KV
cache greedy decoding follows ``generate()``'s tokens except where two logits are nearly tied.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors import safe_open

from ..model.configuration import DECODE_MODES
from ..model.feedback import GLUFusion, ResidualGLUFusion, build_fusion
from ..model.generation import _select
from .gguf_export import FUSION_FORMAT, FUSION_NAME, GGUF_NAME, INSTALL_HINT, MANIFEST_NAME, require_gguf

llc = None  # llama_cpp (llama-cpp-python), imported by require_llama_cpp() on first use: the CLI starts without it

KV_TYPES = ("f32", "f16")


def require_llama_cpp():
    """llama-cpp-python (the ``llamacpp`` extra), or a one-line error saying how to install it."""
    global llc
    if llc is None:
        try:
            llc = importlib.import_module("llama_cpp")
        except ImportError:
            raise ValueError(f"llama-cpp-python is not installed: {INSTALL_HINT}") from None
    return llc


def _silence_llama_cpp() -> None:
    """llama.cpp logs every load to stderr; keep only its errors (level 4 = GGML_LOG_LEVEL_ERROR)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        def quiet(level, text, _):
            if level == 4:
                os.write(2, text)
        _LOG_CALLBACK = llc.llama_log_callback(quiet)
        llc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())


_LOG_CALLBACK = None


def _export_paths(path: str) -> tuple[str, dict]:
    """The export directory's manifest, given the directory or its GGUF file; one-line errors."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path) if os.path.isfile(path) else path
    manifest_path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(manifest_path):
        raise FileNotFoundError(f"{path!r} is not a GGUF export of fullband (no {MANIFEST_NAME}): make one with "
                                "`fullband export gguf MODEL --out DIR`")
    with open(manifest_path) as f:
        manifest = json.load(f)
    if not os.path.isfile(os.path.join(folder, manifest.get("gguf", GGUF_NAME))):
        raise FileNotFoundError(f"{folder!r} has no {manifest.get('gguf', GGUF_NAME)}")
    return folder, manifest


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


class StepFusion:
    """The fusion of a decode step on llama.cpp's float32 states, in numpy: per step the work is two ``d x d``
    products at most, and the framework's per-call overhead is what counts there (the package's torch module took
    about 250 us a step inside the decode loop, this 60 us; ``fullband bench llamacpp``). For the GLU family
    (``glu``, ``residual``) it computes ``norm(W_U h * g) (+ e)`` with the module's own weights and eps, the gate
    ``g = sigmoid(W_G norm(e))`` taken from the module itself (:meth:`GLUFusion.gate`) once per token, the first
    time the token is fused (the engine's weights never change); the ablations (``concat``, ``add``) run the module
    as it is. tests/test_llamacpp.py checks it against the module on every fusion."""

    def __init__(self, module, embeds: torch.Tensor):
        self.module, self.embeds = module, embeds
        self.glu = isinstance(module, GLUFusion)
        if self.glu:
            self.residual = isinstance(module, ResidualGLUFusion)
            self.w_u = module.value_proj.weight.detach().numpy().T.copy()
            self.gain = module.out_norm.weight.detach().numpy().copy()
            self.eps = float(module.out_norm.eps if module.out_norm.eps is not None else np.finfo(np.float32).eps)
            self.gates = np.empty((embeds.shape[0], module.gate_proj.out_features), dtype=np.float32)
            self.have = np.zeros(embeds.shape[0], dtype=bool)

    def __call__(self, states: np.ndarray, ids: np.ndarray) -> np.ndarray:
        e = self.embeds.numpy()[ids]
        if not self.glu:
            with torch.no_grad():
                return self.module(torch.from_numpy(states), torch.from_numpy(e)).numpy()
        todo = np.unique(ids[~self.have[ids]])
        if len(todo):
            with torch.no_grad():
                self.gates[todo] = self.module.gate(self.embeds[torch.from_numpy(todo)]).numpy()
            self.have[todo] = True
        x = (states @ self.w_u) * self.gates[ids]
        u = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.gain
        return e + u if self.residual else u


@dataclass
class EngineResult:
    """What :meth:`LlamaCppEngine.generate` returns: per sequence its new tokens, and (``output_logits``) the logits
    each was chosen from, ``[n_new, vocab]`` float32; the prompt and decode wall times of the call."""

    new_tokens: list[list[int]]
    logits: list[np.ndarray] | None = None
    mode: str = "soft"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    states: list[np.ndarray] = field(default_factory=list)


class LlamaCppEngine:
    """A fullband GGUF export decoded by llama.cpp, with latent feedback.

    Args:
        path: the export directory (``fullband export gguf``) or its ``model.gguf``.
        n_seq: the most sequences one :meth:`generate` call decodes together.
        n_ctx: KV-cache positions in all (default: ``n_seq`` x the model's context length).
        threads: llama.cpp's threads (default: one per core this process may use).
        kv_type: ``f32`` (default: the closest to PyTorch) or ``f16``.
        repack: llama.cpp's CPU weight repacking (its "extra buffer types", ``llama-cli --no-repack`` turns them
            off). Off by default: with it on, ``llama_decode`` of a ``q8_0`` GGUF crashed (segmentation fault) on
            these machines' x86-64 CPUs with llama-cpp-python 0.3.36, and with it off the same file decodes
            correctly; ``f32`` and ``f16`` weights are not repacked either way.
        embeddings: read llama.cpp's final hidden states (the fed-back state); ``False`` makes a plain llama.cpp
            context, ``standard`` mode only (the benchmark's baseline).
    """

    def __init__(self, path: str, *, n_seq: int = 1, n_ctx: int | None = None, threads: int | None = None,
                 kv_type: str = "f32", repack: bool = False, embeddings: bool = True):
        require_llama_cpp()
        gguf = require_gguf()
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        if n_seq < 1:
            raise ValueError(f"n_seq must be >= 1, got {n_seq}")
        self.folder, self.manifest = _export_paths(path)
        gguf_path = os.path.join(self.folder, self.manifest.get("gguf", GGUF_NAME))
        reader = gguf.GGUFReader(gguf_path)
        self.uuid = _field(reader, "general.uuid")
        arch = _field(reader, "general.architecture")
        self.context_length = int(_field(reader, f"{arch}.context_length"))
        self.feedback = bool(_field(reader, "fullband.feedback"))
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ValueError(f"{gguf_path!r} has no token_embd.weight")
        # the token embeddings as llama.cpp stores them (dequantized): the fusion's e_t and the plain input alike
        self.embeds = torch.from_numpy(np.array(gguf.quants.dequantize(embd.data, embd.tensor_type),
                                                dtype=np.float32))
        self._embeds_np = self.embeds.numpy()
        self.fusion, self.doc_start, self.default_mode = None, None, "standard"
        if self.feedback:
            self._load_fusion()
        self.n_seq = n_seq
        self.n_ctx = n_ctx or n_seq * self.context_length
        _silence_llama_cpp()
        llc.llama_backend_init()
        mp = llc.llama_model_default_params()
        mp.use_extra_bufts = bool(repack)
        self._model = llc.llama_model_load_from_file(gguf_path.encode(), mp)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {gguf_path!r}")
        self.n_embd = llc.llama_model_n_embd(self._model)
        self.n_vocab = llc.llama_vocab_n_tokens(llc.llama_model_get_vocab(self._model))
        if tuple(self.embeds.shape) != (self.n_vocab, self.n_embd):
            raise ValueError(f"token_embd is {tuple(self.embeds.shape)}, llama.cpp reports "
                             f"{(self.n_vocab, self.n_embd)}")
        cp = llc.llama_context_default_params()
        cp.n_ctx = self.n_ctx
        cp.n_batch = self.n_ctx
        cp.n_ubatch = min(self.n_ctx, 512)
        cp.n_seq_max = n_seq
        cp.kv_unified = True
        cp.embeddings = embeddings  # the final normed hidden state of every output token, beside its logits
        self.embeddings = embeddings
        cp.pooling_type = llc.LLAMA_POOLING_TYPE_NONE
        cp.type_k = cp.type_v = llc.GGML_TYPE_F32 if kv_type == "f32" else llc.GGML_TYPE_F16
        cp.no_perf = True
        # llama.cpp's own default (4) oversubscribes a smaller machine: one thread per usable core by default
        cp.n_threads = cp.n_threads_batch = int(threads or len(os.sched_getaffinity(0)))
        self._ctx = llc.llama_init_from_model(self._model, cp)
        if not self._ctx:
            raise ValueError("llama.cpp could not create a context (lower n_ctx or n_seq)")
        self._mem = llc.llama_get_memory(self._ctx)
        self._tokens = llc.llama_batch_init(self.n_ctx, 0, 1)
        self._embd = llc.llama_batch_init(self.n_ctx, self.n_embd, 1)
        self._embd_view = np.ctypeslib.as_array(self._embd.embd, shape=(self.n_ctx, self.n_embd))
        self._token_view = np.ctypeslib.as_array(self._tokens.token, shape=(self.n_ctx,))

    def _load_fusion(self) -> None:
        path = os.path.join(self.folder, FUSION_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"the GGUF says it has latent feedback, but {path!r} is missing")
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            weights = {k: f.get_tensor(k) for k in f.keys()}
        if meta.get("format") != FUSION_FORMAT:
            raise ValueError(f"{path!r} is not a fusion file this version reads (format {meta.get('format')!r})")
        if meta.get("gguf_uuid") != self.uuid:
            raise ValueError(f"{path!r} belongs to another GGUF (uuid {meta.get('gguf_uuid')} != {self.uuid}): "
                             "export again")
        fusion = build_fusion(meta["fusion"], int(meta["hidden_size"]), int(meta["embed_dim"]), float(meta["eps"]))
        missing = set(fusion.state_dict()) ^ set(weights)
        if missing:
            raise ValueError(f"{path!r} does not fit the {meta['fusion']!r} fusion: {sorted(missing)}")
        fusion.load_state_dict(weights)
        self.fusion = StepFusion(fusion.float().eval(), self.embeds)
        self.doc_start = json.loads(meta.get("doc_start_token_id", "null"))
        self.default_mode = meta.get("default_feedback_mode", "fused")

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            llc.llama_batch_free(self._tokens)
            llc.llama_batch_free(self._embd)
            llc.llama_free(self._ctx)
            llc.llama_model_free(self._model)
            self._ctx = self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ llama.cpp calls

    def _decode(self, seqs, positions, tokens=None, embeds=None, outputs=None):
        """One ``llama_decode`` of ``len(seqs)`` entries, token ids or input vectors; returns (logits, states) of
        the entries whose ``outputs`` flag is set (all when ``outputs`` is None), in order, as float32 copies."""
        n = len(seqs)
        batch = self._tokens if embeds is None else self._embd
        if embeds is None:
            self._token_view[:n] = tokens
        else:
            self._embd_view[:n] = embeds
        wanted = []
        for i in range(n):
            batch.pos[i] = positions[i]
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seqs[i]
            want = outputs is None or bool(outputs[i])
            batch.logits[i] = want
            if want:
                wanted.append(i)
        batch.n_tokens = n
        rc = llc.llama_decode(self._ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}): the KV cache is full (raise n_ctx) or the batch is invalid")
        logits = np.empty((len(wanted), self.n_vocab), dtype=np.float32)
        states = np.empty((len(wanted), self.n_embd), dtype=np.float32) if self.embeddings else None
        for r, i in enumerate(wanted):  # by batch index: llama.cpp's output order need not be the batch's
            logits[r] = np.ctypeslib.as_array(llc.llama_get_logits_ith(self._ctx, i), shape=(self.n_vocab,))
            if states is not None:
                states[r] = np.ctypeslib.as_array(llc.llama_get_embeddings_ith(self._ctx, i), shape=(self.n_embd,))
        return logits, states

    def _fuse(self, states: np.ndarray, tokens) -> np.ndarray:
        """The inputs of ``tokens`` that follow ``states``: fused, except at document starts."""
        ids = np.asarray(tokens, dtype=np.int64)
        u = self.fusion(states, ids)
        if self.doc_start is not None and self.doc_start in tokens:
            u = np.where((ids != self.doc_start)[:, None], u, self._embeds_np[ids])
        return u

    def _fed(self, token: int, position: int) -> bool:
        return position > 0 and token != self.doc_start

    # ------------------------------------------------------------------ prefill per mode

    def _prefill(self, prompts, mode, prefill_passes):
        """(last logits [B, V], last state [B, d]) after the prompts, the cache filled as ``generate()`` fills it."""
        seqs = [s for s, p in enumerate(prompts) for _ in p]
        pos = [t for p in prompts for t in range(len(p))]
        flat = [tok for p in prompts for tok in p]
        last = np.cumsum([len(p) for p in prompts]) - 1
        if mode in ("standard", "soft"):
            outputs = np.zeros(len(flat), dtype=bool)
            outputs[last] = True
            return self._decode(seqs, pos, tokens=flat, outputs=outputs)
        if mode == "fused":
            _, h = self._decode(seqs, pos, tokens=flat)
            base = self.embeds[torch.as_tensor(flat)].numpy()
            fed = np.array([self._fed(tok, t) for tok, t in zip(flat, pos)])
            for _ in range(prefill_passes):
                prev = np.zeros_like(h)
                prev[1:] = h[:-1]  # position t reads t-1 of the same sequence; where t = 0 it is not fed
                u = np.where(fed[:, None], self._fuse(prev, flat), base)
                for s in range(len(prompts)):
                    llc.llama_memory_seq_rm(self._mem, s, -1, -1)
                logits, h = self._decode(seqs, pos, embeds=u)
            return logits[last], h[last]
        # exact: token by token, all sequences together
        state = np.zeros((len(prompts), self.n_embd), dtype=np.float32)
        logits = np.zeros((len(prompts), self.n_vocab), dtype=np.float32)
        for t in range(max(len(p) for p in prompts)):
            rows = [s for s, p in enumerate(prompts) if t < len(p)]
            toks = [prompts[s][t] for s in rows]
            u = self._fuse(state[rows], toks) if t > 0 else self.embeds[torch.as_tensor(toks)].numpy()
            lg, h = self._decode(rows, [t] * len(rows), embeds=u)
            logits[rows], state[rows] = lg, h
        return logits, state

    # ------------------------------------------------------------------ generation

    def generate(self, prompts, *, mode: str | None = None, max_new_tokens: int = 32, prefill_passes: int = 1,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None, eos_token_id: int | None = None,
                 forced=None, output_logits: bool = False, on_token=None) -> EngineResult:
        """Continue each prompt (a list of token ids) by up to ``max_new_tokens`` tokens in decode ``mode``
        (default: the model's default mode). ``forced`` ``[B][N]``: feed these tokens instead of the chosen ones
        (teacher forcing, to compare per-step logits); ``on_token(row, token)`` is called as each is chosen."""
        mode = mode or self.default_mode
        if mode not in DECODE_MODES:
            raise ValueError(f"unknown decode mode {mode!r}: choose one of {', '.join(DECODE_MODES)}")
        if mode != "standard" and self.fusion is None:
            raise ValueError(f"decode mode {mode!r} needs latent feedback; this GGUF has none -- use 'standard'")
        if mode != "standard" and not self.embeddings:
            raise ValueError(f"decode mode {mode!r} reads the final hidden states: make the engine with embeddings=True")
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (e.g. BOS)")
        if len(prompts) > self.n_seq:
            raise ValueError(f"{len(prompts)} prompts, but this engine was made for {self.n_seq} sequences (n_seq)")
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > self.context_length or sum(len(p) for p in prompts) + len(prompts) * max_new_tokens > self.n_ctx:
            raise ValueError(f"prompts plus {max_new_tokens} new tokens exceed the context ({self.context_length} "
                             f"positions per sequence, {self.n_ctx} in all)")
        if not isinstance(prefill_passes, int) or prefill_passes < 1:
            raise ValueError(f"prefill_passes must be an integer >= 1, got {prefill_passes!r}")
        llc.llama_memory_clear(self._mem, True)
        B = len(prompts)
        t0 = time.perf_counter()
        logits, state = self._prefill(prompts, mode, prefill_passes)
        t1 = time.perf_counter()
        new = [[] for _ in range(B)]
        kept = [[] for _ in range(B)] if output_logits else None
        active = list(range(B))
        lengths = [len(p) for p in prompts]
        for i in range(max_new_tokens):
            if output_logits:
                for r, s in enumerate(active):
                    kept[s].append(logits[r].copy())
            if forced is not None:
                toks = [int(forced[s][i]) for s in active]
            else:
                toks = _select(torch.from_numpy(logits), do_sample, temperature, top_k, top_p, generator).tolist()
            for s, tok in zip(active, toks):
                new[s].append(tok)
                if on_token is not None:
                    on_token(s, tok)
            keep = [r for r, tok in enumerate(toks) if eos_token_id is None or tok != eos_token_id]
            if i == max_new_tokens - 1 or not keep:
                break
            active, toks = [active[r] for r in keep], [toks[r] for r in keep]
            positions = [lengths[s] + i for s in active]
            if mode == "standard":
                logits, _ = self._decode(active, positions, tokens=toks)
            else:
                logits, state = self._decode(active, positions, embeds=self._fuse(state[keep], toks))
        t2 = time.perf_counter()
        return EngineResult(new_tokens=new, logits=[np.stack(k) for k in kept] if kept else None, mode=mode,
                            prefill_seconds=t1 - t0, decode_seconds=t2 - t1)
