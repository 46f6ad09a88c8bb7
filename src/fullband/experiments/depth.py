"""``fullband experiment depth``: does latent feedback add sequential depth where a plain model runs out of layers?

Owns the depth experiment: its arms (:data:`ARMS`), their training on the tasks of
:mod:`fullband.eval.depth_tasks` (k-hop pointer chasing, iterated composition), the per-example evaluation in
every decode mode, the state interventions, and the report.

Every arm but the two equal-FLOPs controls trains on the same problems in the same order for the same steps (equal
tokens), from the same random backbone of its depth (a Llama built in code, saved once under ``OUT/init/``):

* ``baseline-L``: plain, L layers; ``baseline-2L``: plain, 2L layers (the depth-matched reference);
* ``fbt-L``: L layers, ``fullband train``'s default recipe (residual entry ``u = e + GLU(h, e)``, WSD, feedback
  from 70% of the steps, K = 2 with 10% K = 4, switch-on warm-up); ``fbt-L-glu``: the same with the paper's pure
  GLU; ``fbt-L-k3``: the default with K = 3 and 10% K = 6 (more passes);
* the controls of the first FBT arm, plain, L layers, trained for its training FLOPs (every pass counted) with
  their own full LR schedule: ``baseline-L-flops`` on fresh problems (more unique tokens), ``baseline-L-epochs``
  re-reading exactly baseline-L's problems epoch after epoch (``--unique-batches``: equal unique tokens and equal
  FLOPs).

Training data mixes the tasks, k uniform in 1..max_k and 0..max_think filler (think) positions before ``=``; the
loss is on the answer token only. Test problems come from another seed, ``--test-per-cell`` per (task, k, think)
for think = 0 and think = max_think. Each FBT arm is scored in ``standard`` (no feedback), ``K=2`` / ``K=3``
(teacher-forced passes) and ``exact`` (the token-by-token recurrence) mode, all through
:func:`fullband.eval.scoring.mode_logits`; the answer is the argmax of the logits at the ``=`` position. In exact
mode interventions on the fed-back state say whether the state is used, each removing the state alone: taken from
another problem everywhere (``other-row``) or only where it enters the ``=`` position (``other-row-at-answer``),
and, where a zero state leaves the token in the fused input (the residual entry;
:func:`fullband.experiments.interventions.zero_keeps_token`), zeroed everywhere or only there (on the pure GLU a
zero state zeroes the whole input, token included: no state intervention, so not run). Reported: accuracy per cell with a 95% bootstrap CI,
the inference FLOPs per token of each mode (x the L-layer model's standard pass), paired differences to both
baselines (and, for the FBT arms, to both controls) on the k >= 2 cells, the paired effect of think positions (the
same questions at 0 and max_think), pointer accuracy where the answer is not the start symbol (the copy shortcut),
and a plot.
A finished run is reused only for the same options, the same training problems and the same initial backbone; one
that differs is kept and the experiment stops with an error naming the differences, unless ``--overwrite``. Writes
``results.json`` (per-example correctness included), ``report.md`` and ``depth.png`` into ``--out``.
"""

from __future__ import annotations

import os
import platform
import sys
import time

import torch
from transformers.utils import logging as hf_logging

from ..data.corpus import Corpus
from ..eval.depth_tasks import (
    EQUALS,
    THINK,
    answer_labels,
    depth_tokenizer,
    encode_rows,
    make_depth_problems,
    row_length,
)
from ..eval.flops import flop_parameters
from ..eval.scoring import load_any_model, mode_logits
from ..model.configuration import has_feedback
from ..training.device import load_average
from ..training.distributed import resolve_device
from ..training.pretrain import PretrainRecipe
from ..utils.stats import bootstrap_ci
from .common import accuracy_panels, apply_quick, pick_arms, refuse_changed_runs, write_outputs
from .interventions import zero_keeps_token
from .synthetic import (
    CONTROL_ARMS,
    EPOCHS_ARM,
    FLOPS_ARM,
    Arm,
    arm_config,
    control_reference,
    init_backbone,
    mode_cost,
    run_flops,
    train_arm,
    train_controls,
)


