"""Checkpoints of a training run: atomic writes, safe loads, and the run directory's layout.

Owns ``OUT/checkpoints/step-NNNNNNN/`` (written under a temporary name, fsynced, renamed; a re-saved step swapped
in with the old one kept aside until the new one is in place, :func:`swap_in`; ``latest`` updated atomically
afterwards and read back only as a plain step name, :func:`read_latest`; the oldest beyond ``--keep-checkpoints``
removed). The model and optimizer come in one of two layouts, recorded as ``layout`` in ``trainer_state.json``
(absent: ``full``) so a resume picks the right reader:

* ``full`` (one process, DDP): ``model.safetensors``, the full model state, shared tensors stored once, and
  ``optimizer.pt``, the full optimizer state (tensors, numbers, strings, lists, tuples: no pickled objects);
* ``sharded`` (FSDP2): every rank's own shards, ``shard-0000R-model-0000i-of-0000n.safetensors``, and
  ``sharded_state.json`` (:mod:`fullband.training.sharded`: nothing is gathered to one rank, and the checkpoint
  resumes on any number of processes, or one without a process group);

and, in both:

* ``rng-rankN.pt``: every rank's RNG states (torch, CUDA, Python ``random``, numpy, the prefix-mixing generator),
  stored as tensors, lists and numbers (:func:`rng_state`); a rank the saving run did not have takes the shared
  prefix-mixing stream from rank 0's file and seeds its own streams from the seed, its rank and the step
  (:func:`fallback_seed`);
* ``trainer_state.json``: the step, tokens, elapsed time, guard state, the run's config and where the schedules
  stand.

Every file is read back with ``torch.load(..., weights_only=True)`` (or safetensors / JSON), so loading a
checkpoint never runs pickled code; a missing, truncated or corrupt file is a ``ValueError`` naming it
(:func:`load_checkpoint`, :func:`load_trainer_state`). Checkpoints of format 1 (numpy's RNG state as a pickled
array) still load weights-only, with exactly numpy's array reconstruction allowed (:func:`load_legacy_rng`). Also the run directory's other names (:data:`METRICS`,
:data:`TOKENIZER_DIR`, ...), :func:`prepare_out` (what ``--resume`` / ``--overwrite`` find there),
:func:`clear_outputs`, and a saved model's identity (:func:`model_fingerprint`, :func:`evaluation_key`: what every
cached evaluation or decode of a run is keyed by).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..utils.io import atomic_write_text, fsync_dir
from . import distributed as D
from . import sharded as S

CKPT_DIR = "checkpoints"
LATEST = "latest"
METRICS = "metrics.jsonl"
TOKENIZER_DIR = "tokenizer"
RUN_CONFIG = "run_config.json"
TRAINER_STATE = "trainer_state.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SUMMARY = "summary.json"  # written when a run ends; its status "done" marks a finished run
FORMAT = 2  # 2: RNG states as tensors / lists / numbers; 1: numpy's state as a pickled array (:func:`load_legacy_rng`)
LAYOUTS = ("full", "sharded")  # trainer_state.json's "layout": model.safetensors + optimizer.pt, or DCP shards
# what --overwrite removes (only these names, never anything else in OUT)
RUN_OUTPUTS = (CKPT_DIR, METRICS, "tb", "curves.png", RUN_CONFIG, TOKENIZER_DIR, SUMMARY, "config.json",
               "generation_config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
WEIGHT_SHARDS = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")  # save_pretrained's files of a large model


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def rng_file_name(rank: int) -> str:
    return f"rng-rank{rank}.pt"


_STEP_NAME = re.compile(r"step-[0-9]{7,}")


def aside_name(name: str) -> str:
    """Where :func:`save_checkpoint` keeps the old checkpoint of a step while it swaps in a re-saved one."""
    return f".{name}.old"


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRAINER_STATE)) and (
        os.path.isfile(os.path.join(path, MODEL_FILE)) or os.path.isfile(os.path.join(path, S.INDEX)))


def read_latest(root: str) -> str | None:
    """The step name in ``root/latest`` (``None`` when there is no such file); ``ValueError`` (one line) when it is
    anything but a plain step name (``step-NNNNNNN``): a tampered file must not lead outside the run directory."""
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as f:
            text = f.read(256)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"checkpoint pointer {os.path.join(root, LATEST)!r} is unreadable ({type(err).__name__})") from None
    name = text.strip()
    if not _STEP_NAME.fullmatch(name):
        raise ValueError(f"checkpoint pointer {os.path.join(root, LATEST)!r} holds {name[:40]!r}, not a step name "
                         "such as 'step-0000100'; it was tampered with (fix or remove it)")
    return name


def find_checkpoint(out: str) -> str | None:
    """The newest complete checkpoint of a run (``latest``, else the highest ``step-*``, else one kept aside by a
    re-save that was interrupted), or ``None``. ``ValueError`` when ``latest`` is not a plain step name."""
    root = os.path.join(out, CKPT_DIR)
    if not os.path.isdir(root):
        return None
    name = read_latest(root)
    if name is not None and _complete(os.path.join(root, name)):
        return os.path.join(root, name)
    found = {}
    for n in os.listdir(root):
        step = n[1:-len(".old")] if n.startswith(".") and n.endswith(".old") else n
        if _STEP_NAME.fullmatch(step) and _complete(os.path.join(root, n)):
            found[(int(step[len("step-"):]), step == n)] = n  # a step's own directory before its aside copy
    return os.path.join(root, found[max(found)]) if found else None


# what a saved model's identity is made of: its weights and the config that says how they are used
_MODEL_FILES = re.compile(r"(model|pytorch_model)(-[0-9]+-of-[0-9]+)?\.(safetensors|bin)|config\.json")
_digests: dict[tuple, str] = {}


def file_sha256(path: str) -> str:
    """The sha256 of a file's bytes (remembered per path, size and modification time within a process)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _digests:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _digests[key] = h.hexdigest()
    return _digests[key]


