"""``fullband experiment reasoning``

    A baseline and an FBT model trained on the same synthetic chain-of-thought data (:mod:`fullband.reasoning`:
    2-3 step addition and subtraction by default) for the same tokens, then greedy decoding on held-out problems
    (none of whose questions occur in training): the baseline in standard mode, FBT in standard, soft and exact
    mode.
    Reported: accuracy (math-verify), reasoning-trace length (tokens before ``####``), and paired statistics
    (exact McNemar on correctness, percentile-bootstrap CI of the trace-length difference) between the
    baseline and each FBT mode and between FBT's modes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time

import torch
from transformers.utils import logging as hf_logging

from ..data.corpus import Corpus, Document, pack, tokenize_documents, train_tokenizer
from ..eval.problems import ANSWER_MARKER, format_example, make_problems
from ..eval.reasoning import compare_runs, evaluate_reasoning, report_markdown, summarize
from ..eval.scoring import evaluate_loss
from ..model.generation import MODES
from ..model.modeling import load_model
from ..utils.io import atomic_write_json, atomic_write_text
from .experiment_common import base_config, plain_config, say_for, steps_for, train_pair

RS_DEFAULTS = dict(out=os.path.join("runs", "experiments", "reasoning"), preset="tiny", steps=600, batch_size=16,
                   seq_len=128, vocab_size=300, task="arithmetic", train_problems=20000, test_problems=200,
                   max_new_tokens=64)
# The default arithmetic problems are 2-3 additions / subtractions of 1..9 ("3+8-9=?" -> "3+8=11; 11-9=2. #### 2"):
# a chain a `tiny` model learns within the CPU budget. Probes of the baseline (tiny, 16 x 128 tokens a step): the
# generator's own default (2-4 operators with *) reached 3.5% accuracy after 300 steps (512-entry BPE) and 10% after
# 600 (300-entry BPE), too close to the floor to compare anything; 2-3 of +/- (300-entry BPE) reached 9% after 300
# steps and 94% after 600, hence 600 steps.
TASK_DEFAULTS = {"arithmetic": {"num_ops": (2, 3), "ops": "+-"}}

# ============================================================================================== reasoning


def parse_task_options(items: list[str] | None) -> dict:
    """``--task-option NAME=VALUE`` for the problem generator (e.g. ``num_ops=2,3`` -> ``(2, 3)``)."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--task-option takes NAME=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        key = key.strip().replace("-", "_")
        parts = [v.strip() for v in raw.split(",")]
        try:
            vals = [int(v) for v in parts]
            out[key] = tuple(vals) if len(vals) > 1 else vals[0]
        except ValueError:
            out[key] = raw
    return out


def reasoning_problems(task: str, n_train: int, n_test: int, seed: int, options: dict):
    """``(train, test, overlap_removed)``: training problems from ``seed``, test problems from another seed
    with every question that occurs in training removed."""
    if task == "gsm8k":
        raise ValueError("the reasoning experiment trains on synthetic tasks: choose arithmetic, state or permutation")
    try:
        train = make_problems(task, n_train, seed, **options)
        seen = {p.question for p in train}
        pool = make_problems(task, 4 * n_test, seed + 7_919, **options)
    except TypeError as err:
        raise ValueError(f"--task-option: {err}") from None
    test = [p for p in pool if p.question not in seen]
    removed = len(pool) - len(test)
    test = test[:n_test]
    if not test:
        raise ValueError("every test question also occurs in training; use a harder task or fewer training problems")
    return train, test, removed


