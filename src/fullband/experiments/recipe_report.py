"""The analysis and report of ``fullband experiment recipe`` (:mod:`fullband.experiments.recipe` trains and scores the
runs): the paired differences of every (arm, mode) to the arm's baseline at equal tokens and, interpolated between
that baseline and each of its FLOP-matched ones (``-flops``: more unique tokens; ``-epochs``: the same unique
tokens), at equal FLOPs (:func:`analyse`); each mode's inference FLOPs relative to ``standard`` (:func:`mode_cost`);
the tables, the best feedback arm, the plot and ``report.md``."""

from __future__ import annotations

import math

from ..eval.flops import inference_flops
from ..utils.stats import bootstrap_ci, bootstrap_ci_within_seeds
from .common import save_png


def _interp_rows(lo: list[float], hi: list[float], f_lo: float, f_hi: float, f: float) -> list[float] | None:
    """Per-row baseline loss at FLOPs ``f``, linear in log FLOPs between two baseline runs (None outside)."""
    if not f_lo <= f <= f_hi * (1 + 1e-9):
        return None
    w = 0.0 if f_hi == f_lo else (math.log(f) - math.log(f_lo)) / (math.log(f_hi) - math.log(f_lo))
    return [a + w * (b - a) for a, b in zip(lo, hi)]


def mode_cost(mode: str, fp: dict, row_tokens: int, prompt_tokens: int) -> float:
    """Inference FLOPs of scoring a row in the table's ``mode`` (``standard``, ``K=k``, ``exact``, ``soft``,
    ``fused``) relative to ``standard``, as the recipe scores it (:func:`fullband.eval.scoring.row_losses` after a
    ``prompt_tokens`` prompt, ``fused`` with one prefill pass): :func:`fullband.eval.flops.inference_flops`."""
    k = int(mode[2:]) if mode.startswith("K=") else 2
    return inference_flops("passes" if mode.startswith("K=") else mode, fp, row_tokens, prompt_tokens,
                           num_passes=k, prefill_passes=1)["relative"]


def analyse(seeds: list[dict], arms: list, controls: dict[str, dict[str, str]], prompt_tokens: int,
            boot_seed: int = 0) -> list[dict]:
    """One table row per (arm, mode): loss per seed and mean, its inference FLOPs relative to ``standard``
    (:func:`mode_cost`, the arm's parameters), paired deltas at equal tokens (vs the arm's reference) and, per
    control (``{"flops": FLOPS_OF, "epochs": EPOCHS_OF}``: reference -> its FLOP-matched baseline reading further /
    re-reading the reference's own rows), at equal FLOPs: vs the reference's loss at the arm's FLOPs, interpolated
    towards that control (``delta_flops``, ``delta_epochs``)."""
    table = []
    for arm in arms:
        refs = {kind: of.get(arm.reference) for kind, of in controls.items()}
        first = seeds[0]["runs"][arm.name]
        for mode in first["losses"]:
            per_seed, d_tok, d_self = [], [], []
            d_ctl = {kind: [] for kind in controls}
            for s in seeds:
                runs = s["runs"]
                run, ref = runs[arm.name], runs[arm.reference]
                mine = run["losses"][mode]
                per_seed.append(sum(mine) / len(mine))
                d_tok.append([a - b for a, b in zip(mine, ref["losses"]["standard"])])
                d_self.append([a - b for a, b in zip(mine, run["losses"]["standard"])])
                for kind, name in refs.items():
                    at = None
                    if name is not None and d_ctl[kind] is not None:
                        big = runs[name]
                        at = _interp_rows(ref["losses"]["standard"], big["losses"]["standard"], ref["flops"],
                                          big["flops"], run["flops"])
                    if at is None:
                        d_ctl[kind] = None  # not at every seed: not compared
                    else:
                        d_ctl[kind].append([a - b for a, b in zip(mine, at)])
            row = {"arm": arm.name, "mode": mode, "loss": sum(per_seed) / len(per_seed), "loss_per_seed": per_seed,
                   "reference": arm.reference, **{f"{kind}_reference": name for kind, name in refs.items()},
                   "flops": [s["runs"][arm.name]["flops"] for s in seeds],
                   "inference_flops": mode_cost(mode, first["flop_parameters"], seeds[0]["row_tokens"],
                                                prompt_tokens)}
            if arm.name != arm.reference:
                # each seed scores rows of its own seeded validation split: the seeds, then rows within each
                row["delta_tokens"] = bootstrap_ci_within_seeds(d_tok, boot_seed)
                row["delta_tokens_per_seed"] = [bootstrap_ci(d, seed=boot_seed).as_dict() for d in d_tok]
            if mode != "standard":
                row["delta_vs_own_standard"] = bootstrap_ci_within_seeds(d_self, boot_seed)
            for kind, d in d_ctl.items():
                if d is not None and arm.name != arm.reference:
                    row[f"delta_{kind}"] = bootstrap_ci_within_seeds(d, boot_seed)
            table.append(row)
    return table


def _ci(d: dict | None) -> str:
    if not d:
        return ""
    return f"{d['estimate']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"