def model_fingerprint(path: str) -> str:
    """The identity of the saved model in directory ``path``: a sha256 over its weight files (one or sharded
    safetensors / ``.bin``) and ``config.json``. What a cached evaluation of the model is keyed by; a retrained or
    replaced model has another. ``FileNotFoundError`` when ``path`` holds no weights."""
    names = sorted(n for n in os.listdir(path) if _MODEL_FILES.fullmatch(n)) if os.path.isdir(path) else []
    if not any(n != "config.json" for n in names):
        raise FileNotFoundError(f"{path!r} holds no saved model weights")
    h = hashlib.sha256()
    for n in names:
        h.update(f"{n}\0{file_sha256(os.path.join(path, n))}\n".encode())
    return h.hexdigest()


def evaluation_key(path: str, **settings) -> dict:
    """The key of a cached evaluation of the model in ``path``: the model's identity (:func:`model_fingerprint`)
    and the evaluation ``settings`` (JSON values). A cache hit needs the whole key equal."""
    return {"model_sha256": model_fingerprint(path), **settings}


def prepare_out(out: str, resume: bool, overwrite: bool) -> str | None:
    """Check the output directory (before anything is written); return the checkpoint to resume from."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(f"--out {out!r} exists and is not a directory")
    ckpt = find_checkpoint(out) if resume and os.path.isdir(out) else None
    if resume:
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {os.path.join(out, CKPT_DIR)!r} "
                                    "(train with --save-every N, or start without --resume)")
        return ckpt
    existing = [n for n in (CKPT_DIR, METRICS, "config.json") if os.path.exists(os.path.join(out, n))]
    if existing and not overwrite:
        raise ValueError(f"{out!r} already holds a run ({', '.join(existing)}); continue it with --resume or "
                         "start over with --overwrite")
    return None


def clear_outputs(out: str) -> None:
    """Remove what a run writes into ``out`` (:data:`RUN_OUTPUTS`, :data:`WEIGHT_SHARDS`), nothing else."""
    shards = [n for n in os.listdir(out) if WEIGHT_SHARDS.fullmatch(n)] if os.path.isdir(out) else []
    for n in (*RUN_OUTPUTS, *shards):
        p = os.path.join(out, n)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)


# ----------------------------------------------------------------------------------------------- RNG states


def rng_state(generator: torch.Generator) -> dict:
    """This process's RNG states in a form ``torch.load(weights_only=True)`` accepts: tensors, lists, numbers."""
    version, mt, gauss = random.getstate()
    key, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "prefix": generator.get_state(),
             "python": {"version": int(version), "state": [int(x) for x in mt], "gauss": gauss},
             "numpy": {"key": str(key), "state": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def fallback_seed(seed: int, rank: int, step: int) -> int:
    """The seed of rank ``rank``'s own RNG streams when it resumes from step ``step`` of a checkpoint written by
    fewer processes (no RNG file of its own): fixed by the run's seed, the rank and the step, and unlike every other
    rank's and every other step's."""
    return int.from_bytes(hashlib.sha256(f"fullband-rng/{seed}/{rank}/{step}".encode()).digest()[:8], "little") >> 1


def set_rng_state(state: dict, generator: torch.Generator, seed: int | None = None) -> None:
    """Restore what :func:`rng_state` saved. A state of the shared prefix-mixing stream alone (a rank the saving
    run did not have, :func:`load_checkpoint`) seeds this process's own streams with ``seed`` instead."""
    generator.set_state(state["prefix"])
    if "torch" not in state:
        if seed is None:
            raise ValueError("this rank has no RNG state in the checkpoint and no seed to start its streams from")
        torch.manual_seed(seed)  # CUDA's generators too
        random.seed(seed)
        np.random.seed(seed % 2**32)
        return
    py, npy = state["python"], state["numpy"]
    torch.set_rng_state(state["torch"])
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    np.random.set_state((npy["key"], npy["state"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------- save


def dedupe_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state without the second name of a tied tensor (safetensors refuses shared storage)."""
    seen, out = set(), {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key in seen:
            continue
        seen.add(key)
        out[k] = v.contiguous()
    return out


def swap_in(root: str, name: str, tmp: str) -> None:
    """Make the complete checkpoint in ``tmp`` step ``name`` of ``root`` and point ``latest`` at it. Re-saving a
    step (a resumed run that stopped again) moves the old one aside first and deletes it only once the new one is
    in place, so a crash at any point leaves a complete checkpoint (:func:`find_checkpoint` finds the aside one)."""
    final, old = os.path.join(root, name), os.path.join(root, aside_name(name))
    if os.path.isdir(final):
        if os.path.isdir(old):  # a stale aside copy from an interrupted re-save: the step itself is complete
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_text(os.path.join(root, LATEST), name + "\n")
    if os.path.isdir(old):
        shutil.rmtree(old)


def save_checkpoint(out: str, step: int, env: D.DistEnv, model, optimizer, generator: torch.Generator,
                    trainer_state: dict, keep: int = 1, rng: dict | None = None) -> str:
    """Write checkpoint ``step`` of the run in ``out``; returns its path.

    Every rank calls this and writes its own RNG file into a temporary directory. An FSDP2 model is written
    ``sharded`` (every rank its own shards, :func:`fullband.training.sharded.save_sharded`: nothing gathered); any
    other ``full``, by rank 0. Rank 0 then writes ``trainer_state.json`` (last: it marks the checkpoint complete),
    fsyncs the files, renames the directory into place and updates ``latest``. ``rng``: this rank's RNG states to
    save (:func:`rng_state`, taken earlier); default: taken now, ``generator`` the prefix-mixing stream.
    """
    layout = "sharded" if D.is_sharded(D.unwrap(model)) else "full"
    root = os.path.join(out, CKPT_DIR)
    name = step_dir_name(step)
    tmp = S.mkdtemp_everywhere(root, f".{name}.", env)
    torch.save(rng if rng is not None else rng_state(generator), os.path.join(tmp, rng_file_name(env.rank)))
    if layout == "sharded":
        S.save_sharded(tmp, model, optimizer, env)
    elif env.is_main:  # DDP replicas are equal: rank 0 alone copies them out (every rank did: 12 GB each at 1B)
        save_file(dedupe_shared(D.full_model_state(model)), os.path.join(tmp, MODEL_FILE))
        torch.save(D.full_optimizer_state(model, optimizer), os.path.join(tmp, OPTIMIZER_FILE))
    D.barrier(env)
    if env.is_main:
        with open(os.path.join(tmp, TRAINER_STATE), "w") as f:
            json.dump({"format": FORMAT, "layout": layout, "step": step, **trainer_state}, f, indent=2)
        for n in os.listdir(tmp):
            with open(os.path.join(tmp, n), "rb") as fh:
                os.fsync(fh.fileno())
        swap_in(root, name, tmp)
        names = sorted(n for n in os.listdir(root) if n.startswith("step-"))
        for old in names[:-keep]:
            if old != name:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        for n in os.listdir(root):  # what saves killed half-way left (this save's own was renamed in)
            if n.startswith(".step-") and n.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    D.barrier(env)
    return os.path.join(root, name)


# ----------------------------------------------------------------------------------------------- load


def _unreadable(path: str, err: BaseException) -> ValueError:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    first = first.split(". ")[0][:160]
    if isinstance(err, pickle.UnpicklingError):
        return ValueError(f"checkpoint file {path!r} holds objects that a safe (weights_only) load refuses ({first}); "
                          "it was not written by fullband, or was tampered with")
    return ValueError(f"checkpoint file {path!r} is corrupt or truncated ({type(err).__name__}: {first})")


def _read_json(file: str):
    if not os.path.isfile(file):
        raise FileNotFoundError(f"checkpoint file {file!r} does not exist")
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise _unreadable(file, err) from None


def load_trainer_state(path: str) -> dict:
    """``trainer_state.json`` of checkpoint directory ``path`` (``ValueError`` naming the file when unreadable)."""
    file = os.path.join(path, TRAINER_STATE)
    state = _read_json(file)
    if not (isinstance(state, dict) and isinstance(state.get("step"), int) and isinstance(state.get("config"), dict)):
        raise ValueError(f"checkpoint file {file!r} is corrupt or truncated (no step and config in it)")
    return state


def load_sharded_index(path: str) -> dict:
    """The index of ``sharded`` checkpoint ``path`` (:data:`fullband.training.sharded.INDEX`), every shard file's
    header read: a missing, truncated or foreign file fails here, before anything is written."""
    file = os.path.join(path, S.INDEX)
    index = _read_json(file)
    if not (isinstance(index, dict) and isinstance(index.get("shards"), list) and index["shards"]
            and isinstance(index.get("param_groups"), list) and isinstance(index.get("optimizer_state"), dict)):
        raise ValueError(f"checkpoint file {file!r} is corrupt (not a sharded checkpoint's index)")
    for name in index["shards"]:
        shard = os.path.join(path, str(name))
        if os.path.basename(shard) != name or not os.path.isfile(shard):
            raise FileNotFoundError(f"checkpoint file {shard!r} does not exist (the checkpoint is incomplete)")
        try:
            with safe_open(shard, framework="pt") as f:  # the header, checked against the file's length
                f.metadata()
        except Exception as err:  # noqa: BLE001 - SafetensorError and OSError alike
            raise _unreadable(shard, err) from None
    return index


def safe_torch_load(file: str, mmap: bool = False):
    """``torch.load(file, weights_only=True)`` on the CPU; ``ValueError`` naming the file when it is missing,
    truncated, corrupt or holds objects that a weights-only load refuses. ``mmap``: the tensors are views of the
    file mapped copy-on-write (pages read on first use, shared through the page cache by every process that maps
    the same file), not a private copy of it."""
    if not os.path.isfile(file):
        raise FileNotFoundError(f"checkpoint file {file!r} does not exist")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # noqa: BLE001 - every failure to read the file is the file's problem
        raise _unreadable(file, err) from None


def load_model_state(path: str) -> dict[str, torch.Tensor]:
    """The full model state of checkpoint directory ``path`` in this process (safetensors; ``ValueError`` naming the
    file if bad); a ``sharded`` checkpoint's shards are assembled (:func:`fullband.training.sharded.read_model`)."""
    if _layout(load_trainer_state(path), path) == "sharded":
        load_sharded_index(path)  # every shard file there and readable
        return S.read_model(path)
    return _model_file(path)


def _model_file(path: str) -> dict[str, torch.Tensor]:
    file = os.path.join(path, MODEL_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"checkpoint file {file!r} does not exist")
    try:
        return load_file(file)
    except Exception as err:  # noqa: BLE001 - SafetensorError and OSError alike
        raise _unreadable(file, err) from None


def _numpy_array_globals() -> list:
    """The numpy names an array pickled by ``torch.save`` refers to (``numpy._core`` in numpy 2, ``core`` in 1)."""
    core = getattr(np, "_core", None) or np.core
    names = [np.ndarray, np.dtype, core.multiarray._reconstruct]
    if hasattr(np, "dtypes"):  # numpy >= 1.25 pickles the dtype's class
        names.append(type(np.dtype(np.uint32)))
    return names


def load_legacy_rng(file: str) -> dict:
    """A format-1 RNG file (numpy's state pickled as an array, Python's as a tuple), still loaded weights-only with
    exactly numpy's array reconstruction allowed, converted to :func:`rng_state`'s form."""
    if not os.path.isfile(file):
        raise FileNotFoundError(f"checkpoint file {file!r} does not exist")
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            old = torch.load(file, map_location="cpu", weights_only=True)
        version, mt, gauss = old["python"]
        key, keys, pos, has_gauss, cached = old["numpy"]
        state = {"torch": old["torch"], "prefix": old["prefix"],
                 "python": {"version": int(version), "state": [int(x) for x in mt], "gauss": gauss},
                 "numpy": {"key": str(key), "state": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                           "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    except Exception as err:  # noqa: BLE001 - every failure to read the file is the file's problem
        raise _unreadable(file, err) from None
    if "cuda" in old:
        state["cuda"] = list(old["cuda"])
    return state


def _layout(state: dict, path: str) -> str:
    layout = state.get("layout", "full")
    if layout not in LAYOUTS:
        raise ValueError(f"checkpoint file {os.path.join(path, TRAINER_STATE)!r} names layout {str(layout)[:40]!r}, "
                         f"not one of {', '.join(LAYOUTS)}")
    return layout


def load_checkpoint(path: str, rank: int = 0) -> dict:
    """Everything a resumed run needs from checkpoint ``path``, read and checked before anything is changed:
    ``{"state", "layout", "path", "model", "optimizer", "index", "rng"}``. ``full``: ``model`` and ``optimizer`` are
    the full states, memory-mapped from the files (no private copy in any rank); ``sharded``: ``index`` is the shards' index (every shard file's header read), the tensors are
    read into the built model by :func:`restore_model`. ``rng``: this rank's states; a rank the saving run did not
    have gets the shared prefix-mixing stream of rank 0's file alone (:func:`set_rng_state`)."""
    state = load_trainer_state(path)
    layout = _layout(state, path)
    own = os.path.exists(os.path.join(path, rng_file_name(rank)))
    rng_file = os.path.join(path, rng_file_name(rank if own else 0))
    rng = safe_torch_load(rng_file) if state.get("format", 1) >= FORMAT else load_legacy_rng(rng_file)
    if not isinstance(rng, dict) or not {"torch", "prefix", "python", "numpy"} <= set(rng):
        raise ValueError(f"checkpoint file {rng_file!r} is corrupt (not an RNG state)")
    if not own:
        rng = {"prefix": rng["prefix"]}
    out = {"state": state, "layout": layout, "path": path, "model": None, "optimizer": None, "index": None, "rng": rng}
    if layout == "sharded":
        out["index"] = load_sharded_index(path)
        return out
    # memory-mapped, as safetensors maps the model file: N DDP ranks resuming on one machine share one copy of the
    # checkpoint in the page cache instead of holding N private ones (16 bytes a parameter each for AdamW)
    optimizer = safe_torch_load(os.path.join(path, OPTIMIZER_FILE), mmap=True)
    if not isinstance(optimizer, dict):
        raise ValueError(f"checkpoint file {os.path.join(path, OPTIMIZER_FILE)!r} is corrupt (not an optimizer state)")
    return {**out, "model": _model_file(path), "optimizer": optimizer}


def restore_model(restored: dict, model, optimizer, env: D.DistEnv) -> None:
    """Load what :func:`load_checkpoint` read into the built (wrapped) ``model`` and its ``optimizer``, whatever the
    checkpoint's layout and this run's parallelism."""
    if restored["layout"] == "sharded":
        S.load_sharded(restored["path"], restored["index"], model, optimizer, env)
        return
    D.load_full_model_state(model, restored["model"])
    D.load_full_optimizer_state(model, optimizer, restored["optimizer"])
