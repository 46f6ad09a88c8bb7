"""Process groups, model wrapping (DDP or FSDP2) and the full state dicts of unsharded models for ``fullband train``.

The same command runs single-process or under ``torchrun --nproc_per_node N``: :func:`init_distributed` reads
torchrun's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``) and starts a process group (gloo on CPU, nccl on
CUDA). :func:`wrap_model` wraps with ``DistributedDataParallel`` or, for large models, FSDP2 (``fully_shard`` on
every decoder layer, then the root). A single process or DDP saves full state dicts (:func:`full_model_state`,
:func:`full_optimizer_state`: one copy, no gather); an FSDP2 model is saved and exported shard by shard
(:mod:`fullband.training.sharded`), never gathered. :func:`load_full_model_state` /
:func:`load_full_optimizer_state` also load a full checkpoint into an FSDP2 model (each rank keeps its shards):
a run resumes with another parallelism either way. (The FSDP2 and distributed-checkpoint modules are imported
where used: only sharded runs need them.)
"""

from __future__ import annotations

import os
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

PARALLEL_MODES = ("ddp", "fsdp")


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for but CUDA is not available")
    return torch.device(name)


def init_distributed(device: str = "auto") -> DistEnv:
    """The process's place in the job (a one-process job when not launched by torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = resolve_device(device)
    if world <= 1:
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return DistEnv(device=dev)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=dev if dev.type == "cuda" else None)
    return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=dev,
                   backend=backend)


GLOO_THREADS = 2  # gloo's worker threads per process group (ProcessGroupGloo._Options()._threads)


def shutdown(env: DistEnv) -> None:
    """The end of a run every rank finished (call it once the run's DDP / FSDP model is freed): all ranks meet at a
    barrier, gloo's worker threads get time to free their finished work, then the group is destroyed.

    Why the pause: a gloo worker thread frees a finished collective's work, and with it the Python-visible tensors
    it held, after the collective has returned, and that needs the GIL; the group's destructor joins those threads
    while holding the GIL. A group freed at that moment deadlocks: seen in CI as a rank that never exited, its main
    thread in ``~ProcessGroupGloo`` (from DDP's ``~Reducer``, the model freed as the run returned) joining a worker
    blocked on the GIL in ``~AsyncBarrierWork`` (``py-spy dump --native``). Sleeping releases the GIL.

    To the end: a gloo worker marks a collective's work complete (which wakes the waiting caller) and only then drops
    its own reference to it; when that is the last reference, the work's destructor runs in the worker and frees
    tensors whose Python objects it keeps alive, which takes the GIL. So the deadlock needs a worker still holding
    the last reference to a finished work when the group is destroyed. Here every one of the group's worker threads
    (gloo's default: :data:`GLOO_THREADS`) is given a barrier of its own, enqueued together (each waits for the work
    before it, so a free worker takes the next) and referenced from this thread until the group is destroyed: a
    worker drops its previous work before it takes a new one, so once all have completed no worker holds a last
    reference to anything but those barriers, whose last references are dropped here, after the workers are
    joined. The pause stays as a second line of defence."""
    if env.distributed and dist.is_initialized():
        barrier(env)
        held = []
        if env.backend == "gloo":
            held = [dist.barrier(async_op=True) for _ in range(GLOO_THREADS)]
            for work in held:
                work.wait()
            time.sleep(0.2)
        dist.destroy_process_group()
        del held  # the barriers' last references, dropped here once gloo's workers are joined


def barrier(env: DistEnv) -> None:
    if env.distributed:
        if env.backend == "nccl":
            dist.barrier(device_ids=[env.device.index])
        else:
            dist.barrier()


def all_reduce_mean(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Mean over ranks (in place on a copy)."""
    if not env.distributed:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / env.world_size


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum over ranks (of a copy)."""
    if not env.distributed:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def rank_share(n: int, env: DistEnv) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of ``n`` evaluation items, ``(indices, counted)``: items ``rank, rank + W, ...``, then as
    many repeats of item 0 (``counted`` False) as make every rank's share ``ceil(n / W)`` long, so that every rank
    runs the same number of forward calls (FSDP's all-gathers pair up across ranks) and each item is counted once
    over all ranks. One process: every item, all counted."""
    if not env.distributed:
        return torch.arange(n), torch.ones(n, dtype=torch.bool)
    own = torch.arange(env.rank, max(n, env.rank), env.world_size)  # a rank past the last item: none of its own
    pad = -(-n // env.world_size) - own.numel()
    return (torch.cat([own, torch.zeros(pad, dtype=torch.long)]),
            torch.cat([torch.ones(own.numel(), dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)]))


def all_true(flag: bool, env: DistEnv) -> bool:
    if not env.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() > 0)


def broadcast_object(obj, env: DistEnv):
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=env.device if env.backend == "nccl" else None)
    return box[0]


# ----------------------------------------------------------------------------------------------- wrapping


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a (wrapped) HF decoder, for FSDP sharding units."""
    backbone = getattr(model, "backbone", model)
    base = getattr(backbone, backbone.base_model_prefix, backbone) if hasattr(backbone, "base_model_prefix") else backbone
    for name in ("layers", "h", "blocks", "layer"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList):
            return list(layers)
    return []


def wrap_model(model: nn.Module, env: DistEnv, mode: str = "ddp") -> nn.Module:
    """DDP (``find_unused_parameters``: the fusion is unused on K = 1 steps) or FSDP2 over ``env``'s group."""
    if mode not in PARALLEL_MODES:
        raise ValueError(f"parallel mode must be one of {', '.join(PARALLEL_MODES)}, got {mode!r}")
    if not env.distributed:
        return model
    if mode == "ddp":
        # K = 1 steps leave the fusion unused, K > 1 steps use everything; DDP warns about the latter
        warnings.filterwarnings("ignore", message=".*find_unused_parameters=True was specified.*")
        ids = [env.device.index] if env.device.type == "cuda" else None
        return DDP(model, device_ids=ids, find_unused_parameters=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "no_sync") and hasattr(model, "module") else model


def no_sync(model: nn.Module, skip: bool):
    """DDP: skip the gradient all-reduce on accumulation micro-batches before the last one."""
    if skip and hasattr(model, "no_sync"):
        return model.no_sync()
    if skip and hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        return _RestoreSync(model)
    return nullcontext()


class _RestoreSync:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)
        return False


