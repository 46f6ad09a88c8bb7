"""Sharded checkpoints and the final model of an FSDP2 run, written and read with ``torch.distributed.checkpoint``.

Under ``--parallel fsdp`` no rank gathers the whole model or optimizer state, neither to save nor to resume:

* a checkpoint's model and optimizer tensors are the FSDP2 state dicts with ``full_state_dict=False``
  (``torch.distributed.checkpoint.state_dict.get_state_dict``: each rank's own shards), written by ``dcp.save``
  through DCP's safetensors storage (``HuggingFaceStorageWriter(save_distributed=True)``):
  ``shard-0000R-model-0000i-of-0000n.safetensors``, rank R-1's shards in files of up to :data:`FILE_BYTES` (DCP
  builds a file in memory before writing it), their places in the full tensors in each file's JSON header.
  Safetensors and JSON only: DCP's default ``.metadata`` and byte items are pickles, which a resume must never
  load. What is no tensor (the optimizer's parameter groups, which parameters have state) is :data:`INDEX`, JSON,
  written by rank 0 (:func:`save_sharded`);
* a resume builds the model and optimizer first, then ``dcp.load`` reads into their (sharded or plain) state dicts
  and ``set_state_dict`` applies them (:func:`load_sharded`). DCP reshards on the way in: the checkpoint of N
  processes resumes on any number M of FSDP processes, under DDP, or in one process without a process group;
* the final model (:func:`save_pretrained_sharded`): the same per-rank write into a temporary directory, then
  torch's safetensors consolidation (``consolidate_safetensors_files_on_every_rank``; transformers consolidates
  its distributed checkpoints with the same module) writes the ``save_pretrained`` files, each output file by one
  rank, one full tensor in memory at a time, and HF's ``save_pretrained(..., state_dict={})`` writes everything but the weights (config,
  generation config). One ``model.safetensors`` up to HF's default shard size (50 GB), else
  ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``, as ``save_pretrained`` names them.

A tied parameter (the LM head tied to the embeddings) is stored once, under the name ``named_parameters`` keeps
(:func:`canonical_keys`), as ``save_pretrained`` does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..utils.io import atomic_save_pretrained
from . import distributed as D

INDEX = "sharded_state.json"  # the optimizer's groups, which parameters have state, the shard files
FILE_BYTES = 10**9  # a checkpoint's files per rank: shard-{rank+1}-model-{i}-of-{n}.safetensors, up to this size
MAX_SHARD_BYTES = 50 * 10**9  # save_pretrained's default max_shard_size ("50GB")
_OPTIONS = StateDictOptions(full_state_dict=False)
_WEIGHT_FILES = re.compile(r"model(-[0-9]{5}-of-[0-9]{5})?\.safetensors|model\.safetensors\.index\.json")


def canonical_keys(module: nn.Module, state: dict) -> list[str]:
    """The keys of ``state`` (``module``'s state dict) without the second name of a tied parameter."""
    aliases = ({n for n, _ in module.named_parameters(remove_duplicate=False)}
               - {n for n, _ in module.named_parameters()})
    return [k for k in state if k not in aliases]


def _flat(module: nn.Module, model_state: dict, optim_state: dict, state_keys: dict[str, list[str]]) -> dict:
    """The tensors of a checkpoint under one flat name each: ``model.<fqn>``, ``optim.<fqn>.<key>``."""
    flat = {f"model.{k}": model_state[k] for k in canonical_keys(module, model_state)}
    for fqn, keys in state_keys.items():
        for key in keys:
            flat[f"optim.{fqn}.{key}"] = optim_state["state"][fqn][key]
    return flat


def shard_plan(state: dict, max_bytes: int) -> dict[str, int]:
    """Each tensor's file (1..n), filled in order up to ``max_bytes`` (global sizes), as ``save_pretrained`` splits."""
    plan, index, size = {}, 1, 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if size and size + nbytes > max_bytes:
            index, size = index + 1, 0
        plan[k] = index
        size += nbytes
    return plan


def write_shards(state: dict, path: str, env: D.DistEnv) -> None:
    """``dcp.save`` of ``state`` into ``path``: every rank its own shards, in safetensors files of up to
    :data:`FILE_BYTES` each (DCP builds a file in memory: this bounds what a save adds to a rank)."""
    writer = HuggingFaceStorageWriter(path, fqn_to_index_mapping=shard_plan(state, FILE_BYTES * env.world_size),
                                      save_distributed=True)
    dcp.save(state, storage_writer=writer, no_dist=not env.distributed)


def mkdtemp_everywhere(parent: str, prefix: str, env: D.DistEnv) -> str:
    """A new temporary directory in ``parent``, made by rank 0 and known to every rank."""
    tmp = None
    if env.is_main:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=parent)
    return D.broadcast_object(tmp, env)


# ----------------------------------------------------------------------------------------------- checkpoints


def save_sharded(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, env: D.DistEnv) -> None:
    """Write the model and optimizer state into directory ``path`` (collective: every rank writes its shards;
    rank 0 writes :data:`INDEX`)."""
    module = D.unwrap(model)
    model_state, optim_state = get_state_dict(module, optimizer, options=_OPTIONS)
    state_keys = {fqn: sorted(k for k, v in s.items() if isinstance(v, torch.Tensor))
                  for fqn, s in optim_state["state"].items()}
    write_shards(_flat(module, model_state, optim_state, state_keys), path, env)
    if env.is_main:
        shards = sorted(n for n in os.listdir(path) if n.startswith("shard-") and n.endswith(".safetensors"))
        index = {"world_size": env.world_size, "shards": shards, "param_groups": optim_state["param_groups"],
                 "optimizer_state": state_keys}
        with open(os.path.join(path, INDEX), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=1)


