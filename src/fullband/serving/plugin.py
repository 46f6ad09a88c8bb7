"""The vLLM plugin entry point (``[project.entry-points."vllm.general_plugins"] fullband``).

Owns :func:`register`, which vLLM calls in every one of its processes (API server, engine core, workers, the
model-inspection subprocess). Importing this module imports :mod:`fullband`, which registers ``model_type:
"fullband"`` with ``AutoConfig`` (vLLM reads the checkpoint's config through it); :func:`register` adds the
architecture ``FullBandwidthForCausalLM`` to ``vllm.ModelRegistry`` lazily (vLLM imports
:mod:`fullband.serving.vllm_model` only when it builds the model) and the startup checks to vLLM's per-architecture
config hooks, and asks Linux for the AMX tile state in every process that can use it (:func:`allow_amx`).
"""

from __future__ import annotations

import torch

import fullband  # noqa: F401  (registers the fullband config with transformers' AutoConfig)

from .config import ARCHITECTURE, MODEL_CLASS, ConfigHook


def register() -> None:
    """Make ``FullBandwidthForCausalLM`` checkpoints loadable by vLLM (idempotent)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, ConfigHook)
    allow_amx()


def allow_amx() -> bool:
    """On a CPU with AMX, request the AMX tile state for this process (``torch.cpu._init_amx``: Linux's
    ``arch_prctl(ARCH_REQ_XCOMP_PERM)``); returns whether AMX may run. vLLM's CPU build picks its AMX attention
    kernel for bf16 whenever the CPU has AMX, but does not ask for the permission; a process in which oneDNN has not
    asked first dies of SIGILL at its first attention call (measured: a plain Llama served in bf16 on an AMX Xeon,
    worker dead in 4 of 5 runs, exit code -4). Without AMX this does nothing."""
    if not torch.cpu._is_amx_tile_supported():
        return False
    return bool(torch.cpu._init_amx())
