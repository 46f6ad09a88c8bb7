"""The command line of labelled tasks: ``data prepare --labelled`` and ``eval labelled``.

Owns the flags and output of ``fullband data prepare TASKS.jsonl --labelled --out DIR`` (:func:`run_prepare`,
called by :mod:`fullband.commands.data` when ``--labelled`` is given or the file is detected as labelled) and
of ``fullband eval labelled MODEL_DIR --data TEST.jsonl`` (:func:`add_eval_parser`, registered by
:mod:`fullband.commands.eval`): per-position accuracy per decode mode with row-bootstrap CIs, JSON on ``--json`` /
``--out FILE.json`` (written atomically, only once everything is scored). The row format is
:mod:`fullband.data.labelled`'s.
"""

from __future__ import annotations

import json
import os

from ..data.labelled import ROW_FORMAT, prepare_labelled
from ..eval.labelled import CI_NOTE, MODES, PROMPT_MODES, check_no_overlap, length_buckets, read_test_rows
from ..eval.labelled import score_rows, summarize_mode
from ..eval.scoring import load_any_model
from ..model.configuration import has_feedback
from ..utils.errors import UsageError
from ..utils.io import atomic_write_json
from ..utils.argtypes import NONNEG_INT, POSITIVE_INT

FORMAT_HELP = (f"Labelled rows: {ROW_FORMAT}; null or '_' = no target at that position. The model at the position "
               "of input t predicts target t.")


def run_prepare(args) -> int:
    """``fullband data prepare SRC --labelled --out DIR``."""
    if args.tokenizer is not None:
        raise UsageError("--tokenizer does not apply to labelled data: its vocabulary is built from its tokens")
    manifest = prepare_labelled(args.source, args.out, val_fraction=args.val_fraction, seed=args.seed,
                                overwrite=args.overwrite)
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    tr, va = manifest["splits"]["train"], manifest["splits"]["val"]
    print(f"fullband data prepare: {tr['rows'] + va['rows']:,} labelled rows (train {tr['rows']:,}, val "
          f"{va['rows']:,}; {manifest['duplicate_rows']:,} repeat an earlier row's inputs, split by content), "
          f"vocabulary {manifest['vocab_size']}, longest row {max(tr['max_length'], va['max_length'])} inputs; "
          f"{args.out}")
    return 0


def _ints(text: str | None, name: str) -> list[int]:
    if not text:
        return []
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{name} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise UsageError(f"{name} must be integers >= 1, got {text!r}")
    return values


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def run_eval(args) -> int:
    """``fullband eval labelled MODEL_DIR --data TEST.jsonl``."""
    if args.out is not None and not args.out.endswith(".json"):
        raise UsageError(f"--out must be a path ending in .json, got {args.out!r}")
    if not os.path.isdir(args.model):
        raise FileNotFoundError(f"model directory {args.model!r} does not exist")
    run_config = _read_json(os.path.join(args.model, "run_config.json"))
    summary = _read_json(os.path.join(args.model, "summary.json"))
    passes = _ints(args.passes, "--passes") or [int(run_config.get("num_passes") or 2)]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else None
    bad = [m for m in modes or [] if m not in MODES]
    if bad:
        raise UsageError(f"unknown mode(s) {', '.join(bad)}: choose from {', '.join(MODES)}")
    if any(m in PROMPT_MODES for m in modes or []) and not args.prompt_tokens:
        raise UsageError("modes soft / fused score a continuation: give --prompt-tokens P (the inputs of the prompt)")
    buckets_edges = _ints(args.buckets, "--buckets")
    train = args.train
    if train is None and run_config.get("data") and os.path.exists(str(run_config["data"])):
        train = run_config["data"]  # the run's own training data, where it still is
    model, tokenizer = load_any_model(args.model, device=args.device)
    if modes is None:
        modes = ["standard"] + (["passes", "exact"] if has_feedback(model) else [])
        if args.prompt_tokens and has_feedback(model):
            modes += list(PROMPT_MODES)
    rows = read_test_rows(args.data, tokenizer)
    compared = check_no_overlap(rows, train) if train is not None else None
    if args.prompt_tokens and any(m in PROMPT_MODES for m in modes):
        short = next((r for r in rows if r["length"] < args.prompt_tokens), None)
        if short is not None:
            raise UsageError(f"{short['where']}: {short['length']} inputs, fewer than --prompt-tokens "
                             f"{args.prompt_tokens}: soft / fused need a prompt inside every row")
    train_max = summary.get("train_max_length")
    buckets = length_buckets([r["length"] for r in rows], buckets_edges)
    plan = [(m, k) for m in modes for k in (passes if m == "passes" else [None])]
    results = []
    for mode, k in plan:
        per_row = score_rows(model, rows, mode, num_passes=k or 2, prompt_tokens=args.prompt_tokens or 0,
                             prefill_passes=args.prefill_passes, batch_size=args.batch_size)
        res = {"mode": mode, "num_passes": k if mode == "passes" else (1 if mode == "standard" else None),
               "prompt_tokens": args.prompt_tokens if mode in PROMPT_MODES else None,
               "prefill_passes": args.prefill_passes if mode == "fused" else None,
               **summarize_mode(per_row, buckets, args.seed, args.resamples, train_max)}
        results.append(res)
    report = {"model": os.path.abspath(args.model), "data": os.path.abspath(args.data), "rows": len(rows),
              "lengths": {"min": min(r["length"] for r in rows), "max": max(r["length"] for r in rows)},
              "train_max_length": train_max,
              "overlap_check": ({"train_data": os.path.abspath(train), "train_rows_compared": compared,
                                 "result": "no test row's input equals a training row's"} if train is not None
                                else None),
              "ci": CI_NOTE.format(n=args.resamples, seed=args.seed), "results": results}
    if args.out:
        atomic_write_json(args.out, report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report) + (f"\nwrote {args.out}" if args.out else ""))
    return 0


