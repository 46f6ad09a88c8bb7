"""The tables and ``report.md`` of ``fullband experiment reasoning`` (:mod:`fullband.experiments.reasoning` trains,
decodes and compares), and the names of its runs and comparisons: per (model, mode) accuracy, trace length and
decode FLOPs per verbosity, then FBT's paired differences against each plain run."""

from __future__ import annotations

from ..utils.stats import resamples_seeds

BASELINE, FBT, FLOPS, EPOCHS = "baseline", "FBT", "baseline-flops", "baseline-epochs"
PAUSE_ARM, INTERN = "baseline-pause", "baseline-internalized"
# the kinds of comparison of FBT's modes: against which plain run (in its standard mode)
KINDS = (("equal tokens", BASELINE), ("equal FLOPs", FLOPS), ("equal unique tokens & FLOPs", EPOCHS),
         ("pause tokens, equal FLOPs", PAUSE_ARM), ("stepwise internalization, equal FLOPs", INTERN))


def _ci(c: dict | None, digits: int = 3) -> str:
    if c is None:
        return "–"
    return f"{c['estimate']:+.{digits}f} [{c['low']:+.{digits}f}, {c['high']:+.{digits}f}]"


def _two_level(res: dict) -> bool:
    """Whether the results' paired CIs resampled the seeds too (results from before that lack the label)."""
    first = next((c["accuracy"] for c in res.get("comparisons") or [] if c.get("accuracy")), {})
    return resamples_seeds(first.get("resamples"))


