"""``fullband quickstart``: the main job. A plain baseline and a full-bandwidth (FBT) model, trained on the
embedded corpus for the same number of tokens, evaluated on the held-out works, reported.

What it does (defaults sized for a few minutes on 2 CPU cores):

1. builds the corpus once (embedded Shakespeare, one work = one document, 10% of the works held out, a 4,096-entry
   byte-level BPE trained on the training works, rows of 128 tokens);
2. trains the **baseline**: preset ``tiny``, K = 1 on every step (saved as the plain Llama checkpoint it is), and
   the **FBT** model with ``fullband train``'s recipe, the one ``fullband experiment recipe`` measured best: the
   same backbone config, seed, data order, batch, steps and WSD learning rate; feedback switched on during the
   constant-LR phase (``--feedback-start``) through the token-preserving ``residual`` entry (exactly the plain model
   at switch-on), with the fusion's LR x10 warmed up, per-group clipping and λ ramped in; K = 2 with a tenth of the
   feedback steps at K = 4, prefix mixing, jitter. The two runs are identical, bit for bit, up to the feedback start
   (same seed and data, K = 1, no random draws), so that shared prefix is trained once: the baseline stops at the
   start step with a checkpoint, the FBT run resumes from a copy of it with its feedback settings
   (``--no-share-prefix`` trains both from scratch instead). Two controls are trained for as many FLOPs as the
   FBT run (every pass counted), each with its own full LR schedule: ``baseline-flops`` reads further in the data
   order (more unique tokens; ``--no-flops-baseline`` skips it), ``baseline-epochs`` re-reads exactly the rows the
   FBT run read, in a fresh order each epoch (``--unique-batches``: the same unique tokens;
   ``--no-epochs-baseline`` skips it). Finished runs of the same options and data are reused;
3. evaluates on the same held-out rows: whole rows in ``standard`` / K-pass / ``exact`` mode, and the continuation
   of each row after a prompt in every decode mode (``standard``, ``soft``, ``fused``, ``exact``), each with its
   inference FLOPs relative to ``standard`` (:func:`fullband.eval.flops.inference_flops`) and the paired
   difference to the baseline at equal tokens and to both controls; checks the recipe's targets (the best
   feedback mode no worse than the model's own standard mode, exact within 0.02 nats of K passes, no mode
   collapsing);
4. samples a few continuations of held-out prompts per decode mode;
5. shows where the fed-back state must pay (:mod:`fullband.experiments.quickstart_state`, ``--no-state`` skips it):
   the running-state tasks of ``fullband experiment state`` (S3 and parity, a label at every position) at a cheap
   setting, the L-layer FBT model trained with the exact recurrence vs plain L- and 2L-layer models on equal
   tokens, tested at T, 2T and 4T on rows none of them trained on, FBT in exact mode and with only its fed-back
   state replaced (the test rows' mean state at that step, another row's state; the token kept); its runs and
   full report in ``OUT/state/``;
6. writes ``OUT/report.md`` (tables, targets, curves, samples), ``OUT/results.json``, ``OUT/curves.png``, and the
   models with their tokenizer in ``OUT/baseline/``, ``OUT/fbt/``, ``OUT/baseline-flops/`` and
   ``OUT/baseline-epochs/``; prints the tables.

``results.json`` has ``baseline_val_loss`` and ``fbt_val_loss`` (FBT in ``exact`` mode: the model as it decodes
with feedback), plus every mode's figure.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time

import torch
from transformers.utils import logging as hf_logging

from ..eval.flops import flop_parameters, inference_flops
from ..eval.scoring import load_any_model, row_losses
from ..model.generation import MODES, generate
from ..training.config import TrainConfig
from ..training.device import load_average
from ..training.distributed import resolve_device
from ..training.pretrain import build_tokenizer_and_corpus, refuse_changed_runs, spread_rows
from ..utils.jobs import default_jobs, run_jobs
from ..utils.plotting import plot_loss_curves
from ..utils.stats import bootstrap_ci
from .common import (branch_step, epochs_config, flops_config, train_or_reuse, train_pair, unique_tokens,
                     write_results)
from .quickstart_state import run_state_part

DEFAULTS = dict(out=os.path.join("runs", "quickstart"), preset="tiny", steps=300, batch_size=16, seq_len=128,
                vocab_size=4096, seed=0, feedback_start=TrainConfig().feedback_start, num_passes=2, eval_rows=128, samples=3,
                sample_tokens=48, prompt_tokens=24, score_prompt=None, state_steps=900, state_test_rows=200)
# The recipe is `fullband train`'s defaults (chosen by `fullband experiment recipe`, see the README): both runs share
# the LR schedule; the report lists these settings of the FBT run.
RECIPE_FIELDS = ("fusion", "lr_schedule", "decay_fraction", "fusion_lr_mult", "fusion_warmup", "clip_per_group",
                 "feedback_ramp", "fusion_only")
# the most a feedback mode may lose to the same model's standard mode before it counts as collapsed (nats/token)
COLLAPSE = 0.1


def _configs(args):
    common = dict(steps=args.steps, seed=args.seed, preset=args.preset, seq_len=args.seq_len,
                  batch_size=args.batch_size, vocab_size=args.vocab_size, feedback_start=args.feedback_start,
                  progress=not args.no_progress and args.jobs == 1, tensorboard=False, plot=False, eval_every=0,
                  eval_rows=32, device=args.device, save_every=0)
    base = TrainConfig(out=os.path.join(args.out, "baseline"), num_passes=1, deep_passes=1, **common)
    fbt = TrainConfig(out=os.path.join(args.out, "fbt"), num_passes=args.num_passes, **common)
    return base, fbt


# the running-state part's cost at 900 steps in default plain steps (one thread: trained and scored in about 230)
STATE_COST = 230.0


def _controls(args, fbt, vocab_size: int):
    """The baseline given as many training FLOPs as the FBT run (counted as its metrics are, the fusion's
    included): more steps, same schedule shape; reading further (baseline-flops) or re-reading exactly the FBT
    run's rows (baseline-epochs)."""
    return (flops_config(fbt, os.path.join(args.out, "baseline-flops"), vocab_size),
            epochs_config(fbt, os.path.join(args.out, "baseline-epochs"), vocab_size))


