"""The quickstart's running-state part: where the fed-back state must pay. A cheap setting of ``fullband experiment
state`` (:mod:`fullband.experiments.state`, run as is: its arms, training, run reuse, evaluation and report): the S3
word problem and parity, a label at every position, rows of T = 10; ``fbt-L-glu-x2`` (L = 2 layers, the paper's pure
GLU entry, trained on the exact recurrence at linear cost: the row's exact states token by token without gradient,
then 2 teacher-forced passes with gradient from them) against plain ``baseline-L`` and ``baseline-2L`` on equal
tokens; scored at T, 2T and 4T (length generalisation), FBT in exact mode and with only its fed-back state replaced,
the token kept: by the test rows' mean state at that step and by another row's state (a zero state is no such
intervention on the GLU entry: it zeroes the whole input, token included). No training row is a test row. The table
ends with each arm's training FLOPs beside what K = T + 1 passes (the exact recurrence as teacher-forced passes)
would have cost on the same steps. Writes the full state report into ``OUT/state/`` and returns the compact table
the quickstart's report shows."""

from __future__ import annotations

import argparse
import os

from . import state

# the GLU entry, not the language model's default residual one: at this setting it learns S3 where the residual
# entry does not yet (docs/experiments/quickstart.md); trained with exact states + 2 gradient passes (linear in T)
# rather than K = T + 1 passes (quadratic): at 900 steps it solved both tasks at T, 2T and 4T for 2.5x a plain
# model's training FLOPs, where K = 11 passes cost 11.9x and reached S3 0.66 at 4T at 300 steps
ARMS = ("baseline-L", "baseline-2L", "fbt-L-glu-x2")
LABELS = {"mean": "mean state, token kept", "shuffle": "another row's state, token kept"}
SETTINGS = dict(tasks="s3,parity", layers=2, hidden=64, heads=4, length=10, batch_size=32, lr=2e-3)


def state_args(args) -> argparse.Namespace:
    """The state experiment's options for the quickstart's ``args`` (its seed, device, --overwrite; its
    ``--state-steps`` / ``--state-test-rows``); the cost table is not measured."""
    opts = dict(state.DEFAULTS) | SETTINGS | dict(
        out=os.path.join(args.out, "state"), steps=args.state_steps, test_rows=args.state_test_rows,
        arms=",".join(ARMS), seeds=str(args.seed), seed=None, overwrite=args.overwrite, device=args.device,
        no_cost=True, quick=False, json=args.quiet)
    return argparse.Namespace(**opts)


def run_state_part(args) -> dict:
    """Train (or reuse) and score the three arms; the summary the quickstart keeps (its table and figures)."""
    res = state.run_state(state_args(args), show=False)
    return {"table": compact_table(res), "settings": res["settings"], "seconds": res["seconds"],
            "train_seconds": {n: r["train_seconds"] for n, r in res["runs"].items()},
            "rows": [r for r in res["table"] if r["mode"] in ("standard", "exact")],
            "interventions": res["interventions"], "report": os.path.join(args.out, "state", "report.md")}


def compact_table(res: dict) -> str:
    """Per task: each baseline, FBT in exact mode and the change when only FBT's fed-back state is replaced (the
    mean state, another row's state), per-position accuracy [95% CI] at each length (last-position accuracy after
    the slash)."""
    lengths = sorted({r["length"] for r in res["table"]})
    head = ["| task | model | " + " | ".join(f"T={n}" + (" (trained)" if n == lengths[0] else "") for n in lengths)
            + " |", "| --- | --- |" + " ---: |" * len(lengths)]
    lines = []
    for task in res["settings"]["tasks"].split(","):
        cells = {}
        for r in res["table"]:
            if r["task"] == task and (r["mode"] == "standard" and not r["arm"].startswith("fbt")
                                      or r["mode"] == "exact"):
                cells.setdefault(f"{r['arm']} ({r['mode']})", {})[r["length"]] = (
                    f"{state.fmt_ci(r['pos'])} / {r['last']['estimate']:.2f}")
        for r in res["interventions"]:
            if r["task"] == task and r["intervention"] in LABELS:
                cells.setdefault(f"{r['arm']} (exact, {LABELS[r['intervention']]}: change)", {})[r["length"]] = (
                    state.fmt_ci(r["delta"], sign=True))
        lines += [f"| {task} | {name} | " + " | ".join(v.get(n, "") for n in lengths) + " |"
                  for name, v in cells.items()]
    chance = ", ".join(f"{t} {state.CHANCE[t]:.3f}" for t in res["settings"]["tasks"].split(","))
    return "\n".join(head + lines) + f"\n\nChance per position: {chance}." + cost_line(res)


def cost_line(res: dict) -> str:
    """Each arm's training FLOPs over baseline-L's and, for a feedback arm, what K = T + 1 passes would have cost on
    the same steps (``train_flops_k_exact``; absent from results of before it was recorded: no line). Counted, not
    timed: the table stays the same on a re-run (the training seconds are in ``train_seconds``, said beside it)."""
    runs, plain = res["runs"], res["runs"].get("baseline-L", {}).get("train_flops")
    if not plain:
        return ""
    parts = [f"{n} {r['train_flops'] / plain:.2f}x" + (
        f" (K = {res['settings']['num_passes']} passes on the same steps: {r['train_flops_k_exact'] / plain:.2f}x)"
        if "train_flops_k_exact" in r else "") for n, r in runs.items() if n != "baseline-L"]
    return f"\n\nTraining FLOPs (x baseline-L's): {'; '.join(parts)}."
