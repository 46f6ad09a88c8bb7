"""``fullband experiment recipe``: which feedback recipe keeps feedback from hurting its own model, measured.

Owns the recipe grid (:data:`ARMS`), its runs and their evaluation (the analysis and the report are
:mod:`fullband.experiments.recipe_report`'s). One plain **trunk** per seed is trained first (constant LR after warmup,
saved as the plain HF checkpoint it is); every arm then continues that trunk for the same number of steps on the
same next batches (``--init-from`` the trunk, ``--data-offset`` where it stopped), so the arms differ only in what
the arm says:

* baselines (K = 1): ``baseline`` (WSD: constant, then a linear decay over the last 30%), ``baseline-decayed``
  (the LR the shipped recipe switches feedback on at: cosine from 0.25x down to 0.1x of the peak) and
  ``baseline-flops`` (WSD, more steps: as many training FLOPs as the costliest FBT arm), from which the baseline's
  loss at each arm's FLOPs is interpolated (per row, linearly in log FLOPs);
* FBT arms, a ladder of levers: the shipped recipe (paper GLU, K = 2 with 10% K = 4, at a decayed LR) -> WSD
  (feedback at the peak LR) -> switch-on warm-up (fusion LR x10 warmed up over 10% of the branch, per-group
  clipping, lambda ramped over 20%) -> the token-preserving ``residual`` entry (``u = e + GLU(h, e)``, exactly the
  plain model at switch-on) -> K = 3 / a fusion-only phase / the ``add`` and ``concat`` entries; plus the public
  reproduction's retrofit (GLU, K = 2 at a constant LR, no levers; its SFT-with-K=3 stage needs chat data and is
  not run here);
* the paper's own recipe, trained **from scratch** for ``--trunk-steps`` + ``--branch-steps`` steps (not off the
  trunk; WSD over the whole run, the last 20% a linear cooldown), not in the default grid: ``paper`` (pure GLU, tied
  input/output embeddings, K drawn per batch from 75% K = 1 / 22% K = 2 / 3% K = 3 from step 0), ``paper-k3``
  (the same with K = 3 on every batch) and ``residual-k3-all`` (the residual entry, untied, K = 3 on every batch),
  against plain models of the same steps, schedule and tying (``baseline-tied``, ``baseline-scratch``) and, at
  equal FLOPs, against the same plain models trained ``--scratch-flops-multiplier`` times longer
  (``baseline-tied-flops``, ``baseline-scratch-flops``). Their FLOPs count the whole run, the branched arms' only
  the branch (the trunk is shared): compare each family with its own baselines;
* at equal unique tokens *and* equal FLOPs: ``baseline-epochs``, ``baseline-scratch-epochs``,
  ``baseline-tied-epochs``, each as long as its ``-flops`` twin but re-reading exactly the batches its plain arm
  reads (``--unique-batches`` that arm's steps from the same ``--data-offset``: the branch's batches after the
  trunk, or the scratch run's from batch 0), in a fresh seeded order each epoch, its own full LR schedule. Every
  FLOP-matched baseline is added with the plain arm it controls and is no table row of its own.

Every run is evaluated on the same held-out rows (documents never trained on) in every mode: ``standard``,
K = 2 and K = 3 teacher-forced passes, ``exact`` (the token-by-token recurrence), and decoding-style ``soft`` and
``fused`` scoring of each row's continuation after a ``--prompt-tokens`` prompt; all modes score the same
tokens (each row's positions after the prompt). Reported per arm and mode: the loss (mean over seeds, and per
seed), its inference FLOPs relative to ``standard``, the paired difference to the baseline at equal tokens, at
equal training FLOPs and at equal unique tokens and training FLOPs (percentile bootstrap
over rows, per seed; the pooled CI resamples the seeds, then the rows within each drawn seed: each seed's held-out
rows come from its own seeded validation split, so the seeds share no rows), and the switch-on diagnostics (pass-2 minus
pass-1 loss and gradient norm over the first feedback steps). Writes ``results.json``, ``report.md`` and
``recipe.png`` into ``--out``. Finished runs of the same options, data and trunk are reused, and their evaluations
as long as the model's weights and the scored rows are the same; a finished run that differs is kept and the
experiment stops with an error naming the differences, unless ``--overwrite``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
import time

import torch
from transformers.utils import logging as hf_logging

from ..eval.flops import flop_parameters, training_flops
from ..eval.scoring import load_any_model, row_losses
from ..model.configuration import has_feedback
from ..training.checkpoint import evaluation_key
from ..training.config import TrainConfig
from ..training.device import load_average
from ..training.distributed import resolve_device
from ..training.presets import get_preset
from ..training.pretrain import PretrainRecipe, build_tokenizer_and_corpus, rows_fingerprint, run_to_end, spread_rows
from ..utils.io import atomic_write_json, read_jsonl
from .common import (
    apply_quick,
    finished,
    pick_arms,
    refuse_changed_runs,
    write_outputs,
)
from .recipe_report import analyse, best_feedback_arm, plot, report, tables

# ---------------------------------------------------------------------------------------------- the grid

_WSD = dict(lr_schedule="wsd", warmup_fraction=0.05, decay_fraction=0.3, min_lr_ratio=0.1)
_DECAYED = dict(lr_schedule="cosine", warmup_fraction=0.0, min_lr_ratio=0.4)  # and lr = 0.25 x peak
_CONSTANT = dict(lr_schedule="constant", warmup_fraction=0.05)
_WARM = dict(fusion_lr_mult=10.0, fusion_warmup=0.1, clip_per_group=True, feedback_ramp=0.2)
_PAPER_K = dict(num_passes=2, deep_passes=4, deep_fraction=0.1)
# the arms trained from scratch: WSD over trunk + branch steps, feedback (if any) from step 0
_SCRATCH = dict(lr_schedule="wsd", warmup_fraction=0.05, decay_fraction=0.2, min_lr_ratio=0.1, feedback_start=0.0)
_PAPER_MIX = dict(num_passes=3, deep_fraction=0.0, pass_mix="1:0.75,2:0.22,3:0.03")  # the paper's per-batch mix
_K3_ALL = dict(num_passes=3, deep_fraction=0.0)
_PAPER_Z = dict(z_loss=1e-4)  # the paper family (tied, and its plain reference) trains with PaLM's z-loss


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    description: str
    settings: dict
    lr_scale: float = 1.0  # x the preset's peak LR
    reference: str = "baseline"  # the equal-token baseline arm with the same LR schedule
    default: bool = True
    scratch: bool = False  # trained from scratch for --trunk-steps + --branch-steps (not branched off the trunk)
    flops_of: str | None = None  # a FLOP-matched baseline: of this plain arm, x --(scratch-)flops-multiplier steps
    epochs: bool = False  # a FLOP-matched baseline on exactly its plain arm's unique rows (--unique-batches)


ARMS: tuple[Arm, ...] = (
    Arm("baseline", "plain, WSD", dict(num_passes=1, **_WSD)),
    Arm("baseline-decayed", "plain, cosine from 0.25x to 0.1x peak", dict(num_passes=1, **_DECAYED), lr_scale=0.25),
    Arm("baseline-constant", "plain, constant LR", dict(num_passes=1, **_CONSTANT)),
    Arm("shipped", "paper GLU, K=2 (+10% K=4), switched on at a decayed LR (the old default)",
        dict(fusion="glu", **_PAPER_K, **_DECAYED), lr_scale=0.25, reference="baseline-decayed"),
    Arm("glu-wsd", "paper GLU, K=2 (+10% K=4), WSD (feedback at the peak LR)", dict(fusion="glu", **_PAPER_K, **_WSD)),
    Arm("glu-warm", "glu-wsd + fusion LR x10 warmed up, per-group clipping, lambda ramp",
        dict(fusion="glu", **_PAPER_K, **_WSD, **_WARM)),
    Arm("residual-warm", "glu-warm with the token-preserving entry u = e + GLU(h, e)",
        dict(fusion="residual", **_PAPER_K, **_WSD, **_WARM)),
    Arm("residual-warm-k3", "residual-warm with K=3 (+10% K=4)",
        dict(fusion="residual", num_passes=3, deep_passes=4, deep_fraction=0.1, **_WSD, **_WARM)),
    Arm("residual-fusion-only", "residual-warm with the backbone frozen for the first 20% of the branch",
        dict(fusion="residual", **_PAPER_K, **_WSD, **_WARM, fusion_only=0.2)),
    Arm("add-warm", "glu-warm with the additive entry u = e + W h", dict(fusion="add", **_PAPER_K, **_WSD, **_WARM)),
    Arm("concat-warm", "glu-warm with the concat entry u = W [e; h]", dict(fusion="concat", **_PAPER_K, **_WSD, **_WARM),
        default=False),
    Arm("retrofit-repro", "public reproduction's retrofit: paper GLU, K=2, constant LR, no levers",
        dict(fusion="glu", num_passes=2, deep_fraction=0.0, **_CONSTANT), reference="baseline-constant"),
)


def _scratch(name: str, description: str, reference: str, tied: bool, **settings) -> Arm:
    return Arm(name, description, dict(tie_embeddings=tied, **settings, **_SCRATCH), reference=reference,
               scratch=True, default=False)


def _flops_arm(of: Arm, multiplier: str) -> Arm:
    return Arm(f"{of.name}-flops", f"{of.name} trained {multiplier} times as many steps (the equal-FLOPs reference)",
               of.settings, of.lr_scale, reference=of.name, default=False, scratch=of.scratch, flops_of=of.name)


def _epochs_arm(of: Arm, multiplier: str) -> Arm:
    return Arm(f"{of.name}-epochs", f"{of.name} trained {multiplier} times as many steps on exactly its own unique "
                                    "rows, re-read epoch after epoch (the equal-unique-tokens-and-FLOPs reference)",
               of.settings, of.lr_scale, reference=of.name, default=False, scratch=of.scratch, flops_of=of.name,
               epochs=True)


ARMS += (  # from scratch, trunk + branch steps: the paper's recipe and its plain references
    _scratch("baseline-scratch", "plain, untied, from scratch for trunk + branch steps, WSD (cooldown over the last "
                                 "20%)", "baseline-scratch", False, num_passes=1),
    _scratch("baseline-tied", "baseline-scratch with tied input/output embeddings and z-loss 1e-4", "baseline-tied",
             True, num_passes=1, **_PAPER_Z),
    _scratch("paper", "the paper's recipe from scratch: pure GLU, tied embeddings, z-loss 1e-4, K per batch 75% 1 / "
                      "22% 2 / 3% 3 from step 0, WSD", "baseline-tied", True, fusion="glu", **_PAPER_MIX, **_PAPER_Z),
    _scratch("paper-k3", "paper with K=3 on every batch", "baseline-tied", True, fusion="glu", **_K3_ALL,
             **_PAPER_Z),
    _scratch("residual-k3-all", "paper-k3 with the residual entry u = e + GLU(h, e) and an untied head",
             "baseline-scratch", False, fusion="residual", **_K3_ALL),
)
_CONTROLLED = (("baseline", "--flops-multiplier"), ("baseline-scratch", "--scratch-flops-multiplier"),
               ("baseline-tied", "--scratch-flops-multiplier"))
ARMS += tuple(make(next(a for a in ARMS if a.name == name), mult)
              for make in (_flops_arm, _epochs_arm) for name, mult in _CONTROLLED)
ARM_BY_NAME = {a.name: a for a in ARMS}
# equal-token baseline -> its FLOP-matched baseline reading further (more unique tokens) / re-reading its own rows
FLOPS_OF = {a.flops_of: a.name for a in ARMS if a.flops_of and not a.epochs}
EPOCHS_OF = {a.flops_of: a.name for a in ARMS if a.epochs}
FBT_MODES = (("standard", 1), ("passes", 2), ("passes", 3), ("exact", None), ("soft", None), ("fused", None))

DEFAULTS = dict(out=os.path.join("runs", "experiments", "recipe"), preset="tiny", trunk_steps=250, branch_steps=100,
                batch_size=16, seq_len=128, vocab_size=4096, seeds="0,1", eval_rows=64, prompt_tokens=32,
                flops_multiplier=2.3, scratch_flops_multiplier=3.1)
QUICK = dict(preset="micro", trunk_steps=6, branch_steps=4, batch_size=4, seq_len=32, vocab_size=300, eval_rows=4,
             prompt_tokens=8)


def mode_key(mode: str, k: int | None) -> str:
    return f"K={k}" if mode == "passes" else mode


# ---------------------------------------------------------------------------------------------- runs


# every recipe setting an arm may change, pinned here so that the arms mean the same whatever the defaults of
# `fullband train` are (the defaults were chosen from this grid); an arm overrides what it names
_PINNED = dict(fusion="glu", lr_schedule="cosine", warmup_fraction=0.05, decay_fraction=0.2, min_lr_ratio=0.1,
               num_passes=2, deep_passes=4, deep_fraction=0.1, fusion_lr_mult=1.0, fusion_warmup=0.0,
               clip_per_group=False, feedback_ramp=0.0, fusion_only=0.0, prefix_mix=0.25, jitter=0.02,
               feedback_weight=1.0, feedback_start=0.75, pass_mix=None, tie_embeddings=None)


def _config(args, out: str, steps: int, seed: int, **extra) -> TrainConfig:
    return TrainConfig(out=out, steps=steps, seed=seed, preset=args.preset, batch_size=args.batch_size,
                       seq_len=args.seq_len, vocab_size=args.vocab_size, device=args.device,
                       progress=not args.no_progress, tensorboard=False, plot=False, save_every=0, eval_every=0,
                       eval_rows=8, **{**_PINNED, **extra})


def _train(cfg: TrainConfig, corpus, name: str) -> dict:
    return run_to_end(PretrainRecipe(cfg, corpus, name), corpus)


def switch_on_stats(records: list[dict], first: int = 10) -> dict | None:
    """Pass-2 minus pass-1 loss and gradient norm over the first ``first`` feedback steps of a run."""
    fb = [r for r in records if r.get("split") == "train" and r.get("num_passes", 1) > 1 and not r.get("skipped")]
    if not fb:
        return None
    head, tail = fb[:first], fb[-first:]
    gap = lambda rs: sum(r["pass_losses"][1] - r["pass_losses"][0] for r in rs) / len(rs)  # noqa: E731
    return {"first_gap": gap(head), "last_gap": gap(tail), "first_max_grad_norm": max(r["grad_norm"] for r in head),
            "last_mean_grad_norm": sum(r["grad_norm"] for r in tail) / len(tail)}


def evaluate_run(cfg: TrainConfig, rows: torch.Tensor, args) -> dict:
    """Per-row losses of a finished run in every mode it has (cached in ``OUT/recipe_eval.json``, keyed by the
    model scored, :func:`fullband.training.checkpoint.evaluation_key`, and the rows and prompt it was scored on),
    its training FLOPs, its switch-on statistics and the parameter counts its inference FLOPs need
    (:func:`fullband.eval.flops.flop_parameters`; an evaluation cached before they were kept loads the model once
    for them and keeps them in its cache, under the same key)."""
    key = evaluation_key(cfg.out, rows_sha256=rows_fingerprint(rows), prompt_tokens=args.prompt_tokens)
    path = os.path.join(cfg.out, "recipe_eval.json")
    try:
        with open(path) as f:
            cached = json.load(f)
        if cached.get("key") == key:
            result = cached["result"]
            if "flop_parameters" not in result:  # cached before they were kept: counted once, then kept
                result["flop_parameters"] = flop_parameters(load_any_model(cfg.out, device="cpu")[0])
                atomic_write_json(path, {"key": key, "result": result})
            return result
    except (OSError, ValueError):
        pass
    model = load_any_model(cfg.out, device=args.device_resolved)[0]
    records = read_jsonl(os.path.join(cfg.out, "metrics.jsonl"))
    fp = flop_parameters(model)
    fl = training_flops(records, cfg.batch_size * cfg.seq_len, cfg.seq_len, fp)
    feedback = has_feedback(model)
    t = time.perf_counter()
    losses = {mode_key(mode, k): row_losses(model, rows, mode, num_passes=k or 1,
                                            prompt_length=args.prompt_tokens).tolist()
              for mode, k in (FBT_MODES if feedback else (("standard", 1),))}
    result = {"steps": cfg.steps, "flops": fl["flops"], "passes": fl["passes"], "tokens": fl["tokens"],
              "losses": losses, "eval_seconds": time.perf_counter() - t,
              "switch_on": switch_on_stats(records) if feedback else None,
              "skipped_steps": sum(1 for r in records if r.get("skipped")), "flop_parameters": fp}
    atomic_write_json(path, {"key": key, "result": result})
    return result


def _elapsed(out: str) -> float | None:
    """Training seconds of a finished run (its summary.json)."""
    try:
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f).get("elapsed")
    except (OSError, ValueError):
        return None


def arm_steps(args, arm: Arm) -> int:
    """Steps of ``arm``: ``--branch-steps`` off the trunk, ``--trunk-steps`` + ``--branch-steps`` from scratch, and
    a FLOP-matched baseline's (``-flops``, ``-epochs``) multiplier times the steps of the baseline it controls."""
    if arm.flops_of:
        mult = args.scratch_flops_multiplier if arm.scratch else args.flops_multiplier
        return math.ceil(arm_steps(args, ARM_BY_NAME[arm.flops_of]) * mult)
    return args.trunk_steps + args.branch_steps if arm.scratch else args.branch_steps