def _samples(models: dict, tokenizer, val_rows: torch.Tensor, n: int, prompt_tokens: int, new_tokens: int,
             seed: int) -> tuple[list[dict], str]:
    """Sampled continuations of held-out prompts per (model, decode mode)."""
    how = "fullband.model.generation.generate (temperature 0.8, top-k 40)"
    bos = tokenizer.bos_token_id
    picks = [int(i) for i in torch.linspace(0, val_rows.shape[0] - 1, n).round().long()] if n > 0 else []
    prompts = []
    for i in picks:
        row = val_rows[i].tolist()
        # start the prompt at a line start so it reads well; a held-out document's own text
        text = tokenizer.decode(row, skip_special_tokens=True)
        cut = text.find("\n", len(text) // 8)
        text = text[cut + 1:] if cut >= 0 else text
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:prompt_tokens]
        prompts.append([bos, *ids] if bos is not None else ids)
    out = []
    for label, (model, modes) in models.items():
        for mode in modes:
            for j, prompt in enumerate(prompts):
                ids = torch.tensor([prompt])
                g = torch.Generator().manual_seed(seed + 1000 * j)
                with torch.inference_mode():
                    res = generate(model, ids, mode=mode, max_new_tokens=new_tokens, do_sample=True,
                                   temperature=0.8, top_k=40, generator=g, ignore_eos=True)
                new = res.new_tokens[0]
                out.append({"model": label, "mode": mode, "prompt_index": j,
                            "prompt": tokenizer.decode(prompt, skip_special_tokens=True),
                            "continuation": tokenizer.decode(new, skip_special_tokens=True)})
    return out, how


def _ci(d: dict | None) -> str:
    return "" if d is None else f"{d['estimate']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"


# the controls beside the baseline at equal tokens: (key, run name, what it matches)
CONTROLS = (("flops", "baseline-flops", "equal FLOPs, more unique tokens"),
            ("epochs", "baseline-epochs", "equal unique tokens + FLOPs"))