ARMS = (
    Arm("baseline-L", "plain, L layers", 1, dict(num_passes=1)),
    Arm("fbt-L", "L layers, the default recipe (residual entry, K=2 +10% K=4)", 1, {}),
    Arm("fbt-L-glu", "L layers, the default recipe with the paper's pure GLU", 1, dict(fusion="glu")),
    Arm("fbt-L-k3", "L layers, the default recipe with K=3 (+10% K=6)", 1, dict(num_passes=3, deep_passes=6)),
    Arm("baseline-2L", "plain, 2L layers (depth-matched reference)", 2, dict(num_passes=1)),
    Arm("baseline-L-flops", "plain, L layers, trained for the first FBT arm's training FLOPs on fresh problems", 1,
        dict(num_passes=1)),
    Arm("baseline-L-epochs", "plain, L layers, trained for the first FBT arm's training FLOPs re-reading exactly "
        "baseline-L's problems (--unique-batches --steps), its own full LR schedule", 1, dict(num_passes=1)),
)
ARM_BY_NAME = {a.name: a for a in ARMS}
FBT_MODES = (("standard", 1), ("K=2", 2), ("K=3", 3), ("exact", None))
INTERVENTIONS = ("zero", "other-row", "zero-at-answer", "other-row-at-answer")
ZEROING = ("zero", "zero-at-answer")  # run only where a zero state leaves the token (zero_keeps_token)

DEFAULTS = dict(out=os.path.join("runs", "experiments", "depth"), layers=2, hidden=128, heads=4, steps=4000,
                batch_size=64, lr=2e-3, tasks="pointer,compose", max_k=4, max_think=4, test_per_cell=100, seed=0)
QUICK = dict(layers=1, hidden=32, heads=2, steps=24, batch_size=16, max_k=3, max_think=2, test_per_cell=8)


# ---------------------------------------------------------------------------------------------- training


class DepthRecipe(PretrainRecipe):
    """Pre-training on fixed-format problem rows with the loss on the answer token only."""

    def batch(self, step, num_passes, generator, env):
        sb = super().batch(step, num_passes, generator, env)
        eq = self.tokenizer.convert_tokens_to_ids(EQUALS)
        for mb in sb.micro:
            mb["labels"] = answer_labels(mb["input_ids"], eq)
        return sb


def training_corpus(args, tokenizer, tasks: list[str], seq_len: int, steps: int, seed: int):
    """``(corpus, problems)``: ``steps`` x ``--batch-size`` training problems of ``seed``, one row each."""
    problems = make_depth_problems(tasks, steps * args.batch_size, seed, args.max_k, args.max_think,
                                   single_cycle=args.pointer_cycle)
    rows, _ = encode_rows(tokenizer, problems, seq_len)
    return Corpus(tokenizer, rows, torch.empty(0, seq_len, dtype=torch.long), ["depth-train"], []), problems


# ---------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def answers_correct(model, rows, pos, mode: str, num_passes: int = 1, state_hook=None, batch: int = 512) -> list[int]:
    """1/0 per row: whether the argmax at the ``=`` position is the answer (``state_hook``: exact mode with an
    intervention on the fed-back state)."""
    out = []
    for i in range(0, rows.shape[0], batch):
        r, p = rows[i:i + batch], pos[i:i + batch]
        if state_hook is None:
            logits = mode_logits(model, r, mode, num_passes)
        else:
            logits = model.recurrent_forward(r, state_hook=state_hook(p)).logits
        idx = torch.arange(r.shape[0], device=r.device)
        pred = logits[idx, p - 1].argmax(-1)
        out += (pred == r[idx, p]).long().tolist()
    return out


def intervention_hook(name: str):
    """``make(pos) -> hook(t, prev)``: the state fused at step t replaced as ``name`` says (``other-row``: the state
    the previous row of the scoring batch has at that step, cyclically; ``*-at-answer``: only at the step whose
    token is ``=``, row by row)."""
    if name not in INTERVENTIONS:
        raise ValueError(f"unknown intervention {name!r}: choose from {', '.join(INTERVENTIONS)}")

    def make(pos):
        def hook(t, prev):
            new = torch.zeros_like(prev) if name.startswith("zero") else prev.roll(1, dims=0)
            if not name.endswith("-at-answer"):
                return new
            return torch.where((pos - 1 == t).to(prev.device).view(-1, 1, 1), new, prev)
        return hook
    return make


def interventions_for(model) -> list[str]:
    """The interventions that remove the state alone from ``model``'s input: the zeroing ones only where a zero
    state leaves the token."""
    return [n for n in INTERVENTIONS if n not in ZEROING or zero_keeps_token(model)]


