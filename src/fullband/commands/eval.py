"""``fullband eval``: held-out loss / perplexity of a saved model per mode (standard, K passes, exact)."""

from __future__ import annotations

import os

from ..eval.scoring import (
    evaluate_model,
    evaluation_rows,
    load_any_model,
    report_markdown,
    split_settings,
    write_report,
)
from ..utils.errors import UsageError
from .labelled import add_eval_parser
from ..utils.argtypes import NONNEG_INT, OPEN_FRACTION, POSITIVE_INT


def parse_int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    return values


def run(args) -> int:
    if args.model is None:
        raise UsageError("--model is required (or `fullband eval labelled MODEL_DIR --data TEST.jsonl`)")
    passes = parse_int_list(args.passes, "--passes") if args.passes else []
    if any(k < 1 for k in passes):
        raise ValueError(f"--passes must be integers >= 1, got {args.passes!r}")
    if args.max_rows is not None and args.max_rows < 1:
        raise ValueError(f"--max-rows must be >= 1, got {args.max_rows}")
    settings, source = split_settings(args.model, args.data, args.seed, args.val_fraction, args.seq_len)
    model, tokenizer = load_any_model(args.model, device=args.device, dtype=args.dtype)
    rows, data_info = evaluation_rows(tokenizer, settings["data"], args.split, settings["seq_len"],
                                      settings["val_fraction"], settings["seed"])
    if source:
        data_info["settings_from"] = source
    report = evaluate_model(model, rows, passes=passes, exact=not args.no_exact, batch_size=args.batch_size,
                            max_rows=args.max_rows, tokenizer=tokenizer, progress=args.progress)
    report = {"model": os.path.abspath(args.model), "data": data_info, **report}
    return show_report(report, report_markdown(report), args.out, "eval")


def show_report(report: dict, markdown: str, out: str | None, stem: str) -> int:
    """Print the markdown; with ``out``, also write ``stem``.json / .md there and say where."""
    print(markdown, end="")
    if out:
        json_path, md_path = write_report(report, markdown, out, stem)
        print(f"wrote {json_path} and {md_path}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval", help="held-out loss / perplexity per feedback mode",
        description="Validation loss and perplexity of a saved model on held-out text: standard (K=1), the "
                    "K-pass forward for each --passes K, and the exact token-by-token recurrence. By default the "
                    "text is the validation documents split exactly as `fullband train` split them: its data, "
                    "seed, validation fraction and row length are read from the run_config.json it saved beside "
                    "the model (the embedded corpus, seed 0, 0.1 and 256 without one).")
    p.add_argument("--model", default=None, help="model directory (fullband or plain Hugging Face causal LM; required)")
    p.add_argument("--data", default=None,
                   help="text file, folder, .jsonl or datasets directory (default: the training run's, else the "
                        "embedded corpus)")
    p.add_argument("--split", default="val", choices=["val", "train", "all"],
                   help="which documents of --data to score (default: val, the training split's held-out part)")
    p.add_argument("--seed", type=NONNEG_INT, default=None, help="document-split seed (default: the training run's, else 0)")
    p.add_argument("--val-fraction", type=OPEN_FRACTION, default=None,
                   help="validation fraction (default: the training run's, else 0.1)")
    p.add_argument("--seq-len", type=POSITIVE_INT, default=None, help="tokens per packed row (default: the training run's, "
                                                             "else 256)")
    p.add_argument("--max-rows", type=POSITIVE_INT, default=None, help="score only the first N rows (default: all)")
    p.add_argument("--passes", default="2,3,4", help="K values for the multi-pass forward (default 2,3,4)")
    p.add_argument("--no-exact", action="store_true", help="skip the (slow, token-by-token) exact recurrence")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=8)
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="load the weights in this dtype (default: as saved)")
    p.add_argument("--out", default=None,
                   help="write the report: a folder (eval.json + eval.md) or a path ending in .json (+ .md beside it)")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.set_defaults(func=run)
    add_eval_parser(p.add_subparsers(dest="eval_command", metavar="SUBCOMMAND"))