def _table(rows: list[dict]) -> str:
    prompt = rows[0]["prompt_tokens"]
    what = (f"continuation after a {prompt}-token prompt, {rows[0]['tokens']:,} tokens" if prompt
            else f"whole rows, {rows[0]['tokens']:,} tokens")
    head = " | ".join(f"Δ vs {name}, {match} [95% CI]" for _, name, match in CONTROLS)
    lines = [f"| model | mode ({what}) | val loss (nats/token) | perplexity | inference FLOPs (× standard) | "
             f"Δ vs baseline, equal tokens [95% CI] | {head} |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        deltas = " | ".join(_ci(r.get(f"delta_{key}")) for key, _, _ in CONTROLS)
        lines.append(f"| {r['model']} | {r['label']} | {r['loss']:.4f} | {r['perplexity']:.2f} | "
                     f"{r['inference_flops']:.3f} | {_ci(r.get('delta'))} | {deltas} |")
    for key, name, match in CONTROLS:
        if f"{key}_baseline_loss" in rows[0]:
            loss = rows[0][f"{key}_baseline_loss"]
            lines.append(f"| {name} | standard ({match}) | {loss:.4f} | {math.exp(min(loss, 50.0)):.2f} | "
                         f"{rows[0]['inference_flops']:.3f} | | | |")
    return "\n".join(lines)


def _score_table(plan, rows, K: int, prompt: int, controls: dict, seed: int) -> list[dict]:
    """Per (model, mode) the mean held-out loss of ``rows`` (tokens after ``prompt``) and its inference FLOPs
    relative to ``standard`` (:func:`fullband.eval.flops.inference_flops`), with the paired difference to the first
    line's model (equal tokens) and to each control in ``controls`` (``{key: model}`` of :data:`CONTROLS`):
    percentile bootstraps over rows of the per-row differences."""
    out, base_rows = [], None
    control_rows = {key: row_losses(m, rows, "standard", prompt_length=prompt) for key, m in controls.items()}
    tokens = int(rows[:, max(1, prompt):].numel())
    for model_name, model, label, mode in plan:
        per_row = row_losses(model, rows, mode, num_passes=K, prompt_length=prompt)
        loss = float(per_row.mean())
        cost = inference_flops(mode, flop_parameters(model), rows.shape[1], prompt, num_passes=K)
        entry = {"model": model_name, "label": label, "mode": mode, "num_passes": K if mode == "passes" else None,
                 "loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens, "prompt_tokens": prompt,
                 "inference_flops": cost["relative"], "inference_flops_per_token": cost["flops_per_token"],
                 "sequential_calls": cost["sequential_calls"]}
        if base_rows is None:
            base_rows = per_row
            for key, r in control_rows.items():
                entry[f"{key}_baseline_loss"] = float(r.mean())
        else:
            entry["delta"] = bootstrap_ci((per_row - base_rows).tolist(), seed=seed).as_dict()
            for key, r in control_rows.items():
                entry[f"delta_{key}"] = bootstrap_ci((per_row - r).tolist(), seed=seed).as_dict()
        out.append(entry)
    return out


def _targets(table_rows: list[dict], decode_rows: list[dict]) -> dict:
    """The recipe's targets for the FBT model, checked on held-out text."""
    fbt = {e["mode"]: e["loss"] for e in table_rows if e["model"] == "FBT"}
    dec = {e["mode"]: e["loss"] for e in decode_rows if e["model"] == "FBT"}
    # every feedback mode beside FBT's standard mode scored on the same tokens: (loss, standard's loss)
    pairs = {m: (v, fbt["standard"]) for m, v in fbt.items() if m != "standard"}
    pairs.update({f"{m} (decode)": (v, dec["standard"]) for m, v in dec.items() if m != "standard"})
    best_mode = min(pairs, key=lambda m: pairs[m][0])
    worst = max(loss - standard for loss, standard in pairs.values())
    return {
        "best_feedback_mode": best_mode,
        "best_feedback_not_worse_than_standard": pairs[best_mode][0] <= pairs[best_mode][1],
        "exact_minus_passes": fbt["exact"] - fbt["passes"],
        "exact_within_0.02_of_passes": abs(fbt["exact"] - fbt["passes"]) <= 0.02,
        "worst_feedback_mode_minus_standard": worst,
        "no_mode_collapses": worst <= COLLAPSE,
    }


def _targets_text(t: dict) -> str:
    ok = lambda b: "met" if b else "NOT met"  # noqa: E731
    return (f"Targets: best feedback mode ({t['best_feedback_mode']}) <= FBT standard: "
            f"{ok(t['best_feedback_not_worse_than_standard'])}; exact - K-pass = {t['exact_minus_passes']:+.4f} "
            f"(within 0.02: {ok(t['exact_within_0.02_of_passes'])}); worst feedback mode - standard = "
            f"{t['worst_feedback_mode_minus_standard']:+.4f} (no collapse, <= {COLLAPSE}: {ok(t['no_mode_collapses'])}).")


def run_quickstart(args) -> dict:
    """The main job (the module docstring), at one thread in this process and in each of its ``--jobs`` workers (the
    caller's thread count restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_quickstart(args)
    finally:
        torch.set_num_threads(threads)


def _run_quickstart(args) -> dict:
    hf_logging.disable_progress_bar()
    t_all = time.perf_counter()
    load_start = load_average()
    for name in ("steps", "batch_size", "seq_len", "eval_rows"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.samples < 0 or args.sample_tokens < 1 or args.prompt_tokens < 1:
        raise ValueError("--samples must be >= 0, --sample-tokens and --prompt-tokens >= 1")
    if args.state_steps < 1 or args.state_test_rows < 2:
        raise ValueError("--state-steps must be >= 1 and --state-test-rows >= 2 (the shuffle intervention feeds each "
                         "test row another row's state)")
    if args.num_passes < 2:
        raise ValueError(f"--num-passes must be >= 2 for the FBT model, got {args.num_passes}")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    # one thread a process, trained side by side (:mod:`fullband.utils.jobs`): the numbers of a one-thread run
    if args.jobs is None:
        args.jobs = 1 if resolve_device(args.device).type != "cpu" else default_jobs(4)
    if args.score_prompt is None:  # a quarter of a row, at most 32 tokens
        args.score_prompt = max(1, min(32, args.seq_len // 4))
    if not 1 <= args.score_prompt < args.seq_len - 1:
        raise ValueError(f"--score-prompt must be in [1, --seq-len - 1), got {args.score_prompt}")
    base_cfg, fbt_cfg = _configs(args)
    for c in (base_cfg, fbt_cfg):
        c.validate()
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))

    # ---- data (once, for every run); the controls' steps count the model's FLOPs with the tokenizer's vocabulary
    t = time.perf_counter()
    corpus = build_tokenizer_and_corpus(fbt_cfg)
    t_data = time.perf_counter() - t
    flops_cfg, epochs_cfg = _controls(args, fbt_cfg, len(corpus.tokenizer))
    for c in (flops_cfg, epochs_cfg):
        c.validate()
    say(f"quickstart: corpus {corpus.train_rows.numel():,} train tokens ({len(corpus.train_docs)} works), "
        f"{corpus.val_rows.numel():,} held-out tokens ({len(corpus.val_docs)} works: {', '.join(corpus.val_docs)}); "
        f"{t_data:.1f}s")

    # ---- training (a finished run of the same options and data is reused; one of other options or data is kept
    # unless --overwrite: checked before anything is trained)
    flops_run = None if args.no_flops_baseline else flops_cfg
    epochs_run = None if args.no_epochs_baseline else epochs_cfg
    refuse_changed_runs([c for c in (base_cfg, fbt_cfg, flops_run, epochs_run) if c is not None], corpus,
                        args.overwrite)
    # ---- training, in --jobs one-thread processes: the running-state part (fullband experiment state at a cheap
    # setting: trained and scored), the baseline/FBT pair (sharing the steps before the feedback start), and each
    # control unless it shares steps with the pair
    share = not args.no_share_prefix
    start = fbt_cfg.schedule().start_step(fbt_cfg.steps)
    flops_alone = flops_run is not None and not (share and branch_step(base_cfg, flops_run) > 0)
    # each unit's cost in plain steps, to order them: FBT's is its FLOPs in plain steps, the controls' step count
    fbt_cost = flops_cfg.steps
    work = [(base_cfg.steps + fbt_cost - (start if share else 0) + (0 if flops_alone or flops_run is None
             else flops_run.steps), "baseline + FBT", train_pair,
             (base_cfg, fbt_cfg, corpus, share, None if flops_alone else flops_run, args.overwrite))]
    if flops_alone:
        work.append((flops_run.steps, "baseline-flops", train_or_reuse,
                     (flops_run, corpus, "baseline-flops (FBT's training FLOPs, fresh rows)")))
    if epochs_run is not None:
        work.append((epochs_run.steps, "baseline-epochs", train_or_reuse,
                     (epochs_run, corpus, "baseline-epochs (FBT's unique rows for its training FLOPs)")))
    if not args.no_state:
        work.append((STATE_COST * args.state_steps / 900, "running-state part", run_state_part, (args,)))
    say(f"quickstart: training {len(work)} units ({', '.join(w[1] for w in work)}), {args.jobs} at a time")
    t = time.perf_counter()
    done = run_jobs(work, args.jobs, say)
    t_train = time.perf_counter() - t
    shared = done["baseline + FBT"][2]
    running_state = done.get("running-state part")
    t_state = running_state["seconds"] if running_state else 0.0
    # the new arm's own training time (as its run recorded it; a reused run's from when it was trained)
    t_epochs = done["baseline-epochs"].get("elapsed", 0.0) if epochs_run is not None else 0.0

    # ---- evaluation: the saved models, reloaded (checks they load), on the same held-out rows
    t = time.perf_counter()
    baseline = load_any_model(base_cfg.out, device="cpu")[0]  # the plain backbone's own checkpoint
    fbt = load_any_model(fbt_cfg.out, device="cpu")[0]
    rows = spread_rows(corpus.val_rows, args.eval_rows)
    say(f"quickstart: evaluating on {rows.shape[0]} of {corpus.val_rows.shape[0]} held-out rows "
        f"({rows[:, 1:].numel():,} predicted tokens)")
    K = args.num_passes
    controls = {key: load_any_model(c.out, device="cpu")[0]
                for key, c in (("flops", flops_run), ("epochs", epochs_run)) if c is not None}
    # whole rows (every token after the first): the K-pass and exact figures of training's objective
    plan = [("baseline", baseline, "standard", "standard"),
            ("FBT", fbt, "standard (K=1, no feedback)", "standard"),
            ("FBT", fbt, f"passes (K={K}, teacher-forced)", "passes"),
            ("FBT", fbt, "exact (token-by-token recurrence)", "exact")]
    table_rows = _score_table(plan, rows, K, 0, controls, args.seed)
    # continuations after a prompt, as decoding sees them: every decode mode on the same tokens
    decode_plan = [("baseline", baseline, "standard", "standard")] + [
        ("FBT", fbt, mode, mode) for mode in MODES]
    decode_rows = _score_table(decode_plan, rows, K, args.score_prompt, controls, args.seed)
    t_eval = time.perf_counter() - t

    # ---- samples
    t = time.perf_counter()
    samples, how = _samples({"baseline": (baseline, ["standard"]), "FBT": (fbt, list(MODES))},
                            corpus.tokenizer, corpus.val_rows, args.samples, args.prompt_tokens, args.sample_tokens,
                            args.seed)
    t_samples = time.perf_counter() - t

    # ---- curves, results, report
    curves = os.path.join(args.out, "curves.png")
    plot_loss_curves({"baseline": os.path.join(base_cfg.out, "metrics.jsonl"),
                      "FBT": os.path.join(fbt_cfg.out, "metrics.jsonl")}, curves,
                     title=f"quickstart: {args.preset}, {base_cfg.steps} steps x {base_cfg.batch_size * base_cfg.seq_len:,} tokens")
    wall = time.perf_counter() - t_all
    by = {e["mode"] if e["model"] == "FBT" else "baseline": e for e in table_rows}
    arms = [(run, c) for run, c in (("baseline", base_cfg), ("fbt", fbt_cfg), ("baseline-flops", flops_run),
                                    ("baseline-epochs", epochs_run)) if c is not None]
    results = {
        "baseline_val_loss": by["baseline"]["loss"],
        "fbt_val_loss": by["exact"]["loss"],
        "fbt_val_loss_mode": "exact",
        "fbt_standard_val_loss": by["standard"]["loss"],
        "fbt_passes_val_loss": by["passes"]["loss"],
        "fbt_passes_num_passes": K,
        "fbt_exact_val_loss": by["exact"]["loss"],
        "fbt_minus_baseline": {m: by[m]["delta"] for m in ("standard", "passes", "exact")},
        "eval_rows": int(rows.shape[0]), "val_rows": int(corpus.val_rows.shape[0]),
        "eval_tokens": by["baseline"]["tokens"],
        "table": table_rows,
        "decode_table": decode_rows,
        "score_prompt": args.score_prompt,
        "fbt_minus_baseline_flops": {e["mode"]: e.get("delta_flops") for e in table_rows if e["model"] == "FBT"},
        "baseline_flops_steps": None if args.no_flops_baseline else flops_cfg.steps,
        "baseline_flops_val_loss": table_rows[0].get("flops_baseline_loss"),
        "fbt_minus_baseline_epochs": {e["mode"]: e.get("delta_epochs") for e in table_rows if e["model"] == "FBT"},
        "baseline_epochs_steps": None if args.no_epochs_baseline else epochs_cfg.steps,
        "baseline_epochs_val_loss": table_rows[0].get("epochs_baseline_loss"),
        "unique_train_tokens": {run: unique_tokens(c, corpus) for run, c in arms},
        "train_tokens": {run: c.steps * c.batch_size * c.seq_len for run, c in arms},
        "targets": _targets(table_rows, decode_rows),
        "recipe": {k: getattr(fbt_cfg, k) for k in RECIPE_FIELDS},
        "train_tokens_per_model": base_cfg.steps * base_cfg.batch_size * base_cfg.seq_len,
        "steps": base_cfg.steps, "batch_size": base_cfg.batch_size, "seq_len": base_cfg.seq_len,
        "preset": args.preset, "parameters": sum(p.numel() for p in baseline.parameters()),
        "fusion_parameters": sum(p.numel() for p in fbt.feedback.parameters()),
        "feedback_start_step": start, "shared_prefix_steps": shared,
        "num_passes": K, "deep_passes": fbt_cfg.deep_passes, "deep_fraction": fbt_cfg.deep_fraction,
        "prefix_mix": fbt_cfg.prefix_mix, "jitter": fbt_cfg.jitter, "fusion_lr_mult": fbt_cfg.fusion_lr_mult,
        "lr": fbt_cfg.resolved_lr(), "seed": args.seed, "val_documents": corpus.val_docs,
        "train_documents": len(corpus.train_docs), "corpus_train_tokens": corpus.train_rows.numel(),
        "seconds": {"data": t_data, "train": t_train, "train_baseline_epochs": t_epochs, "eval": t_eval,
                    "samples": t_samples, "state": t_state, "total": wall},
        "running_state": running_state,
        "threads": torch.get_num_threads(), "jobs": args.jobs, "cpu_count": os.cpu_count(),
        "load_average": [load_start, load_average()],
        "torch": torch.__version__, "platform": platform.platform(),
        "samples": samples, "sampling": how, "fbt_default_mode": fbt.config.default_feedback_mode,
    }
    table = _table(table_rows) + "\n\n" + _table(decode_rows) + "\n\n" + _targets_text(results["targets"])
    write_results(args.out, results, _report(results, table, args))
    print(table)
    if running_state:
        print("\n" + running_state["table"] + "\nTraining time: " + ", ".join(
            f"{n} {v:.0f}s" for n, v in running_state["train_seconds"].items()) + ".")
    print(f"\nbaseline {results['baseline_val_loss']:.4f} vs FBT (exact) {results['fbt_val_loss']:.4f} nats/token on "
          f"{results['eval_tokens']:,} held-out tokens; {results['train_tokens_per_model']:,} training tokens each; "
          f"{wall:.0f}s in all. Report: {os.path.join(args.out, 'report.md')}")
    return results


def _state_section(part: dict | None) -> list[str]:
    """The report's running-state section (none with --no-state)."""
    if not part:
        return []
    s = part["settings"]
    return [f"## Where the fed-back state must pay: running-state tasks ({s['tasks'].replace(',', ', ')})", "",
            f"Streams of T = {s['length']} inputs with a label at every position (the state after that input: the "
            "running product of S3 permutations, the parity of the prefix), both tasks mixed in one stream; every "
            f"model {s['steps']} steps x {s['batch_size']} rows (equal tokens), Llama d{s['hidden']}, L = "
            f"{s['layers']}; `fbt-L-glu-x2` is the L-layer model with feedback (the paper's GLU entry) trained on the "
            "exact recurrence at linear cost: each row's exact states token by token without gradient, then 2 "
            "teacher-forced passes with gradient from them (`--exact-states --grad-passes 2`; K = "
            f"{s['num_passes']} passes would be the same recurrence at quadratic cost, its FLOPs under the table); "
            f"`baseline-2L` has twice the layers. Tested on {s['test_rows']} fresh rows per task and length (none of "
            "them a training row), at the training length and beyond (length generalisation); FBT in exact mode "
            "(token by token, as it decodes) and with only its fed-back state replaced, the token kept: by the mean "
            "over the test rows of the state at that step, or by the state another row had there (how much the "
            "state carries; a zeroed state is no such test on the GLU entry, it zeroes the whole input). The CI "
            "resamples the test rows of this one seed, not seeds. Per-position accuracy [95% CI] / "
            "last-position accuracy; training seconds: " + ", ".join(
                f"{n} {v:.0f}s" for n, v in part["train_seconds"].items()) + ". The equal-FLOPs controls, deeper "
            "baselines, S5, variable tracking and the cost per K are in `fullband experiment state`; this part's full "
            f"report: `{part['report']}`.", "", part["table"], ""]


def _report(res: dict, table: str, args) -> str:
    d = res["fbt_val_loss"] - res["baseline_val_loss"]
    ci = res["fbt_minus_baseline"]["exact"]
    verdict = ("lower (better) than" if d < 0 else "higher (worse) than" if d > 0 else "equal to")
    sec = res["seconds"]
    lines = [
        "# fullband quickstart",
        "",
        f"A plain baseline and a full-bandwidth (FBT) model, preset `{res['preset']}` "
        f"({res['parameters'] / 1e6:.2f}M backbone parameters; the fusion adds {res['fusion_parameters'] / 1e3:.0f}k), "
        f"each trained for {res['steps']} steps x {res['batch_size']} rows x {res['seq_len']} tokens = "
        f"{res['train_tokens_per_model']:,} tokens of the embedded Shakespeare corpus "
        f"({res['train_documents']} works, {res['corpus_train_tokens']:,} tokens), same seed ({res['seed']}), "
        f"same data order, same backbone config, peak LR {res['lr']:g} ({res['recipe']['lr_schedule']}).",
        "",
        f"FBT recipe: plain (K=1) for the first {res['feedback_start_step']} steps, then K={res['num_passes']} with "
        f"{res['deep_fraction']:.0%} of the feedback steps at K={res['deep_passes']}, prefix mixing "
        f"p={res['prefix_mix']}, jitter {res['jitter']}; recipe {res['recipe']}.",
        (f"`baseline-flops` is the baseline trained for {res['baseline_flops_steps']} steps: as many training FLOPs "
         "as the FBT run (every pass counted), reading further in the data order "
         f"({res['unique_train_tokens']['baseline-flops']:,} unique tokens)."
         if res["baseline_flops_steps"] else "No `baseline-flops` was trained (--no-flops-baseline)."),
        (f"`baseline-epochs` is the baseline trained for {res['baseline_epochs_steps']} steps, the same FLOPs, on "
         f"exactly the FBT run's {res['unique_train_tokens']['baseline-epochs']:,} unique tokens (the rows of its "
         f"{res['steps']} batches, `--unique-batches {res['steps']}`), re-read in a fresh order each epoch "
         f"({res['train_tokens']['baseline-epochs'] / res['train_tokens']['fbt']:.2f} epochs); its own full LR "
         f"schedule, trained in {res['seconds']['train_baseline_epochs']:.0f}s."
         if res["baseline_epochs_steps"] else "No `baseline-epochs` was trained (--no-epochs-baseline)."),
        "Inference FLOPs: forward FLOPs of scoring the table's rows in that mode over `standard`'s on the same rows "
        "(`fullband.eval.flops.inference_flops`: K-pass = K passes over the row, logits once; exact = one "
        "token-by-token pass over a KV cache, standard's FLOPs plus a fusion per token but T sequential calls; "
        "soft / fused = the prompt in 1 / 1 + prefill passes, then one fused step per continuation token).",
        (f"The first {res['shared_prefix_steps']} steps are identical for both runs (K=1, same seed and data, no random "
         "draws) and were trained once: the FBT run continued from the baseline's checkpoint at that step."
         if res["shared_prefix_steps"] else "Both runs were trained from scratch."),
        "",
        f"## Held-out loss ({res['eval_rows']} of the {res['val_rows']} rows of the held-out works, spread evenly over them: "
        f"{', '.join(res['val_documents'])}; {res['eval_tokens']:,} predicted tokens, the same rows for every line)",
        "",
        table,
        "",
        f"FBT in exact mode (what decoding with feedback computes) is {abs(d):.4f} nats/token {verdict} the baseline "
        f"(95% CI of the difference {ci['low']:+.4f} to {ci['high']:+.4f}: a percentile bootstrap over the "
        f"{res['eval_rows']} rows, paired; rows of one work are correlated, so read it as optimistic). "
        "Modes: *standard* = one ordinary pass, no feedback; *passes* = the K-pass teacher-forced forward used in "
        "training; *exact* = the true recurrence, each position fused with the previous position's final state.",
        "",
        "![loss curves](curves.png)",
        "",
        *_state_section(res.get("running_state")),
        f"## Samples ({res['sampling']}, held-out prompts)",
        "",
        "Decode modes (`fullband.generation`): *standard* = no feedback; *soft* = the prompt read plainly, every "
        "generated token fused with the previous state; *fused* = as soft after extra Jacobi passes over the prompt; "
        "*exact* = the prompt itself through the exact recurrence, then as soft. Same seed per prompt for every line.",
        "",
    ]
    by_prompt = {}
    for s in res["samples"]:
        by_prompt.setdefault(s["prompt_index"], []).append(s)
    for j, items in sorted(by_prompt.items()):
        lines += [f"### Prompt {j + 1}", "", "```", items[0]["prompt"], "```", ""]
        for s in items:
            default = " (its default decode mode)" if s["model"] == "FBT" and s["mode"] == res.get("fbt_default_mode") else ""
            lines += [f"**{s['model']}, {s['mode']}{default}**", "", "```", s["continuation"], "```", ""]
    lines += [
        "## Run",
        "",
        f"Wall time {sec['total']:.0f}s (data {sec['data']:.0f}s, training {sec['train']:.0f}s"
        + f" in {res.get('jobs', 1)} process(es), the running-state part's {sec['state']:.0f}s among it"
        + f", evaluation {sec['eval']:.0f}s, samples {sec['samples']:.0f}s) at {res['threads']} CPU thread(s) a "
        f"process, of {res['cpu_count']} "
        f"CPUs (1-minute load average {res['load_average'][0]} at the start, {res['load_average'][1]} at the end), "
        f"torch {res['torch']}.",
        "",
        "Models: `baseline/`, `fbt/` and the controls' directories (`save_pretrained` + tokenizer; `import fullband` then "
        "`AutoModelForCausalLM.from_pretrained(dir)`), metrics in each `metrics.jsonl`, figures in `results.json`.",
        "",
        f"Reproduce: `fullband quickstart --steps {res['steps']} --preset {res['preset']} --seed {res['seed']}`.",
        "",
    ]
    return "\n".join(lines)