def run_reasoning_experiment(args) -> dict:
    hf_logging.disable_progress_bar()
    say = say_for(args)
    t_all = time.perf_counter()
    steps = steps_for(args)
    for name in ("train_problems", "test_problems", "max_new_tokens", "gen_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    fbt_modes = [m.strip() for m in args.fbt_modes.split(",") if m.strip()]
    if not fbt_modes or any(m not in MODES for m in fbt_modes):
        raise ValueError(f"--fbt-modes must be decode modes from {', '.join(MODES)}, got {args.fbt_modes!r}")
    options = {**TASK_DEFAULTS.get(args.task, {}), **parse_task_options(args.task_option)}
    cot = not args.no_cot

    # ---- data: problems, documents, tokenizer, rows
    t = time.perf_counter()
    train_p, test_p, removed = reasoning_problems(args.task, args.train_problems, args.test_problems, args.seed,
                                                  options)
    data_dir = os.path.join(args.out, "data")
    os.makedirs(data_dir, exist_ok=True)
    train_docs = [Document(p.id, format_example(p, cot)) for p in train_p]
    test_docs = [Document(p.id, format_example(p, cot)) for p in test_p]
    train_file = os.path.join(data_dir, "train.jsonl")
    atomic_write_text(train_file, "".join(json.dumps({"name": d.name, "text": d.text}) + "\n" for d in train_docs))
    atomic_write_text(os.path.join(data_dir, "test.jsonl"),
                      "".join(json.dumps(p.to_dict()) + "\n" for p in test_p))
    tokenizer = train_tokenizer((d.text for d in train_docs), args.vocab_size)
    train_rows = pack(tokenize_documents(tokenizer, train_docs), args.seq_len)
    try:
        val_rows = pack(tokenize_documents(tokenizer, test_docs), args.seq_len)
    except ValueError:
        val_rows = torch.empty(0, args.seq_len, dtype=torch.long)
    corpus = Corpus(tokenizer, train_rows, val_rows, [d.name for d in train_docs], [d.name for d in test_docs])
    t_data = time.perf_counter() - t
    runs_dir = os.path.join(args.out, "runs")
    fbt_cfg = base_config(args, os.path.join(runs_dir, "fbt"), steps, train_file)
    base_cfg = plain_config(dataclasses.replace(fbt_cfg, out=os.path.join(runs_dir, "baseline")))
    if fbt_cfg.num_passes < 2:
        raise ValueError(f"--num-passes must be >= 2 for the FBT run, got {fbt_cfg.num_passes}")
    fbt_cfg.validate()
    base_cfg.validate()
    tokens = steps * fbt_cfg.batch_size * fbt_cfg.seq_len
    say(f"reasoning: {args.task}, {len(train_p):,} training problems ({train_rows.numel():,} tokens, "
        f"{tokens / max(1, train_rows.numel()):.2f} epochs over {steps} steps), {len(test_p)} held-out problems "
        f"({removed} candidates dropped as training duplicates)")

    # ---- training
    t = time.perf_counter()
    _, _, shared = train_pair(base_cfg, fbt_cfg, corpus, share=not args.no_share_prefix)
    t_train = time.perf_counter() - t

    # ---- evaluation
    t = time.perf_counter()
    baseline = load_model(base_cfg.out).eval()
    fbt = load_model(fbt_cfg.out).eval()
    K = fbt_cfg.num_passes
    losses = []
    if val_rows.shape[0]:
        rows = val_rows[: args.eval_rows]
        losses.append({"model": "baseline", "mode": "standard", **evaluate_loss(baseline, rows, "standard")})
        for mode in ("standard", "passes", "exact"):
            losses.append({"model": "FBT", **evaluate_loss(fbt, rows, mode, num_passes=K)})
    plan = [("baseline", baseline, "standard")] + [("FBT", fbt, m) for m in fbt_modes]
    runs = []
    for label, model, mode in plan:
        say(f"reasoning: decoding {len(test_p)} problems, {label} in {mode} mode")
        recs = evaluate_reasoning(model, tokenizer, test_p, mode, args.max_new_tokens, cot, (), args.gen_batch_size)
        runs.append({"name": f"{label}/{mode}", "model_name": label, "mode": mode, "summary": summarize(recs),
                     "records": recs})
    comparisons = []

    def add(a, b):
        c = compare_runs(a["records"], b["records"], seed=args.seed, n_resamples=args.bootstrap)
        c["b_count"], c["c_count"] = c.pop("b"), c.pop("c")
        comparisons.append({"a": a["name"], "b": b["name"], **c})

    for r in runs[1:]:
        add(runs[0], r)
    fbt_runs = runs[1:]
    for r in fbt_runs[1:]:
        add(fbt_runs[0], r)
    t_eval = time.perf_counter() - t
    wall = time.perf_counter() - t_all
    report = {
        "experiment": "reasoning",
        "config": {"task": args.task, "task_options": {k: list(v) if isinstance(v, tuple) else v
                                                        for k, v in options.items()},
                   "data": None, "num_problems": len(test_p), "seed": args.seed, "cot": cot, "shots": 0,
                   "max_new_tokens": args.max_new_tokens, "train_problems": len(train_p),
                   "test_candidates_dropped_as_training_duplicates": removed},
        "runs": runs, "comparisons": comparisons, "notes": [],
        "held_out_loss": losses,
        "training": {"steps": steps, "tokens_per_model": tokens, "train_tokens_available": int(train_rows.numel()),
                     "epochs": tokens / max(1, train_rows.numel()), "shared_prefix_steps": shared,
                     "preset": fbt_cfg.preset, "batch_size": fbt_cfg.batch_size, "seq_len": fbt_cfg.seq_len,
                     "vocab_size": len(tokenizer), "lr": fbt_cfg.resolved_lr(),
                     "recipe": {k: getattr(fbt_cfg, k) for k in ("feedback_start", "num_passes", "deep_passes",
                                                                  "deep_fraction", "prefix_mix", "jitter",
                                                                  "feedback_weight", "fusion_lr_mult", "fusion",
                                                                  "detach_state", "lr_schedule")}},
        "seconds": {"data": t_data, "train": t_train, "eval": t_eval, "total": wall},
        "threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform(),
        "answer_marker": ANSWER_MARKER,
    }
    table = report_markdown(report)
    loss_table = ""
    if losses:
        loss_table = "\n".join(["| model | mode | held-out CoT loss (nats/token) |", "| --- | --- | ---: |"]
                               + [f"| {x['model']} | {x['mode'] if x['mode'] != 'passes' else f'passes (K={K})'} | "
                                  f"{x['loss']:.4f} |" for x in losses])
    atomic_write_json(os.path.join(args.out, "results.json"), report)
    atomic_write_text(os.path.join(args.out, "report.md"), reasoning_report(report, table, loss_table))
    print(table.split("\n", 2)[2] if table.startswith("# ") else table, end="")
    if loss_table:
        print("\n" + loss_table)
    print(f"\n{wall:.0f}s in all (training {t_train:.0f}s, evaluation {t_eval:.0f}s). "
          f"Report: {os.path.join(args.out, 'report.md')}")
    return report


def reasoning_report(report: dict, table: str, loss_table: str) -> str:
    tr, cfg, sec = report["training"], report["config"], report["seconds"]
    r = tr["recipe"]
    lines = [
        "# fullband experiment reasoning", "",
        f"A baseline (K=1 throughout) and an FBT model, preset `{tr['preset']}`, each trained for {tr['steps']} steps "
        f"x {tr['batch_size']} rows x {tr['seq_len']} tokens = {tr['tokens_per_model']:,} tokens "
        f"({tr['epochs']:.2f} epochs) of {cfg['train_problems']:,} synthetic `{cfg['task']}` problems written with "
        f"their chain of thought (`Q: ...\\nA: steps #### answer`, one document each), same seed and data order; "
        f"a {tr['vocab_size']}-entry BPE trained on them; peak LR {tr['lr']:g} ({r['lr_schedule']}). FBT recipe: "
        f"plain for the first {r['feedback_start']:.0%} of the steps, then K={r['num_passes']} "
        f"({r['deep_fraction']:.0%} at K={r['deep_passes']}), prefix mixing p={r['prefix_mix']}, jitter {r['jitter']}, "
        f"λ={r['feedback_weight']}." + (f" The first {tr['shared_prefix_steps']} steps are shared (identical in both "
                                         "runs, trained once)." if tr["shared_prefix_steps"] else ""),
        "",
        f"Evaluation: {cfg['num_problems']} held-out problems (another seed; "
        f"{cfg['test_candidates_dropped_as_training_duplicates']} candidates whose question occurs in training were "
        "dropped), zero-shot, greedy. Modes: *standard* = no feedback; *soft* = the prompt prefilled plainly, every "
        "generated token fused with the previous step's state; *exact* = the whole sequence through the exact "
        "recurrence.",
        "",
        table.split("\n", 2)[2] if table.startswith("# ") else table,
    ]
    if loss_table:
        lines += ["Teacher-forced loss on the held-out problems' worked solutions:", "", loss_table, ""]
    lines += [f"Wall time {sec['total']:.0f}s (data {sec['data']:.0f}s, training {sec['train']:.0f}s, evaluation "
              f"{sec['eval']:.0f}s), {report['threads']} CPU thread(s), torch {report['torch']}.", ""]
    return "\n".join(lines)
