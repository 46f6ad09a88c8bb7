"""``fullband experiment reasoning``: reasoning at the edge of the baseline, with traces of mixed verbosity.

    Per seed, four models trained on the same synthetic problems (:mod:`fullband.eval.problems`; by default
    multi-step addition and subtraction at a difficulty where the baseline with chain of thought is right on roughly
    half of the held-out problems): ``baseline`` (plain), ``FBT`` (``fullband train``'s recipe, sharing the
    baseline's first K = 1 steps) on equal tokens in the same order, ``baseline-flops``, the baseline trained for as
    many training FLOPs as FBT (every pass counted, reading further), and ``baseline-epochs``, as long, re-reading
    exactly the rows FBT read (``--unique-batches``: equal unique tokens and FLOPs; ``--no-epochs-baseline`` skips
    it). Each training problem is written in one verbosity drawn at random (``--verbosity-mix``): ``full`` (every
    step), ``partial`` (about half of the steps written, the others done silently) or ``direct`` (the answer only),
    so a model can choose how much to write.
    Held-out problems (none of whose questions occur in training) are decoded greedily by every model in every
    decode mode it has (FBT: standard, soft, fused, exact), once letting the model choose (``free``) and once per
    forced verbosity (the prompt followed by that verbosity's opening tokens).
    Reported per model, mode and verbosity: accuracy (math-verify), mean trace length (tokens before ``####``),
    for ``free`` which verbosity the model chose, and the decode FLOPs relative to ``standard`` (:func:`decode_flops`);
    paired against the baseline at equal tokens, ``baseline-flops`` at equal FLOPs and ``baseline-epochs`` at equal
    unique tokens and FLOPs, over seeds that decode the same problems (the problem is the unit): the exact
    sign-flip test of the per-problem correctness differences summed over seeds (one seed: exact McNemar), McNemar
    per seed, and percentile-bootstrap 95% CIs of the accuracy and trace-length differences that draw one set of
    problems per resample for every seed (problems resampled, not training runs). Finished runs of the same
    options and data are reused, and their decodes as long as the model's weights are the same; a finished run
    that differs is kept and the experiment stops with an error naming the differences, unless ``--overwrite``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import time

import numpy as np
import torch
from transformers.utils import logging as hf_logging

from ..data.corpus import Corpus, Document, pack, tokenize_documents, train_tokenizer
from ..eval.flops import flop_parameters, inference_flops
from ..eval.problems import ANSWER_MARKER, VERBOSITIES, format_example, format_prompt, make_problems
from ..eval.reasoning import evaluate_reasoning, special_bos, style_openings, summarize
from ..model.generation import MODES
from ..model.modeling import load_model
from ..training.checkpoint import evaluation_key
from ..training.device import load_average
from ..training.distributed import resolve_device
from ..utils.io import atomic_write_json, atomic_write_text
from ..utils.stats import bootstrap_ci_shared_problems, paired_test_shared_problems
from .common import (
    apply_quick,
    base_config,
    finished,
    plain_config,
    refuse_changed_runs,
    say_for,
    steps_for,
    flops_matched_steps,
    train_or_reuse,
    train_pair,
    write_outputs,
)
from .reasoning_controls import (
    control_configs,
    curve_png,
    fbt_recipe,
    pause_count,
    stage_drops,
    stage_label,
    trace_savings,
)
from .reasoning_report import BASELINE, EPOCHS, FBT, FLOPS, INTERN, KINDS, PAUSE_ARM, markdown, tables

RS_DEFAULTS = dict(out=os.path.join("runs", "experiments", "reasoning"), preset="tiny", steps=1200, batch_size=16,
                   seq_len=128, vocab_size=300, task="arithmetic", train_problems=20000, test_problems=200,
                   max_new_tokens=64, num_seeds=2, verbosity_mix="full=1,partial=1,direct=1", styles="free,full,partial,direct",
                   fbt_modes="standard,soft,fused,exact", gen_batch_size=50, bootstrap=10_000, fbt_recipe="default",
                   pause_tokens=None, internalize_stages=3)
RS_QUICK = dict(preset="micro", steps=6, batch_size=4, seq_len=64, train_problems=200, test_problems=6,
                max_new_tokens=24, bootstrap=200)
# Arithmetic at the edge of the default budget (1,200 steps): one-seed probes of the baseline's free accuracy gave
# 0.08 (2-3 operations, 600 steps), 0.045 (2-4, 600), 0.075 (3-4, 600) and 0.505 (3-4, 1,200); the README has them.
TASK_DEFAULTS = {"arithmetic": {"num_ops": (3, 4), "ops": "+-"}, "s3": {"num_steps": (6, 10)}}
STYLES = ("free",) + VERBOSITIES

# ============================================================================================== data


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


def parse_mix(text: str) -> dict[str, float]:
    """``--verbosity-mix full=1,partial=1,direct=1`` -> normalised weights (a verbosity left out has weight 0)."""
    mix = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, sep, raw = item.partition("=")
        name = name.strip()
        try:
            weight = float(raw)
        except ValueError:
            weight = -1.0
        if not sep or name not in VERBOSITIES or weight < 0 or name in mix:
            raise ValueError(f"--verbosity-mix takes NAME=WEIGHT pairs with NAME in {', '.join(VERBOSITIES)} "
                             f"(each once, weights >= 0), got {text!r}")
        mix[name] = weight
    total = sum(mix.values())
    if total <= 0:
        raise ValueError(f"--verbosity-mix needs a positive weight, got {text!r}")
    return {v: mix.get(v, 0.0) / total for v in VERBOSITIES}


def reasoning_problems(task: str, n_train: int, n_test: int, seed: int, options: dict):
    """``(train, test, overlap_removed)``: training problems from ``seed``, test problems from another seed
    with every question that occurs in training removed."""
    if task == "gsm8k":
        raise ValueError("the reasoning experiment trains on synthetic tasks: choose arithmetic, state or permutation")
    try:
        train_p = make_problems(task, n_train, seed, **options)
        seen = {p.question for p in train_p}
        pool = make_problems(task, 4 * n_test, seed + 7_919, **options)
    except TypeError as err:
        raise ValueError(f"--task-option: {err}") from None
    test = [p for p in pool if p.question not in seen]
    removed = len(pool) - len(test)
    test = test[:n_test]
    if not test:
        raise ValueError("every test question also occurs in training; use a harder task or fewer training problems")
    return train_p, test, removed


def training_documents(problems, mix: dict[str, float], seed: int, cot: bool = True, pause: int = 0,
                       drop: float = 0.0) -> tuple[list[Document], dict]:
    """One document per problem, written in a verbosity drawn from ``mix`` (seeded: every arm's documents draw the
    same verbosities); also the counts drawn. ``pause`` fillers after each prompt and ``drop`` (the first steps of
    each trace removed): :func:`fullband.eval.problems.format_example`."""
    rng = random.Random(f"verbosity:{seed}")
    names, weights = list(mix), [mix[v] for v in mix]
    docs, counts = [], dict.fromkeys(VERBOSITIES, 0)
    for p in problems:
        v = rng.choices(names, weights)[0] if cot else "direct"
        counts[v] += 1
        docs.append(Document(p.id, format_example(p, cot, v, pause=pause, drop=drop)))
    return docs, counts


def build_data(args, options: dict, mix: dict, say) -> tuple:
    """Problems, training file, tokenizer and packed rows (shared by every seed: the seeds vary init and order)."""
    train_p, test_p, removed = reasoning_problems(args.task, args.train_problems, args.test_problems, args.seed,
                                                  options)
    data_dir = os.path.join(args.out, "data")
    os.makedirs(data_dir, exist_ok=True)
    docs, counts = training_documents(train_p, mix, args.seed, cot=not args.no_cot)
    train_file = os.path.join(data_dir, "train.jsonl")
    atomic_write_text(train_file, "".join(json.dumps({"name": d.name, "text": d.text}) + "\n" for d in docs))
    atomic_write_text(os.path.join(data_dir, "test.jsonl"), "".join(json.dumps(p.to_dict()) + "\n" for p in test_p))
    tokenizer = train_tokenizer((d.text for d in docs), args.vocab_size)
    corpus = packed_corpus(tokenizer, docs, args.seq_len)
    say(f"reasoning: {args.task} {options}, {len(train_p):,} training problems ({corpus.train_rows.numel():,} "
        f"tokens; verbosity drawn: {counts}), {len(test_p)} held-out problems ({removed} candidates dropped as "
        "training duplicates)")
    pause = pause_count(args.pause_tokens, tokenizer, test_p, [d.text for d in docs])
    corpora = {BASELINE: corpus}
    arms = ([(PAUSE_ARM, pause, 0.0, "train-pause.jsonl")] if pause else []) + [
        (stage_label(j, args.internalize_stages), 0, drop, f"train-internalize{j}.jsonl")
        for j, drop in enumerate(stage_drops(args.internalize_stages))]
    for label, n, drop, name in arms:  # the controls' own documents: the same problems and verbosities
        arm_docs, _ = training_documents(train_p, mix, args.seed, not args.no_cot, pause=n, drop=drop)
        atomic_write_text(os.path.join(data_dir, name),
                          "".join(json.dumps({"name": d.name, "text": d.text}) + "\n" for d in arm_docs))
        corpora[label] = packed_corpus(tokenizer, arm_docs, args.seq_len)
    return train_p, test_p, removed, counts, train_file, tokenizer, corpora, pause


def packed_corpus(tokenizer, docs: list[Document], seq_len: int) -> Corpus:
    """``docs`` tokenized and packed into rows of ``seq_len`` tokens, all for training."""
    rows = pack(tokenize_documents(tokenizer, docs), seq_len)
    return Corpus(tokenizer, rows, torch.empty(0, seq_len, dtype=torch.long), [d.name for d in docs], [])


# ============================================================================================== training


def seed_configs(args, seed: int, steps: int, train_file: str, pause: int, vocab_size: int) -> dict:
    """The runs of one seed: baseline and FBT (``--fbt-recipe``) on equal tokens, the baseline on FBT's training
    FLOPs reading further (``baseline-flops``) and, as long, re-reading exactly the rows of FBT's ``steps`` batches
    (``baseline-epochs``, ``--unique-batches``: the same unique tokens, its own full LR schedule with the same
    warm-up steps), and the pause-token and internalization controls for FBT's training FLOPs
    (:func:`~fullband.experiments.reasoning_controls.control_configs`)."""
    root = os.path.join(args.out, f"seed{seed}")
    fbt = base_config(args, os.path.join(root, "fbt"), steps, train_file, seed=seed, **fbt_recipe(args))
    base = plain_config(dataclasses.replace(fbt, out=os.path.join(root, "baseline")))
    if fbt.num_passes < 2:
        raise ValueError(f"--num-passes must be >= 2 for the FBT run, got {fbt.num_passes}")
    flops_steps = flops_matched_steps(fbt, vocab_size)  # counted as its metrics are, the fusion's FLOPs included
    warm = round(base.warmup_fraction * steps)  # the same warm-up steps: the runs share a path until the decay
    flops = dataclasses.replace(base, out=os.path.join(root, "baseline-flops"), steps=flops_steps, eval_every=flops_steps,
                                warmup_fraction=warm / flops_steps)
    epochs = dataclasses.replace(flops, out=os.path.join(root, "baseline-epochs"), unique_batches=steps)
    cfgs = {BASELINE: base, FBT: fbt, FLOPS: flops, EPOCHS: epochs,
            **control_configs(base, flops_steps, root, os.path.join(args.out, "data"), pause, args.internalize_stages)}
    if args.no_flops_baseline:
        del cfgs[FLOPS]
    if args.no_epochs_baseline:
        del cfgs[EPOCHS]
    for c in cfgs.values():  # a later internalization stage starts from a model not trained yet
        dataclasses.replace(c, init_from=None).validate()
    return cfgs


def train_seed(args, cfgs: dict, corpora: dict, say) -> float:
    """Train the seed's runs unless all are finished (finished runs of the same configuration are reused); the
    seconds spent. ``baseline-flops`` branches off the baseline where their LR schedules part; ``baseline-epochs``
    reads other batches from its first step on and is trained on its own; the controls on their own documents
    (``corpora``: per label, the baseline's for the others), the internalization stages in order."""
    corpus = corpora[BASELINE]
    if all(finished(c, corpora.get(label, corpus)) for label, c in cfgs.items()):
        return 0.0
    say(f"reasoning: training {', '.join(c.out for c in cfgs.values())}")
    t = time.perf_counter()
    train_pair(cfgs[BASELINE], cfgs[FBT], corpus, share=not args.no_share_prefix, longer_cfg=cfgs.get(FLOPS),
               overwrite=args.overwrite)
    if EPOCHS in cfgs:
        train_or_reuse(cfgs[EPOCHS], corpus, name="baseline-epochs (FBT's unique rows for its training FLOPs)")
    for label in (x for x in cfgs if x == PAUSE_ARM or x.startswith(INTERN)):
        train_or_reuse(cfgs[label], corpora[label], name=f"{label} (a control at FBT's training FLOPs)")
    return time.perf_counter() - t


# ============================================================================================== decoding


def decodes_of(label: str, styles: list[str], fbt_modes: list[str], pause: int) -> tuple[list[str], list[str], int]:
    """A run's decode modes, styles and pause fillers: FBT every mode, the plain runs ``standard``; an
    internalization stage ``free`` only (it was trained to drop the trace's steps, not to follow an opening); the
    pause control after its fillers."""
    modes = fbt_modes if label == FBT else ["standard"]
    if label.startswith(INTERN):
        return modes, [s for s in styles if s == "free"] or styles[:1], 0
    return modes, styles, pause if label == PAUSE_ARM else 0


def decode_seed(args, cfgs: dict, tokenizer, test_p, styles: list[str], fbt_modes: list[str], pause: int,
                say) -> list[dict]:
    """Every (model, mode, style) run of one seed, cached in ``OUT/seedN/decodes.json`` keyed by what was decoded."""
    seed = cfgs[FBT].seed
    path = os.path.join(os.path.dirname(cfgs[FBT].out), "decodes.json")
    try:
        with open(path) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    key_base = {"problems": [p.id for p in test_p], "questions_sum": sum(len(p.question) for p in test_p),
                "max_new_tokens": args.max_new_tokens, "cot": not args.no_cot}
    runs = []
    for label, cfg in cfgs.items():
        model = None
        modes, label_styles, label_pause = decodes_of(label, styles, fbt_modes, pause)
        # the decoded model's weights: a retrained one is decoded again
        key = evaluation_key(cfg.out, **key_base, pause=label_pause)
        for mode in modes:
            for style in label_styles:
                name = f"{label}/{mode}/{style}"
                hit = cache.get(name)
                if hit is None or hit.get("key") != key:
                    model = model or load_model(cfg.out).to(resolve_device(args.device)).eval()
                    say(f"reasoning: seed {seed}: decoding {len(test_p)} problems, {label} in {mode} mode, {style}")
                    t = time.perf_counter()
                    recs = evaluate_reasoning(model, tokenizer, test_p, mode, args.max_new_tokens, not args.no_cot,
                                              (), args.gen_batch_size,
                                              verbosity=None if style == "free" else style, pause=label_pause)
                    hit = cache[name] = {"key": key, "records": recs, "seconds": time.perf_counter() - t}
                    atomic_write_json(path, cache)
                runs.append({"seed": seed, "model": label, "mode": mode, "style": style, "records": hit["records"],
                             "seconds": hit["seconds"], "pause": label_pause})
    return runs


# ============================================================================================== decode compute


def decode_flops(mode: str, fp: dict, prompt_tokens: int, new_tokens: int) -> float:
    """Forward FLOPs of one greedy decode in ``mode`` (:mod:`fullband.model.generation`) of ``new_tokens`` tokens
    after a ``prompt_tokens`` prompt, from :func:`fullband.eval.flops.inference_flops`'s costs (``fp``:
    :func:`~fullband.eval.flops.flop_parameters`): ``soft`` is its continuation scoring of a row of prompt + new
    tokens (the prompt in one plain pass with logits at its last position, then every new token but the last fed,
    fused, one step each); ``standard`` the same without the fusions; ``fused`` adds one fused pass over the prompt;
    ``exact`` feeds the prompt token by token (logits at every position) and then the new tokens: the recurrence
    over the prompt and all new tokens but the last, i.e. ``exact`` scoring of a row one token shorter."""
    P, G = int(prompt_tokens), max(1, int(new_tokens))
    if mode == "exact":
        return inference_flops("exact", fp, P + G - 1)["flops"]
    if mode == "standard":
        return inference_flops("soft", {**fp, "fusion_params": 0}, P + G, P)["flops"]
    return inference_flops(mode, fp, P + G, P, prefill_passes=1)["flops"]


def prompt_lengths(tokenizer, problems, styles: list[str], cot: bool,
                   pause: int = 0) -> dict[str, list[tuple[int, int]]]:
    """Per style, ``(prompt tokens, forced opening tokens)`` of each problem as
    :func:`fullband.eval.reasoning.evaluate_reasoning` decodes it: the tokenized prompt with its BOS (and ``pause``
    fillers), and for a forced verbosity its opening too (which the records' ``generated_tokens`` count)."""
    texts = [format_prompt(p, (), cot, pause) for p in problems]
    out = {"free": [(len(tokenizer(t)["input_ids"]), 0) for t in texts]}
    forced = [s for s in styles if s != "free"]
    if forced:
        bos = len(special_bos(tokenizer))
        plain = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        openings = [style_openings(tokenizer, p, pause) for p in problems]
        out |= {s: [(bos + n + len(o[s]), len(o[s])) for n, o in zip(plain, openings)] for s in forced}
    return out


def decode_cost(run: dict, fp: dict, prompts: list[tuple[int, int]]) -> dict:
    """A decode run's forward FLOPs (:func:`decode_flops`: each problem's prompt and the tokens it generated up to
    its own stop, EOS included), those of decoding the same prompts and lengths in ``standard``, and the tokens
    generated (``prompts``: :func:`prompt_lengths` of the run's style)."""
    flops = standard = generated = 0.0
    for rec, (P, opening) in zip(run["records"], prompts, strict=True):
        G = rec["generated_tokens"] - opening + int(bool(rec["hit_eos"]))
        flops += decode_flops(run["mode"], fp, P, G)
        standard += decode_flops("standard", fp, P, G)
        generated += max(1, G)
    return {"flops": flops, "standard_flops": standard, "generated_tokens": generated}


# ============================================================================================== statistics


def compare(a: list[dict], b: list[dict], seed: int, n_resamples: int) -> dict:
    """A − B over the same problems of every seed (``a``, ``b``: one run per seed, in the same seed order; every
    seed decodes the same problems, so the problem is the unit): the exact sign-flip test of the per-problem
    differences summed over seeds (each problem counted once; one seed: exact McNemar), McNemar per seed, and
    bootstrap CIs of the mean over seeds that draw one set of problems per resample for all seeds."""
    ids = [r["id"] for r in a[0]["records"]]
    acc, trace, both, ca_all, cb_all = [], [], [], [], []
    for ra, rb in zip(a, b):
        if [r["id"] for r in ra["records"]] != ids or [r["id"] for r in rb["records"]] != ids:
            raise ValueError("the runs did not see the same problems in the same order (in every seed)")
        ca = np.array([r["correct"] for r in ra["records"]], dtype=float)
        cb = np.array([r["correct"] for r in rb["records"]], dtype=float)
        ta = np.array([r["trace_tokens"] for r in ra["records"]], dtype=float)
        tb = np.array([r["trace_tokens"] for r in rb["records"]], dtype=float)
        ca_all.append(ca > 0)
        cb_all.append(cb > 0)
        acc.append(ca - cb)
        trace.append(ta - tb)
        both.append(np.where((ca > 0) & (cb > 0), ta - tb, np.nan))  # defined where both were right
    test = paired_test_shared_problems(ca_all, cb_all)
    both = [x for x in both if not np.isnan(x).all()]
    return {"problems": len(ids), "seeds": len(acc), "p": test["p"], "p_method": test["method"],
            "a_only_per_seed": [t["a_only"] for t in test["per_seed"]],
            "b_only_per_seed": [t["b_only"] for t in test["per_seed"]],
            "mcnemar_p_per_seed": [t["mcnemar_p"] for t in test["per_seed"]],
            "accuracy": bootstrap_ci_shared_problems(acc, seed, n_resamples),
            "trace": bootstrap_ci_shared_problems(trace, seed, n_resamples),
            "trace_both_correct": bootstrap_ci_shared_problems(both, seed, n_resamples) if both else None}


def table_rows(runs: list[dict]) -> list[dict]:
    """One row per (model, mode, style): accuracy and trace length pooled over seeds, per seed, chosen verbosity,
    and the decode FLOPs over those of ``standard`` decoding the same prompts and lengths (a run's ``decode``:
    :func:`decode_cost`), with their sums."""
    rows = []
    for key in dict.fromkeys((r["model"], r["mode"], r["style"]) for r in runs):
        group = [r for r in runs if (r["model"], r["mode"], r["style"]) == key]
        recs = [x for r in group for x in r["records"]]
        s = summarize(recs)
        chosen = {v: sum(1 for x in recs if x.get("verbosity") == v) / len(recs) for v in (*VERBOSITIES, "other")}
        cost = {k: sum(r["decode"][k] for r in group) for k in ("flops", "standard_flops", "generated_tokens")}
        rows.append({"model": key[0], "mode": key[1], "style": key[2], "accuracy": s["accuracy"],
                     "mean_trace_tokens": s["mean_trace_tokens"], "marker_rate": s["marker_rate"],
                     "accuracy_per_seed": [summarize(r["records"])["accuracy"] for r in group],
                     "trace_per_seed": [summarize(r["records"])["mean_trace_tokens"] for r in group],
                     "chosen": chosen, "n": len(recs), "decode_flops": cost["flops"] / cost["standard_flops"],
                     "decode_flops_per_token": cost["flops"] / cost["generated_tokens"],
                     "decode_flops_per_problem": cost["flops"] / len(recs), "decode_sums": cost})
    return rows


def comparisons(runs: list[dict], seeds: list[int], args) -> list[dict]:
    """FBT (each mode) against the baseline (equal tokens), baseline-flops (equal FLOPs), baseline-epochs (equal
    unique tokens and FLOPs), and against its own standard mode; each longer baseline against the baseline; per
    style."""
    def pick(model, mode, style):
        got = [r for s in seeds for r in runs if (r["seed"], r["model"], r["mode"], r["style"]) == (s, model, mode, style)]
        return got if len(got) == len(seeds) else None

    out = []
    styles = list(dict.fromkeys(r["style"] for r in runs))
    modes = list(dict.fromkeys(r["mode"] for r in runs if r["model"] == FBT))
    for style in styles:
        for mode in modes:
            a = pick(FBT, mode, style)
            for kind, ref in (*KINDS, ("own standard mode", FBT)):
                ref_mode = "standard"
                b = pick(ref, ref_mode, style)
                if a is None or b is None or (ref == FBT and mode == "standard"):
                    continue
                out.append({"a": f"{FBT}/{mode}", "b": f"{ref}/{ref_mode}", "style": style, "kind": kind,
                            **compare(a, b, args.seed, args.bootstrap)})
        for longer in (FLOPS, EPOCHS, PAUSE_ARM, INTERN):
            a, b = pick(longer, "standard", style), pick(BASELINE, "standard", style)
            if a and b:
                out.append({"a": f"{longer}/standard", "b": f"{BASELINE}/standard", "style": style,
                            "kind": "more training (reference)", **compare(a, b, args.seed, args.bootstrap)})
    return out


# ============================================================================================== run


def run_reasoning_experiment(args) -> dict:
    hf_logging.disable_progress_bar()
    apply_quick(args, RS_DEFAULTS, RS_QUICK)
    say = say_for(args)
    t_all, load_start = time.perf_counter(), load_average()
    steps = steps_for(args)
    for name in ("train_problems", "test_problems", "max_new_tokens", "gen_batch_size", "num_seeds", "bootstrap"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    fbt_modes = [m.strip() for m in args.fbt_modes.split(",") if m.strip()]
    if not fbt_modes or any(m not in MODES for m in fbt_modes):
        raise ValueError(f"--fbt-modes must be decode modes from {', '.join(MODES)}, got {args.fbt_modes!r}")
    styles = [s.strip() for s in args.styles.split(",") if s.strip()]
    if not styles or any(s not in STYLES for s in styles):
        raise ValueError(f"--styles must be from {', '.join(STYLES)}, got {args.styles!r}")
    if args.no_cot and styles != ["free"]:
        raise ValueError("--no-cot trains on direct answers only: use --styles free")
    mix = parse_mix(args.verbosity_mix)
    options = {**TASK_DEFAULTS.get(args.task, {}), **parse_task_options(args.task_option)}
    if args.internalize_stages < 0:
        raise ValueError(f"--internalize-stages must be >= 0 (0: no internalization control), got "
                         f"{args.internalize_stages}")
    train_p, test_p, removed, counts, train_file, tokenizer, corpora, pause = build_data(args, options, mix, say)
    seeds = [args.seed + i for i in range(args.num_seeds)]
    runs, train_seconds = [], 0.0
    configs = {seed: seed_configs(args, seed, steps, train_file, pause, len(tokenizer)) for seed in seeds}
    for label in dict.fromkeys(x for cfgs in configs.values() for x in cfgs):
        refuse_changed_runs([cfgs[label] for cfgs in configs.values() if label in cfgs],
                            corpora.get(label, corpora[BASELINE]), args.overwrite)
    for seed in seeds:
        cfgs = configs[seed]
        train_seconds += train_seed(args, cfgs, corpora, say)
        runs += decode_seed(args, cfgs, tokenizer, test_p, styles, fbt_modes, pause, say)
    prompts = {n: prompt_lengths(tokenizer, test_p, styles, not args.no_cot, n) for n in {0, pause}}
    fps = {label: flop_parameters(load_model(cfg.out)) for label, cfg in configs[seeds[0]].items()}
    for r in runs:  # every seed's models have the first seed's shapes
        r["decode"] = decode_cost(r, fps[r["model"]], prompts[r["pause"]][r["style"]])
    fbt_cfg = configs[seeds[0]][FBT]
    corpus = corpora[BASELINE]
    res = {
        "experiment": "reasoning", "seeds": seeds,
        "config": {"task": args.task, "task_options": {k: list(v) if isinstance(v, tuple) else v
                                                        for k, v in options.items()},
                   "num_problems": len(test_p), "cot": not args.no_cot, "max_new_tokens": args.max_new_tokens,
                   "train_problems": len(train_p), "verbosity_mix": mix, "verbosity_drawn": counts,
                   "styles": styles, "fbt_modes": fbt_modes, "fbt_recipe": args.fbt_recipe, "pause_tokens": pause,
                   "internalize_stages": args.internalize_stages,
                   "test_candidates_dropped_as_training_duplicates": removed},
        "training": {"steps": steps, "tokens_per_model": steps * fbt_cfg.batch_size * fbt_cfg.seq_len,
                     "flops_steps": configs[seeds[0]][FLOPS].steps if FLOPS in configs[seeds[0]] else None,
                     "epochs_steps": configs[seeds[0]][EPOCHS].steps if EPOCHS in configs[seeds[0]] else None,
                     "train_tokens_available": int(corpus.train_rows.numel()), "preset": fbt_cfg.preset,
                     "batch_size": fbt_cfg.batch_size, "seq_len": fbt_cfg.seq_len, "vocab_size": len(tokenizer),
                     "lr": fbt_cfg.resolved_lr(),
                     "control_steps": {label: c.steps for label, c in configs[seeds[0]].items()
                                       if label == PAUSE_ARM or label.startswith(INTERN)},
                     "recipe": {k: getattr(fbt_cfg, k) for k in ("fusion", "feedback_start", "num_passes",
                                                                  "deep_passes", "deep_fraction", "lr_schedule",
                                                                  "fusion_lr_mult", "feedback_ramp", "exact_states",
                                                                  "grad_passes", "prefix_mix")}},
        "table": table_rows(runs),
        "comparisons": comparisons(runs, seeds, args),
        "trace_savings": trace_savings(runs, seeds, args.internalize_stages, args.seed, args.bootstrap),
        "runs": runs,
        "train_seconds": train_seconds, "decode_seconds": sum(r["seconds"] for r in runs),
        "load_average": [load_start, load_average()], "threads": torch.get_num_threads(),
        "torch": torch.__version__, "platform": platform.platform(), "answer_marker": ANSWER_MARKER,
    }
    res["plot"] = os.path.basename(curve_png(res["table"], args.internalize_stages, args.task,
                                             os.path.join(args.out, "accuracy_vs_trace.png")))
    res["seconds"] = time.perf_counter() - t_all
    text = tables(res)
    write_outputs(args.out, res, markdown(res, tables(res, full=True)), text, args.json, omit=("runs",))
    return res
