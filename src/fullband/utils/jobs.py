"""Independent units of work in several one-thread processes: :func:`run_jobs`.

Why one thread a process: on a machine of a few cores, small models gain little from a second intra-op thread, and
when anything else runs beside them an OpenMP team waits at every barrier for a thread the kernel has descheduled
(a tiny-preset step measured here at 2 threads under load: 4x the time of the same step at 1 thread). Runs of
independent models in one-thread processes keep every core busy and give the bytes a one-thread run gives (a
training run is deterministic at a fixed thread count on one machine), whatever the number of processes.

The processes are spawned (not forked: the parent has used OpenMP and the tokenizers' thread pools), so a job is a
module-level function and picklable arguments. The longest job first (by the cost the caller gives), as a worker
frees; the first job that fails stops the others (the pool terminated) and its exception is raised in the parent.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any, Callable

import torch


def one_thread() -> None:
    """A worker's initializer: one intra-op thread (and the tokenizers' pool off: it would fight for the core)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)


def default_jobs(units: int) -> int:
    """As many processes as this process may use cores, at most ``units``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, units))


def run_jobs(work: list[tuple[float, str, Callable, tuple]], jobs: int,
             say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run each ``(cost, name, function, args)`` of ``work`` as ``function(*args)`` in one of ``jobs`` spawned
    one-thread processes, the costliest first; ``{name: its return value}``. With ``jobs == 1`` (or one unit) the
    units run here, in order, at this process's own thread count. A failing unit's exception is raised here once the
    other processes are stopped."""
    order = sorted(work, key=lambda w: -w[0])
    if jobs <= 1 or len(order) <= 1:
        return {name: fn(*args) for _, name, fn, args in order}
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(processes=min(jobs, len(order)), initializer=one_thread)
    try:
        pending = {name: pool.apply_async(fn, args) for _, name, fn, args in order}
        out = {}
        while pending:
            for name in [n for n, r in pending.items() if r.ready()]:
                out[name] = pending.pop(name).get()  # re-raises the unit's exception
                say(f"{name}: done ({time.perf_counter() - t0:.0f} s since the {len(order)} units started)")
            if pending:
                next(iter(pending.values())).wait(0.5)
        pool.close()
        return out
    finally:
        pool.terminate()
        pool.join()
