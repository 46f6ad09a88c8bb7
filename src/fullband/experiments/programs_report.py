"""The programs experiment's analysis and report: accuracy on the printed values per arm, mode and test length, the
paired per-program differences of the FBT arms to every plain arm, the training and inference FLOPs, the goal
line (:func:`analyse`, :func:`goal`), the tables (:func:`tables`, what the docs renderer calls), the figure and
``report.md``. Pure functions of the results dict :func:`fullband.experiments.programs.run_programs` builds.

Accuracy is correct printed values over printed values (as ``fullband eval labelled`` counts it), per seed; a
table shows the mean over seeds. Its 95% CI resamples the seeds, then the test programs within each drawn seed
(each seed has programs of its own; a two-level bootstrap, so it holds the seed-to-seed spread, as far as the
seeds there are can show it), through each program's linearised share ``acc + (c_r - acc * n_r) / mean(n)``
(``c_r`` of ``n_r`` printed values right), whose mean is the accuracy itself
(:func:`fullband.utils.stats.bootstrap_ci`, one seed; :func:`fullband.utils.stats.bootstrap_ci_within_seeds`,
several); ``{min..max}`` beside it is the range of the per-seed values."""

from __future__ import annotations

from ..utils.stats import bootstrap_ci, bootstrap_ci_within_seeds, interval_scope
from .common import accuracy_panels, save_png

GOAL = dict(fbt=0.99, plain=0.5, flops=3.0)  # the issue's: FBT exact >= 0.99 where plain <= 0.5, at <= 3x FLOPs
REFERENCE = "baseline-L"


def is_fbt(arm: str) -> bool:
    return arm.startswith("fbt-")


def accuracy(rows: list[list[int]]) -> float:
    """Correct printed values over printed values, over programs ``rows`` (each a list of 0/1)."""
    return sum(map(sum, rows)) / sum(map(len, rows))


def linearised(rows: list[list[int]]) -> list[float]:
    """Each program's linearised share of the accuracy (the module docstring): their mean is :func:`accuracy`."""
    acc, mean_n = accuracy(rows), sum(map(len, rows)) / len(rows)
    return [acc + (sum(r) - acc * len(r)) / mean_n for r in rows]


def _ci(groups: list[list[float]], estimate: float, boot: int) -> dict:
    """``estimate`` (the mean over seeds) with a 95% CI resampling each seed's programs (``groups[seed]``)."""
    if len(groups) == 1:
        ci = bootstrap_ci(groups[0], seed=0, n_resamples=boot).as_dict()
    else:
        ci = bootstrap_ci_within_seeds(groups, seed=0, n_resamples=boot) | {"confidence": 0.95}
    return ci | {"estimate": estimate}  # the exact ratio, not the linearisation's rounding


def flops_ratio(res: dict, arm: str, key: str = "train_flops") -> float | None:
    """An arm's training FLOPs (``key``) over baseline-L's (``None`` without baseline-L)."""
    ref = res["runs"].get(REFERENCE)
    return res["runs"][arm][key] / ref["train_flops"] if ref else None


def analyse(res: dict, boot: int = 2000) -> dict:
    """``{"table": accuracy rows, "deltas": FBT - plain rows, "goal": [...]}`` from ``res["per_seed"]``."""
    seeds = [res["per_seed"][str(s)] for s in res["seeds"]]
    lengths = [str(n) for n in res["settings"]["test_statements"]]
    plain = [a for a in res["arms"] if not is_fbt(a)]
    table, deltas = [], []
    for arm in res["arms"]:
        for mode in seeds[0][arm]["correct"]:
            for n in lengths:
                rows = [s[arm]["correct"][mode][n] for s in seeds]
                per_seed = [accuracy(r) for r in rows]
                table.append({"arm": arm, "mode": mode, "statements": int(n), "programs": len(rows[0]),
                              "targets": sum(map(len, rows[0])), "per_seed": per_seed,
                              "accuracy": _ci([linearised(r) for r in rows], sum(per_seed) / len(per_seed), boot),
                              "inference_flops": res["runs"][arm]["inference_flops"][mode][n]})
                if not is_fbt(arm):
                    continue
                for ref in plain:
                    other = [s[ref]["correct"]["standard"][n] for s in seeds]
                    if any(list(map(len, a)) != list(map(len, b)) for a, b in zip(rows, other)):
                        raise ValueError(f"{arm} {mode} and {ref} scored other printed values: no pairing")
                    diff = [x - y for x, y in zip(per_seed, map(accuracy, other))]
                    groups = [[p - q for p, q in zip(linearised(a), linearised(b))] for a, b in zip(rows, other)]
                    deltas.append({"arm": arm, "mode": mode, "vs": ref, "statements": int(n), "per_seed": diff,
                                   "delta": _ci(groups, sum(diff) / len(diff), boot)})
    return {"table": table, "deltas": deltas, "goal": goal(res, table)}


