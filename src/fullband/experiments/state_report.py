"""The state experiment's analysis and report: the paired differences and interventions over seeds
(:func:`analyse`), the tables (per-position accuracy with its CI -- which resamples the seeds, then the test rows
within each drawn seed -- and the range of the per-seed values), the LR sweep table, the figure and ``report.md``. Pure functions of
the results dict that :func:`fullband.experiments.state.run_state` builds."""

from __future__ import annotations

from ..eval.state_tasks import CHANCE
from ..utils.stats import bootstrap_ci, bootstrap_ci_within_seeds, interval_scope
from .common import accuracy_panels
from .interventions import INTERVENTIONS
from .synthetic import CONTROL_ARMS, EPOCHS_ARM, FLOPS_ARM

SWEPT = ("baseline-L", "baseline-2L", "baseline-4L")  # the plain arms --plain-lrs trains at each LR
REFS = ("baseline-L", "baseline-4L", FLOPS_ARM, EPOCHS_ARM)  # paired references; the controls for FBT arms only


def _ci(groups: list[list[float]], boot: int) -> dict:
    """The mean over seeds of each seed's mean of ``groups[seed]``, with a 95% CI that resamples the seeds, then the
    rows within each drawn seed (each seed has its own test rows); one seed: the percentile bootstrap of its rows."""
    if len(groups) == 1:
        return bootstrap_ci(groups[0], seed=0, n_resamples=boot).as_dict()
    return bootstrap_ci_within_seeds(groups, seed=0, n_resamples=boot) | {"confidence": 0.95}


def _mean(values) -> float:
    return sum(values) / len(values)


