"""``fullband experiment programs --dry-run``: what the experiment would cost on a GPU, per arm and in all, computed
before anything is trained or written to ``--out``.

Owns :func:`plan_programs` and :func:`format_programs_plan`. Each arm's plan is ``fullband train --dry-run``'s
(:func:`fullband.training.plan.make_plan`) of the very :class:`fullband.training.config.TrainConfig` the experiment
would train (:func:`fullband.experiments.synthetic.arm_config` on the first seed's programs, its initial backbones
built in a temporary directory, removed afterwards), the equal-FLOPs controls sized by
:func:`fullband.experiments.synthetic.control_plans` from the FBT arm's planned FLOPs, exactly as a run sizes them
from its finished FBT run. The whole experiment: every arm x seeds x LRs of ``--lrs``. The FLOPs are counted as the
runs count theirs; the time is an estimate at ``--plan-mfu`` plus, for the exact-states arm, the token-by-token pass
at the plan's assumed time per layer and step (not measured: no GPU has run it)."""

from __future__ import annotations

import argparse
import tempfile

from ..training.plan import TOKEN_STEP_LAYER_SECONDS, _duration, _si, make_plan
from .synthetic import CONTROL_ARMS, arm_config, control_plans


def plan_programs(args, arms: dict, names: list[str], data, init, gpu: str, mfu: float) -> dict:
    """``{"arms": {name: row}, "runs": arms x seeds x LRs, "seconds", "flops"}`` for the experiment ``args`` (one
    seed's options), its programs ``data`` (:class:`fullband.experiments.programs_data.SeedData`, nothing written)
    and ``init(args, tokenizer, depth)``, the experiment's initial-backbone builder."""
    rows = {}
    with tempfile.TemporaryDirectory(prefix="fullband-programs-plan.") as tmp:
        a = argparse.Namespace(**(vars(args) | {"out": tmp}))
        plans = {}
        for depth in sorted({arms[n].depth for n in names}):  # before arm_config finds them
            init(a, data.tokenizer, depth)
        for name in (n for n in names if n not in CONTROL_ARMS):
            plans[name] = (arms[name], make_plan(arm_config(a, arms[name], data.train), gpu=gpu, mfu=mfu))
        ref = next((n for n in names if n.startswith("fbt-")), None)
        if any(n in CONTROL_ARMS for n in names):
            for c_args, arm, corpus in control_plans(a, arms, names, {ref: (None, None, plans[ref][1]["total_flops"])},
                                                     data.train, data.fresh):
                plans[arm.name] = (arm, make_plan(arm_config(c_args, arm, corpus), gpu=gpu, mfu=mfu))
    base = plans.get("baseline-L", next(iter(plans.values())))[1]["total_flops"]
    for name in names:
        arm, p = plans[name]
        tok = p.get("exact_states_pass") or {}
        rows[name] = {"layers": p["model"]["layers"], "hidden": p["model"]["hidden"],
                      "parameters": p["model"]["backbone_params"] + p["model"]["fusion_params"], "steps": p["steps"],
                      "tokens_per_step": p["tokens_per_step"], "total_flops": p["total_flops"],
                      "x_baseline_L": p["total_flops"] / base, "token_steps": tok.get("sequential_token_steps", 0),
                      "token_pass_seconds": tok.get("latency_seconds", 0.0), "seconds": p["seconds"],
                      "memory_gib": sum(p["memory_per_device_bytes"].values()) / 1024 ** 3,
                      "grad_accum_to_fit": p["grad_accum_to_fit"]}
    runs = len(args.seed_list) * len(args.lrs)
    return {"gpu": gpu, "mfu": mfu, "seq_len": data.train.info["seq_len"], "seeds": args.seed_list,
            "lrs": args.lrs, "arms": rows, "runs_per_arm": runs,
            "flops": runs * sum(r["total_flops"] for r in rows.values()),
            "seconds": runs * sum(r["seconds"] for r in rows.values()),
            "assumptions": plans[names[0]][1]["assumptions"]}


def format_programs_plan(plan: dict, args) -> str:
    """The plan as a table for a person."""
    out = [f"fullband experiment programs --dry-run: {args.grammar} grammar, {args.vars} variables, "
           f"{args.statements} statements (rows of up to {plan['seq_len']} tokens), d{args.hidden} L = {args.layers}, "
           f"{args.steps:,} steps x {args.batch_size} programs; on one {plan['gpu'].upper()} at {plan['mfu']:.0%} MFU",
           "", "| arm | layers | parameters | steps | training FLOPs | x baseline-L | token steps | memory GiB | time |",
           "| --- |" + " ---: |" * 8]
    for name, r in plan["arms"].items():
        out.append(f"| {name} | {r['layers']} | {r['parameters']:,} | {r['steps']:,} | {_si(r['total_flops'])}FLOP | "
                   f"{r['x_baseline_L']:.2f}x | {r['token_steps']:,} | {r['memory_gib']:.1f}"
                   + ("" if r["grad_accum_to_fit"] == 1 else f" (grad accum {r['grad_accum_to_fit']})")
                   + f" | {_duration(r['seconds'])} |")
    out += ["", f"Whole experiment: {len(plan['arms'])} arms x {len(plan['seeds'])} seed(s) x {len(plan['lrs'])} "
                f"LR(s) = {plan['runs_per_arm'] * len(plan['arms'])} runs, {_si(plan['flops'])}FLOP, "
                f"{_duration(plan['seconds'])} on one device (scoring not counted).",
            "Token steps: the exact-states pass's dependent token steps over the run, at the plan's assumed "
            f"{TOKEN_STEP_LAYER_SECONDS * 1e3:.2f} ms per layer and step (not measured), inside the time. "
            f"({plan['assumptions']})"]
    return "\n".join(out) + "\n"
