"""``fullband sft``: the command line of supervised fine-tuning (:mod:`fullband.training.sft`).

Owns the ``sft`` sub-command: the flags of :class:`fullband.training.sft.SFTConfig` (built by
:func:`fullband.commands.train.add_config_arguments`), ``--config``, ``--resume``, ``--overwrite``; prints the
final evaluation tables and the one-line result.
"""

from __future__ import annotations

import os

from ..training.sft import SFTConfig, format_summary, sft
from .train import add_config_arguments, config_from_args, report_status


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sft", help="instruction-tune a model on chat conversations (loss on assistant tokens, K-pass objective)",
        description="Supervised fine-tuning on chat jsonl ({'messages': [{'role': 'system'|'user'|'assistant', "
                    "'content': ...}]} a line) with fullband's chat template; the loss is taken on the assistant's "
                    "tokens only, with pre-training's K-pass objective. Starts from --init-from: a fullband model, "
                    "a `fullband train` run or checkpoint, or a plain HF causal LM (retrofitted). Without --data it "
                    "tunes on synthetic arithmetic conversations (offline). Writes the model and tokenizer (with "
                    "the chat template) to --out, plus metrics.jsonl and summary.json.")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="YAML or TOML file of options (keys as the flags); flags given on the command line win")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="start over in an --out that already holds a run")
    add_config_arguments(p, SFTConfig)
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    cfg, _ = config_from_args(args, args.resume, SFTConfig)
    summary = sft(cfg, resume=args.resume, overwrite=args.overwrite)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    code = report_status("sft", summary)
    if code is not None:
        return code
    table = format_summary(summary)
    if table:
        print(table)
    print(f"fullband sft: done, {cfg.steps} steps in {summary['elapsed']:.1f}s on {summary['data']['train']} "
          f"conversations; model in {cfg.out}")
    return 0