def _paired(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    """Per seed, the per-row differences ``a - b`` (the same test rows in both)."""
    return [[x - y for x, y in zip(sa, sb)] for sa, sb in zip(a, b)]


def analyse(res: dict, boot: int = 2000) -> dict:
    """The table rows (accuracy with CIs, mean over seeds, and the per-seed means), the paired differences to the
    baselines (the equal-FLOPs controls: for the FBT arms) and the interventions."""
    seeds = [res["per_seed"][str(s)] for s in res["seeds"]]
    refs = [n for n in REFS if n in res["arms"]]
    table, deltas, inter = [], [], []
    for arm in res["arms"]:
        for mode, cells in seeds[0][arm]["correct"].items():
            for cell in cells:
                task, length = cell.split("/")

                def rows(a, m, field="pos", cell=cell):
                    return [s[a]["correct"][m][cell][field] for s in seeds]

                pos = rows(arm, mode)
                if "/" in mode:
                    base = rows(arm, "exact")
                    inter.append({"arm": arm, "task": task, "length": int(length), "intervention": mode.split("/")[1],
                                  "exact": _mean([_mean(b) for b in base]), "delta": _ci(_paired(pos, base), boot),
                                  "per_seed": [_mean(d) for d in _paired(pos, base)]})
                    continue
                last = rows(arm, mode, "last")
                table.append({"arm": arm, "mode": mode, "task": task, "length": int(length),
                              "pos": _ci(pos, boot), "last": _ci(last, boot),
                              "per_seed": {"pos": [_mean(p) for p in pos], "last": [_mean(x) for x in last]},
                              "inference_flops": res["runs"][arm]["inference_flops"][mode][length]})
                for ref in refs:
                    if ref != arm and (ref not in CONTROL_ARMS or arm.startswith("fbt")):
                        paired = _paired(pos, rows(ref, "standard"))
                        deltas.append({"arm": arm, "mode": mode, "task": task, "length": int(length), "vs": ref,
                                       "delta": _ci(paired, boot), "per_seed": [_mean(d) for d in paired]})
    return {"table": table, "deltas": deltas, "interventions": inter}


def fmt_ci(d, digits=2, sign=False, per_seed=None):
    """``estimate [low, high]``, and with two or more ``per_seed`` values their range over seeds ``{min..max}``."""
    fmt = f"{{:{'+' if sign else ''}.{digits}f}}"
    text = f"{fmt.format(d['estimate'])} [{fmt.format(d['low'])}, {fmt.format(d['high'])}]"
    if per_seed is not None and len(per_seed) > 1:
        text += f" {{{fmt.format(min(per_seed))}..{fmt.format(max(per_seed))}}}"
    return text


def ci_scope(res: dict) -> str:
    """What the CIs resample (as the intervals in ``res`` say), said beside every table, with the per-seed range."""
    count = len(res["seeds"])
    text = interval_scope(res["table"][0]["pos"], count, "test rows")
    if count > 1:
        return text + ": {min..max} is the range of the per-seed values"
    return text + ": a CI that excludes 0 says nothing about another seed"


def curriculum_note(settings: dict) -> str:
    """What the captions add where the arms were trained with a length curriculum (nothing where they were not)."""
    if settings.get("length_curriculum") is None:
        return ""
    return (f" with a length curriculum: labelled length {settings['curriculum_start']} at the first step, growing "
            f"linearly to T over the first {settings['length_curriculum']:g} of each arm's steps")


def tables(res: dict) -> str:
    lengths = sorted({r["length"] for r in res["table"]})
    seeds = ci_scope(res)
    out = []
    for task in res["settings"]["tasks"].split(","):
        out += [f"**{task}** (per-position accuracy [95% CI] / last-position accuracy, {seeds}; trained at T = "
                f"{res['settings']['length']}{curriculum_note(res['settings'])}; chance {CHANCE[task]:.3f}; "
                "inference FLOPs per token x the L-layer model's standard pass, at each T)", "",
                "| arm | mode | " + " | ".join(f"T={n}" for n in lengths) + " | inference FLOPs |",
                "| --- | --- |" + " ---: |" * (len(lengths) + 1)]
        rows = {}
        for r in res["table"]:
            if r["task"] == task:
                rows.setdefault((r["arm"], r["mode"]), {})[r["length"]] = r
        for (arm, mode), by_len in rows.items():
            out.append(f"| {arm} | {mode} | " + " | ".join(
                f"{fmt_ci(by_len[n]['pos'], per_seed=by_len[n]['per_seed']['pos'])} / "
                f"{by_len[n]['last']['estimate']:.2f}" if n in by_len else ""
                for n in lengths) + " | " + "/".join(f"{by_len[n]['inference_flops']:.3f}" for n in lengths
                                                     if n in by_len) + " |")
        out.append("")
    if res["deltas"]:
        out += ["**Paired per-row difference in per-position accuracy** (FBT exact mode and the other baselines "
                f"minus the reference; FBT arms also vs the equal-FLOPs controls; Δ [95% CI], {seeds})", "",
                "| arm | mode | task | vs | " + " | ".join(f"T={n}" for n in lengths) + " |",
                "| --- | --- | --- | --- |" + " ---: |" * len(lengths)]
        rows = {}
        for d in res["deltas"]:
            if d["mode"] in ("exact", "standard") and not (d["mode"] == "standard" and d["arm"].startswith("fbt")):
                rows.setdefault((d["arm"], d["mode"], d["task"], d["vs"]), {})[d["length"]] = d
        for (arm, mode, task, vs), by_len in rows.items():
            out.append(f"| {arm} | {mode} | {task} | {vs} | " + " | ".join(
                fmt_ci(by_len[n]["delta"], sign=True, per_seed=by_len[n]["per_seed"]) if n in by_len else ""
                for n in lengths) + " |")
        out.append("")
    if res["interventions"]:
        out += ["**Is the fed-back state used?** Exact-mode per-position accuracy and its paired change when only "
                "the fed-back state is replaced, the token kept: `mean` = the mean over the test rows of the state at "
                "that step, `shuffle` = the state another row of the same task had at that step, `zero` = a zero "
                "state, only for fusions where that keeps the token (the residual entry: u = e); on the pure GLU entry "
                "a zero state zeroes the whole input (norm(W_U·0 ⊙ gate) = 0: token gone too), so it is not run "
                f"there (-) (Δ [95% CI], {seeds})", "",
                "| arm | task | T | exact | " + " | ".join(INTERVENTIONS) + " |",
                "| --- | --- | ---: | ---: |" + " ---: |" * len(INTERVENTIONS)]
        rows = {}
        for r in res["interventions"]:
            rows.setdefault((r["arm"], r["task"], r["length"]), {"exact": r["exact"]})[r["intervention"]] = r
        for (arm, task, length), v in rows.items():
            out.append(f"| {arm} | {task} | {length} | {v['exact']:.2f} | " + " | ".join(
                fmt_ci(v[n]["delta"], sign=True, per_seed=v[n]["per_seed"]) if n in v else "-"
                for n in INTERVENTIONS) + " |")
        out.append("")
    if res.get("lr_sweep"):
        lrs = sorted({lr for per in res["lr_sweep"].values() for a in per.values() for lr in a["val"]}, key=float)
        out += ["**LR sweep of the plain arms** (`--plain-lrs`; per-position accuracy in standard mode on the held-out "
                "validation rows at T, mean over tasks; the LR marked * is the one each seed's tables use; the test "
                "rows play no part in the choice)", "",
                "| seed | arm | " + " | ".join(f"lr {lr}" for lr in lrs) + " |", "| --- | --- |" + " ---: |" * len(lrs)]
        for seed, per in res["lr_sweep"].items():
            out += [f"| {seed} | {arm} | " + " | ".join(
                (f"{a['val'][lr]:.3f}" + ("*" if float(lr) == a["lr"] else "")) if lr in a["val"] else ""
                for lr in lrs) + " |" for arm, a in per.items()]
        out.append("")
    if res.get("cost"):
        out += [f"**Cost of a training step** (seed {res['seeds'][0]}, S3 rows, T = {res['settings']['length']}, batch "
                f"{res['settings']['batch_size']}, fusion glu; median of the timed steps; activation memory = the "
                "bytes autograd saved for the backward)", "",
                "| K | grad passes | pass tol | passes run | step time (s) | activation memory (MiB) | FLOPs vs K=1 |",
                "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        out += [f"| {c['num_passes']} | {c['grad_passes']} | {c['pass_tol'] or '-'} | {c['passes_run']:.1f} | "
                f"{c['step_seconds']:.3f} | {c['saved_mib']:.1f} | {c['flops_ratio']:.2f} |" for c in res["cost"]]
        out.append("")
    return "\n".join(out)


def plot(res: dict, path: str) -> str:
    longest = max(r["length"] for r in res["table"])
    seeds = [res["per_seed"][str(s)] for s in res["seeds"]]
    panels = []
    for task in res["settings"]["tasks"].split(","):
        lines = []
        for i, arm in enumerate(res["arms"]):
            for mode, style in (("standard", "-"), ("exact", ":")):
                curves = [s[arm]["correct"].get(mode, {}).get(f"{task}/{longest}") for s in seeds]
                if curves[0] is not None and not (mode == "standard" and arm.startswith("fbt")):
                    mean = [_mean(v) for v in zip(*(c["by_position"] for c in curves))]  # over seeds
                    lines.append((range(1, longest + 1), mean, style, f"C{i}", f"{arm} {mode}"))
        panels.append({"title": f"{task}: accuracy per position (T={longest})", "chance": CHANCE[task],
                       "lines": lines, "vline": res["settings"]["length"]})
    return accuracy_panels(panels, path, "position")


def report(res: dict, text: str) -> str:
    s = res["settings"]
    train_s = sum(r["train_seconds"] for r in res["runs"].values())
    lines = ["# fullband experiment state", "",
             f"Tasks {s['tasks']}{' (mixed in one stream)' if ',' in s['tasks'] else ''}, rows of T = "
             f"{s['length']} inputs with a label at every position; every arm {s['steps']} steps x "
             f"{s['batch_size']} rows (equal tokens; baseline-L-flops: more steps on fresh rows, to the first FBT "
             "arm's training FLOPs; baseline-L-epochs: as many steps re-reading baseline-L's rows), Llama "
             f"d{s['hidden']} with {s['heads']} heads, L = {s['layers']}, seeds {s['seeds']} (each its own training "
             f"rows, initial weights and test rows, in OUT/seed{{N}}/), peak LR {s['lr']}; FBT arms trained with "
             f"K = {s['num_passes']} passes. Test: {s['test_rows']} fresh rows per task, length and seed "
             f"({', '.join(map(str, s['lengths']))}), and {s['validation_rows']} validation rows per task at T; no "
             "training row of any arm is a test or validation row (drawn apart, then checked before scoring). "
             + (f"Plain arms {', '.join(SWEPT)} trained at each LR of {s['plain_lrs']} and reported at the LR best on "
                "the validation rows (the LR sweep table); the equal-FLOPs controls at the peak LR. "
                if s.get("plain_lrs") else "")
             + ("Every arm trained on randomized positions (BOS at 0, the other position ids a sorted random subset "
                f"of 1..{s['position_range'] - 1} per row), so every relative distance of the 2T and 4T rows was seen "
                "in training; scored on contiguous positions. " if s.get("position_range") else
                "Positions contiguous in training (0..T+1): at 2T and 4T the model meets relative distances it never "
                "saw (RoPE extrapolation and state extrapolation are not separated; --random-positions does). ")
             + (f"Every arm trained{curriculum_note(s)} (the loss only at the first n inputs of each row; FLOPs "
                "counted on whole rows). " if s.get("length_curriculum") is not None else "")
             + f"Training {train_s:.0f}s summed over the runs; this invocation "
             f"{res['seconds']:.0f}s wall (finished runs are reused), load average {res['load_average'][0]} at the "
             f"start and {res['load_average'][1]} at the end, {res['threads']} thread(s).", "", "Arms:", ""]
    lines += [f"* `{n}` ({r['layers']} layers, {r['parameters']:,} parameters, {r['steps']} steps, "
              f"{r['train_flops']:.3g} training FLOPs): {res['arm_descriptions'][n]}" for n, r in res["runs"].items()]
    lines += ["", "Modes: `standard` no feedback; `K=2` two teacher-forced passes; `exact` the token-by-token "
              "recurrence (T sequential one-token calls); `exact/mean`, `exact/shuffle` (and `exact/zero` where a zero "
              "state keeps the token) the recurrence with only its fed-back state replaced. Inference FLOPs per token "
              "are counted from what each "
              "mode runs (`fullband.eval.flops.inference_flops`), relative to the L-layer model's standard pass on "
              "the same rows.", "", text, "![state](state.png)", ""]
    return "\n".join(lines)