def goal(res: dict, table: list[dict]) -> list[dict]:
    """Per FBT arm, the issue's goal at the training length: its exact mode >= 0.99 where every plain arm (standard
    mode) is <= 0.5, at <= 3x baseline-L's training FLOPs; on the means over seeds (``every_seed``: on each seed)."""
    n = res["settings"]["statements"]
    cell = {(r["arm"], r["mode"]): r for r in table if r["statements"] == n}
    plain = [a for a in res["arms"] if not is_fbt(a)]
    out = []
    for arm in (a for a in res["arms"] if is_fbt(a)):
        if REFERENCE not in res["arms"]:
            out.append({"arm": arm, "met": None, "why": f"needs {REFERENCE} (the FLOPs reference and a plain arm)"})
            continue
        fbt = cell[(arm, "exact")]
        others = {a: cell[(a, "standard")] for a in plain}
        ratio = flops_ratio(res, arm)
        conditions = [fbt["accuracy"]["estimate"] >= GOAL["fbt"],
                      all(c["accuracy"]["estimate"] <= GOAL["plain"] for c in others.values()), ratio <= GOAL["flops"]]
        every_seed = (min(fbt["per_seed"]) >= GOAL["fbt"] and ratio <= GOAL["flops"]
                      and all(max(c["per_seed"]) <= GOAL["plain"] for c in others.values()))
        out.append({"arm": arm, "statements": n, "met": all(conditions), "every_seed": every_seed,
                    "exact": fbt["accuracy"]["estimate"], "plain": {a: c["accuracy"]["estimate"]
                                                                    for a, c in others.items()},
                    "flops_x": ratio})
    return out


# ---------------------------------------------------------------------------------------------- text


def fmt_ci(d: dict, per_seed=None, sign: bool = False) -> str:
    """``estimate [low, high]``, and with two or more ``per_seed`` values their range ``{min..max}``."""
    f = "{:+.2f}" if sign else "{:.2f}"
    text = f"{f.format(d['estimate'])} [{f.format(d['low'])}, {f.format(d['high'])}]"
    if per_seed is not None and len(per_seed) > 1:
        text += f" {{{f.format(min(per_seed))}..{f.format(max(per_seed))}}}"
    return text


def ci_scope(res: dict) -> str:
    """What the CIs resample (as the intervals in ``res`` say), and the per-seed range beside them."""
    text = interval_scope(res["table"][0]["accuracy"], len(res["seeds"]), "test programs")
    return text + ("; {min..max} is the range of the per-seed values" if len(res["seeds"]) > 1 else "")


def _by(rows: list[dict], *keys) -> dict:
    out = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), {})[r["statements"]] = r
    return out


def goal_line(res: dict) -> list[str]:
    out = []
    for g in res["goal"]:
        head = (f"**Goal** ({g['arm']} exact >= {GOAL['fbt']} where every plain arm <= {GOAL['plain']}, at <= "
                f"{GOAL['flops']:g}x baseline-L's training FLOPs")
        if g["met"] is None:
            out.append(f"{head}): not evaluated ({g['why']}).")
            continue
        plain = ", ".join(f"{a} {v:.2f}" for a, v in g["plain"].items())
        out.append(f"{head}, at the training length {g['statements']} statements, means over seeds): "
                   f"**{'met' if g['met'] else 'not met'}**{' in every seed' if g['every_seed'] else ''} -- exact "
                   f"{g['exact']:.3f}; plain {plain}; training FLOPs {g['flops_x']:.2f}x.")
    return out