def tables(res: dict, full: bool = False) -> str:
    """The accuracy / trace / decode-FLOPs table, then FBT's paired differences against each plain run of
    :data:`KINDS` (``full``: also against its own standard mode and each longer baseline against the baseline, each
    with its discordant counts per seed)."""
    rows = res["table"]
    styles = list(dict.fromkeys(r["style"] for r in rows))
    by = {(r["model"], r["mode"], r["style"]): r for r in rows}
    head, sep = "| model | mode | decode FLOPs vs standard | decode MFLOPs a problem |", "| --- | --- | ---: | ---: |"
    for s in styles:
        head += f" {s}: accuracy (per seed) | {s}: trace |"
        sep += " ---: | ---: |"
    if "free" in styles:
        head += " free: chose full / partial / direct |"
        sep += " ---: |"
    lines = [head, sep]
    for model, mode in dict.fromkeys((r["model"], r["mode"]) for r in rows):
        sums = [by[(model, mode, s)]["decode_sums"] for s in styles if (model, mode, s) in by]  # pooled
        per_problem = [by[(model, mode, s)]["decode_flops_per_problem"] for s in styles if (model, mode, s) in by]
        line = (f"| {model} | {mode} | {sum(c['flops'] for c in sums) / sum(c['standard_flops'] for c in sums):.3f} "
                f"| {sum(per_problem) / len(per_problem) / 1e6:.3g} |")
        for s in styles:
            r = by.get((model, mode, s))
            per = " / ".join(f"{x:.2f}" for x in r["accuracy_per_seed"]) if r else ""
            line += f" {r['accuracy']:.3f} ({per}) | {r['mean_trace_tokens']:.1f} |" if r else " – | – |"
        if "free" in styles and (model, mode, "free") in by:
            c = by[(model, mode, "free")]["chosen"]
            line += f" {c['full']:.2f} / {c['partial']:.2f} / {c['direct']:.2f} |"
        lines.append(line)
    comps = res["comparisons"]
    main = {(c["a"], c["style"], c["kind"]): c for c in comps}
    present = [(k, ref) for k, ref in KINDS if any(c["kind"] == k for c in comps)]
    if present:
        head = "| FBT mode | verbosity |" + "".join(f" Δ accuracy vs {ref} ({k}) [95% CI], p |" for k, ref in present)
        head += "".join(f" Δ trace vs {ref} [95% CI] |" for k, ref in present)
        lines += ["", head, "| --- | --- |" + " ---: |" * (2 * len(present))]
        for a, style in dict.fromkeys((c["a"], c["style"]) for c in comps if c["kind"] in dict(present)):
            cs = [main.get((a, style, k)) for k, _ in present]
            lines.append(f"| {a.split('/', 1)[1]} | {style} |"
                         + "".join(f" {_ci(c['accuracy'])}, p={c['p']:.2g} |" if c else " – |" for c in cs)
                         + "".join(f" {_ci(c['trace'], 1)} |" if c else " – |" for c in cs))
    if res.get("trace_savings"):
        lines += ["", savings_table(res["trace_savings"])]
    if full:
        lines += ["", "| A | B | verbosity | Δ accuracy [95% CI] | p (sign-flip) | A only / B only per seed | "
                      "McNemar p per seed | Δ trace [95% CI] | Δ trace, both right |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for c in comps:
            counts = ", ".join(f"{x} / {y}" for x, y in zip(c["a_only_per_seed"], c["b_only_per_seed"]))
            per_seed_p = ", ".join(f"{q:.3g}" for q in c["mcnemar_p_per_seed"])
            lines.append(f"| {c['a']} | {c['b']} ({c['kind']}) | {c['style']} | {_ci(c['accuracy'])} | "
                         f"{c['p']:.3g} | {counts} | {per_seed_p} | {_ci(c['trace'], 1)} | "
                         f"{_ci(c['trace_both_correct'], 1)} |")
    return "\n".join(lines)


def savings_table(savings: list[dict]) -> str:
    """FBT's free decodes against each plain model's accuracy-against-trace frontier: the trace that model needs for
    FBT's accuracy and the saving 1 - FBT's trace / that, with its problem-bootstrap CI."""
    names = list(dict.fromkeys(g for s in savings for g in s["against"]))
    lines = ["| FBT (free) | accuracy | trace |" + "".join(f" {g}: trace at that accuracy | saving [95% CI] |"
                                                          for g in names) + " goal (>= 15% shorter than the best) |",
             "| --- | ---: | ---: |" + " ---: | ---: |" * len(names) + " --- |"]
    for s in savings:
        line = f"| {s['fbt']} | {s['accuracy']:.3f} | {s['trace']:.1f} |"
        for g in names:
            r = s["against"].get(g)
            if r is None:
                line += " – | – |"
                continue
            need = "never reached" if r["needed_trace"] is None else (
                f"{'<= ' if r['how'] == 'at most' else ''}{r['needed_trace']:.1f}")
            line += f" {need} | {r['saving']:+.2f} [{r['low']:+.2f}, {r['high']:+.2f}] |"
        line += f" {'met' if s['goal_met'] else 'not met'} (best: {s['best_control']}) |"
        lines.append(line)
    return "\n".join(lines)


def controls_text(res: dict) -> str:
    """What the two literature controls were, and how the trace savings are read."""
    cfg, steps = res["config"], res["training"].get("control_steps", {})
    parts = []
    if PAUSE_ARM in steps:
        parts.append(f"`{PAUSE_ARM}`: a plain model whose training and test prompts end in {cfg['pause_tokens']} "
                     f"filler tokens (`_`, one token each; as many as FBT's fused mode spends on its extra prompt "
                     f"pass), trained for FBT's training FLOPs ({steps[PAUSE_ARM]} steps).")
    stages = [k for k in steps if k.startswith(INTERN)]
    if stages:
        S = cfg["internalize_stages"]
        parts.append(f"`{INTERN}`: stepwise internalization, {S + 1} chained plain stages of {steps[stages[0]]} "
                     f"steps (FBT's training FLOPs in all), stage j trained on the same documents with the first "
                     f"j/{S} of each trace's steps removed, each from the previous stage's weights with a fresh "
                     f"optimizer and LR schedule; every stage decoded `free` (`{INTERN}@j`; the last is `{INTERN}`).")
    if res.get("trace_savings"):
        parts.append("Trace saving: for each FBT mode's free decode, the trace each plain model needs for FBT's "
                     "accuracy on its accuracy-against-trace frontier (its decodes of every verbosity, or stage, "
                     "each kept if more accurate than every shorter one, read linearly between them; `<=`: its "
                     "shortest decode is already as accurate), and 1 - FBT's trace / that (1: never reached; "
                     f"floored at {-10:.0f}); 95% CIs by a bootstrap that draws "
                     + ("the seeds (with replacement), then "
                        if resamples_seeds(res["trace_savings"][0].get("resampled")) else "")
                     + "one set of problems per resample for every seed and decode. The goal: >= 0.15 against the "
                     "best plain model (its CI's low end).")
    return " ".join(parts)


def markdown(res: dict, text: str) -> str:
    tr, cfg = res["training"], res["config"]
    mix = ", ".join(f"{v} {w:.0%}" for v, w in cfg["verbosity_mix"].items())
    lines = [
        "# fullband experiment reasoning", "",
        f"Task `{cfg['task']}` {cfg['task_options']}; {cfg['train_problems']:,} training problems, each written in "
        f"one verbosity drawn at random ({mix}; drawn: {cfg['verbosity_drawn']}); {cfg['num_problems']} held-out "
        f"problems ({cfg['test_candidates_dropped_as_training_duplicates']} candidates whose question occurs in "
        f"training dropped), greedy, at most {cfg['max_new_tokens']} new tokens. Preset `{tr['preset']}`, "
        f"{tr['batch_size']} x {tr['seq_len']} tokens a step; `{BASELINE}` and `{FBT}` {tr['steps']} steps "
        f"({tr['tokens_per_model']:,} tokens), `{FLOPS}` {tr['flops_steps']} steps (FBT's training FLOPs, every "
        f"pass counted, reading further: more unique tokens), `{EPOCHS}` "
        + (f"{tr['epochs_steps']} steps on exactly the rows of FBT's {tr['steps']} batches (`--unique-batches "
           f"{tr['steps']}`, re-read in a fresh order each epoch: FBT's unique tokens and training FLOPs, its own "
           "full LR schedule)" if tr["epochs_steps"] else "not trained (--no-epochs-baseline)")
        + f"; seeds {res['seeds']} (init and data order; the same problems). FBT recipe "
        f"(`--fbt-recipe {cfg.get('fbt_recipe', 'default')}`): {tr['recipe']}.", "",
        controls_text(res), "",
        "Decode FLOPs vs standard: a mode's forward FLOPs over those of `standard` decoding with the same model, "
        "prompts and generated lengths (pooled over problems, seeds and verbosities; per verbosity in "
        "results.json), counted per problem from `fullband.eval.flops.inference_flops`'s costs: the prompt (with "
        "a forced opening) and the tokens generated up to that problem's own stop, EOS included; `standard` and "
        "`soft` prefill the prompt in one plain pass (logits at its last position) and feed each new token but "
        "the last, one step each, `soft` fusing it (a fusion counted as computing its gate, an upper bound where "
        "a decode call looks the gate up); `fused` adds one fused pass over the prompt; `exact` runs the prompt "
        "token by token too (logits at every position). Not counted: padding of a batch and the steps a batch "
        "decodes after this problem stopped. Decode MFLOPs a problem: the same counts, absolute, averaged over "
        "verbosities (a pause-token model's fillers are part of its prompt: counted here, not in its trace).", "",
        "Verbosity: `free` = the model chooses (greedy); `full` / `partial` / `direct` = the prompt followed by "
        "that verbosity's opening tokens (counted in the trace). Trace = tokens before `####`. Accuracy pooled over "
        "seeds (per seed in brackets). Δ: A − B, the mean over seeds of the mean over the same problems; every seed "
        "decodes the same problems, so the problem is the unit: p is the exact two-sided sign-flip test of the "
        "per-problem differences summed over seeds (each problem counted once; with one seed it is exact McNemar), "
        "next to exact McNemar on each seed's discordant pairs (A only / B only); the percentile-bootstrap 95% CIs "
        + ("draw the seeds with replacement, then one set of problems per resample applied to every drawn seed "
           "(problems and training runs resampled)." if _two_level(res) else
           "draw one set of problems per resample and apply it to every seed (problems resampled, not training "
           "runs)."),
        "",
        text, "",
        f"Wall time {res['seconds']:.0f}s (training {res['train_seconds']:.0f}s in this invocation, decoding "
        f"{res['decode_seconds']:.0f}s summed, finished runs and decodes reused); load average "
        f"{res['load_average'][0]} at the start, {res['load_average'][1]} at the end; {res['threads']} thread(s), "
        f"torch {res['torch']}.", ""]
    return "\n".join(lines)