def evaluate_arm(model, rows, pos) -> dict:
    if not has_feedback(model):
        return {"standard": answers_correct(model, rows, pos, "standard")}
    res = {key: answers_correct(model, rows, pos, "passes" if key.startswith("K=") else key, k or 1)
           for key, k in FBT_MODES}
    for name in interventions_for(model):
        res[f"exact/{name}"] = answers_correct(model, rows, pos, "exact", state_hook=intervention_hook(name))
    return res


# ---------------------------------------------------------------------------------------------- analysis


def cells(test: list[dict]) -> list[tuple[str, int, int]]:
    return sorted({(t["task"], t["think"], t["k"]) for t in test})


# the paired references: (result key, arm); the equal-FLOPs controls are references of the FBT arms only
REFS = (("delta_L", "baseline-L"), ("delta_2L", "baseline-2L"), ("delta_flops", FLOPS_ARM),
        ("delta_epochs", EPOCHS_ARM))


def analyse(res: dict, boot: int = 2000) -> list[dict]:
    """One row per (arm, mode, task, think): accuracy per k with a 95% CI, the mode's inference FLOPs per token
    (x the L-layer standard pass); paired Δ vs the baselines (:data:`REFS`) on k >= 2."""
    test = res["test"]
    table = []
    refs = [(key, name, res["runs"].get(name, {}).get("correct", {}).get("standard")) for key, name in REFS]
    for arm in res["arms"]:
        for mode, correct in res["runs"][arm]["correct"].items():
            for task, think in sorted({(t["task"], t["think"]) for t in test}):
                row = {"arm": arm, "mode": mode, "task": task, "think": think, "acc": {},
                       "inference_flops": res["runs"][arm]["inference_flops"].get(mode)}
                for k in sorted({t["k"] for t in test}):
                    idx = [i for i, t in enumerate(test) if (t["task"], t["think"], t["k"]) == (task, think, k)]
                    row["acc"][str(k)] = bootstrap_ci([correct[i] for i in idx], seed=0, n_resamples=boot).as_dict()
                deep = [i for i, t in enumerate(test) if (t["task"], t["think"]) == (task, think) and t["k"] >= 2]
                for key, name, ref in refs:
                    if name in CONTROL_ARMS and not arm.startswith("fbt"):
                        continue
                    if ref is not None and deep and not (mode == "standard" and ref is correct):
                        row[key] = bootstrap_ci([correct[i] - ref[i] for i in deep], seed=0, n_resamples=boot).as_dict()
                table.append(row)
    return table


def _ci(d: dict | None, digits: int = 2) -> str:
    if not d:
        return ""
    return f"{d['estimate']:+.{digits}f} [{d['low']:+.{digits}f}, {d['high']:+.{digits}f}]"