# ----------------------------------------------------------------------------------------------- state dicts


def is_sharded(model: nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _refuse_sharded(model: nn.Module) -> None:
    if is_sharded(model):
        raise ValueError("an FSDP-sharded model's full state would be gathered onto one rank; save it with "
                         "fullband.training.sharded instead")


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full CPU state dict of an unsharded (single-process or DDP) model."""
    model = unwrap(model)
    _refuse_sharded(model)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    model = unwrap(model)
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in _tied_names(model)]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _tied_names(model: nn.Module) -> set[str]:
    seen, tied = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        key = (t.data_ptr(), t.shape)
        if key in seen:
            tied.add(name)
        else:
            seen[key] = name
    return tied


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict, for an unsharded model."""
    _refuse_sharded(unwrap(model))
    return optimizer.state_dict()


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a full optimizer state: keyed by parameter index (``optimizer.state_dict()``, a single process's or
    DDP's) or by parameter name (an FSDP run's before sharded checkpoints), into an unsharded or FSDP2 model."""
    if is_sharded(unwrap(model)):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = _keyed(model, optimizer, state, by_name=True)
        # strict=False: parameters never stepped yet (the fusion before feedback starts) have no saved state;
        # torch initialises every parameter's state first (a zero-LR step), so drop what the checkpoint lacks
        set_optimizer_state_dict(unwrap(model), optimizer, state,
                                 options=StateDictOptions(full_state_dict=True, strict=False))
        drop_unsaved_state(model, optimizer, set(state.get("state", {})))
        return
    optimizer.load_state_dict(_keyed(model, optimizer, state, by_name=False))


def _keyed(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, by_name: bool) -> dict:
    """``state`` with its parameters named by FQN (``by_name``) or by index in the optimizer's groups."""
    names = {p: n for n, p in unwrap(model).named_parameters()}
    order = [names[p] for g in optimizer.param_groups for p in g["params"]]
    saved = [i for g in state.get("param_groups", []) for i in g["params"]]
    if all(isinstance(i, str) for i in saved) == by_name:
        return state
    if len(saved) != len(order):
        raise ValueError(f"the checkpoint's optimizer has {len(saved)} parameters, this model {len(order)}")
    to = dict(zip(saved, order)) if by_name else {n: i for i, n in enumerate(order)}
    if not by_name and set(saved) != set(to):
        unknown = sorted(set(saved) - set(to))[:5]
        raise ValueError(f"the checkpoint's optimizer names parameters this model lacks: {unknown}")
    return {"state": {to[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [to[i] for i in g["params"]]} for g in state["param_groups"]]}


def drop_unsaved_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: set[str]) -> None:
    """Forget the optimizer state of parameters the checkpoint has none for (named ``saved`` has the others): a
    resumed run starts their AdamW state afresh, as the uninterrupted run does."""
    names = {p: n for n, p in unwrap(model).named_parameters()}
    for p in [p for p in optimizer.state if names.get(p) not in saved]:
        del optimizer.state[p]