def complete_arms(names: list[str]) -> list[Arm]:
    """The arms to train for the ``names`` asked for: those, each one's equal-token baseline (and ``baseline`` when
    one branches off the trunk) and the two FLOP-matched baselines of every baseline that has them (``-flops``,
    then ``-epochs``, listed last)."""
    wanted = set(names)
    if any(not ARM_BY_NAME[n].scratch for n in names):
        wanted.add("baseline")
    wanted |= {ARM_BY_NAME[n].reference for n in wanted}
    wanted |= {of[n] for of in (FLOPS_OF, EPOCHS_OF) for n in wanted if n in of}
    return ([a for a in ARMS if a.name in wanted and not a.flops_of]
            + [a for a in ARMS if a.name in wanted and a.flops_of])


def uses_trunk(trunk_cfg: TrainConfig, cfgs: dict[str, TrainConfig]) -> bool:
    return any(cfg.init_from == trunk_cfg.out for cfg in cfgs.values())


def seed_plan(args, seed: int, arms: list[Arm]) -> tuple[TrainConfig, dict[str, TrainConfig]]:
    """The trunk's config of one seed and every arm's, validated (an arm from scratch reads the batches the trunk
    and a branch read, in the same order; an ``-epochs`` arm re-reads exactly the batches its plain arm reads:
    ``--unique-batches`` its steps, from the same ``--data-offset``)."""
    root = os.path.join(args.out, f"seed{seed}")
    peak = args.lr or get_preset(args.preset).lr
    trunk_cfg = _config(args, os.path.join(root, "trunk"), args.trunk_steps, seed, num_passes=1, lr=peak,
                        lr_schedule="constant", warmup_fraction=0.05)
    cfgs = {}
    for a in arms:
        branch = {} if a.scratch else dict(init_from=trunk_cfg.out, feedback_start=0.0, data_offset=args.trunk_steps)
        pool = dict(unique_batches=arm_steps(args, ARM_BY_NAME[a.flops_of])) if a.epochs else {}
        cfgs[a.name] = _config(args, os.path.join(root, a.name), arm_steps(args, a), seed, lr=peak * a.lr_scale,
                               **branch, **pool, **a.settings)
    trunk_cfg.validate()
    for cfg in cfgs.values():  # the trunk they continue may not exist yet
        dataclasses.replace(cfg, init_from=None).validate()
    return trunk_cfg, cfgs


