"""Sharded (DCP) checkpoints under FSDP2: no rank gathers the model or optimizer to save, resume or export; a
checkpoint of 2 processes resumes on 2 (bitwise) and on 1 without a process group (to rounding: the gradient's
reduction order differs), and the final model is the ``save_pretrained`` directory a single process writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import assert_losses_close, micro_rtol, random_ids, tiny_backbone_config
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import fullband
from fullband import cli
from fullband.training import checkpoint as C
from fullband.training import distributed as D
from fullband.training import sharded as S
from fullband.training.checkpoint import find_checkpoint
from fullband.utils.io import read_jsonl

WORLD = 2


def tied_model(seed: int) -> torch.nn.Module:
    """A tiny Llama with its LM head tied to the embeddings (97 rows: FSDP's shards of them are uneven)."""
    config = tiny_backbone_config("llama")
    config.tie_word_embeddings = True
    torch.manual_seed(seed)
    backbone = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(seed + 1)
    return fullband.FullBandwidthForCausalLM.from_backbone(backbone, fusion="glu")


def adamw(model) -> torch.optim.Optimizer:
    """Two groups; the fusion is not stepped (no gradient), so it has no optimizer state in the checkpoint."""
    fusion = [p for n, p in model.named_parameters() if n.startswith("feedback.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("feedback.")]
    return torch.optim.AdamW([{"params": rest, "name": "backbone"}, {"params": fusion, "name": "fusion"}],
                             lr=1e-2, betas=(0.8, 0.9))


def train_steps(model, optimizer, rank: int, steps: int = 2) -> None:
    for step in range(steps):
        ids = random_ids(2, 12, seed=10 * step + rank)
        model(input_ids=ids, labels=ids, num_passes=1).loss.backward()
        for n, p in model.named_parameters():
            if n.startswith("feedback."):
                p.grad = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Gathered(AssertionError):
    pass


def forbid_full_gathers(monkeypatch_like: list) -> None:
    """Make every way of gathering the whole state raise (restored by the caller from ``monkeypatch_like``)."""
    from torch.distributed.checkpoint import state_dict as SD
    from torch.distributed.tensor import DTensor

    def refuse(name):
        def f(*args, **kwargs):
            raise Gathered(f"{name} was called")
        return f

    real_options = SD.StateDictOptions.__init__

    def options(self, *args, **kwargs):
        real_options(self, *args, **kwargs)
        if self.full_state_dict:
            raise Gathered("StateDictOptions(full_state_dict=True)")

    for owner, name, new in [(D, "full_model_state", refuse("full_model_state")),
                             (D, "full_optimizer_state", refuse("full_optimizer_state")),
                             (D, "load_full_model_state", refuse("load_full_model_state")),
                             (D, "load_full_optimizer_state", refuse("load_full_optimizer_state")),
                             (DTensor, "full_tensor", refuse("DTensor.full_tensor")),
                             (SD.StateDictOptions, "__init__", options)]:
        monkeypatch_like.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)


def _join(rank: int, root: str, name: str = "pg", world: int = WORLD) -> D.DistEnv:
    """This worker's place in a gloo group of ``world`` processes (one thread each)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/{name}", rank=rank, world_size=world)
    return D.DistEnv(rank=rank, world_size=world, backend="gloo")


def _full_state(model, optimizer) -> tuple[dict, dict]:
    """The full model and optimizer tensors of an FSDP2 model, gathered (collectives: on every rank) only to be
    compared with a reference."""
    names = {p: n for n, p in model.named_parameters()}
    model_full = {n: p.full_tensor() for n, p in model.named_parameters()}
    optim_full = {f"{names[p]}.{k}": local(v).clone() if k == "step" else v.full_tensor()
                  for p, s in optimizer.state.items() for k, v in s.items()}
    return model_full, optim_full


def _write_full_state(model, optimizer, rank: int, model_path: str, optim_path: str) -> None:
    """:func:`_full_state` (collectives: every rank), written by rank 0 to ``{path}.safetensors``; then a barrier."""
    model_full, optim_full = _full_state(model, optimizer)
    if rank == 0:
        save_file(model_full, f"{model_path}.safetensors")
        save_file(optim_full, f"{optim_path}.safetensors")
    dist.barrier()


def _worker(rank: int, root: str) -> None:
    env = _join(rank, root)
    try:
        model = D.wrap_model(tied_model(0), env, "fsdp")
        optimizer = adamw(model)
        train_steps(model, optimizer, rank)
        saved = []
        forbid_full_gathers(saved)
        try:  # save, export and resume: nothing gathered
            S.FILE_BYTES = 20_000  # several files per rank
            C.save_checkpoint(f"{root}/run", 2, env, model, optimizer, torch.Generator().manual_seed(rank),
                              {"tokens": 0, "elapsed": 0.0, "config": {}, "guard": {}})
            S.save_pretrained_sharded(model, f"{root}/final", env)
            S.save_pretrained_sharded(model, f"{root}/split", env, max_bytes=30_000)
            fresh = D.wrap_model(tied_model(1), env, "fsdp")
            fresh_opt = adamw(fresh)
            C.restore_model(C.load_checkpoint(find_checkpoint(f"{root}/run"), rank), fresh, fresh_opt, env)
        finally:
            for owner, name, old in saved:
                setattr(owner, name, old)
        # the resumed shards are the saved ones, bit for bit, and so is the optimizer state
        for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
            assert torch.equal(local(a), local(b)), n
        names = {p: n for n, p in model.named_parameters()}
        fresh_names = {n: p for n, p in fresh.named_parameters()}
        assert len(fresh_opt.state) == len(optimizer.state)  # the unstepped fusion has no state in either
        for p, s in optimizer.state.items():
            t = fresh_opt.state[fresh_names[names[p]]]
            assert set(t) == set(s) and all(torch.equal(local(s[k]), local(t[k])) for k in s), names[p]
        assert [g["betas"] for g in fresh_opt.param_groups] == [(0.8, 0.9)] * 2
        # the reference for the parent process: the full tensors, gathered here only to be compared with
        _write_full_state(model, optimizer, rank, f"{root}/model_ref", f"{root}/optim_ref")
    finally:
        D.shutdown(env)  # the package's teardown (a barrier per gloo worker, then destroy): see its docstring


@pytest.fixture(scope="module")
def two_rank_save(tmp_path_factory):
    """Two gloo processes: train 2 steps under FSDP2, save a checkpoint and the final model with every full-gather
    helper patched to raise, resume the checkpoint into a fresh FSDP2 model and check it there."""
    root = str(tmp_path_factory.mktemp("fsdp"))
    mp.spawn(_worker, args=(root,), nprocs=WORLD, join=True)
    return root


def test_fsdp_save_export_and_resume_never_gather(two_rank_save):
    path = find_checkpoint(f"{two_rank_save}/run")
    names = sorted(os.listdir(path))
    shards = [n for n in names if n.startswith("shard-")]
    assert [n for n in names if n not in shards] == ["rng-rank0.pt", "rng-rank1.pt", "sharded_state.json",
                                                     "trainer_state.json"]
    assert json.load(open(os.path.join(path, "trainer_state.json")))["layout"] == "sharded"
    per_rank = {r: [n for n in shards if n.startswith(f"shard-0000{r}-model-")] for r in (1, 2)}
    assert len(per_rank[1]) > 1 and len(per_rank[1]) + len(per_rank[2]) == len(shards)  # FILE_BYTES: several
    # each rank wrote its own half of an FSDP-sharded weight (97 embedding rows: 49 and 48), not the whole of it
    tensors = {r: {k: v for n in per_rank[r] for k, v in load_file(os.path.join(path, n)).items()} for r in (1, 2)}
    for key, rows in (("model.backbone.model.layers.0.mlp.up_proj.weight", [32, 32]),
                      ("model.backbone.model.embed_tokens.weight", [49, 48]),
                      ("optim.backbone.model.embed_tokens.weight.exp_avg", [49, 48])):
        assert [tensors[r][key].shape[0] for r in (1, 2)] == rows, key
    assert not any("lm_head" in k for r in (1, 2) for k in tensors[r])  # the tied head: stored once


def test_a_sharded_checkpoint_resumes_in_one_process_without_a_process_group(two_rank_save):
    assert not dist.is_initialized()
    model_ref = load_file(f"{two_rank_save}/model_ref.safetensors")
    optim_ref = load_file(f"{two_rank_save}/optim_ref.safetensors")
    model = tied_model(1)
    optimizer = adamw(model)
    restored = C.load_checkpoint(find_checkpoint(f"{two_rank_save}/run"), rank=0)
    C.restore_model(restored, model, optimizer, D.DistEnv())
    for n, p in model.named_parameters():
        assert torch.equal(p, model_ref[n]), n
    assert model.backbone.lm_head.weight is model.backbone.model.embed_tokens.weight  # still tied
    names = {p: n for n, p in model.named_parameters()}
    got = {f"{names[p]}.{k}": v for p, s in optimizer.state.items() for k, v in s.items()}
    assert sorted(got) == sorted(optim_ref) and all(torch.equal(got[k], optim_ref[k]) for k in got)
    assert not any(k.startswith("feedback.") for k in got)
    # the same tensors for --init-from, assembled from the shards
    full = C.load_model_state(restored["path"])
    assert all(torch.equal(full[n], model_ref[n]) for n in model_ref)


def test_the_sharded_export_is_what_save_pretrained_writes(two_rank_save, tmp_path):
    """Same files, same config, same tensor names (the tied head stored once) and the same values as a single
    process's ``save_pretrained`` of the same weights; loadable with ``from_pretrained``."""
    model = tied_model(0)  # the trained model's config (its embeddings' initial RMS among it)
    model.load_state_dict(load_file(f"{two_rank_save}/model_ref.safetensors"), strict=False)
    model.save_pretrained(tmp_path / "single")
    final = f"{two_rank_save}/final"
    assert sorted(os.listdir(final)) == sorted(os.listdir(tmp_path / "single"))
    for name in ("config.json", "generation_config.json"):
        assert open(os.path.join(final, name)).read() == open(tmp_path / "single" / name).read()
    a, b = load_file(os.path.join(final, "model.safetensors")), load_file(tmp_path / "single" / "model.safetensors")
    assert sorted(a) == sorted(b) and "backbone.lm_head.weight" not in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    loaded = fullband.model.modeling.load_model(final)
    ids = random_ids(2, 12, seed=5)
    with torch.no_grad():
        assert torch.equal(loaded(ids, num_passes=2).logits, model.eval()(ids, num_passes=2).logits)


def test_the_export_splits_beyond_the_shard_size_as_save_pretrained_names_it(two_rank_save, tmp_path):
    """Above the shard size: ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``, the same
    tensors, each file within the size unless one tensor alone is larger; ``from_pretrained`` reads it."""
    split = f"{two_rank_save}/split"
    index = json.load(open(os.path.join(split, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(n for n in os.listdir(split) if n.endswith(".safetensors")) == files
    assert "model.safetensors" not in os.listdir(split)
    whole = load_file(os.path.join(two_rank_save, "final", "model.safetensors"))
    parts = {}
    for f in files:
        part = load_file(os.path.join(split, f))
        assert sum(v.numel() * 4 for v in part.values()) <= 30_000 or len(part) == 1, f
        assert all(index["weight_map"][k] == f for k in part)
        parts.update(part)
    assert sorted(parts) == sorted(whole) and all(torch.equal(parts[k], whole[k]) for k in whole)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in whole.values())
    ids = random_ids(2, 12, seed=5)
    with torch.no_grad():
        a = fullband.model.modeling.load_model(split)(ids, num_passes=2).logits
        b = fullband.model.modeling.load_model(f"{two_rank_save}/final")(ids, num_passes=2).logits
    assert torch.equal(a, b)


def test_a_missing_or_truncated_shard_or_index_is_a_one_line_error(two_rank_save, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(f"{two_rank_save}/run", run)
    path = find_checkpoint(str(run))
    shard = os.path.join(path, sorted(n for n in os.listdir(path) if n.startswith("shard-00002-"))[0])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(ValueError, match="corrupt or truncated") as err:
        C.load_checkpoint(path)
    assert shard in str(err.value) and "\n" not in str(err.value)
    os.unlink(shard)
    with pytest.raises(FileNotFoundError, match="incomplete"):
        C.load_checkpoint(path)
    index = os.path.join(path, "sharded_state.json")
    with open(index, "r+b") as f:
        f.truncate(os.path.getsize(index) // 2)
    with pytest.raises(ValueError, match="corrupt or truncated") as err:
        C.load_checkpoint(path)
    assert index in str(err.value) and "\n" not in str(err.value)


def _reshard_worker(rank: int, root: str, world: int, run: str, tag: str, gathers: bool = False) -> None:
    """Resume checkpoint ``root/run`` into a fresh FSDP2 model over ``world`` processes (nothing gathered on the way
    unless ``gathers``: a full checkpoint is read whole); rank 0 writes the resumed full tensors and every rank the
    number of embedding rows it holds."""
    env = _join(rank, root, f"pg-{tag}", world=world)
    try:
        fresh = D.wrap_model(tied_model(1), env, "fsdp")
        fresh_opt = adamw(fresh)
        saved = []
        if not gathers:
            forbid_full_gathers(saved)
        try:
            C.restore_model(C.load_checkpoint(find_checkpoint(f"{root}/{run}"), rank), fresh, fresh_opt, env)
        finally:
            for owner, name, old in saved:
                setattr(owner, name, old)
        with open(f"{root}/{tag}-rows{rank}.json", "w") as f:
            json.dump(local(fresh.get_input_embeddings().weight).shape[0], f)
        _write_full_state(fresh, fresh_opt, rank, f"{root}/{tag}-model", f"{root}/{tag}-optim")
    finally:
        D.shutdown(env)  # the package's teardown (a barrier per gloo worker, then destroy): see its docstring


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_one_process_checkpoint_resumes_on_two_fsdp_processes(tmp_path):
    """1 -> 2: the checkpoint of a single process (no process group: the ``full`` layout) resumes under FSDP2 on two,
    each rank keeping its own (uneven) shard of every tensor and optimizer state, bitwise."""
    root = str(tmp_path)
    model = tied_model(0)
    optimizer = adamw(model)
    train_steps(model, optimizer, rank=0)
    C.save_checkpoint(f"{root}/run1", 2, D.DistEnv(), model, optimizer, torch.Generator().manual_seed(0),
                      {"tokens": 0, "elapsed": 0.0, "config": {}, "guard": {}})
    assert json.load(open(os.path.join(find_checkpoint(f"{root}/run1"), "trainer_state.json")))["layout"] == "full"
    names = {p: n for n, p in model.named_parameters()}
    model_ref = {n: p.detach() for n, p in model.named_parameters()}
    optim_ref = {f"{names[p]}.{k}": v for p, s in optimizer.state.items() for k, v in s.items()}
    mp.spawn(_reshard_worker, args=(root, 2, "run1", "one-to-two", True), nprocs=2, join=True)
    _assert_same_tensors(load_file(f"{root}/one-to-two-model.safetensors"), model_ref)
    _assert_same_tensors(load_file(f"{root}/one-to-two-optim.safetensors"), optim_ref)
    assert [json.load(open(f"{root}/one-to-two-rows{r}.json")) for r in range(2)] == [49, 48]


def test_a_two_process_sharded_checkpoint_resumes_on_three_uneven_shards(two_rank_save):
    """2 -> 3: the 97 embedding rows saved as 49 + 48 are read back as 33 + 33 + 31 (FSDP2 shards as torch.chunk),
    every tensor and optimizer state bitwise."""
    root = two_rank_save
    mp.spawn(_reshard_worker, args=(root, 3, "run", "two-to-three"), nprocs=3, join=True)
    _assert_same_tensors(load_file(f"{root}/two-to-three-model.safetensors"), load_file(f"{root}/model_ref.safetensors"))
    _assert_same_tensors(load_file(f"{root}/two-to-three-optim.safetensors"), load_file(f"{root}/optim_ref.safetensors"))
    assert [json.load(open(f"{root}/two-to-three-rows{r}.json")) for r in range(3)] == [33, 33, 31]


# ----------------------------------------------------------------------------------------------- the CLI


def args(data, out, *extra):
    return ["train", "--preset", "micro", "--steps", "6", "--out", str(out), "--seed", "0", "--data", data,
            "--vocab-size", "300", "--seq-len", "32", "--batch-size", "4", "--no-progress", "--no-tensorboard",
            "--no-plot", "--feedback-start", "0.5", "--jitter", "0", "--save-every", "2", "--parallel", "fsdp", *extra]


def losses(out):
    return [(r["step"], r["loss"], r["pass_losses"], r["num_passes"])
            for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("split") == "train"]


def torchrun(argv):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD), "-m",
           "fullband.cli", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_fsdp_killed_and_resumed_on_2_and_on_1_process(data, tmp_path):
    """(1) an uninterrupted 2-process FSDP2 run; (2) the same run SIGKILLed after step 5 (its checkpoint: step 4,
    sharded), resumed on 2 processes: the same losses and final weights, bitwise; (3) that checkpoint resumed in
    one process: the same losses to :func:`conftest.micro_rtol` relative (the worst-case error of the loss's sums in
    another order: the gradient is one process's sum, not the mean of two halves; seen: 1.9e-7 relative) and weights
    to 1e-5 (--jitter 0: each process draws its own jitter noise)."""
    full, killed = tmp_path / "full", tmp_path / "killed"
    p = torchrun(args(data, full))
    assert p.returncode == 0, p.stderr[-3000:]
    p = torchrun(args(data, killed, "--debug-kill-at-step", "5"))
    assert p.returncode != 0 and p.stderr.count("Signal 9 (SIGKILL) received") == WORLD, p.stderr[-2000:]
    ckpt = find_checkpoint(str(killed))
    assert ckpt.endswith("step-0000004") and [x[0] for x in losses(killed)] == [1, 2, 3, 4, 5]
    files = os.listdir(ckpt)
    assert "model.safetensors" not in files and "optimizer.pt" not in files
    assert sorted(n for n in files if n.startswith("shard-")) == [
        f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)]
    one = tmp_path / "one"
    shutil.copytree(killed, one)
    p = torchrun(["train", "--resume", "--out", str(killed), "--no-progress"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(killed) == losses(full) and [x[3] for x in losses(full)] == [1, 1, 1, 2, 2, 2]
    ref = load_file(full / "model.safetensors")
    got = load_file(killed / "model.safetensors")
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert cli.main(["train", "--resume", "--out", str(one), "--no-progress"]) == 0
    a, b = losses(full), losses(one)
    assert [x[0] for x in b] == list(range(1, 7)) and a[:4] == b[:4]
    for (_, la, pa, _), (_, lb, pb, _) in zip(a, b):
        assert_losses_close(lb, la, micro_rtol(4 * 32))
        assert_losses_close(pb, pa, micro_rtol(4 * 32))
    got = load_file(one / "model.safetensors")
    assert sorted(got) == sorted(ref) and max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-5
    assert open(one / "config.json").read() == open(full / "config.json").read()


def _reset_worker(rank: int, root: str) -> None:
    env = _join(rank, root, "pg-reset")
    try:
        model = D.wrap_model(tied_model(0), env, "fsdp")
        with torch.no_grad():  # move the embeddings (97 rows: uneven shards) so embed_rms is re-measured for real
            local(model.get_input_embeddings().weight).mul_(1.5 + rank)
        model.reset_feedback(torch.Generator().manual_seed(7))
        full = {n: p.full_tensor() for n, p in model.feedback.named_parameters()}
        embeddings = model.get_input_embeddings().weight.full_tensor()  # collectives: on every rank
        if rank == 0:
            save_file(full, f"{root}/fusion.safetensors")
            save_file({"embeddings": embeddings}, f"{root}/embeddings.safetensors")
            with open(f"{root}/embed_rms.json", "w") as f:
                json.dump(model.config.embed_rms, f)
        dist.barrier()
    finally:
        D.shutdown(env)  # the package's teardown (a barrier per gloo worker, then destroy): see its docstring


def test_switching_feedback_on_under_fsdp_initialises_the_fusion_as_one_process_does(tmp_path):
    """``reset_feedback`` on FSDP2 shards: each rank keeps its own shard of one full draw (an in-place init filled
    every shard from the same draws, so the sharded halves of each matrix came out equal), and ``embed_rms`` is
    the RMS of the whole (unevenly sharded) embedding matrix."""
    root = str(tmp_path)
    mp.spawn(_reset_worker, args=(root,), nprocs=WORLD, join=True)
    sharded = load_file(f"{root}/fusion.safetensors")
    embeddings = load_file(f"{root}/embeddings.safetensors")["embeddings"]
    with open(f"{root}/embed_rms.json") as f:
        rms = json.load(f)
    assert rms == pytest.approx(float(embeddings.double().pow(2).mean().sqrt()), rel=1e-6)
    reference = tied_model(0)
    with torch.no_grad():
        reference.get_input_embeddings().weight.copy_(embeddings)
    reference.reset_feedback(torch.Generator().manual_seed(7))
    assert reference.config.embed_rms == pytest.approx(rms, rel=1e-6)
    for name, value in reference.feedback.named_parameters():
        torch.testing.assert_close(sharded[name], value.detach(), rtol=1e-6, atol=0, msg=name)
    gate = sharded["gate_proj.weight"]
    half = gate.shape[0] // 2
    assert not torch.allclose(gate[:half], gate[half:2 * half])  # the symptom of the old init