def tables(res: dict) -> str:
    s = res["settings"]
    lengths = s["test_statements"]
    scope = ci_scope(res)
    head = " | ".join(f"N={n}" + (" (trained)" if n == s["statements"] else "") for n in lengths)
    out = [f"**Accuracy on the printed values** ({s['vars']} variables, values 1-10, trained on programs of "
           f"{s['statements']} statements, tested on {s['test_rows']} fresh programs per length N and seed; chance "
           f"{res['chance']:.2f}; {scope}; inference FLOPs of a test row x baseline-L's standard pass, per N)", "",
           f"| arm | mode | {head} | inference FLOPs |", "| --- | --- |" + " ---: |" * (len(lengths) + 1)]
    for (arm, mode), by_n in _by(res["table"], "arm", "mode").items():
        out.append(f"| {arm} | {mode} | " + " | ".join(fmt_ci(by_n[n]["accuracy"], by_n[n]["per_seed"])
                                                        for n in lengths)
                   + " | " + " / ".join(f"{by_n[n]['inference_flops']:.3f}" for n in lengths) + " |")
    out.append("")
    if res["deltas"]:
        out += [f"**Paired differences, FBT - plain** (accuracy on the same test programs within each seed, FBT in "
                f"each mode minus the plain arm in standard mode; Δ [95% CI], {scope})", "",
                f"| arm | mode | vs | {' | '.join(f'N={n}' for n in lengths)} |",
                "| --- | --- | --- |" + " ---: |" * len(lengths)]
        for (arm, mode, vs), by_n in _by(res["deltas"], "arm", "mode", "vs").items():
            out.append(f"| {arm} | {mode} | {vs} | " + " | ".join(
                fmt_ci(by_n[n]["delta"], by_n[n]["per_seed"], sign=True) for n in lengths) + " |")
        out.append("")
    out += ["**Training** (FLOPs counted from each run's own metrics, every pass, a pass without gradient at its "
            "forward, at batch x the longest training row's tokens per step: rows are padded to their batch's "
            "longest, so the count is nominal, alike for every arm on the same programs; baseline-L-flops' fresh "
            "programs may hold a longer row, counted so at the same steps; the controls' steps match the first FBT "
            "arm's FLOPs at baseline-L's row length; mean over seeds; seconds summed over seeds)",
            "", "| arm | layers | parameters | steps | training programs | training FLOPs | x baseline-L | "
                "K = T + 1 on the same steps | training s |", "| --- |" + " ---: |" * 8]
    for arm, r in res["runs"].items():
        ratio = flops_ratio(res, arm)
        k = flops_ratio(res, arm, "train_flops_k_exact") if "train_flops_k_exact" in r else None
        out.append(f"| {arm} | {r['layers']} | {r['parameters']:,} | {r['steps']:,} | {r['rows']:,}"
                   + (f" (baseline-L's {r['unique_batches']:,} batches re-read)" if r["unique_batches"] else "")
                   + f" | {r['train_flops']:.3g} | " + (f"{ratio:.2f}x" if ratio is not None else "-") + " | "
                   + (f"{k:.2f}x" if k is not None else "") + f" | {r['train_seconds']:.0f} |")
    checked = {a: [res["held_out"][str(seed)][a]["training_rows_checked"] for seed in res["seeds"]]
               for a in res["arms"]}
    tests = [res["held_out"][str(seed)][res["arms"][0]]["test_programs"] for seed in res["seeds"]]
    out += ["", f"Held out: before each arm was scored its training programs were checked against the test programs "
                f"of every length ({'/'.join(map(str, tests))} per seed, by the row key of the whole program): none "
                "is one. Training programs checked per seed: " + "; ".join(
                    f"{a} {'/'.join(f'{c:,}' for c in v)}" for a, v in checked.items()) + ".", ""]
    out += per_seed_tables(res)
    out += goal_line(res)
    return "\n".join(out) + "\n"


def per_seed_tables(res: dict) -> list[str]:
    """The test accuracy of every arm and mode per seed at the training length and, where the run chose LRs on its
    validation programs (results with ``lr_search``), each arm's validation accuracy per LR and the one it kept."""
    if "lr_search" not in res:  # results of runs before the validation split: the CI columns show the seed range
        return []
    n, seeds = res["settings"]["statements"], res["seeds"]
    out = [f"**Per seed** (test accuracy at the training length, {n} statements)", "",
           "| arm | mode | " + " | ".join(f"seed {s}" for s in seeds) + " |", "| --- | --- |" + " ---: |" * len(seeds)]
    for (arm, mode), by_n in _by(res["table"], "arm", "mode").items():
        out.append(f"| {arm} | {mode} | " + " | ".join(f"{v:.3f}" for v in by_n[n]["per_seed"]) + " |")
    lrs = [f"{x:g}" for x in res["settings"]["lrs"]]
    out += ["", f"**Validation** ({res['settings']['val_rows']:,} validation programs per seed of the training length, "
                "none a test or training program; accuracy in the arm's headline mode: exact for FBT, standard for "
                "plain; " + ("each arm keeps the peak LR its validation programs score best, per seed; *: kept)"
                             if len(lrs) > 1 else f"one peak LR, {lrs[0]}: no search)"), "",
            "| arm | seed | " + " | ".join(f"LR {x}" for x in lrs) + " | search s |", "| --- | ---: |"
            + " ---: |" * (len(lrs) + 1)]
    for arm in res["arms"]:
        for s in seeds:
            c = res["lr_search"][str(s)][arm]
            out.append(f"| {arm} | {s} | " + " | ".join(
                f"{c['val_accuracy'][x]:.3f}" + ("*" if len(lrs) > 1 and x == f"{c['lr']:g}" else "")
                for x in lrs) + f" | {c['seconds']:.0f} |")
    return out + [""]