def run_seed(args, seed: int, trunk_cfg: TrainConfig, cfgs: dict[str, TrainConfig], corpus, say) -> dict:
    """Trunk (when an arm branches off it), every arm and the FLOP-matched baselines of one seed (finished runs of
    the same options, data and trunk are reused); per-row losses of each (run, mode)."""
    if uses_trunk(trunk_cfg, cfgs) and not finished(trunk_cfg, corpus):
        say(f"recipe: seed {seed}: trunk, {args.trunk_steps} plain steps")
        _train(trunk_cfg, corpus, f"seed {seed} trunk")
    rows = spread_rows(corpus.val_rows, args.eval_rows)
    runs = {}
    for name, cfg in cfgs.items():
        if not finished(cfg, corpus):  # also when the trunk it continues was retrained
            say(f"recipe: seed {seed}: {name}, {cfg.steps} steps")
            _train(cfg, corpus, f"seed {seed} {name}")
        runs[name] = dict(evaluate_run(cfg, rows, args), train_seconds=_elapsed(cfg.out))
    return {"seed": seed, "runs": runs, "eval_rows": int(rows.shape[0]), "row_tokens": int(rows.shape[1]),
            "scored_tokens": int(rows.shape[0] * (rows.shape[1] - args.prompt_tokens))}