def tables(res: dict) -> str:
    """The report's tables, read from ``res["table"]`` and the analyses only (not the per-problem ``test``/``runs``,
    so that a trimmed results file renders them too)."""
    ks = sorted({int(k) for r in res["table"] for k in r["acc"]})
    refs = [(key, name) for key, name in REFS if name in res["arms"]]
    out = []
    for task in dict.fromkeys(r["task"] for r in res["table"]):
        out += [f"**{task}** (accuracy [95% CI]; chance {res['chance'][task]:.2f}; inference FLOPs per token x "
                "the L-layer model's standard pass; Δ paired per problem, FBT arms also vs the equal-FLOPs "
                "controls)", "",
                "| arm | mode | think | " + " | ".join(f"k={k}" for k in ks) + " | inference FLOPs | "
                + " | ".join(f"Δ vs {name}, k≥2" for _, name in refs) + " |",
                "| --- | --- | ---: |" + " ---: |" * (len(ks) + 1 + len(refs))]
        for r in res["table"]:
            if r["task"] != task or "/" in r["mode"]:
                continue
            accs = " | ".join(f"{r['acc'][str(k)]['estimate']:.2f} [{r['acc'][str(k)]['low']:.2f}, "
                              f"{r['acc'][str(k)]['high']:.2f}]" for k in ks)
            out.append(f"| {r['arm']} | {r['mode']} | {r['think']} | {accs} | {r['inference_flops']:.3f} | "
                       + " | ".join(_ci(r.get(key)) for key, _ in refs) + " |")
        out.append("")
    if res.get("pointer_no_copy"):
        ks = sorted(res["pointer_no_copy"][0]["n"], key=int)
        out += ["**pointer, answer ≠ start symbol** (accuracy; problems per cell in the header)", "",
                "| arm | mode | think | " + " | ".join(f"k={k} (n={res['pointer_no_copy'][0]['n'][k]})" for k in ks)
                + " |", "| --- | --- | ---: |" + " ---: |" * len(ks)]
        out += [f"| {r['arm']} | {r['mode']} | {r['think']} | " + " | ".join(f"{r['acc'][k]:.2f}" for k in ks) + " |"
                for r in res["pointer_no_copy"]]
        out.append("")
    if res.get("think_effect"):
        lo, hi = res["think_effect"][0]["think"]
        out += [f"**Does it need think positions?** Accuracy over the k ≥ 2 cells with {lo} and {hi} think positions "
                "(the same questions), and the paired change", "",
                f"| arm | mode | task | think={lo} | think={hi} | Δ [95% CI] |",
                "| --- | --- | --- | ---: | ---: | ---: |"]
        out += [f"| {r['arm']} | {r['mode']} | {r['task']} | {r['acc'][0]:.2f} | {r['acc'][1]:.2f} | "
                f"{_ci(r['delta'])} |"
                for r in res["think_effect"]]
        out.append("")
    if res.get("interventions"):
        out += ["**Is the fed-back state used?** Exact-mode accuracy over the k ≥ 2 cells, and the change when the "
                "state is replaced (Δ [95% CI], paired per problem)", "",
                "| arm | task | think | exact | " + " | ".join(INTERVENTIONS) + " |",
                "| --- | --- | ---: | ---: |" + " ---: |" * len(INTERVENTIONS)]
        for r in res["interventions"]:
            out.append(f"| {r['arm']} | {r['task']} | {r['think']} | {r['exact']:.2f} | "
                       + " | ".join(_ci(r["delta"][n]) if n in r["delta"] else "n/a" for n in INTERVENTIONS)
                       + " |")
        out.append("")
    return "\n".join(out)


def _question_key(t: dict) -> tuple:
    """A test problem without its think positions."""
    return t["task"], t["k"], t["question"].replace(" " + THINK, "")


def pointer_no_copy(res: dict) -> list[dict]:
    """Per arm, mode and think: pointer accuracy per k >= 2 on the problems whose answer is not the start symbol
    (the start symbol is the answer whenever its cycle length divides k: a copy shortcut)."""
    test, rows = res["test"], []
    for arm in res["arms"]:
        for mode, correct in res["runs"][arm]["correct"].items():
            for think in sorted({t["think"] for t in test}):
                acc, n = {}, {}
                for k in sorted({t["k"] for t in test if t["k"] >= 2}):
                    cell = [correct[i] for i, t in enumerate(test) if t["task"] == "pointer" and t["think"] == think
                            and t["k"] == k and not t["answer_is_start"]]
                    if cell:
                        acc[str(k)], n[str(k)] = sum(cell) / len(cell), len(cell)
                if acc and "/" not in mode:
                    rows.append({"arm": arm, "mode": mode, "think": think, "acc": acc, "n": n})
    return rows


def think_effect(res: dict, boot: int = 2000) -> list[dict]:
    """Per arm, mode and task: accuracy over the k >= 2 cells without and with the most think positions, and
    the paired change (the same questions at both think counts)."""
    test, rows = res["test"], []
    thinks = sorted({t["think"] for t in test})
    if len(thinks) < 2:
        return rows
    lo, hi = thinks[0], thinks[-1]
    for arm in res["arms"]:
        for mode, correct in res["runs"][arm]["correct"].items():
            if "/" in mode:
                continue
            for task in dict.fromkeys(t["task"] for t in test):
                a = {_question_key(t): correct[i] for i, t in enumerate(test)
                     if t["task"] == task and t["think"] == lo and t["k"] >= 2}
                b = [(a[_question_key(t)], correct[i]) for i, t in enumerate(test)
                     if t["task"] == task and t["think"] == hi and t["k"] >= 2 and _question_key(t) in a]
                if b:
                    rows.append({"arm": arm, "mode": mode, "task": task, "think": [lo, hi],
                                 "acc": [sum(x for x, _ in b) / len(b), sum(y for _, y in b) / len(b)],
                                 "delta": bootstrap_ci([y - x for x, y in b], seed=0, n_resamples=boot).as_dict()})
    return rows