def load_sharded(path: str, index: dict, model: nn.Module, optimizer: torch.optim.Optimizer,
                 env: D.DistEnv) -> None:
    """Read checkpoint ``path`` (:func:`save_sharded`'s, with its ``index``) into ``model`` and ``optimizer``, as they
    are sharded now (FSDP2 over any number of processes, DDP, or one process). Parameters the checkpoint has no
    optimizer state for (never stepped: the fusion before feedback starts) start their AdamW state afresh, as in
    the uninterrupted run."""
    module = D.unwrap(model)
    # the templates: this run's own (sharded) tensors; torch first gives every parameter an optimizer state
    model_state, optim_state = get_state_dict(module, optimizer, options=_OPTIONS)
    state_keys = index["optimizer_state"]
    missing = [fqn for fqn in state_keys if fqn not in optim_state["state"]]
    if missing:
        raise ValueError(f"checkpoint {path!r} does not match the model: optimizer state for unknown parameters "
                         f"{missing[:5]}")
    try:
        _load(_flat(module, model_state, optim_state, state_keys), path, env)
    except Exception as err:  # noqa: BLE001 - a missing tensor or a shape that differs: the checkpoint's problem
        first = (str(err).strip().splitlines() or [type(err).__name__])[-1][:200]
        raise ValueError(f"checkpoint {path!r} does not match the model ({type(err).__name__}: {first})") from None
    optim_state = {"state": {fqn: {k: optim_state["state"][fqn][k] for k in keys} for fqn, keys in state_keys.items()},
                   "param_groups": _typed_groups(index["param_groups"], optim_state["param_groups"])}
    set_model_state_dict(module, model_state, options=StateDictOptions(full_state_dict=False, strict=True))
    # strict=False: the parameters without saved state; torch gave them one (the zero-LR step), dropped here
    set_optimizer_state_dict(module, optimizer, optim_state, options=StateDictOptions(full_state_dict=False,
                                                                                       strict=False))
    D.drop_unsaved_state(module, optimizer, set(state_keys))


def _load(state: dict, path: str, env: D.DistEnv) -> None:
    """``dcp.load`` of ``state`` (in place) from the shards in ``path``; one process needs no process group."""
    with warnings.catch_warnings():  # DCP's note that it reads in one process: what was asked for
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(path), no_dist=not env.distributed)


def read_model(path: str) -> dict[str, torch.Tensor]:
    """The full model state of checkpoint ``path`` assembled in this process (what ``--init-from`` a sharded
    checkpoint reads): every ``model.*`` tensor at its full shape, read from the shards by ``dcp.load``."""
    meta = HuggingFaceStorageReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith("model.")}
    _load(state, path, D.DistEnv())
    return {k[len("model."):]: v for k, v in state.items()}


def _typed_groups(saved: list[dict], fresh: list[dict]) -> list[dict]:
    """The saved parameter groups (JSON) with tuples where this optimizer has them (``betas``)."""
    if len(saved) != len(fresh):
        raise ValueError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this run's {len(fresh)}")
    return [{k: tuple(v) if isinstance(f.get(k), tuple) and isinstance(v, list) else v for k, v in s.items()}
            for s, f in zip(saved, fresh)]


# ----------------------------------------------------------------------------------------------- final model


class _Consolidated:
    """What :func:`fullband.utils.io.atomic_save_pretrained` saves: HF's files of ``module`` except the weights,
    and the consolidated weight files in ``weights_dir``."""

    def __init__(self, module, weights_dir: str):
        self.module, self.weights_dir = module, weights_dir

    def save_pretrained(self, path: str) -> None:
        self.module.save_pretrained(path, state_dict={})  # config, generation config; an empty weights file
        for n in os.listdir(path):
            if n.endswith(".safetensors") or n == "model.safetensors.index.json":
                os.unlink(os.path.join(path, n))
        for n in os.listdir(self.weights_dir):
            os.replace(os.path.join(self.weights_dir, n), os.path.join(path, n))


def save_pretrained_sharded(module: nn.Module, out: str, env: D.DistEnv, max_bytes: int = MAX_SHARD_BYTES) -> None:
    """``module.save_pretrained(out)`` for an FSDP2-sharded ``module`` without gathering it (collective): every rank
    writes its shards, each output file is consolidated by one rank one tensor at a time, and rank 0 merges the
    directory into ``out`` (``config.json`` last), removing weight files of an earlier save that the new one does
    not replace."""
    state = module.state_dict()
    state = {k: state[k] for k in canonical_keys(module, state)}
    plan = shard_plan(state, max_bytes)
    tmp = mkdtemp_everywhere(out, ".export.", env)
    try:
        write_shards(state, os.path.join(tmp, "sharded"), env)
        # every output file written by one rank (file i by rank i mod N), one full tensor in memory at a time
        consolidate_safetensors_files_on_every_rank(os.path.join(tmp, "sharded"), tmp, plan)
        if env.is_main:
            shutil.rmtree(os.path.join(tmp, "sharded"))
            if max(plan.values()) == 1:  # one file: save_pretrained's name for it, no index
                os.replace(os.path.join(tmp, "model-00001-of-00001.safetensors"),
                           os.path.join(tmp, "model.safetensors"))
                os.unlink(os.path.join(tmp, "model.safetensors.index.json"))
            for n in os.listdir(out):
                if _WEIGHT_FILES.fullmatch(n) and not os.path.exists(os.path.join(tmp, n)):
                    os.unlink(os.path.join(out, n))
            atomic_save_pretrained(_Consolidated(module, tmp), out, mode="merge")
    finally:
        D.barrier(env)
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