# ---------------------------------------------------------------------------------------------- command


def run_recipe(args) -> dict:
    hf_logging.disable_progress_bar()
    apply_quick(args, DEFAULTS, QUICK)
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    if len(seeds) < 1:
        raise ValueError("--seeds must name at least one seed (two or more for a fair comparison)")
    arms = complete_arms(pick_arms(args.arms, ARM_BY_NAME, [a.name for a in ARMS if a.default]))
    for name in ("trunk_steps", "branch_steps", "batch_size", "eval_rows"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("flops_multiplier", "scratch_flops_multiplier"):
        if not getattr(args, name) >= 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 1 <= args.prompt_tokens < args.seq_len - 1:
        raise ValueError(f"--prompt-tokens must be in [1, --seq-len - 1), got {args.prompt_tokens}")
    args.device_resolved = str(resolve_device(args.device))
    say = (lambda *a: None) if args.no_progress and args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    load0, t0 = load_average(), time.perf_counter()
    plans = {s: seed_plan(args, s, arms) for s in seeds}
    corpora = {s: build_tokenizer_and_corpus(plans[s][0]) for s in seeds}
    for s, (trunk_cfg, cfgs) in plans.items():  # before anything is trained
        refuse_changed_runs([trunk_cfg] * uses_trunk(trunk_cfg, cfgs) + list(cfgs.values()), corpora[s],
                            args.overwrite)
    per_seed = [run_seed(args, s, *plans[s], corpora[s], say) for s in seeds]
    scored = [a for a in arms if not a.flops_of]
    res = {"arms": [a.name for a in arms], "arm_descriptions": {a.name: a.description for a in arms},
           "scratch_arms": [a.name for a in arms if a.scratch and not a.flops_of], "seeds": seeds,
           "unique_batches": {a.name: plans[seeds[0]][1][a.name].unique_batches for a in arms if a.epochs},
           "settings": {k: getattr(args, k) for k in DEFAULTS if k != "out"} | {"quick": bool(args.quick)},
           "per_seed": per_seed}
    res["table"] = analyse(per_seed, scored, {"flops": FLOPS_OF, "epochs": EPOCHS_OF}, args.prompt_tokens)
    res["switch_on"] = {a.name: per_seed[0]["runs"][a.name]["switch_on"] for a in scored}
    res["best"] = best_feedback_arm(res)
    res["seconds"] = time.perf_counter() - t0
    res["train_seconds"] = sum(r["train_seconds"] or 0.0 for s in per_seed for r in s["runs"].values()) + sum(
        _elapsed(plans[s][0].out) or 0.0 for s in seeds if uses_trunk(*plans[s]))
    res["load_average"] = [load0, load_average()]
    res["threads"], res["torch"], res["platform"] = torch.get_num_threads(), torch.__version__, platform.platform()
    os.makedirs(args.out, exist_ok=True)
    text = tables(res)
    res["plot"] = plot(res, os.path.join(args.out, "recipe.png"))
    write_outputs(args.out, res, report(res, text), text, args.json, omit=("per_seed",), lead=f"{len(seeds)} seed(s), ")
    return res
