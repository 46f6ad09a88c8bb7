"""``fullband train``: the command line of pre-training (:mod:`fullband.training.pretrain`).

Owns the ``train`` sub-command: one flag per :class:`fullband.training.config.TrainConfig` field
(:func:`add_config_arguments`, shared with ``fullband sft``), ``--config FILE`` (YAML/TOML), ``--resume`` (the
checkpoint's saved options apply unless overridden: :func:`config_from_args`) and ``--overwrite``; the exit code
(3 when the stability guard stopped the run) and the one-line result; ``--dry-run`` prints the plan of
:mod:`fullband.training.plan` instead of training.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from ..training.checkpoint import CKPT_DIR, find_checkpoint, load_trainer_state
from ..training.config import TrainConfig, flag_name, make_config, option_names, read_config_file, saved_options
from ..training.device import tune_cpu_allocator
from ..training.engine import EXIT_STOPPED
from ..training.labelled import train_labelled, wants_labelled
from ..training.plan import GPU_PEAK_BF16, format_plan, make_plan
from ..training.pretrain import train
from ..utils.argtypes import POSITIVE_FRACTION, POSITIVE_INT

GROUP_TITLES = {"run": "run", "data": "data", "model": "model", "optim": "optimisation", "feedback": "feedback schedule",
                "guard": "stability guard", "log": "evaluation and logging", "hw": "hardware"}


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
    plan = p.add_argument_group("plan (--dry-run: print what the run would cost and exit; reads no data, writes nothing)")
    plan.add_argument("--dry-run", action="store_true",
                      help="print parameters, training FLOPs per step for each K of the schedule, memory per device "
                           "and the time at --plan-mfu on --plan-devices x --plan-gpu, then exit")
    plan.add_argument("--plan-gpu", default="h200", choices=sorted(GPU_PEAK_BF16), help="GPU of the plan (default: h200)")
    plan.add_argument("--plan-devices", type=POSITIVE_INT, default=None, metavar="N",
                      help="devices of the plan (default: WORLD_SIZE, else 1)")
    plan.add_argument("--plan-mfu", type=POSITIVE_FRACTION, default=0.4, metavar="X",
                      help="model-FLOP utilisation assumed for the time (default: 0.4)")
    plan.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
    p.add_argument("--labelled", action="store_true",
                   help="--data is labelled rows (a .jsonl of {\"input\": ..., \"target\": ...} or a `fullband data "
                        "prepare --labelled` directory; both are detected): the loss only at the targets, the model "
                        "at input t predicting target t (fullband.data.labelled)")
    add_config_arguments(p, TrainConfig)
    p.set_defaults(func=run_cli)


def add_config_arguments(p, cls=TrainConfig) -> None:
    """One flag per option of ``cls`` (not its ``skip_options``), default SUPPRESS (so only given flags override
    file / checkpoint values)."""
    defaults = cls()
    groups = {}
    for f in dataclasses.fields(cls):
        if f.name in cls.skip_options:
            continue
        meta = f.metadata
        flag = "--" + flag_name(f.name)
        if meta.get("hidden"):
            if f.name == "debug_nan_steps":
                p.add_argument(flag, type=lambda s: [int(x) for x in s.split(",") if x], default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS)
            else:
                p.add_argument(flag, type=numeric_type(f), default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            continue
        group = meta.get("group", "run")
        if group not in groups:
            groups[group] = p.add_argument_group(GROUP_TITLES.get(group, group))
        g = groups[group]
        default = getattr(defaults, f.name)
        help_text = meta["help"] + (f" (default: {default})" if default not in (None, "") else "")
        t = str(f.type)
        if t.startswith("bool"):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            typ = numeric_type(f) if t.startswith(("int", "float")) else str
            metavar = {"int": "N", "float": "X", "str": "S"}[typ.__name__]
            if f.name in ("out", "init_from", "tokenizer"):
                metavar = "DIR"
            g.add_argument(flag, type=typ, default=argparse.SUPPRESS, metavar=metavar, help=help_text)


def numeric_type(f: dataclasses.Field):
    """The argparse type of a numeric config field: its ``arg`` (:mod:`fullband.utils.argtypes`, with its range)."""
    typ = f.metadata.get("arg")
    if typ is None:
        raise TypeError(f"config field {f.name!r} is numeric but gives no arg= type (fullband.utils.argtypes)")
    return typ


def config_from_args(args, resume: bool, cls=TrainConfig):
    """``(config, explicit options)``: defaults < the resumed checkpoint's options < ``--config`` < flags given."""
    names = set(option_names(cls))
    explicit = {k: v for k, v in vars(args).items() if k in names}
    base = None
    if resume:
        out = explicit.get("out")
        if out is None and args.config:
            out = read_config_file(args.config, cls).get("out")
        if out is None:
            raise ValueError("--resume needs --out DIR (the run to continue)")
        ckpt = find_checkpoint(out) if os.path.isdir(out) else None
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {os.path.join(out, CKPT_DIR)!r} "
                                    f"({'tune' if cls.config_section == 'sft' else 'train'} with --save-every N, or start "
                                    "without --resume)")
        base = saved_options(load_trainer_state(ckpt)["config"], cls)
    return make_config(explicit, args.config, base, cls), explicit


def report_status(command: str, summary: dict) -> int | None:
    """The exit code of a stopped (3) or paused (0) run, its message printed; ``None`` for a finished one."""
    if summary["status"] in ("stopped", "paused"):
        print(f"fullband {command}: {summary['message']}", file=sys.stderr)
        return EXIT_STOPPED if summary["status"] == "stopped" else 0
    return None


def run_cli(args) -> int:
    if args.dry_run:
        explicit = {k: v for k, v in vars(args).items() if k in set(option_names(TrainConfig))}
        explicit.setdefault("out", "(dry run)")
        cfg = make_config(explicit, args.config, None, TrainConfig)
        devices = args.plan_devices or int(os.environ.get("WORLD_SIZE", "1"))
        result = make_plan(cfg, world_size=devices, gpu=args.plan_gpu, mfu=args.plan_mfu)
        print(json.dumps(result, indent=2) if args.json else format_plan(result))
        return 0
    cfg, _ = config_from_args(args, args.resume)
    tune_cpu_allocator()
    summary = (train_labelled if wants_labelled(cfg, args.labelled) else train)(cfg, resume=args.resume,
                                                                                 overwrite=args.overwrite)
    if int(os.environ.get("RANK", "0")) == 0:
        code = report_status("train", summary)
        if code is not None:
            return code
        val = f", val loss {summary['val_loss']:.4f}" if "val_loss" in summary else ""
        print(f"fullband train: done, {cfg.steps} steps in {summary['elapsed']:.1f}s{val}; model in {cfg.out}")
    return EXIT_STOPPED if summary["status"] == "stopped" else 0