def plot(res: dict, path: str) -> str:
    """Accuracy against the test programs' statements: the plain arms, and every mode of the FBT arms."""
    lengths = res["settings"]["test_statements"]
    lines = []
    for i, ((arm, mode), by_n) in enumerate(_by(res["table"], "arm", "mode").items()):
        style = "-" if mode in ("standard", "exact") else ":"
        lines.append((lengths, [by_n[n]["accuracy"]["estimate"] for n in lengths], style, f"C{i % 10}",
                      f"{arm} {mode}"))
    panel = {"title": f"programs, {res['settings']['vars']} variables: accuracy on printed values",
             "chance": res["chance"], "lines": lines, "vline": res["settings"]["statements"], "xticks": lengths,
             "marker": "o"}
    return accuracy_panels([panel], path, "statements per test program")


def plot_curves(res: dict, path: str) -> str | None:
    """The learning curves (results with ``curves``): the held-out target loss on the validation programs per
    arm (FBT arms in exact mode, plain in standard) and the training objective against the step, the mean over
    seeds of each logged point (the k-th of every seed, at their mean step), the seeds' range shaded; ``None`` for
    results without curves."""
    if not res.get("curves"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for i, arm in enumerate(res["arms"]):
        runs = [res["curves"][str(s)][arm] for s in res["seeds"]]
        for ax, key, col in ((axes[0], "val", 2 if is_fbt(arm) else 1), (axes[1], "train", 1)):
            # the seeds' k-th points together (the controls' steps differ a little from seed to seed)
            points = list(zip(*(r[key] for r in runs)))
            if not points or any(p[col] is None for pts in points for p in pts):
                continue
            x = [sum(p[0] for p in pts) / len(pts) for pts in points]
            ys = [[p[col] for p in pts] for pts in points]
            ax.plot(x, [sum(y) / len(y) for y in ys], color=f"C{i % 10}", lw=1.2,
                    label=f"{arm}{' exact' if key == 'val' and is_fbt(arm) else ''}")
            if len(runs) > 1:
                ax.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=f"C{i % 10}", alpha=0.15)
    for ax, title in zip(axes, ("held-out target loss (validation programs)", "training objective")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("nats per printed value")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    return save_png(fig, path)


def report(res: dict, text: str) -> str:
    s = res["settings"]
    lines = ["# fullband experiment programs", "",
             f"The Feedback Transformer's algorithmic task: programs of {s['statements']} statements (=, ++, --, if, "
             f"print) over {s['vars']} variables with values 1-10, the target the printed value. Every arm "
             f"{s['steps']} steps x {s['batch_size']} programs from {s['rows']:,} training programs (equal tokens; "
             "baseline-L-flops: more steps on fresh programs, to the first FBT arm's training FLOPs; "
             "baseline-L-epochs: as many steps re-reading baseline-L's), Llama "
             f"d{s['hidden']} with {s['heads']} heads, L = {s['layers']}, peak LR "
             + (f"chosen per arm and seed on the validation programs among {', '.join(f'{v:g}' for v in s['lrs'])}"
                if len(s.get("lrs") or [1]) > 1 else f"{s['lr']}") + ", seeds "
             f"{', '.join(map(str, res['seeds']))} (each its own programs, initial weights and runs, in "
             f"OUT/seed{{N}}/); rows of up to {s['seq_len']} tokens, backbones of {s['positions']} positions. Test: "
             f"{s['test_rows']} programs per length ({', '.join(map(str, s['test_statements']))} statements) and seed, "
             f"none a training program of any arm. This invocation {res['seconds']:.0f}s wall (finished runs are "
             f"reused), load average {res['load_average'][0]} at the start and {res['load_average'][1]} at the end, "
             f"{res['threads']} thread(s).", "", "Arms:", ""]
    lines += [f"* `{n}` ({r['layers']} layers, {r['parameters']:,} parameters, {r['steps']} steps): "
              f"{res['arm_descriptions'][n]}" for n, r in res["runs"].items()]
    lines += ["", "Modes (`fullband eval labelled`'s scorer): `standard` no feedback; `K=2` two teacher-forced "
              "passes; `exact` the token-by-token recurrence; `soft` / `fused` the opening assignments "
              f"({s['prompt_tokens']} inputs) as the prompt (plain; `fused` with one Jacobi pass over it), then the "
              "recurrence; every mode scores every printed value (the first comes after the prompt).", "", text,
              "![programs](programs.png)", ""] + (["![learning curves](programs-curves.png)", ""]
                                                  if res.get("curves_plot") else [])
    return "\n".join(lines)