def _acc(a: dict) -> str:
    acc = a["accuracy"]
    if acc is None:
        return "-"
    return f"{acc['estimate']:.3f} [{acc['low']:.3f}, {acc['high']:.3f}] ({a['targets']})"


def format_report(report: dict) -> str:
    """The report as text: one line per mode, then its accuracy per length bucket."""
    lines = [f"labelled accuracy of {report['model']} on {report['data']} ({report['rows']} rows, input lengths "
             f"{report['lengths']['min']}-{report['lengths']['max']}; trained up to "
             f"{report['train_max_length'] if report['train_max_length'] is not None else '?'})",
             "accuracy [95% CI] (targets); " + report["ci"]]
    check = report["overlap_check"]
    lines.append("overlap with the training data: not checked (give --train FILE|DIR)" if check is None else
                 f"overlap with the training data {check['train_data']}: none ({check['train_rows_compared']} rows "
                 "compared)")
    for r in report["results"]:
        label = r["mode"] + (f" K={r['num_passes']}" if r["mode"] == "passes" else "")
        label += f" P={r['prompt_tokens']}" if r["prompt_tokens"] else ""
        lines.append(f"{label}: {_acc(r['overall'])}")
        for b in r["by_length"]:
            lines.append(f"    length {b['lengths']}: {_acc(b)}")
    return "\n".join(lines)


def add_eval_parser(group) -> None:
    """Register ``eval labelled`` under the ``eval`` command's sub-commands ``group``."""
    p = group.add_parser(
        "labelled", help="per-position accuracy on labelled rows per decode mode",
        description="Accuracy of a model trained on labelled rows (`fullband train --data TASKS.jsonl`) where a "
                    "test row has a target, per decode mode, overall and per input-length bucket (rows longer than "
                    "any training row included), with 95% bootstrap CIs that resample rows. " + FORMAT_HELP)
    p.add_argument("model", metavar="MODEL_DIR", help="the trained model's directory (fullband train --out)")
    p.add_argument("--data", required=True, metavar="FILE", help="held-out labelled rows (.jsonl)")
    p.add_argument("--train", default=None, metavar="FILE|DIR",
                   help="the training data: refuse when a test row's input equals one of its rows (default: the "
                        "run's --data from MODEL_DIR/run_config.json when it still exists)")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated modes of {', '.join(MODES)} (default: standard,passes,exact, plus "
                        "soft,fused with --prompt-tokens; standard only for a plain model)")
    p.add_argument("--passes", default=None, metavar="K,..", help="K of the passes mode (default: the run's K)")
    p.add_argument("--prompt-tokens", type=NONNEG_INT, default=None, metavar="P",
                   help="soft / fused: the first P inputs are the prompt; the targets at inputs P..T are scored")
    p.add_argument("--prefill-passes", type=POSITIVE_INT, default=1, metavar="N", help="fused: Jacobi passes over the prompt")
    p.add_argument("--buckets", default=None, metavar="N,..",
                   help="upper bounds of the input-length buckets (default: each length, or powers of two)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=32, metavar="N", help="rows per forward (default: 32)")
    p.add_argument("--resamples", type=POSITIVE_INT, default=10_000, metavar="N", help="bootstrap resamples (default: 10000)")
    p.add_argument("--seed", type=NONNEG_INT, default=0, metavar="N", help="seed of the bootstrap (default: 0)")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the JSON report here (atomically)")
    p.set_defaults(func=run_eval)