def interventions(res: dict, boot: int = 2000) -> list[dict]:
    """Per FBT arm, task and think: exact accuracy over k >= 2 and each intervention's paired change."""
    test, rows = res["test"], []
    for arm in res["arms"]:
        correct = res["runs"][arm]["correct"]
        if "exact" not in correct:
            continue
        for task, think in sorted({(t["task"], t["think"]) for t in test}):
            idx = [i for i, t in enumerate(test) if (t["task"], t["think"]) == (task, think) and t["k"] >= 2]
            if not idx:
                continue
            base = [correct["exact"][i] for i in idx]
            rows.append({"arm": arm, "task": task, "think": think, "exact": sum(base) / len(base), "delta": {
                n: bootstrap_ci([correct[f"exact/{n}"][i] - b for i, b in zip(idx, base)], seed=0,
                                n_resamples=boot).as_dict() for n in INTERVENTIONS if f"exact/{n}" in correct}})
    return rows


def plot(res: dict, path: str) -> str:
    panels = []
    for task, think in sorted({(r["task"], r["think"]) for r in res["table"]}):
        lines, ks = [], None
        for r in res["table"]:
            if (r["task"], r["think"]) == (task, think) and r["mode"] in ("standard", "exact", "K=2"):
                ks = sorted(int(k) for k in r["acc"])
                lines.append((ks, [r["acc"][str(k)]["estimate"] for k in ks],
                              {"standard": "-", "K=2": "--", "exact": ":"}[r["mode"]],
                              f"C{res['arms'].index(r['arm'])}", f"{r['arm']} {r['mode']}"))
        panels.append({"title": f"{task}, think={think}", "chance": res["chance"][task], "lines": lines,
                       "xticks": ks, "marker": "o"})
    return accuracy_panels(panels, path, "k (hops / steps)", height=3.6)


# ---------------------------------------------------------------------------------------------- command


