"""Checkpoints of replicated (DDP) runs at many ranks: rank 0 alone copies the replicas out to save, and a resumed
rank maps the checkpoint's files instead of holding a private copy of them (16 bytes a parameter for AdamW)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fullband.training import checkpoint as C
from fullband.training import distributed as D

WORLD = 2
STATE = {"tokens": 0, "elapsed": 0.0, "config": {}, "guard": {}}


def stepped(width: int, seed: int = 0):
    """A linear model after one AdamW step (so the optimizer has its two moments per weight)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(width, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _save_worker(rank: int, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=WORLD)
    env = D.DistEnv(rank=rank, world_size=WORLD, backend="gloo")
    try:
        model, optimizer = stepped(8)
        model = D.wrap_model(model, env, "ddp")
        calls = []
        if rank != 0:  # a replica other than rank 0 must not copy the model or the optimizer out
            for name in ("full_model_state", "full_optimizer_state"):
                real = getattr(D, name)
                setattr(D, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
        C.save_checkpoint(f"{root}/run", 1, env, model, optimizer, torch.Generator().manual_seed(rank), STATE)
        with open(f"{root}/calls{rank}.json", "w") as f:
            json.dump(calls, f)
    finally:
        D.shutdown(env)


def test_only_rank_0_copies_a_replicated_model_out_to_save(tmp_path):
    mp.spawn(_save_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    assert json.load(open(tmp_path / "calls1.json")) == []
    path = C.find_checkpoint(str(tmp_path / "run"))
    assert sorted(os.listdir(path)) == ["model.safetensors", "optimizer.pt", "rng-rank0.pt", "rng-rank1.pt",
                                        "trainer_state.json"]
    model, optimizer = stepped(8)  # the same replica, in this process: what was saved
    restored = C.load_checkpoint(path)
    assert all(torch.equal(restored["model"][k], v) for k, v in model.state_dict().items())
    assert torch.equal(restored["optimizer"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


PROBE = r"""
import sys, torch
from fullband.training import checkpoint as C

def anonymous_kib():  # private memory not backed by a file: what a copy of the checkpoint would add
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:"))

before = anonymous_kib()
restored = C.load_checkpoint(C.find_checkpoint(sys.argv[1]))
touched = sum(float(t.sum()) for s in restored["optimizer"]["state"].values() for t in s.values())
touched += sum(float(t.sum()) for t in restored["model"].values())
print(anonymous_kib() - before)
"""


def test_a_resumed_rank_maps_the_checkpoint_instead_of_copying_it(tmp_path):
    """A 1024 x 1024 model (4 MiB) with AdamW (8 MiB): loading the checkpoint and reading every tensor adds well
    under a tenth of its 12 MiB to the process's anonymous (private, not file-backed) memory; a private copy of
    the optimizer file (the old torch.load) adds its 8 MiB."""
    model, optimizer = stepped(1024)
    C.save_checkpoint(str(tmp_path / "run"), 1, D.DistEnv(), model, optimizer, torch.Generator(), STATE)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "run")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    added_kib = int(out.stdout.split()[-1])
    assert added_kib < 12 * 1024 / 10, f"{added_kib} KiB of private memory for a 12 MiB checkpoint"
