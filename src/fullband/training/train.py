"""``fullband train``: train a full-bandwidth model from scratch or retrofit a pretrained checkpoint.

Owns the training recipe and its bookkeeping:

* data: :func:`fullband.data.build_corpus` (embedded corpus by default; text files / folders, jsonl, ``datasets``
  directories), a BPE trained on the training documents or a local tokenizer, packed rows, split by document;
* model: a Llama-style backbone from a size preset (:mod:`fullband.presets`), or ``--init-from DIR`` (a local HF
  causal LM, retrofitted; or a saved fullband model, continued);
* recipe: AdamW (fused where available) with the fusion weights in their own parameter groups (``--fusion-lr-mult``),
  no weight decay on 1-D parameters; warmup + cosine, WSD or constant LR; grad clipping and accumulation; bf16
  autocast where supported; the feedback schedule (:class:`fullband.FeedbackSchedule`: plain steps before
  ``--feedback-start``, then K = ``--num-passes``, a ``--deep-fraction`` of steps at ``--deep-passes``), per-document
  prefix mixing and jitter on the fed-back state;
* the stability guard: a step whose loss or gradient norm is NaN/inf, or whose pass-1 loss exceeds
  ``--spike-factor`` × its running average, is skipped and logged; ``--max-bad-steps`` in a row stop the run
  (exit code 3) and leave the last good checkpoint as it was;
* checkpoints (``OUT/checkpoints/step-NNNNNNN/``, written under a temporary name then renamed, ``latest`` updated
  atomically afterwards): safetensors weights, optimiser, every rank's RNG states, the prefix-mixing generator,
  the data position, the guard state and the run's config. ``--resume`` continues a run so that it logs the same
  per-step losses as an uninterrupted one (bitwise on CPU in fp32, same number of processes);
* distributed: the same command under ``torchrun --nproc_per_node N`` (DDP; ``--parallel fsdp`` for FSDP2), the
  global batch split over the ranks;
* logging: ``OUT/metrics.jsonl`` (one JSON object per step: ``step``, ``loss``, ``pass_losses``, ``num_passes``,
  ``lr``, ``grad_norm``, ``tokens``, ...; validation rows have ``split: "val"`` and ``val_loss``), a progress bar
  (tokens/s, loss per pass, ETA), TensorBoard under ``OUT/tb`` when installed, ``OUT/curves.png`` at the end;
* output: the final model (``save_pretrained``) and its tokenizer in ``OUT`` itself, loadable with
  ``AutoModelForCausalLM.from_pretrained(OUT)`` (after ``import fullband``) and by ``fullband generate``.

Also :func:`benchmark_train` (``fullband bench train``): step time and tokens/s for K = 1, K = 2 and K = 2 with a
stop-gradient state.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ..training import distributed as D
from ..utils.io import append_jsonl, atomic_save_pretrained, atomic_write_json, atomic_write_text, read_jsonl, rewrite_jsonl

LR_SCHEDULES = ("cosine", "wsd", "constant")
PRECISIONS = ("auto", "fp32", "bf16")
EXIT_STOPPED = 3


# ============================================================================================== config


def _f(default, help, *, traj=True, branch=False, hidden=False, cli=True, **kw):
    """A config field: ``traj`` = changing it changes the training trajectory (refused on --resume);
    ``branch`` = a feedback setting that may change on --resume while the checkpoint precedes the feedback start."""
    meta = {"help": help, "traj": traj, "branch": branch, "hidden": hidden, "cli": cli, **kw}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Every option of ``fullband train`` (the CLI flags are these names with dashes)."""

    # ---- run
    out: str | None = _f(None, "output directory: checkpoints, metrics.jsonl, the final model and tokenizer", traj=False, group="run")
    steps: int = _f(200, "optimizer steps (the LR and feedback schedules are fractions of this)", group="run")
    seed: int = _f(0, "seed of the model init, data split and order, prefix mixing and jitter", group="run")
    save_every: int = _f(0, "write a checkpoint every N steps (0: only when stopping early); the last --keep-checkpoints are kept", traj=False, group="run")
    keep_checkpoints: int = _f(1, "how many checkpoints to keep", traj=False, group="run")
    stop_after: int | None = _f(None, "stop cleanly after this step, writing a checkpoint (continue later with --resume; not remembered by it)", traj=False, persist=False, group="run")
    # ---- data
    data: str = _f("shakespeare", "training text: 'shakespeare' (embedded corpus), a text file, a folder, a .jsonl with a 'text' field, or a datasets directory", group="data")
    tokenizer: str | None = _f(None, "local HF tokenizer directory (default: train a byte-level BPE on the training documents; with --init-from, that checkpoint's tokenizer)", group="data")
    vocab_size: int = _f(4096, "vocabulary size of a BPE trained here", group="data")
    seq_len: int = _f(256, "tokens per packed row", group="data")
    val_fraction: float = _f(0.1, "fraction of documents held out for validation", group="data")
    batch_size: int = _f(16, "global batch in rows per optimizer step (split over processes and --grad-accum micro-batches)", group="data")
    grad_accum: int = _f(1, "micro-batches per optimizer step (per process)", group="data")
    data_offset: int = _f(0, "skip the first N batches of the data order (continue where an --init-from run stopped reading)", group="data")
    # ---- model
    preset: str = _f("tiny", "backbone size from scratch: tiny (~3M), small (~25M), gpt2-small (~125M at a 50k vocabulary); micro (d64, tests)", group="model")
    init_from: str | None = _f(None, "local HF causal-LM checkpoint to retrofit (or a fullband model to continue) instead of a preset", group="model")
    fusion: str = _f("glu", "fusion of h_{t-1} and e_t: glu (paper), concat, add", group="model")
    feedback_weight: float = _f(1.0, "lambda in loss = L_1 + lambda * mean(L_2..L_K)", branch=True, group="model")
    jitter: float = _f(0.02, "uniform noise on the fed-back state, +-jitter * RMS(state)", branch=True, group="model")
    detach_state: bool = _f(False, "stop gradients through the fed-back state (cheaper; not in the paper)", branch=True, group="model")
    # ---- optimisation
    lr: float | None = _f(None, "peak learning rate (default: the preset's, 3e-4 with --init-from)", group="optim")
    min_lr_ratio: float = _f(0.1, "final LR as a fraction of the peak", group="optim")
    lr_schedule: str = _f("cosine", "cosine, wsd (warmup-stable-decay) or constant", group="optim")
    warmup_fraction: float = _f(0.05, "fraction of steps of linear warmup", group="optim")
    decay_fraction: float = _f(0.2, "WSD: fraction of steps of the final linear decay", group="optim")
    weight_decay: float = _f(0.1, "AdamW weight decay (matrices only)", group="optim")
    beta1: float = _f(0.9, "AdamW beta1", group="optim")
    beta2: float = _f(0.95, "AdamW beta2", group="optim")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0: no clipping)", group="optim")
    fusion_lr_mult: float = _f(1.0, "LR multiplier of the fusion weights' parameter groups", branch=True, group="optim")
    fusion_warmup: float = _f(0.0, "fraction of the feedback phase over which the fusion LR warms up linearly from 0", branch=True, group="optim")
    clip_per_group: bool = _f(False, "clip the backbone's and the fusion's gradient norms separately (each to --grad-clip)", branch=True, group="optim")
    precision: str = _f("auto", "auto (bf16 autocast on a GPU that supports it, else fp32), fp32 or bf16", group="optim")
    # ---- feedback schedule
    num_passes: int = _f(2, "K once feedback is on (1: a plain baseline)", branch=True, group="feedback")
    feedback_start: float = _f(0.75, "fraction of the steps trained plain before feedback switches on", branch=True, group="feedback")
    deep_passes: int = _f(4, "K of the deep steps", branch=True, group="feedback")
    deep_fraction: float = _f(0.1, "fraction of the feedback steps that use --deep-passes", branch=True, group="feedback")
    prefix_mix: float = _f(0.25, "probability that a document keeps a random plain prefix on feedback steps", branch=True, group="feedback")
    feedback_ramp: float = _f(0.0, "fraction of the feedback phase over which lambda ramps linearly from 0 to --feedback-weight", branch=True, group="feedback")
    fusion_only: float = _f(0.0, "fraction of the feedback phase, at its start, in which only the fusion trains (backbone frozen)", branch=True, group="feedback")
    # ---- stability guard
    spike_factor: float = _f(3.0, "skip a step whose pass-1 loss exceeds this times its running average (0: off)", group="guard")
    max_bad_steps: int = _f(5, "stop after this many skipped steps in a row", traj=False, group="guard")
    # ---- evaluation and logging
    eval_every: int = _f(0, "validation loss every N steps (0: ten times per run)", traj=False, group="log")
    eval_rows: int = _f(32, "validation rows used by the periodic evaluation", traj=False, group="log")
    progress: bool = _f(True, "progress bar (tokens/s, loss per pass, ETA)", traj=False, group="log")
    tensorboard: bool = _f(True, "TensorBoard logs under OUT/tb when tensorboard is installed", traj=False, group="log")
    plot: bool = _f(True, "write OUT/curves.png at the end", traj=False, group="log")
    # ---- hardware
    device: str = _f("auto", "auto, cpu, cuda or cuda:N", traj=False, group="hw")
    parallel: str = _f("ddp", "under torchrun: ddp, or fsdp (FSDP2, for large models)", traj=False, group="hw")
    # ---- test hooks (hidden)
    debug_nan_steps: list = _f([], "", traj=False, hidden=True)
    debug_kill_at_step: int | None = _f(None, "", traj=False, hidden=True)

    # -------------------------------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def schedule(self):
        from ..model.objective import FeedbackSchedule

        # --num-passes 1 is a plain baseline: no deep steps either
        return FeedbackSchedule(start_fraction=self.feedback_start, num_passes=self.num_passes,
                                deep_passes=self.deep_passes,
                                deep_fraction=self.deep_fraction if self.num_passes > 1 else 0.0)

    def switch_on(self):
        from ..model.objective import SwitchOn

        return SwitchOn(feedback_ramp=self.feedback_ramp, fusion_warmup=self.fusion_warmup, fusion_only=self.fusion_only)

    @property
    def feedback_ever(self) -> bool:
        sched = self.schedule()
        return sched.start_step(self.steps) < self.steps and max(sched.num_passes, sched.deep_passes if sched.deep_fraction > 0 else 1) > 1

    def resolved_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        if self.init_from:
            return 3e-4
        from .presets import get_preset

        return get_preset(self.preset).lr

    def validate(self, world_size: int = 1) -> "TrainConfig":
        """Raise ``ValueError`` for any bad value (before anything is written)."""
        from ..model.feedback import check_fusion_name
        from .presets import get_preset

        def need(cond, msg):
            if not cond:
                raise ValueError(msg)

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            t = f.type if isinstance(f.type, str) else str(f.type)
            if v is None:
                need("None" in t, f"--{_flag(f.name)} must be given")
                continue
            if t.startswith("int"):
                need(isinstance(v, int) and not isinstance(v, bool), f"--{_flag(f.name)} must be an integer, got {v!r}")
            elif t.startswith("float"):
                need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                     f"--{_flag(f.name)} must be a number, got {v!r}")
            elif t.startswith("bool"):
                need(isinstance(v, bool), f"--{_flag(f.name)} must be true or false, got {v!r}")
            elif t.startswith("str"):
                need(isinstance(v, str), f"--{_flag(f.name)} must be a string, got {v!r}")
        need(self.out is not None and str(self.out).strip() != "", "--out DIR is required")
        need(self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        need(self.save_every >= 0, f"--save-every must be >= 0, got {self.save_every}")
        need(self.keep_checkpoints >= 1, f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")
        need(self.stop_after is None or 1 <= self.stop_after, f"--stop-after must be >= 1, got {self.stop_after}")
        need(self.vocab_size >= 300, f"--vocab-size must be >= 300, got {self.vocab_size}")
        need(self.seq_len >= 2, f"--seq-len must be >= 2, got {self.seq_len}")
        need(0.0 <= self.val_fraction < 1.0, f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        need(self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}")
        need(self.data_offset >= 0, f"--data-offset must be >= 0, got {self.data_offset}")
        need(self.batch_size % (world_size * self.grad_accum) == 0,
             f"--batch-size {self.batch_size} must be divisible by processes x --grad-accum = {world_size} x {self.grad_accum}")
        if self.init_from is None:
            get_preset(self.preset)
        check_fusion_name(self.fusion)
        need(self.feedback_weight >= 0, f"--feedback-weight must be >= 0, got {self.feedback_weight}")
        need(self.jitter >= 0, f"--jitter must be >= 0, got {self.jitter}")
        need(self.lr is None or self.lr > 0, f"--lr must be > 0, got {self.lr}")
        need(0.0 <= self.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        need(self.lr_schedule in LR_SCHEDULES, f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        need(0.0 <= self.warmup_fraction < 1.0, f"--warmup-fraction must be in [0, 1), got {self.warmup_fraction}")
        need(0.0 <= self.decay_fraction <= 1.0, f"--decay-fraction must be in [0, 1], got {self.decay_fraction}")
        need(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        need(0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0, "--beta1 and --beta2 must be in [0, 1)")
        need(self.grad_clip >= 0, f"--grad-clip must be >= 0, got {self.grad_clip}")
        need(self.fusion_lr_mult >= 0, f"--fusion-lr-mult must be >= 0, got {self.fusion_lr_mult}")
        need(self.precision in PRECISIONS, f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        need(0.0 <= self.prefix_mix <= 1.0, f"--prefix-mix must be in [0, 1], got {self.prefix_mix}")
        for name in ("fusion_warmup", "feedback_ramp", "fusion_only"):
            v = getattr(self, name)
            need(0.0 <= v <= 1.0, f"--{_flag(name)} must be in [0, 1], got {v}")
        self.schedule()  # start fraction, passes, deep fraction
        need(self.spike_factor == 0 or self.spike_factor > 1, f"--spike-factor must be 0 (off) or > 1, got {self.spike_factor}")
        need(self.max_bad_steps >= 1, f"--max-bad-steps must be >= 1, got {self.max_bad_steps}")
        need(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        need(self.eval_rows >= 1, f"--eval-rows must be >= 1, got {self.eval_rows}")
        need(self.parallel in D.PARALLEL_MODES, f"--parallel must be one of {', '.join(D.PARALLEL_MODES)}, got {self.parallel!r}")
        D.resolve_device(self.device)
        need(isinstance(self.debug_nan_steps, list) and all(isinstance(s, int) for s in self.debug_nan_steps),
             "debug_nan_steps must be a list of step numbers")
        if self.init_from is not None and not os.path.isdir(self.init_from):
            raise FileNotFoundError(f"--init-from directory {self.init_from!r} does not exist")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise FileNotFoundError(f"--tokenizer directory {self.tokenizer!r} does not exist")
        if self.data not in (None, "shakespeare") and not os.path.exists(self.data):
            raise FileNotFoundError(f"--data {self.data!r} does not exist (a text file, folder, .jsonl, datasets "
                                    "directory, or 'shakespeare')")
        return self


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _field_map() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TrainConfig)}


def read_config_file(path: str) -> dict:
    """Options from a YAML or TOML file (keys as on the command line, with dashes or underscores)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".toml"):
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise ValueError("TOML config files need Python 3.11+ (or `pip install tomli`); use a YAML file") from None
    try:
        if path.endswith(".toml"):
            data = tomllib.loads(raw.decode("utf-8"))
        else:
            import yaml

            data = yaml.safe_load(raw.decode("utf-8"))
    except Exception as err:  # noqa: BLE001 - any parse error is a user error
        raise ValueError(f"config file {path!r} could not be parsed: {str(err).splitlines()[0]}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of option names to values")
    if isinstance(data.get("train"), dict) and len(data) == 1:
        data = data["train"]
    fields_ = _field_map()
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in fields_ or fields_[name].metadata.get("hidden"):
            raise ValueError(f"config file {path!r}: unknown option {key!r}")
        out[name] = value
    return out


def make_config(explicit: dict, config_file: str | None = None, base: dict | None = None) -> TrainConfig:
    """Defaults < ``base`` (a resumed run's saved config) < config file < explicit command-line options."""
    values = TrainConfig().to_dict()
    for layer in (base or {}), (read_config_file(config_file) if config_file else {}), explicit:
        for k, v in layer.items():
            if k in values:
                values[k] = v
    # ints written as floats in a file (1e3) are accepted when integral
    for name, f in _field_map().items():
        v = values[name]
        if str(f.type).startswith("int") and isinstance(v, float) and v.is_integer():
            values[name] = int(v)
    return TrainConfig(**values)


def trajectory_diff(old: TrainConfig, new: TrainConfig) -> tuple[list[str], list[str]]:
    """(fields that change the trajectory, feedback fields among them)."""
    diff, branch = [], []
    for f in dataclasses.fields(TrainConfig):
        if not f.metadata["traj"]:
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        if f.name == "lr":
            a, b = old.resolved_lr(), new.resolved_lr()
        if a != b:
            (branch if f.metadata["branch"] else diff).append(f.name)
    return diff, branch


# ============================================================================================== schedule


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of 0-based ``step``."""
    peak, floor, n = cfg.resolved_lr(), cfg.resolved_lr() * cfg.min_lr_ratio, cfg.steps
    warm = max(1, round(cfg.warmup_fraction * n)) if cfg.warmup_fraction > 0 else 0
    if step < warm:
        return peak * (step + 1) / warm
    if cfg.lr_schedule == "constant":
        return peak
    if cfg.lr_schedule == "cosine":
        progress = (step - warm) / max(1, n - warm - 1)
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    decay_start = max(warm, n - round(cfg.decay_fraction * n))
    if step < decay_start:
        return peak
    progress = (step - decay_start + 1) / max(1, n - decay_start)
    return peak + (floor - peak) * min(1.0, progress)


# ============================================================================================== building


def build_tokenizer_and_corpus(cfg: TrainConfig, tokenizer=None):
    from ..data.corpus import build_corpus, load_tokenizer

    if tokenizer is None:
        path = cfg.tokenizer
        if path is None and cfg.init_from is not None:
            if not any(os.path.exists(os.path.join(cfg.init_from, n)) for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
                raise ValueError(f"--init-from {cfg.init_from!r} holds no tokenizer; give its tokenizer with --tokenizer DIR")
            path = cfg.init_from
        if path is not None:
            tokenizer = load_tokenizer(path)
    return build_corpus(cfg.data, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, val_fraction=cfg.val_fraction,
                        seed=cfg.seed, tokenizer=tokenizer)


def build_model(cfg: TrainConfig, tokenizer):
    """The model to train (fp32 weights), seeded by ``cfg.seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..model.configuration import FullBandwidthConfig
    from ..data.corpus import special_ids
    from ..model.modeling import FullBandwidthForCausalLM, load_model
    from .presets import backbone_config

    bos, eos = special_ids(tokenizer)
    pad = tokenizer.pad_token_id
    feedback = dict(feedback_weight=float(cfg.feedback_weight), jitter=float(cfg.jitter), detach_state=cfg.detach_state)
    torch.manual_seed(cfg.seed)
    if cfg.init_from is not None:
        try:
            model_type = AutoConfig.from_pretrained(cfg.init_from).model_type
        except (OSError, ValueError) as err:
            raise ValueError(f"--init-from {cfg.init_from!r} is not a loadable HF checkpoint: {str(err).splitlines()[0]}") from None
        if model_type == FullBandwidthConfig.model_type:
            model = load_model(cfg.init_from, dtype=torch.float32)
            if model.config.fusion != cfg.fusion:
                raise ValueError(f"--init-from holds a fullband model with fusion {model.config.fusion!r}; "
                                 f"--fusion {cfg.fusion!r} cannot change it")
            for k, v in feedback.items():
                setattr(model.config, k, v)
        else:
            backbone = AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
            model = FullBandwidthForCausalLM.from_backbone(backbone, fusion=cfg.fusion, doc_start_token_id=bos, **feedback)
        vocab = model.get_input_embeddings().num_embeddings
        if len(tokenizer) > vocab:
            raise ValueError(f"the tokenizer has {len(tokenizer)} entries but the model's vocabulary only {vocab}; "
                             "give the checkpoint's own tokenizer with --tokenizer")
    else:
        config = backbone_config(cfg.preset, len(tokenizer), bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                                 max_position_embeddings=max(2048, cfg.seq_len))
        backbone = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = FullBandwidthForCausalLM.from_backbone(backbone, fusion=cfg.fusion, doc_start_token_id=bos, **feedback)
    return model.float()


def param_groups(model, cfg: TrainConfig) -> list[dict]:
    """Backbone / fusion × decay / no-decay (1-D parameters: norms, biases, get no weight decay)."""
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        fusion = name.startswith("feedback.")
        decay = p.dim() >= 2
        key = ("fusion" if fusion else "backbone", decay)
        groups.setdefault(key, []).append(p)
    out = []
    for (kind, decay), params in sorted(groups.items()):
        out.append({"params": params, "name": f"{kind}{'' if decay else '_no_decay'}",
                    "weight_decay": cfg.weight_decay if decay else 0.0,
                    "lr_mult": cfg.fusion_lr_mult if kind == "fusion" else 1.0})
    return out


def build_optimizer(model, cfg: TrainConfig, device: torch.device, sharded: bool = False) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg)
    kwargs = dict(lr=cfg.resolved_lr(), betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    if not sharded and device.type in ("cuda", "cpu"):
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            pass
    return torch.optim.AdamW(groups, **kwargs)


def autocast_context(precision: str, device: torch.device):
    if precision == "auto":
        use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    else:
        use_bf16 = precision == "bf16"
    if not use_bf16:
        return nullcontext, "fp32"
    return (lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)), "bf16"


# ============================================================================================== the step


def feedback_mask_for(batch: torch.Tensor, doc_start_id: int | None, prefix_mix: float,
                      generator: torch.Generator) -> torch.Tensor:
    """Feedback mask of a global batch with prefix mixing (draws from ``generator``)."""
    from ..model.feedback import build_feedback_mask, document_starts, prefix_mixing_mask

    mask = build_feedback_mask(batch, None, doc_start_id)
    if prefix_mix > 0:
        mask &= ~prefix_mixing_mask(document_starts(batch, doc_start_id), prefix_mix, generator)
    return mask


def forward_backward(model, micro_batches, num_passes: int, autocast, nan: bool = False,
                     feedback_weight: float | None = None):
    """Forward + backward over micro-batches (each ``(ids, feedback_mask)``); returns summed
    ``(loss, pass_losses)`` tensors (divide by the number of micro-batches for the mean). ``feedback_weight``
    overrides the model's λ for these calls."""
    n = len(micro_batches)
    loss_sum, pass_sum = None, None
    for i, (ids, mask) in enumerate(micro_batches):
        with D.no_sync(model, skip=i < n - 1), autocast():
            out = model(input_ids=ids, labels=ids, num_passes=num_passes, feedback_mask=mask,
                        feedback_weight=feedback_weight)
            loss = out.loss
            if nan:
                loss = loss * float("nan")
        (loss / n).backward()
        ls, ps = loss.detach().float(), out.pass_losses.float()
        if nan:
            ps = ps * float("nan")
        loss_sum = ls if loss_sum is None else loss_sum + ls
        pass_sum = ps if pass_sum is None else pass_sum + ps
    return loss_sum, pass_sum


def clip_gradients(params: list, max_norm: float) -> float:
    """Clip the gradient norm of ``params`` to ``max_norm`` (0: no clipping); returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _fusion_was_trained(cfg: TrainConfig) -> bool:
    """Whether the run starts from a fullband checkpoint, whose fusion may already be trained."""
    if cfg.init_from is None:
        return False
    try:
        with open(os.path.join(cfg.init_from, "config.json")) as f:
            return json.load(f).get("model_type") == "fullband"
    except (OSError, ValueError):
        return False


# ============================================================================================== checkpoints

CKPT_DIR = "checkpoints"
LATEST = "latest"
METRICS = "metrics.jsonl"
TOKENIZER_DIR = "tokenizer"
RUN_CONFIG = "run_config.json"
# what --overwrite removes (only these names, never anything else in OUT)
RUN_OUTPUTS = (CKPT_DIR, METRICS, "tb", "curves.png", RUN_CONFIG, TOKENIZER_DIR, "summary.json", "config.json",
               "generation_config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def find_checkpoint(out: str) -> str | None:
    """The newest complete checkpoint of a run (``latest``, else the highest ``step-*``), or ``None``."""
    root = os.path.join(out, CKPT_DIR)
    if not os.path.isdir(root):
        return None
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
        path = os.path.join(root, name)
        if name and os.path.isfile(os.path.join(path, "trainer_state.json")):
            return path
    except OSError:
        pass
    cands = sorted(n for n in os.listdir(root) if n.startswith("step-")
                   and os.path.isfile(os.path.join(root, n, "trainer_state.json")))
    return os.path.join(root, cands[-1]) if cands else None


def _dedupe_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen, out = set(), {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key in seen:
            continue
        seen.add(key)
        out[k] = v.contiguous()
    return out


def _rng_state(generator: torch.Generator) -> dict:
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
             "prefix": generator.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict, generator: torch.Generator) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    generator.set_state(state["prefix"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run: "Run", step: int) -> str:
    """Every rank calls this (the state dicts are collective under FSDP); rank 0 writes the shared files."""
    from safetensors.torch import save_file

    env = run.env
    model_state = D.full_model_state(run.model)
    optim_state = D.full_optimizer_state(run.model, run.optimizer)
    root = os.path.join(run.cfg.out, CKPT_DIR)
    name = _step_dir_name(step)
    tmp = None
    if env.is_main:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=root)
    tmp = D.broadcast_object(tmp, env)
    torch.save(_rng_state(run.prefix_gen), os.path.join(tmp, f"rng-rank{env.rank}.pt"))
    D.barrier(env)
    if env.is_main:
        save_file(_dedupe_shared(model_state), os.path.join(tmp, "model.safetensors"))
        torch.save(optim_state, os.path.join(tmp, "optimizer.pt"))
        state = {"format": 1, "step": step, "tokens": step * run.cfg.batch_size * run.cfg.seq_len,
                 "elapsed": run.elapsed(), "world_size": env.world_size, "guard": run.guard.to_dict(),
                 "config": run.cfg.to_dict(), "data_position": {"next_batch": step, "seed": run.cfg.seed},
                 "schedule": _schedule_state(run.cfg, step)}
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state, f, indent=2)
        for n in os.listdir(tmp):
            with open(os.path.join(tmp, n), "rb") as fh:
                os.fsync(fh.fileno())
        final = os.path.join(root, name)
        if os.path.exists(final):  # re-saving the same step (a resumed run that stopped again)
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(os.path.join(root, LATEST), name + "\n")
        keep = sorted(n for n in os.listdir(root) if n.startswith("step-"))
        for old in keep[:-run.cfg.keep_checkpoints]:
            if old != name:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    D.barrier(env)
    return os.path.join(root, name)


def _schedule_state(cfg: TrainConfig, step: int) -> dict:
    """Where the (stateless, step-indexed) LR and feedback schedules stand: for people and tools reading the
    checkpoint; a resumed run recomputes them from the step and the config."""
    sched = cfg.schedule()
    nxt = min(step, cfg.steps - 1)
    return {"next_step": step, "total_steps": cfg.steps, "next_lr": lr_at(nxt, cfg),
            "next_num_passes": sched.passes_at(nxt, cfg.steps), "feedback_start_step": sched.start_step(cfg.steps),
            "lr_schedule": cfg.lr_schedule, "feedback": sched.to_dict()}


def load_checkpoint_state(path: str) -> dict:
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


# ============================================================================================== guard


@dataclass
class Guard:
    """Skips NaN/inf and spiking steps; counts them."""

    spike_factor: float = 3.0
    warmup: int = 10
    beta: float = 0.9
    ema: float | None = None
    good_steps: int = 0
    bad_in_row: int = 0
    skipped: int = 0

    def check(self, loss: float, first_pass: float, grad_norm: float | None) -> str | None:
        if not math.isfinite(loss) or not math.isfinite(first_pass):
            return "non-finite loss"
        if grad_norm is not None and not math.isfinite(grad_norm):
            return "non-finite gradient"
        if (self.spike_factor > 0 and self.ema is not None and self.good_steps >= self.warmup
                and first_pass > self.spike_factor * self.ema):
            return f"loss spike ({first_pass:.3f} > {self.spike_factor:g} x running {self.ema:.3f})"
        return None

    def good(self, first_pass: float) -> None:
        self.ema = first_pass if self.ema is None else self.beta * self.ema + (1 - self.beta) * first_pass
        self.good_steps += 1
        self.bad_in_row = 0

    def bad(self) -> None:
        self.bad_in_row += 1
        self.skipped += 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ============================================================================================== the run


@dataclass
class Run:
    cfg: TrainConfig
    env: D.DistEnv
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    prefix_gen: torch.Generator
    guard: Guard
    t_start: float = 0.0
    elapsed_before: float = 0.0

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t_start


class _Log:
    """Rank 0's sinks: metrics.jsonl, TensorBoard, the progress bar."""

    def __init__(self, cfg: TrainConfig, env: D.DistEnv, start_step: int, name: str):
        self.main = env.is_main
        self.path = os.path.join(cfg.out, METRICS)
        self.tb = None
        self.bar = None
        if not self.main:
            return
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(cfg.out, "tb"), purge_step=start_step + 1)
            except Exception:  # noqa: BLE001 - tensorboard not installed or unusable: skip it
                self.tb = None
        if cfg.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=cfg.steps, initial=start_step, desc=name, unit="step", dynamic_ncols=True,
                            file=sys.stderr, smoothing=0.1)

    def record(self, rec: dict) -> None:
        if not self.main:
            return
        append_jsonl(self.path, rec)
        if self.tb is not None:
            step = rec["step"]
            if rec.get("split") == "val":
                for k in ("val_loss", "val_loss_passes"):
                    if rec.get(k) is not None:
                        self.tb.add_scalar(f"val/{k}", rec[k], step)
            elif not rec.get("skipped"):
                self.tb.add_scalar("train/loss", rec["loss"], step)
                for i, v in enumerate(rec["pass_losses"], 1):
                    self.tb.add_scalar(f"train/pass_{i}", v, step)
                self.tb.add_scalar("train/lr", rec["lr"], step)
                self.tb.add_scalar("train/grad_norm", rec["grad_norm"], step)
                self.tb.add_scalar("train/tokens_per_s", rec["tokens_per_s"], step)

    def progress(self, rec: dict, tok_s: float) -> None:
        if self.bar is None:
            return
        post = {"K": rec.get("num_passes")}
        if rec.get("skipped"):
            post["skipped"] = rec["skipped"][:20]
        else:
            for i, v in enumerate(rec["pass_losses"], 1):
                post[f"L{i}"] = f"{v:.3f}"
        post["lr"] = f"{rec['lr']:.2e}"
        post["tok/s"] = f"{tok_s:,.0f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def write(self, msg: str) -> None:
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def _clean(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _prepare_out(cfg: TrainConfig, resume: bool, overwrite: bool, env: D.DistEnv) -> str | None:
    """Check the output directory (before anything is written); return the checkpoint to resume from."""
    out = cfg.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(f"--out {out!r} exists and is not a directory")
    ckpt = find_checkpoint(out) if os.path.isdir(out) else None
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


def _clear_outputs(out: str) -> None:
    for n in RUN_OUTPUTS:
        p = os.path.join(out, n)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)


def spread_rows(rows: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` rows spread evenly over ``rows`` (all when there are fewer): every held-out document gets its share,
    where the first ``n`` rows would all come from the first document."""
    if n >= rows.shape[0]:
        return rows
    return rows[torch.linspace(0, rows.shape[0] - 1, n).round().long()]


def _evaluate(run: Run, val_rows: torch.Tensor, step: int, start_step_fb: int) -> dict | None:
    from ..eval.scoring import evaluate_loss

    if val_rows.shape[0] == 0:
        return None
    model = D.unwrap(run.model)
    rows = spread_rows(val_rows, run.cfg.eval_rows)
    rec = {"step": step, "split": "val", "tokens": step * run.cfg.batch_size * run.cfg.seq_len,
           "val_loss": evaluate_loss(model, rows, "standard", batch_size=max(1, run.cfg.batch_size // run.env.world_size))["loss"],
           "val_tokens": rows[:, 1:].numel()}
    if run.cfg.num_passes > 1 and step > start_step_fb:
        rec["val_loss_passes"] = evaluate_loss(model, rows, "passes", num_passes=run.cfg.num_passes,
                                               batch_size=max(1, run.cfg.batch_size // run.env.world_size))["loss"]
        rec["val_num_passes"] = run.cfg.num_passes
    return rec


def train(cfg: TrainConfig, resume: bool = False, overwrite: bool = False, corpus=None, name: str = "train") -> dict:
    """Run (or continue) training as ``cfg`` says; returns a summary dict (``status`` = ``done`` / ``stopped`` /
    ``paused``). ``corpus`` (a :class:`fullband.data.Corpus`) skips loading and tokenizing the data."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    env = D.init_distributed(cfg.device)
    try:
        return _train(cfg, env, resume, overwrite, corpus, name)
    finally:
        D.shutdown(env)


def _train(cfg: TrainConfig, env: D.DistEnv, resume: bool, overwrite: bool, corpus, name: str) -> dict:
    from safetensors.torch import load_file

    from ..data.corpus import load_tokenizer

    cfg.validate(env.world_size)
    ckpt = _prepare_out(cfg, resume, overwrite, env)
    saved = None
    if ckpt is not None:
        saved = load_checkpoint_state(ckpt)
        old = TrainConfig(**{k: v for k, v in saved["config"].items() if k in TrainConfig.field_names()})
        diff, branch = trajectory_diff(old, cfg)
        if diff:
            raise ValueError(f"--resume: {', '.join('--' + _flag(d) for d in diff)} differ from the checkpoint's run; "
                             "a resumed run must keep them (start a new --out to change them)")
        if branch:
            c = saved["step"]
            if c > old.schedule().start_step(old.steps) or c > cfg.schedule().start_step(cfg.steps):
                raise ValueError(f"--resume: {', '.join('--' + _flag(d) for d in branch)} differ from the checkpoint's "
                                 "run; feedback settings may only change while the checkpoint precedes the feedback start")
        if saved["world_size"] != env.world_size and env.is_main:
            print(f"warning: the checkpoint was written by {saved['world_size']} process(es), this run has "
                  f"{env.world_size}; per-rank jitter streams differ, so the run will not be bitwise identical",
                  file=sys.stderr)

    # ---- data and tokenizer (nothing written yet: a bad --data / --tokenizer fails here)
    tok_dir = os.path.join(cfg.out, TOKENIZER_DIR)
    if corpus is None:
        tokenizer = load_tokenizer(tok_dir) if (ckpt is not None and os.path.isdir(tok_dir)) else None
        corpus = build_tokenizer_and_corpus(cfg, tokenizer)
    tokenizer = corpus.tokenizer
    train_rows, val_rows = corpus.train_rows, corpus.val_rows
    if train_rows.shape[1] != cfg.seq_len:
        raise ValueError(f"the corpus has rows of {train_rows.shape[1]} tokens but --seq-len is {cfg.seq_len}")
    model = build_model(cfg, tokenizer)

    # ---- the output directory: from here on things are written
    if env.is_main:
        if overwrite and ckpt is None:
            _clear_outputs(cfg.out)
        os.makedirs(cfg.out, exist_ok=True)
        if not os.path.isdir(tok_dir):
            atomic_save_pretrained(tokenizer, tok_dir)
        atomic_write_json(os.path.join(cfg.out, RUN_CONFIG), cfg.to_dict())
    D.barrier(env)

    model.to(env.device).train()
    model = D.wrap_model(model, env, cfg.parallel) if env.distributed else model
    sharded = D.is_sharded(D.unwrap(model))
    optimizer = build_optimizer(D.unwrap(model), cfg, env.device, sharded)
    prefix_gen = torch.Generator().manual_seed(cfg.seed * 7919 + 17)
    # every rank its own jitter stream; model init above used the shared seed
    torch.manual_seed(cfg.seed * 1_000_003 + 1 + env.rank)
    random.seed(cfg.seed + env.rank)
    guard = Guard(spike_factor=cfg.spike_factor)
    run = Run(cfg, env, model, optimizer, prefix_gen, guard)
    start = 0
    if ckpt is not None:
        D.load_full_model_state(model, load_file(os.path.join(ckpt, "model.safetensors")))
        D.load_full_optimizer_state(model, optimizer, torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=False))
        # the saved groups carry the old run's options (lr_mult among them); options allowed to change win
        for group, fresh in zip(optimizer.param_groups, param_groups(D.unwrap(model), cfg)):
            group["lr_mult"] = fresh["lr_mult"]
        rng_file = os.path.join(ckpt, f"rng-rank{env.rank}.pt")
        if not os.path.exists(rng_file):
            rng_file = os.path.join(ckpt, "rng-rank0.pt")
        _set_rng_state(torch.load(rng_file, weights_only=False), prefix_gen)
        g = saved["guard"]
        run.guard = guard = Guard(spike_factor=cfg.spike_factor, **{k: v for k, v in g.items() if k != "spike_factor"})
        start = saved["step"]
        run.elapsed_before = saved.get("elapsed", 0.0)
        if env.is_main:  # forget what a killed run logged after its checkpoint
            rewrite_jsonl(os.path.join(cfg.out, METRICS),
                          [r for r in read_jsonl(os.path.join(cfg.out, METRICS)) if r.get("step", 0) <= start])
    D.barrier(env)

    sched = cfg.schedule()
    fb_start = sched.start_step(cfg.steps)
    doc_id = D.unwrap(model).config.doc_start_token_id
    autocast, precision = autocast_context(cfg.precision, env.device)
    per_rank = cfg.batch_size // env.world_size
    micro = per_rank // cfg.grad_accum
    tokens_per_step = cfg.batch_size * cfg.seq_len
    eval_every = cfg.eval_every or max(1, cfg.steps // 10)
    switch_on = cfg.switch_on()
    fusion_params = [p for n, p in D.unwrap(model).named_parameters() if n.startswith("feedback.")]
    fusion_ids = {id(p) for p in fusion_params}
    backbone_params = [p for p in model.parameters() if p.requires_grad and id(p) not in fusion_ids]
    all_params = [p for p in model.parameters() if p.requires_grad]
    # a fusion built at step 0 (from scratch, or retrofitted onto a plain checkpoint) is re-initialised when
    # feedback switches on, at the scale the embeddings have by then
    fresh_fusion = cfg.feedback_ever and fb_start > 0 and not _fusion_was_trained(cfg)
    log = _Log(cfg, env, start, name)
    if env.is_main and start == 0:
        n_params = sum(p.numel() for p in D.unwrap(model).parameters())
        log.write(f"{name}: {n_params / 1e6:.2f}M parameters, {train_rows.shape[0]} train rows x {cfg.seq_len} "
                  f"tokens ({train_rows.numel():,}), {val_rows.shape[0]} val rows; {cfg.steps} steps x "
                  f"{tokens_per_step:,} tokens, "
                  + (f"feedback from step {fb_start + 1} (K={cfg.num_passes}), " if cfg.feedback_ever else "no feedback (K=1), ")
                  + f"{env.world_size} process(es), {precision}, device {env.device}")
    run.t_start = time.perf_counter()
    status, message, last_ckpt = "done", "", ckpt
    stop_at = min(cfg.steps, cfg.stop_after) if cfg.stop_after is not None else cfg.steps
    from ..data.corpus import batch_rows

    try:
        for step in range(start, stop_at):
            t0 = time.perf_counter()
            K = sched.passes_at(step, cfg.steps)
            if fresh_fusion and step == fb_start:
                D.unwrap(model).reset_feedback(torch.Generator().manual_seed(cfg.seed * 31 + 7))
            lr = lr_at(step, cfg)
            fusion_lr = lr * switch_on.fusion_lr_factor(step, fb_start, cfg.steps)
            frozen = switch_on.backbone_frozen(step, fb_start, cfg.steps)
            for group in optimizer.param_groups:
                group["lr"] = (fusion_lr if group["name"].startswith("fusion") else lr) * group.get("lr_mult", 1.0)
            weight = cfg.feedback_weight * switch_on.feedback_weight_factor(step, fb_start, cfg.steps)
            batch = train_rows[batch_rows(step + cfg.data_offset, cfg.batch_size, train_rows.shape[0], cfg.seed)]
            mask = feedback_mask_for(batch, doc_id, cfg.prefix_mix, prefix_gen) if K > 1 else None
            lo = env.rank * per_rank
            local = batch[lo:lo + per_rank].to(env.device)
            local_mask = mask[lo:lo + per_rank].to(env.device) if mask is not None else None
            micro_batches = [(local[i:i + micro], local_mask[i:i + micro] if local_mask is not None else None)
                             for i in range(0, per_rank, micro)]
            loss_sum, pass_sum = forward_backward(model, micro_batches, K, autocast,
                                                  nan=(step + 1) in cfg.debug_nan_steps, feedback_weight=weight)
            if K == 1:
                for p in fusion_params:  # unused on a plain step: no update, no weight decay, as single-process
                    p.grad = None
            if frozen:
                for p in backbone_params:  # fusion-only phase: the backbone is not updated
                    p.grad = None
            stats = D.all_reduce_mean(torch.cat([loss_sum.view(1), pass_sum]) / len(micro_batches), env)
            stats = stats.tolist()
            loss, pass_losses = stats[0], stats[1:]
            reason = guard.check(loss, pass_losses[0], None)
            grad_norm = float("nan")
            fusion_norm = None
            if reason is None:
                if cfg.clip_per_group:
                    grad_norm = clip_gradients(backbone_params, cfg.grad_clip)
                    if K > 1:
                        fusion_norm = clip_gradients(fusion_params, cfg.grad_clip)
                        grad_norm = math.hypot(grad_norm, fusion_norm)
                else:
                    grad_norm = clip_gradients(all_params, cfg.grad_clip)
                reason = guard.check(loss, pass_losses[0], grad_norm)
            if reason is None:
                optimizer.step()
                guard.good(pass_losses[0])
            else:
                guard.bad()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            rec = {"step": step + 1, "split": "train", "loss": _clean(loss), "pass_losses": [_clean(v) for v in pass_losses],
                   "num_passes": K, "lr": lr, "grad_norm": _clean(grad_norm), "feedback_weight": weight if K > 1 else None,
                   "fusion_lr": next((g["lr"] for g in optimizer.param_groups if g["name"].startswith("fusion")), None) if K > 1 else None,
                   "tokens": (step + 1) * tokens_per_step, "step_time": dt, "tokens_per_s": tokens_per_step / dt,
                   "elapsed": run.elapsed()}
            if fusion_norm is not None:
                rec["fusion_grad_norm"] = _clean(fusion_norm)
            if frozen:
                rec["backbone_frozen"] = True
            if reason is not None:
                rec["skipped"] = reason
            log.record(rec)
            log.progress(rec, tokens_per_step / dt)
            if reason is not None:
                log.write(f"step {step + 1}: skipped ({reason}); {guard.bad_in_row} bad step(s) in a row")
                if guard.bad_in_row >= cfg.max_bad_steps:
                    status = "stopped"
                    message = (f"stopped after {guard.bad_in_row} bad steps in a row at step {step + 1}; "
                               + (f"last good checkpoint: {last_ckpt}" if last_ckpt else "no checkpoint was written"))
                    log.record({"step": step + 1, "split": "event", "event": "stopped", "reason": message})
                    break
            done = step + 1
            if done % eval_every == 0 or done == cfg.steps:
                val = _evaluate(run, val_rows, done, fb_start)
                if val is not None:
                    log.record(val)
                    extra = f", K={val['val_num_passes']}: {val['val_loss_passes']:.4f}" if "val_loss_passes" in val else ""
                    log.write(f"step {done}: val loss {val['val_loss']:.4f}{extra}")
            if (cfg.save_every and done % cfg.save_every == 0) or (done == stop_at and done < cfg.steps):
                if guard.bad_in_row == 0:
                    last_ckpt = save_checkpoint(run, done)
                else:  # only good states are checkpointed
                    log.write(f"step {done}: no checkpoint while steps are being skipped")
            if cfg.debug_kill_at_step is not None and done == cfg.debug_kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            if stop_at < cfg.steps:
                status = "paused"
                message = f"paused after step {stop_at} of {cfg.steps}; continue with --resume"
    finally:
        log.close()

    summary = {"status": status, "message": message, "out": cfg.out, "steps_done": None, "checkpoint": last_ckpt,
               "elapsed": run.elapsed(), "skipped_steps": guard.skipped}
    if status == "done":
        summary["steps_done"] = cfg.steps
        _finish(run, tokenizer)
    val = [r for r in read_jsonl(os.path.join(cfg.out, METRICS)) if r.get("split") == "val"]
    if val:
        summary["val_loss"] = val[-1]["val_loss"]
    if env.is_main and status == "done":
        atomic_write_json(os.path.join(cfg.out, "summary.json"), summary)
    return summary


def _finish(run: Run, tokenizer) -> None:
    """Write the final model (save_pretrained) and tokenizer into OUT, and the curves."""
    cfg, env = run.cfg, run.env
    if D.is_sharded(D.unwrap(run.model)):
        state = D.full_model_state(run.model)
        if env.is_main:
            model = build_model(cfg, tokenizer)
            D.load_full_model_state(model, state)
        else:
            model = None
    else:
        model = D.unwrap(run.model)
    if env.is_main:
        model.eval()
        # a plain run (feedback never on) is saved as the plain HF checkpoint of its backbone: its fusion was never
        # trained, and `lm_eval --model hf`, `pipeline(...)` and `--init-from` take it as the plain model it is
        saved = model if cfg.feedback_ever else model.backbone
        atomic_save_pretrained(saved, cfg.out, mode="merge")
        atomic_save_pretrained(tokenizer, cfg.out, mode="merge")
        if cfg.plot:
            try:
                from ..utils.plotting import plot_loss_curves

                plot_loss_curves({os.path.basename(os.path.normpath(cfg.out)) or "run": os.path.join(cfg.out, METRICS)},
                                 os.path.join(cfg.out, "curves.png"))
            except Exception as err:  # noqa: BLE001 - a plot is not worth failing a finished run
                print(f"warning: could not draw curves.png: {err}", file=sys.stderr)
        model.train()
    D.barrier(env)


# ============================================================================================== CLI


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
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a full-bandwidth model (from scratch or --init-from a checkpoint)",
        description="Train a full-bandwidth transformer. Runs as it is on one process, or under "
                    "`torchrun --nproc_per_node N fullband train ...` with DDP (gloo on CPU, nccl on GPU). "
                    "Per-step metrics go to OUT/metrics.jsonl; the final model and tokenizer to OUT.")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="YAML or TOML file of options (keys as the flags, dashes or underscores); flags given on "
                        "the command line win")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint (its saved options apply unless "
                        "overridden; changing the trajectory is refused)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in an --out that already holds a run (removes its checkpoints, metrics and model)")
    add_config_arguments(p, TrainConfig)
    p.set_defaults(func=run_cli)


def add_config_arguments(p, cls=TrainConfig, skip: tuple = ()) -> None:
    """One flag per config field, default SUPPRESS (so only given flags override file / checkpoint values)."""
    defaults = cls()
    titles = {"run": "run", "data": "data", "model": "model", "optim": "optimisation", "feedback": "feedback schedule",
              "guard": "stability guard", "log": "evaluation and logging", "hw": "hardware"}
    groups = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        flag = "--" + _flag(f.name)
        if meta.get("hidden"):
            if f.name == "debug_nan_steps":
                p.add_argument(flag, type=lambda s: [int(x) for x in s.split(",") if x], default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS)
            else:
                p.add_argument(flag, type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            continue
        group = meta.get("group", "run")
        if group not in groups:
            groups[group] = p.add_argument_group(titles.get(group, group))
        g = groups[group]
        default = getattr(defaults, f.name)
        help_text = meta["help"] + (f" (default: {default})" if default not in (None, "") else "")
        t = str(f.type)
        if t.startswith("bool"):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            typ = int if t.startswith("int") else float if t.startswith("float") else str
            metavar = {"int": "N", "float": "X", "str": "S"}[typ.__name__]
            if f.name in ("out", "init_from", "tokenizer"):
                metavar = "DIR"
            g.add_argument(flag, type=typ, default=argparse.SUPPRESS, metavar=metavar, help=help_text)


def config_from_args(args, resume: bool) -> tuple[TrainConfig, dict]:
    names = set(TrainConfig.field_names())
    explicit = {k: v for k, v in vars(args).items() if k in names}
    base = None
    if resume:
        out = explicit.get("out")
        if out is None and args.config:
            out = read_config_file(args.config).get("out")
        if out is None:
            raise ValueError("--resume needs --out DIR (the run to continue)")
        ckpt = find_checkpoint(out) if os.path.isdir(out) else None
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {os.path.join(out, CKPT_DIR)!r} "
                                    "(train with --save-every N, or start without --resume)")
        base = load_checkpoint_state(ckpt)["config"]
        fields_ = _field_map()
        base = {k: v for k, v in base.items()
                if k in names and not fields_[k].metadata.get("hidden") and fields_[k].metadata.get("persist", True)}
    cfg = make_config(explicit, args.config, base)
    return cfg, explicit


def run_cli(args) -> int:
    cfg, _ = config_from_args(args, args.resume)
    tune_cpu_allocator()
    summary = train(cfg, resume=args.resume, overwrite=args.overwrite)
    if int(os.environ.get("RANK", "0")) == 0:
        if summary["status"] == "stopped":
            print(f"fullband train: {summary['message']}", file=sys.stderr)
            return EXIT_STOPPED
        if summary["status"] == "paused":
            print(f"fullband train: {summary['message']}", file=sys.stderr)
            return 0
        val = f", val loss {summary['val_loss']:.4f}" if "val_loss" in summary else ""
        print(f"fullband train: done, {cfg.steps} steps in {summary['elapsed']:.1f}s{val}; model in {cfg.out}")
    return EXIT_STOPPED if summary["status"] == "stopped" else 0


# ============================================================================================== benchmark


def benchmark_train(args) -> dict:
    """``fullband bench train``: seconds per optimizer step and tokens/s for K = 1, K = 2 and K = 2 with a
    stop-gradient fed-back state, on random tokens (the full step: forward, backward, clip, AdamW)."""
    from transformers.utils import logging as hf_logging

    from ..model.feedback import build_feedback_mask
    from ..model.modeling import FullBandwidthForCausalLM
    from .presets import backbone_config

    hf_logging.disable_progress_bar()
    tuned = tune_cpu_allocator()  # as `fullband train` does
    preset = getattr(args, "preset", "tiny")
    batch = getattr(args, "batch_size", 16)
    seq = getattr(args, "seq_len", 256)
    vocab = getattr(args, "vocab_size", 4096)
    steps = getattr(args, "steps", 5)
    warmup = getattr(args, "warmup", 2)
    device = D.resolve_device(getattr(args, "device", "auto"))
    autocast, precision = autocast_context(getattr(args, "precision", "auto"), device)
    for name, v in (("--batch-size", batch), ("--seq-len", seq), ("--steps", steps)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    ids[:, 0] = 1
    ids = ids.to(device)
    cases = [("K1", 1, False), ("K2", 2, False), ("K2_detach", 2, True)]
    cfg = TrainConfig(out="-", preset=preset)
    from transformers import AutoModelForCausalLM

    setups = {}
    for label, K, detach in cases:
        torch.manual_seed(0)
        backbone = AutoModelForCausalLM.from_config(backbone_config(preset, vocab, bos_token_id=1, eos_token_id=2,
                                                                    pad_token_id=0, max_position_embeddings=max(2048, seq)))
        model = FullBandwidthForCausalLM.from_backbone(backbone, doc_start_token_id=1, detach_state=detach).to(device).train()
        setups[label] = (model, build_optimizer(model, cfg, device), K)
    mask = build_feedback_mask(ids, None, 1)

    def one_step(label) -> float:
        model, opt, K = setups[label]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        forward_backward(model, [(ids, mask)], K, autocast)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    # rounds of one step per case, interleaved, so that a change in machine load hits every case alike
    times = {label: [] for label, *_ in cases}
    for i in range(warmup + steps):
        for label, *_ in cases:
            t = one_step(label)
            if i >= warmup:
                times[label].append(t)
    results = {}
    for label, K, detach in cases:
        ts = sorted(times[label])
        med = ts[len(ts) // 2]
        results[label] = {"num_passes": K, "detach_state": detach, "step_s": med, "tokens_per_s": batch * seq / med,
                          "step_s_min": ts[0], "step_s_all": times[label]}
    ratio = results["K2"]["step_s"] / results["K1"]["step_s"]
    return {"preset": preset, "batch_size": batch, "seq_len": seq, "vocab_size": vocab, "device": str(device),
            "precision": precision, "threads": torch.get_num_threads(), "steps": steps, "warmup": warmup,
            "allocator_tuned": tuned,
            "results": results, "ratio_K2_K1": ratio,
            "ratio_K2_detach_K1": results["K2_detach"]["step_s"] / results["K1"]["step_s"],
            "goal_ratio_K2_K1": 2.1, "meets_goal": ratio <= 2.1}


def format_benchmark(res: dict) -> str:
    lines = [f"fullband bench train: preset {res['preset']}, batch {res['batch_size']} x {res['seq_len']} tokens, "
             f"{res['device']} {res['precision']}, {res['threads']} thread(s), median of {res['steps']} steps",
             "", "| case | step (s) | tokens/s |", "| --- | ---: | ---: |"]
    for label, r in res["results"].items():
        lines.append(f"| {label} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} |")
    lines += ["", f"K=2 / K=1 = {res['ratio_K2_K1']:.2f} (goal <= {res['goal_ratio_K2_K1']}: "
                  f"{'met' if res['meets_goal'] else 'NOT met'}); K=2 detached / K=1 = {res['ratio_K2_detach_K1']:.2f}"]
    return "\n".join(lines)
