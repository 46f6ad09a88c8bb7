"""``fullband experiment state``: running-state tasks with a label at every position -- does a long feedback
recurrence carry the state where a fixed-depth transformer runs out of layers?

Owns the state experiment: its arms, their training on the tasks of :mod:`fullband.eval.state_tasks` (the S3 and
S5 word problems, parity, variable tracking; mixed in one training stream, the label at every position), the
per-position evaluation at the training length T and at 2T and 4T (length generalisation) in every decode mode,
the state interventions, the cost of long recurrences per K and per ``--grad-passes``, and the report. Training
reuses the depth experiment's machinery (:func:`fullband.experiments.depth.train_arm`: the same initial backbones,
``fullband train``'s engine, finished runs reused only for the same options and data).

Arms (every one the same steps on the same rows -- equal tokens -- except the equal-FLOPs control):

* ``baseline-L`` / ``baseline-2L`` / ``baseline-4L``: plain, L / 2L / 4L layers;
* ``fbt-L``: L layers, residual entry, trained with the long recurrence K = T + 1 (the exact recurrence on every
  labelled position; :func:`fullband.eval.state_tasks.exact_passes`) from the first step, all passes
  backpropagated, no prefix mixing, no deep steps; ``fbt-L-glu``: the same with the paper's pure GLU;
* ``baseline-L-flops``: plain, L layers, trained for the training FLOPs of the first FBT arm (every pass counted,
  a pass without gradient at a third: :func:`fullband.eval.flops.training_flops`) on fresh rows;
* not in the default set (``--arms``): ``fbt-L-glu-g2`` / ``-g1`` (``--grad-passes 2`` / ``1``), ``fbt-L-glu-tol`` (``--pass-tol``
  early stop), ``fbt-L-glu-cur`` (a curriculum in K over the first half of the steps): the cheaper settings.

FBT arms are scored in ``standard`` (no feedback), ``K=2`` (two teacher-forced passes) and ``exact`` (the
token-by-token recurrence) mode, all through :func:`fullband.eval.scoring.mode_logits`; in exact mode the fed-back
state is zeroed (``exact/zero``) or taken from another row of the same task (``exact/shuffle``) to show whether it
is used. Reported per (task, length): per-position accuracy and last-position accuracy with 95% bootstrap CIs, the
paired per-row differences to baseline-L and baseline-4L, the interventions' paired effects, and the cost table.
Writes ``results.json`` (per-row results included), ``report.md`` and ``state.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

import torch
from transformers.utils import logging as hf_logging

from ..data.corpus import Corpus
from ..eval.flops import flop_parameters, training_flops
from ..eval.scoring import load_any_model, mode_logits
from ..eval.state_tasks import (
    CHANCE,
    LabelTable,
    dense_labels,
    encode_state_rows,
    exact_passes,
    make_state_problems,
    predicted_states,
    state_tokenizer,
)
from ..model.configuration import has_feedback
from ..training.device import load_average
from ..training.distributed import resolve_device
from ..training.pretrain import PretrainRecipe
from ..utils.io import read_jsonl
from ..utils.stats import bootstrap_ci
from .depth import Arm, arm_config, init_backbone, train_arm
from .common import (
    apply_quick,
    pick_arms,
    refuse_changed_runs,
    save_png,
    write_outputs,
)
from .state_cost import measure_costs

LONG = dict(feedback_start=0.0, deep_fraction=0.0, prefix_mix=0.0)  # the long recurrence from the first step
ARM_NAMES = ("baseline-L", "baseline-2L", "baseline-4L", "fbt-L", "fbt-L-glu", "baseline-L-flops",
             "fbt-L-glu-g2", "fbt-L-glu-g1", "fbt-L-glu-tol", "fbt-L-glu-cur")
DEFAULT_ARMS = ARM_NAMES[:6]
FBT_MODES = (("standard", "standard", 1), ("K=2", "passes", 2), ("exact", "exact", None))
INTERVENTIONS = ("zero", "shuffle")
MULTIPLES = (1, 2, 4)

DEFAULTS = dict(out=os.path.join("runs", "experiments", "state"), layers=2, hidden=128, heads=4, steps=600,
                batch_size=64, lr=2e-3, tasks="s3,s5,parity,vars", length=10, test_rows=200, pass_tol=0.01, seed=0)
QUICK = dict(layers=1, hidden=32, heads=2, steps=6, batch_size=8, length=4, test_rows=8)


def make_arms(args) -> dict[str, Arm]:
    K = exact_passes(args.length)
    fbt = dict(num_passes=K, **LONG)
    arms = [Arm("baseline-L", "plain, L layers", 1, dict(num_passes=1)),
            Arm("baseline-2L", "plain, 2L layers", 2, dict(num_passes=1)),
            Arm("baseline-4L", "plain, 4L layers", 4, dict(num_passes=1)),
            Arm("fbt-L", f"L layers, residual entry, K = {K} (exact recurrence) on every step", 1, fbt),
            Arm("fbt-L-glu", f"L layers, pure GLU, K = {K} (exact recurrence) on every step", 1,
                fbt | {"fusion": "glu"}),
            Arm("baseline-L-flops", "plain, L layers, trained for the first FBT arm's training FLOPs", 1,
                dict(num_passes=1)),
            Arm("fbt-L-glu-g2", f"fbt-L-glu with --grad-passes 2 (passes 1..{K - 2} without gradient)", 1,
                fbt | {"fusion": "glu", "grad_passes": 2}),
            Arm("fbt-L-glu-g1", f"fbt-L-glu with --grad-passes 1 (passes 1..{K - 1} without gradient)", 1,
                fbt | {"fusion": "glu", "grad_passes": 1}),
            Arm("fbt-L-glu-tol", f"fbt-L-glu with --pass-tol {args.pass_tol} (early stop)", 1,
                fbt | {"fusion": "glu", "pass_tol": args.pass_tol}),
            Arm("fbt-L-glu-cur", "fbt-L-glu with a curriculum in K (2 -> K over the first half)", 1,
                fbt | {"fusion": "glu", "pass_curriculum": 0.5})]
    return {a.name: a for a in arms}


class StateRecipe(PretrainRecipe):
    """Pre-training on running-state rows with a label at every input position (:func:`dense_labels`)."""

    def batch(self, step, num_passes, generator, env):
        sb = super().batch(step, num_passes, generator, env)
        table = getattr(self, "_table", None) or LabelTable(self.tokenizer)
        self._table = table
        for mb in sb.micro:
            mb["labels"] = dense_labels(mb["input_ids"], table)
        return sb


def training_corpus(args, tokenizer, steps: int, seed: int) -> Corpus:
    rows = encode_state_rows(tokenizer, make_state_problems(args.tasks_list, steps * args.batch_size, seed,
                                                            args.length))
    return Corpus(tokenizer, rows, torch.empty(0, rows.shape[1], dtype=torch.long), ["state-train"], [])


def run_flops(cfg) -> float:
    """Training FLOPs of a finished run (its metrics, every pass counted; a pass without gradient at a third)."""
    fp = flop_parameters(load_any_model(cfg.out)[0])
    records = read_jsonl(os.path.join(cfg.out, "metrics.jsonl"))
    return training_flops(records, cfg.batch_size * cfg.seq_len, cfg.seq_len, fp)["flops"]


def train_all(args, arms: dict, names: list[str], tokenizer, say) -> dict:
    """Train (or reuse) every arm; returns ``{name: (cfg, seconds, flops)}``."""
    corpus = training_corpus(args, tokenizer, args.steps, args.seed)
    plain = [n for n in names if n != "baseline-L-flops"]
    refuse_changed_runs([arm_config(args, arms[n], corpus) for n in plain], corpus, args.overwrite)
    out = {}
    for name in plain:
        cfg, elapsed = train_arm(args, arms[name], corpus, say, recipe=StateRecipe, tag="state")
        out[name] = (cfg, elapsed, run_flops(cfg))
    if "baseline-L-flops" in names:
        ref = next((n for n in names if n.startswith("fbt-")), None)
        if ref is None:
            raise ValueError("--arms: baseline-L-flops needs an FBT arm to match")
        per_step = training_flops([{"num_passes": 1}], args.batch_size * corpus.train_rows.shape[1],
                                  corpus.train_rows.shape[1], flop_parameters(load_any_model(
                                      init_backbone(args, tokenizer, 1))[0]))["flops"]
        steps = max(args.steps, math.ceil(out[ref][2] / per_step))
        long_args = argparse.Namespace(**(vars(args) | {"steps": steps}))
        long_corpus = training_corpus(long_args, tokenizer, steps, args.seed + 7)  # fresh rows
        arm = arms["baseline-L-flops"]
        refuse_changed_runs([arm_config(long_args, arm, long_corpus)], long_corpus, args.overwrite)
        cfg, elapsed = train_arm(long_args, arm, long_corpus, say, recipe=StateRecipe, tag="state")
        out["baseline-L-flops"] = (cfg, elapsed, run_flops(cfg))
    return out


# ---------------------------------------------------------------------------------------------- evaluation


def test_sets(args, tokenizer) -> dict:
    """``{(task, length): rows}``: fresh rows of each task at T, 2T and 4T (other seeds than training's)."""
    sets = {}
    for j, task in enumerate(args.tasks_list):
        for m in MULTIPLES:
            probs = make_state_problems([task], args.test_rows, args.seed + 1_000_003 * (1 + m) + 101 * j,
                                        args.length * m)
            sets[(task, args.length * m)] = encode_state_rows(tokenizer, probs)
    return sets


@torch.no_grad()
def per_row(model, rows, table, mode: str, num_passes: int = 1, hook: str | None = None, batch: int = 256):
    """``(per-position accuracy per row, last-position correctness per row, accuracy per position)``."""
    marks = []
    for i in range(0, rows.shape[0], batch):
        r = rows[i:i + batch]
        if hook is None:
            logits = mode_logits(model, r, mode, num_passes)
        else:
            def state_hook(t, prev):
                return torch.zeros_like(prev) if hook == "zero" else prev.roll(1, dims=0)
            logits = model.recurrent_forward(r, state_hook=state_hook).logits
        marks.append(predicted_states(logits, r, table).cpu())
    m = torch.cat(marks).double()
    return m.mean(1).tolist(), m[:, -1].long().tolist(), m.mean(0).tolist()


def evaluate_arm(model, sets: dict, table, device) -> dict:
    """``{mode: {"task/length": {"pos": [...], "last": [...], "by_position": [...]}}}``."""
    plans = [("standard", "standard", 1, None)]
    if has_feedback(model):
        plans = [(key, mode, k, None) for key, mode, k in FBT_MODES]
        plans += [(f"exact/{h}", "exact", None, h) for h in INTERVENTIONS]
    res = {}
    for key, mode, k, hook in plans:
        res[key] = {}
        for (task, length), rows in sets.items():
            pos, last, curve = per_row(model, rows.to(device), table, mode, k or 1, hook)
            res[key][f"{task}/{length}"] = {"pos": pos, "last": last, "by_position": curve}
    return res


def _ci(values, boot):
    return bootstrap_ci(values, seed=0, n_resamples=boot).as_dict()


def analyse(res: dict, boot: int = 2000) -> dict:
    """The table rows (accuracy with CIs), the paired differences to the baselines and the interventions."""
    table, deltas, inter = [], [], []
    refs = {n: res["runs"][n]["correct"]["standard"] for n in ("baseline-L", "baseline-4L") if n in res["runs"]}
    for arm in res["arms"]:
        correct = res["runs"][arm]["correct"]
        for mode, cells in correct.items():
            for cell, v in cells.items():
                task, length = cell.split("/")
                if "/" in mode:
                    base = correct["exact"][cell]["pos"]
                    inter.append({"arm": arm, "task": task, "length": int(length), "intervention": mode.split("/")[1],
                                  "exact": sum(base) / len(base),
                                  "delta": _ci([a - b for a, b in zip(v["pos"], base)], boot)})
                    continue
                table.append({"arm": arm, "mode": mode, "task": task, "length": int(length),
                              "pos": _ci(v["pos"], boot), "last": _ci(v["last"], boot)})
                for ref, rc in refs.items():
                    if ref != arm:
                        deltas.append({"arm": arm, "mode": mode, "task": task, "length": int(length), "vs": ref,
                                       "delta": _ci([a - b for a, b in zip(v["pos"], rc[cell]["pos"])], boot)})
    return {"table": table, "deltas": deltas, "interventions": inter}


def _f(d, digits=2, sign=False):
    fmt = f"{{:{'+' if sign else ''}.{digits}f}}"
    return f"{fmt.format(d['estimate'])} [{fmt.format(d['low'])}, {fmt.format(d['high'])}]"


def tables(res: dict) -> str:
    lengths = sorted({r["length"] for r in res["table"]})
    out = []
    for task in res["settings"]["tasks"].split(","):
        out += [f"**{task}** (per-position accuracy [95% CI] / last-position accuracy; trained at T = "
                f"{res['settings']['length']}; chance {CHANCE[task]:.3f})", "",
                "| arm | mode | " + " | ".join(f"T={n}" for n in lengths) + " |",
                "| --- | --- |" + " ---: |" * len(lengths)]
        rows = {}
        for r in res["table"]:
            if r["task"] == task:
                rows.setdefault((r["arm"], r["mode"]), {})[r["length"]] = r
        for (arm, mode), by_len in rows.items():
            out.append(f"| {arm} | {mode} | " + " | ".join(
                f"{_f(by_len[n]['pos'])} / {by_len[n]['last']['estimate']:.2f}" if n in by_len else ""
                for n in lengths) + " |")
        out.append("")
    if res["deltas"]:
        out += ["**Paired per-row difference in per-position accuracy** (FBT exact mode and the other baselines "
                "minus the reference; Δ [95% CI])", "",
                "| arm | mode | task | vs | " + " | ".join(f"T={n}" for n in lengths) + " |",
                "| --- | --- | --- | --- |" + " ---: |" * len(lengths)]
        rows = {}
        for d in res["deltas"]:
            if d["mode"] in ("exact", "standard") and not (d["mode"] == "standard" and d["arm"].startswith("fbt")):
                rows.setdefault((d["arm"], d["mode"], d["task"], d["vs"]), {})[d["length"]] = d["delta"]
        for (arm, mode, task, vs), by_len in rows.items():
            out.append(f"| {arm} | {mode} | {task} | {vs} | "
                       + " | ".join(_f(by_len[n], sign=True) if n in by_len else "" for n in lengths) + " |")
        out.append("")
    if res["interventions"]:
        out += ["**Is the fed-back state used?** Exact-mode per-position accuracy and its paired change when the "
                "state is zeroed or taken from another row of the same task (Δ [95% CI])", "",
                "| arm | task | T | exact | " + " | ".join(INTERVENTIONS) + " |",
                "| --- | --- | ---: | ---: |" + " ---: |" * len(INTERVENTIONS)]
        rows = {}
        for r in res["interventions"]:
            rows.setdefault((r["arm"], r["task"], r["length"]), {"exact": r["exact"]})[r["intervention"]] = r["delta"]
        for (arm, task, length), v in rows.items():
            out.append(f"| {arm} | {task} | {length} | {v['exact']:.2f} | "
                       + " | ".join(_f(v[n], sign=True) for n in INTERVENTIONS) + " |")
        out.append("")
    if res.get("cost"):
        out += [f"**Cost of a training step** (S3 rows, T = {res['settings']['length']}, batch "
                f"{res['settings']['batch_size']}, fusion glu; median of the timed steps; activation memory = the "
                "bytes autograd saved for the backward)", "",
                "| K | grad passes | pass tol | passes run | step time (s) | activation memory (MiB) | FLOPs vs K=1 |",
                "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        out += [f"| {c['num_passes']} | {c['grad_passes']} | {c['pass_tol'] or '-'} | {c['passes_run']:.1f} | "
                f"{c['step_seconds']:.3f} | {c['saved_mib']:.1f} | {c['flops_ratio']:.2f} |" for c in res["cost"]]
        out.append("")
    return "\n".join(out)


def plot(res: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = res["settings"]["tasks"].split(",")
    longest = max(r["length"] for r in res["table"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, arm in enumerate(res["arms"]):
            for mode, style in (("standard", "-"), ("exact", ":")):
                cell = res["runs"][arm]["correct"].get(mode, {}).get(f"{task}/{longest}")
                if cell is not None and not (mode == "standard" and arm.startswith("fbt")):
                    ax.plot(range(1, longest + 1), cell["by_position"], style, color=f"C{i}", label=f"{arm} {mode}")
        ax.axvline(res["settings"]["length"], color="grey", lw=0.7)
        ax.axhline(CHANCE[task], color="grey", lw=0.7, ls="--")
        ax.set_title(f"{task}: accuracy per position (T={longest})", fontsize=9)
        ax.set_xlabel("position")
        ax.set_ylim(0, 1.02)
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    return save_png(fig, path)


# ---------------------------------------------------------------------------------------------- command


def run_state(args) -> dict:
    hf_logging.disable_progress_bar()
    apply_quick(args, DEFAULTS, QUICK)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    for name in ("steps", "batch_size", "test_rows", "layers", "length", "hidden", "heads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.pass_tol <= 0:
        raise ValueError(f"--pass-tol must be > 0, got {args.pass_tol}")
    args.tasks_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    arms = make_arms(args)
    names = pick_arms(args.arms, arms, list(DEFAULT_ARMS))
    t0, load0 = time.perf_counter(), load_average()
    tokenizer = state_tokenizer()
    table = LabelTable(tokenizer)
    sets = test_sets(args, tokenizer)  # fails fast on an unknown task
    device = str(resolve_device(args.device))
    trained = train_all(args, arms, names, tokenizer, say)
    res = {"arms": names, "arm_descriptions": {n: arms[n].description for n in names},
           "settings": {k: getattr(args, k) for k in DEFAULTS if k != "out"} | {
               "quick": bool(args.quick), "num_passes": exact_passes(args.length),
               "lengths": [args.length * m for m in MULTIPLES]},
           "chance": {t: CHANCE[t] for t in args.tasks_list}, "runs": {}}
    for name in names:
        cfg, elapsed, flops = trained[name]
        model = load_any_model(cfg.out, device=device)[0].eval()
        t = time.perf_counter()
        say(f"state: evaluating {name}")
        res["runs"][name] = {"layers": args.layers * arms[name].depth, "train_seconds": elapsed, "steps": cfg.steps,
                             "parameters": sum(p.numel() for p in model.parameters()), "train_flops": flops,
                             "tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
                             "correct": evaluate_arm(model, sets, table, device),
                             "eval_seconds": time.perf_counter() - t}
    res |= analyse(res)
    if not args.no_cost:
        say("state: measuring the cost per K and --grad-passes")
        res["cost"] = measure_costs(args, tokenizer, table, device)
    res["seconds"], res["load_average"] = time.perf_counter() - t0, [load0, load_average()]
    res["threads"], res["torch"], res["platform"] = torch.get_num_threads(), torch.__version__, platform.platform()
    os.makedirs(args.out, exist_ok=True)
    text = tables(res)
    res["plot"] = plot(res, os.path.join(args.out, "state.png"))
    write_outputs(args.out, res, report(res, text), text, args.json, omit=("runs",))
    return res


def report(res: dict, text: str) -> str:
    s = res["settings"]
    train_s = sum(r["train_seconds"] or 0.0 for r in res["runs"].values())
    lines = ["# fullband experiment state", "",
             f"Tasks {s['tasks']}{' (mixed in one stream)' if ',' in s['tasks'] else ''}, rows of T = "
             f"{s['length']} inputs with a label at every position; every arm {s['steps']} steps x {s['batch_size']} rows (equal tokens; baseline-L-flops: "
             f"more steps on fresh rows, to the first FBT arm's training FLOPs), Llama d{s['hidden']} with "
             f"{s['heads']} heads, L = {s['layers']}, seed {s['seed']}, peak LR {s['lr']}; FBT arms trained with "
             f"K = {s['num_passes']} passes. Test: {s['test_rows']} fresh rows per task and length "
             f"({', '.join(map(str, s['lengths']))}). Training {train_s:.0f}s summed over the runs; this invocation "
             f"{res['seconds']:.0f}s wall (finished runs are reused), load average {res['load_average'][0]} at the "
             f"start and {res['load_average'][1]} at the end, {res['threads']} thread(s).", "", "Arms:", ""]
    lines += [f"* `{n}` ({r['layers']} layers, {r['parameters']:,} parameters, {r['steps']} steps, "
              f"{r['train_flops']:.3g} training FLOPs): {res['arm_descriptions'][n]}" for n, r in res["runs"].items()]
    lines += ["", "Modes: `standard` no feedback; `K=2` two teacher-forced passes; `exact` the token-by-token "
              "recurrence.", "", text, "![state](state.png)", ""]
    return "\n".join(lines)
