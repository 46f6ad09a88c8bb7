"""What the synthetic-task experiments (``fullband experiment depth`` and ``state``) share: an arm (:class:`Arm`), the
initial backbones (:func:`init_backbone`: one random Llama per depth and seed, saved once under ``OUT/init/``),
training an arm through ``fullband train``'s engine (:func:`train_arm`; a finished run is reused only for the same
options, data and initial model), the training FLOPs of a run, the equal-FLOPs controls of the first FBT arm
(:func:`train_controls`: ``baseline-L-flops`` on fresh rows, ``baseline-L-epochs`` re-reading exactly baseline-L's
rows with ``--unique-batches``) and the inference FLOPs of a scoring mode (:func:`mode_cost`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ..eval.flops import flop_parameters, inference_flops, training_flops
from ..eval.scoring import load_any_model
from ..training.config import TrainConfig
from ..training.pretrain import run_to_end
from ..utils.io import atomic_directory, read_jsonl
from .common import finished, refuse_changed_runs

@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    description: str
    depth: int  # x L
    settings: dict


FLOPS_ARM, EPOCHS_ARM = "baseline-L-flops", "baseline-L-epochs"
CONTROL_ARMS = (FLOPS_ARM, EPOCHS_ARM)  # trained after the FBT arm whose FLOPs they match
MAX_POSITIONS = 256  # the initial backbones' position limit


def init_backbone(args, tokenizer, depth: int) -> str:
    """A random Llama of ``depth`` x L layers saved once under ``OUT/init`` (every arm of that depth starts here)."""
    layers = args.layers * depth
    path = os.path.join(args.out, "init", f"L{layers}-d{args.hidden}-h{args.heads}-s{args.seed}")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with atomic_directory(path) as tmp:  # weights and tokenizer appear together or not at all
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return path


def arm_config(args, arm: Arm, corpus) -> TrainConfig:
    cfg = TrainConfig(out=os.path.join(args.out, "runs", arm.name), steps=args.steps, seed=args.seed,
                      init_from=init_backbone(args, corpus.tokenizer, arm.depth), lr=args.lr,
                      batch_size=args.batch_size, seq_len=corpus.train_rows.shape[1], device=args.device,
                      progress=False, tensorboard=False, plot=False, save_every=getattr(args, "save_every", 0),
                      debug_kill_at_step=getattr(args, "debug_kill_at_step", None), **arm.settings)
    return cfg.validate()


def train_arm(args, arm: Arm, corpus, say, recipe, tag: str) -> tuple[TrainConfig, float | None]:
    """Train ``arm`` (a finished run of the same options and data is reused); ``recipe`` (a
    :class:`fullband.training.pretrain.PretrainRecipe` subclass) says where the labels are."""
    cfg = arm_config(args, arm, corpus)
    if not finished(cfg, corpus):  # the same options, the same problems in the same order, the same initial model
        say(f"{tag}: training {arm.name} ({cfg.steps} steps)")
        run_to_end(recipe(cfg, corpus, arm.name), corpus)  # continues a run the stability guard stopped
    try:
        with open(os.path.join(cfg.out, "summary.json")) as f:
            elapsed = json.load(f).get("elapsed")
    except (OSError, ValueError):
        elapsed = None
    return cfg, elapsed


def run_flops(cfg) -> float:
    """Training FLOPs of a finished run (its metrics, every pass counted; a pass without gradient at a third)."""
    fp = flop_parameters(load_any_model(cfg.out)[0])
    records = read_jsonl(os.path.join(cfg.out, "metrics.jsonl"))
    return training_flops(records, cfg.batch_size * cfg.seq_len, cfg.seq_len, fp)["flops"]


def control_reference(names: list[str]) -> str | None:
    """The FBT arm whose training FLOPs the controls in ``names`` match (the first one), ``None`` without controls;
    a one-line error for controls without an FBT arm (checked before anything trains)."""
    wanted = [n for n in CONTROL_ARMS if n in names]
    ref = next((n for n in names if n.startswith("fbt-")), None)
    if wanted and ref is None:
        raise ValueError(f"--arms: {wanted[0]} needs an FBT arm to match (add e.g. fbt-L)")
    return ref if wanted else None


def control_plans(args, arms: dict, names: list[str], trained: dict, corpus, fresh_corpus) -> list:
    """``[(args of the control, its arm, its corpus)]`` for the equal-FLOPs controls in ``names``: plain, L layers,
    trained for the training FLOPs of the first FBT arm's finished run (``trained[name][2]``), each with its own
    full LR schedule -- ``baseline-L-flops`` on fresh rows (``fresh_corpus(args, steps)``), ``baseline-L-epochs``
    on exactly ``corpus``'s rows (baseline-L's: ``--unique-batches`` = ``--steps``), re-read epoch after epoch."""
    ref = control_reference(names)
    if ref is None:
        return []
    wanted = [n for n in CONTROL_ARMS if n in names]
    seq = corpus.train_rows.shape[1]
    plain = flop_parameters(load_any_model(init_backbone(args, corpus.tokenizer, 1))[0])
    per_step = training_flops([{"num_passes": 1}], args.batch_size * seq, seq, plain)["flops"]
    steps = max(args.steps, math.ceil(trained[ref][2] / per_step))
    long_args = argparse.Namespace(**(vars(args) | {"steps": steps}))
    plans = []
    if FLOPS_ARM in wanted:
        plans.append((long_args, arms[FLOPS_ARM], fresh_corpus(long_args, steps)))
    if EPOCHS_ARM in wanted:
        arm = arms[EPOCHS_ARM]
        plans.append((long_args, dataclasses.replace(arm, settings=arm.settings | {"unique_batches": args.steps}),
                      corpus))
    return plans


def train_controls(args, arms: dict, names: list[str], trained: dict, corpus, fresh_corpus, say, recipe,
                   tag: str) -> None:
    """Train (or reuse) the equal-FLOPs controls of :func:`control_plans` into ``trained`` (``name: (cfg, seconds,
    FLOPs)``); a finished control of other options is refused before either trains."""
    plans = control_plans(args, arms, names, trained, corpus, fresh_corpus)
    for a, arm, c in plans:
        refuse_changed_runs([arm_config(a, arm, c)], c, args.overwrite)
    for a, arm, c in plans:
        cfg, elapsed = train_arm(a, arm, c, say, recipe=recipe, tag=tag)
        trained[arm.name] = (cfg, elapsed, run_flops(cfg))


def mode_cost(fp: dict, reference_fp: dict, row_tokens: int, mode: str, num_passes: int = 1) -> float:
    """Forward FLOPs per token of scoring rows of ``row_tokens`` tokens in ``mode`` (``standard``, ``passes`` with
    ``num_passes``, ``exact``) the way :func:`fullband.eval.scoring.mode_logits` runs it, relative to the plain
    L-layer model's ``standard`` pass on the same rows (``reference_fp``; :func:`fullband.eval.flops.inference_flops`:
    K passes with the logits once, exact = T one-token steps over a KV cache with T - 1 fusions)."""
    own = inference_flops(mode, fp, row_tokens, num_passes=num_passes)["flops"]
    return own / inference_flops("standard", reference_fp, row_tokens)["flops"]
