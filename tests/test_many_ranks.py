"""What must not grow with the number of ranks: rank 0 alone copies DDP replicas out to save; a resumed rank maps the
checkpoint's files instead of holding a private copy of them (16 bytes a parameter for AdamW); the periodic
evaluation is split over the ranks (each scores its share, the sums are reduced) instead of repeated on each."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fullband.training import checkpoint as C
from fullband.training import distributed as D
from fullband.training import pretrain as P
from fullband.model.feedback import PREFIX_DRAWS
from fullband.training.config import TrainConfig
from fullband.training.pretrain import run_differences, split_loss, train
from fullband.eval.scoring import row_losses

from conftest import random_ids, reorder_rtol, tiny_model

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


def test_each_rank_scores_its_own_share_once():
    for n, world in [(5, 2), (7, 3), (2, 4), (8, 2)]:
        shares = [D.rank_share(n, D.DistEnv(rank=r, world_size=world, backend="gloo")) for r in range(world)]
        assert len({len(i) for i, _ in shares}) == 1 and len(shares[0][0]) == -(-n // world)  # equal forward counts
        counted = sorted(int(i) for index, c in shares for i in index[c])
        assert counted == list(range(n))  # every row once over the ranks


def _eval_worker(rank: int, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg-eval", rank=rank, world_size=WORLD)
    env = D.DistEnv(rank=rank, world_size=WORLD, backend="gloo")
    try:
        model = tiny_model(fusion="glu")
        seen = []
        real = row_losses

        def recording(model, rows, *args, **kwargs):
            seen.append(rows.shape[0])
            return real(model, rows, *args, **kwargs)

        P.row_losses = recording  # this worker process only
        rows = random_ids(5, 12, seed=3)
        losses = [split_loss(model, rows, env, "standard", batch_size=2),
                  split_loss(model, rows, env, "passes", num_passes=2, batch_size=2)]
        with open(f"{root}/eval{rank}.json", "w") as f:
            json.dump({"losses": losses, "rows": seen}, f)
    finally:
        D.shutdown(env)


def test_the_periodic_evaluation_is_split_over_ranks_and_equals_one_process(tmp_path):
    """5 rows on 2 ranks: each scores 3 (its own 3 and 2, the second evened with one uncounted repeat), and the
    reduced mean equals the mean of every row scored in one process, written here from the per-row losses."""
    mp.spawn(_eval_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    got = [json.load(open(tmp_path / f"eval{r}.json")) for r in range(WORLD)]
    assert [g["rows"] for g in got] == [[3, 3], [3, 3]]
    model, rows = tiny_model(fusion="glu"), random_ids(5, 12, seed=3)
    with torch.no_grad():
        want = [float(row_losses(model, rows, "standard").mean()),
                float(row_losses(model, rows, "passes", num_passes=2).mean())]
    for g in got:
        for a, b in zip(g["losses"], want):
            assert abs(a - b) <= reorder_rtol(5 * 11, 32, 64, 97) * abs(b)


def test_a_run_whose_prefix_draws_were_laid_out_by_an_older_version_is_not_reused(data, tmp_path):
    """The prefix-mixing draws moved from one stream over the global batch to per-row seeds (so each rank draws
    for its own rows): a finished run with prefix mixing from before that trained other masks and is not this run."""
    cfg = TrainConfig(out=str(tmp_path / "run"), preset="micro", steps=2, seed=0, data=data, vocab_size=300,
                      seq_len=32, batch_size=4, progress=False, tensorboard=False, plot=False, feedback_start=0.0,
                      prefix_mix=0.5)
    assert train(cfg)["status"] == "done" and run_differences(cfg) == []
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert summary.pop("prefix_draws") == PREFIX_DRAWS
    with open(tmp_path / "run" / "summary.json", "w") as f:
        json.dump(summary, f)  # as an older version wrote it
    assert [d for d in run_differences(cfg) if "prefix-mixing draws" in d]
    plain = dataclasses.replace(cfg, prefix_mix=0.0)  # no prefix mixing: no draws to differ
    assert not [d for d in (run_differences(plain) or []) if "prefix-mixing draws" in d]
