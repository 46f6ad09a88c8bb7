"""The vLLM plugin entry point (``[project.entry-points."vllm.general_plugins"] fullband``).

Owns :func:`register`, which vLLM calls in every one of its processes (API server, engine core, workers, the
model-inspection subprocess). Importing this module imports :mod:`fullband`, which registers ``model_type:
"fullband"`` with ``AutoConfig`` (vLLM reads the checkpoint's config through it); :func:`register` adds the
architecture ``FullBandwidthForCausalLM`` to ``vllm.ModelRegistry`` lazily (vLLM imports
:mod:`fullband.serving.vllm_model` only when it builds the model) and the startup checks to vLLM's per-architecture
config hooks.
"""

from __future__ import annotations

import fullband  # noqa: F401  (registers the fullband config with transformers' AutoConfig)

from .config import ARCHITECTURE, MODEL_CLASS, ConfigHook


def register() -> None:
    """Make ``FullBandwidthForCausalLM`` checkpoints loadable by vLLM (idempotent)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, ConfigHook)