def tables(res: dict) -> str:
    lines = ["| arm | mode | loss (mean of seeds) | per seed | inference FLOPs vs standard | "
             "Δ vs baseline, equal tokens [95% CI] | Δ vs baseline, equal FLOPs | "
             "Δ vs equal unique tokens & FLOPs | Δ vs own standard |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["table"]:
        per = " / ".join(f"{x:.4f}" for x in r["loss_per_seed"])
        lines.append(f"| {r['arm']} | {r['mode']} | {r['loss']:.4f} | {per} | {r['inference_flops']:.3f} | "
                     f"{_ci(r.get('delta_tokens'))} | {_ci(r.get('delta_flops'))} | {_ci(r.get('delta_epochs'))} | "
                     f"{_ci(r.get('delta_vs_own_standard'))} |")
    lines += ["", "| arm | first-10-step L2−L1 | last-10-step L2−L1 | first-10 max grad norm | last-10 mean grad norm |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for name, so in res["switch_on"].items():
        if so:
            lines.append(f"| {name} | {so['first_gap']:+.3f} | {so['last_gap']:+.3f} | "
                         f"{so['first_max_grad_norm']:.2f} | {so['last_mean_grad_norm']:.2f} |")
    return "\n".join(lines)


def best_feedback_arm(res: dict) -> dict:
    """The FBT arm whose best feedback mode has the lowest mean loss, with that mode."""
    best = None
    for r in res["table"]:
        if r["arm"].startswith("baseline") or r["mode"] == "standard":
            continue
        if best is None or r["loss"] < best["loss"]:
            best = r
    return best


def plot(res: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in res["arms"] if not a.startswith("baseline")]
    modes = ["standard", "K=2", "exact", "soft", "fused"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(arms)), 4))
    width = 0.8 / len(modes)
    by = {(r["arm"], r["mode"]): r for r in res["table"]}
    for j, mode in enumerate(modes):
        xs, ys, errs = [], [], []
        for i, arm in enumerate(arms):
            r = by.get((arm, mode))
            if r and r.get("delta_tokens"):
                d = r["delta_tokens"]
                xs.append(i + (j - len(modes) / 2 + 0.5) * width)
                ys.append(d["estimate"])
                errs.append([[d["estimate"] - d["low"]], [d["high"] - d["estimate"]]])
        if xs:
            err = [[e[0][0] for e in errs], [e[1][0] for e in errs]]
            ax.bar(xs, ys, width, yerr=err, label=mode, capsize=2)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(arms)))
    ax.set_xticklabels(arms, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("held-out loss − baseline (nats/token)")
    ax.set_title("recipe grid: Δ vs the equal-token baseline (95% CI)")
    if ax.get_legend_handles_labels()[0]:  # no bars when no FBT arm was asked for
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_png(fig, path)


COLUMNS = (
    "Columns: *inference FLOPs vs standard* is the forward compute of scoring a held-out row in that mode over "
    "`standard`'s on the same row and model (`fullband.eval.flops.inference_flops`: K=k runs k passes over the row, "
    "passes 2..k fused, logits once; `exact` is `standard`'s FLOPs plus a fusion a token, in one-token steps; `soft` "
    "prefills the prompt plainly, then fuses each continuation token; `fused` adds one fused pass over the prompt). "
    "Each Δ is the arm's per-row loss minus a baseline's, paired by row (95% percentile bootstrap: the seeds "
    "resampled, then the rows within each drawn seed; below 3 seeds it cannot hold the seed variance): *equal tokens* against the arm's plain reference (same steps, the same unique tokens); "
    "*equal FLOPs* against that reference's loss at the arm's training FLOPs, interpolated per row (linear in log "
    "FLOPs) towards its `-flops` baseline (trained longer, reading further: more unique tokens); *equal unique "
    "tokens & FLOPs* the same towards its `-epochs` baseline (trained as long as the `-flops` one, on exactly the "
    "reference's rows: `--unique-batches` its steps, from its `--data-offset`, re-read in a fresh order each epoch, "
    "its own full LR schedule); blank where the arm's FLOPs lie outside the two baselines' or the family has no "
    "such baseline.")


def report(res: dict, text: str) -> str:
    s = res["settings"]
    best = res["best"]
    lines = ["# fullband experiment recipe", "",
             f"Preset `{s['preset']}`; per seed a plain trunk of {s['trunk_steps']} steps, then every arm "
             f"{s['branch_steps']} steps from it on the same next batches ({s['batch_size']} x {s['seq_len']} "
             f"tokens a step); the arms from scratch ({', '.join(f'`{n}`' for n in res['scratch_arms']) or 'none'}) "
             f"train {s['trunk_steps'] + s['branch_steps']} steps on the same batches, their FLOPs counting the whole "
             f"run, their FLOP-matched baselines {s['scratch_flops_multiplier']}x as many (compare each family with its "
             f"own baselines); seeds {res['seeds']}; {s['eval_rows']} held-out "
             f"rows, each scored after a {s['prompt_tokens']}-token prompt in every mode. Training took "
             f"{res['train_seconds']:.0f}s summed over the runs (trunks included); this invocation "
             f"{res['seconds']:.0f}s wall (finished runs are reused), load average "
             f"{res['load_average'][0]} at the start and {res['load_average'][1]} at the end, "
             f"{res['threads']} thread(s).", "", "Arms:", ""]
    lines += [f"* `{n}`: {d}" for n, d in res["arm_descriptions"].items()]
    lines += ["", COLUMNS, "", text, ""]
    if best:
        lines.append(f"Best feedback arm and mode: `{best['arm']}` in `{best['mode']}`, {best['loss']:.4f} "
                     f"(Δ vs baseline at equal tokens {_ci(best.get('delta_tokens'))}).")
    lines += ["", "![recipe](recipe.png)", ""]
    return "\n".join(lines)
