"""``fullband reason``: generative reasoning accuracy and trace length per decode mode, with paired statistics."""

from __future__ import annotations

import os
import sys

from ..eval.problems import TASKS, make_problems, read_gsm8k
from ..eval.reasoning import report_markdown, run_reasoning
from ..eval.scoring import load_any_model
from .eval import show_report
from ..utils.argtypes import NONNEG_INT, POSITIVE_INT


def _progress_printer(message: str) -> None:
    print(f"reason: {message}", file=sys.stderr, flush=True)


def run(args) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else None
    problems = make_problems(args.task, args.num, args.seed, args.data)
    shots = []
    if args.shots:
        if args.task == "gsm8k":
            if not args.shots_data:
                raise ValueError("few-shot gsm8k needs solved examples from another file: give --shots-data FILE")
            shots = read_gsm8k(args.shots_data, limit=args.shots)
        else:  # examples from a disjoint seed
            shots = make_problems(args.task, args.shots, args.seed + 1_000_003)
    models = []
    for i, path in enumerate([args.model] + ([args.compare] if args.compare else [])):
        model, tokenizer = load_any_model(path, device=args.device, dtype=args.dtype)
        label = os.path.basename(os.path.normpath(path)) or path
        models.append((label if not any(label == m[0] for m in models) else f"{label}#{i + 1}", model, tokenizer))
    result = run_reasoning(models, problems, modes, args.max_new_tokens, not args.no_cot, shots, args.batch_size,
                           args.seed, prefill_passes=args.prefill_passes, progress=_progress_printer)
    if not result["runs"]:
        raise ValueError("no run was possible: " + "; ".join(result["notes"]))
    report = {
        "config": {"task": args.task, "data": args.data, "num_problems": len(problems), "seed": args.seed,
                   "cot": not args.no_cot, "shots": len(shots), "max_new_tokens": args.max_new_tokens,
                   "prefill_passes": args.prefill_passes,
                   "models": {name: os.path.abspath(p) for (name, _, _), p in
                              zip(models, [args.model] + ([args.compare] if args.compare else []))}},
        **result,
    }
    return show_report(report, report_markdown(report), args.out, "reason")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "reason", help="generative reasoning accuracy and trace length per decode mode",
        description="Greedy generation on multi-step reasoning problems (synthetic arithmetic, state tracking, "
                    "or a GSM8K-format jsonl file), graded with math-verify; reports accuracy and the reasoning-"
                    "trace length (tokens before '####') per decode mode, with paired statistics (exact McNemar, "
                    "bootstrap CI of the length difference) between modes and between two models.")
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--compare", default=None, help="a second model directory to compare with, mode by mode")
    p.add_argument("--task", default="arithmetic", choices=list(TASKS))
    p.add_argument("--data", default=None, help="GSM8K-format jsonl file (task gsm8k)")
    p.add_argument("--num", type=POSITIVE_INT, default=100, help="number of problems (default 100; gsm8k: the first N)")
    p.add_argument("--seed", type=NONNEG_INT, default=0, help="problem seed, also the bootstrap seed")
    p.add_argument("--modes", default=None,
                   help="comma-separated decode modes (default: standard and the model's default feedback mode)")
    p.add_argument("--no-cot", action="store_true", help="answer only, no chain of thought in the examples")
    p.add_argument("--shots", type=NONNEG_INT, default=0, help="solved examples before each question (default 0)")
    p.add_argument("--shots-data", default=None, help="GSM8K-format file the gsm8k shots come from")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=128)
    p.add_argument("--prefill-passes", type=POSITIVE_INT, default=1, help="Jacobi passes over the prompt in 'fused' mode")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=8)
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", default=None,
                   help="write the report: a folder (reason.json + reason.md) or a path ending in .json")
    p.set_defaults(func=run)
