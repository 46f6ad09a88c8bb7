"""fullband.utils.jobs: independent units in one-thread processes (what the quickstart trains side by side)."""

from __future__ import annotations

import math
import operator
import os
import time

import pytest
import torch

from fullband.utils.errors import TrainingStopped
from fullband.utils.jobs import default_jobs, run_jobs


def _threads_and_env() -> tuple[int, str | None]:
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_units_run_in_one_thread_processes_and_return_their_values():
    got = run_jobs([(1.0, "sqrt", math.sqrt, (9.0,)), (5.0, "add", operator.add, (2, 3)),
                    (3.0, "threads", _threads_and_env, ())], jobs=2)
    assert got == {"sqrt": 3.0, "add": 5, "threads": (1, "1")}
    # one process: here, in turn, at this process's own threads
    assert run_jobs([(1.0, "threads", _threads_and_env, ())], jobs=1)["threads"][0] == torch.get_num_threads()
    assert 1 <= default_jobs(4) <= 4 and default_jobs(1) == 1


def test_a_failing_unit_stops_the_others_and_raises_here():
    t = time.perf_counter()
    with pytest.raises(ValueError, match="math domain error"):
        run_jobs([(9.0, "slow", time.sleep, (120,)), (1.0, "bad", math.sqrt, (-1.0,))], jobs=2)
    assert time.perf_counter() - t < 60  # the sleeping unit was terminated, not waited for


def _stopped(step: int) -> None:
    raise TrainingStopped("fbt", "/runs/fbt", step, step - 1, "/runs/fbt/checkpoints/last", "loss spike")


def test_a_run_the_guard_stops_in_a_worker_reaches_the_parent_whole():
    """The guard's TrainingStopped (the one line the command prints) crosses the process boundary with its fields."""
    with pytest.raises(TrainingStopped) as err:
        run_jobs([(1.0, "a", math.sqrt, (4.0,)), (2.0, "fbt", _stopped, (7,))], jobs=2)
    assert (err.value.name, err.value.step, err.value.last_good) == ("fbt", 7, 6)
    assert "stopped training at step 7 (loss spike)" in str(err.value)
