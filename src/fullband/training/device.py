"""Numerics of the process and the machine it runs on: mixed precision, the CPU allocator, the load average.

Owns :func:`autocast_context` (bf16 autocast where asked for or, with ``auto``, on a GPU that supports it) and
:func:`tune_cpu_allocator` (glibc ``mallopt`` so that big CPU buffers are reused, not unmapped every step).
"""

from __future__ import annotations

import ctypes
import os
import sys
from contextlib import nullcontext

import torch


def autocast_context(precision: str, device: torch.device):
    """``(context factory, "bf16" | "fp32")`` for ``--precision`` on ``device``."""
    if precision == "auto":
        use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    else:
        use_bf16 = precision == "bf16"
    if not use_bf16:
        return nullcontext, "fp32"
    return (lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)), "bf16"


def tune_cpu_allocator() -> bool:
    """Keep freed memory in the process heap instead of handing big blocks back to the OS (glibc only).

    glibc serves allocations above 32 MB (a [16, 256, 4096] fp32 logits tensor is 67 MB) with a fresh ``mmap``
    and unmaps them on free, so every training step page-faults and zeroes them anew; that costs 5-15% of a CPU
    step, more with K > 1 passes (more such buffers alive at once). This switches ``mmap`` allocation off and
    trimming down (``mallopt``), as a caching allocator would. The command-line entry points call it; set
    ``FULLBAND_MALLOC_TUNE=0`` to leave the allocator alone. Returns whether it was applied.
    """
    if os.environ.get("FULLBAND_MALLOC_TUNE", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def load_average() -> float | None:
    """The machine's 1-minute load average (other processes competing for the CPUs make wall times longer)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None