def run_depth(args) -> dict:
    hf_logging.disable_progress_bar()
    apply_quick(args, DEFAULTS, QUICK)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    names = pick_arms(args.arms, ARM_BY_NAME, [a.name for a in ARMS])
    control_reference(names)  # controls without an FBT arm: refused before anything trains
    for name in ("steps", "batch_size", "test_per_cell", "layers", "max_k"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    t0, load0 = time.perf_counter(), load_average()
    tokenizer = depth_tokenizer()
    seq_len = row_length(args.max_k, args.max_think, tasks)
    corpus, train_p = training_corpus(args, tokenizer, tasks, seq_len, args.steps, args.seed)
    test_p = [p for task in tasks for think in sorted({0, args.max_think}) for k in range(1, args.max_k + 1)
              for p in make_depth_problems([task], args.test_per_cell, args.seed + 1_000_003 * (1 + k),
                                           args.max_k, ks=[k], thinks=[think], single_cycle=args.pointer_cycle)]
    # the same questions at every think count (the generators draw alike), so think vs no think is paired
    test_rows, test_pos = encode_rows(tokenizer, test_p, seq_len)
    seen = {p.words for p in train_p}
    res = {"arms": names, "arm_descriptions": {n: ARM_BY_NAME[n].description for n in names},
           "settings": {k: getattr(args, k) for k in DEFAULTS if k != "out"} | {
               "quick": bool(args.quick), "seq_len": seq_len, "pointer_cycle": bool(args.pointer_cycle)},
           "test": [{"task": p.task, "k": p.k, "think": p.think, "answer": p.answer, "question": " ".join(p.words),
                     "in_training": p.words in seen,
                     "answer_is_start": p.task == "pointer" and p.answer == f"s{p.facts[1]}"} for p in test_p],
           "chance": {"pointer": 1 / 6, "compose": 1 / 6, "modsum": 1 / 7}, "runs": {}}
    device = str(resolve_device(args.device))
    test_rows, test_pos = test_rows.to(device), test_pos.to(device)
    plain = [n for n in names if n not in CONTROL_ARMS]
    refuse_changed_runs([arm_config(args, ARM_BY_NAME[n], corpus) for n in plain], corpus, args.overwrite)
    trained = {}
    for name in plain:
        cfg, elapsed = train_arm(args, ARM_BY_NAME[name], corpus, say, DepthRecipe, "depth")
        trained[name] = (cfg, elapsed, run_flops(cfg))
    train_controls(args, ARM_BY_NAME, names, trained, corpus,
                   lambda a, steps: training_corpus(a, tokenizer, tasks, seq_len, steps, a.seed + 7)[0], say,
                   DepthRecipe, "depth")
    ref_fp = flop_parameters(load_any_model(init_backbone(args, tokenizer, 1))[0])
    for name in names:
        cfg, elapsed, flops = trained[name]
        model = load_any_model(cfg.out, device=device)[0].eval()
        t = time.perf_counter()
        modes = [(key, "passes" if key.startswith("K=") else key, k or 1) for key, k in FBT_MODES
                 if has_feedback(model) or key == "standard"]
        res["runs"][name] = {"layers": args.layers * ARM_BY_NAME[name].depth, "train_seconds": elapsed,
                             "parameters": sum(p.numel() for p in model.parameters()), "steps": cfg.steps,
                             "tokens": cfg.steps * cfg.batch_size * seq_len, "train_flops": flops,
                             "inference_flops": {key: mode_cost(flop_parameters(model), ref_fp, seq_len, mode, k)
                                                 for key, mode, k in modes},
                             "correct": evaluate_arm(model, test_rows, test_pos),
                             "eval_seconds": time.perf_counter() - t}
    res["table"], res["think_effect"], res["interventions"] = analyse(res), think_effect(res), interventions(res)
    res["pointer_no_copy"] = pointer_no_copy(res)
    res["seconds"], res["load_average"] = time.perf_counter() - t0, [load0, load_average()]
    res["threads"], res["torch"], res["platform"] = torch.get_num_threads(), torch.__version__, platform.platform()
    os.makedirs(args.out, exist_ok=True)
    text = tables(res)
    res["plot"] = plot(res, os.path.join(args.out, "depth.png"))
    write_outputs(args.out, res, report(res, text), text, args.json, omit=("runs", "test"))
    return res


def report(res: dict, text: str) -> str:
    s = res["settings"]
    train_s = sum(r["train_seconds"] or 0.0 for r in res["runs"].values())
    n_seen = sum(t["in_training"] for t in res["test"])
    lines = ["# fullband experiment depth", "",
             f"Tasks {s['tasks']}, k = 1..{s['max_k']}, 0..{s['max_think']} think positions in training; every arm "
             f"{s['steps']} steps x {s['batch_size']} rows x {s['seq_len']} tokens (equal tokens; the equal-FLOPs "
             "controls more steps, baseline-L-epochs on baseline-L's rows), loss on the answer "
             f"only, Llama d{s['hidden']} with {s['heads']} heads, L = {s['layers']}, seed {s['seed']}, peak LR "
             f"{s['lr']}. Test: {s['test_per_cell']} problems per (task, k, think) from another seed "
             f"({n_seen} of {len(res['test'])} questions also occur in training: small-k composition has few "
             f"distinct questions). Training {train_s:.0f}s summed over the runs; this invocation "
             f"{res['seconds']:.0f}s wall (finished runs are reused), load average {res['load_average'][0]} at the "
             f"start and {res['load_average'][1]} at the end, {res['threads']} thread(s).", "", "Arms:", ""]
    lines += [f"* `{n}` ({res['runs'][n]['layers']} layers, {res['runs'][n]['parameters']:,} parameters, "
              f"{res['runs'][n]['steps']} steps, {res['runs'][n]['train_flops']:.3g} training FLOPs): {d}"
              for n, d in res["arm_descriptions"].items()]
    lines += ["", "Modes: `standard` no feedback; `K=2` / `K=3` teacher-forced passes; `exact` the token-by-token "
              "recurrence (T sequential one-token calls); inference FLOPs per token counted from what each mode runs "
              "(`fullband.eval.flops.inference_flops`), relative to the L-layer model's standard pass; `exact/other-row`, "
              "`exact/other-row-at-answer`: exact with the fed-back state taken from another problem everywhere or "
              "only where it enters the `=` position; `exact/zero`, `exact/zero-at-answer`: zeroed there, run only "
              "where a zero state leaves the token in the input (n/a on the pure GLU, where it zeroes the token "
              "too).", "", text,
              "![depth](depth.png)", ""]
    return "\n".join(lines)
