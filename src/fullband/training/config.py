"""The options of a training run and the one reader of YAML/TOML config files.

Owns :class:`TrainConfig` (every option of ``fullband train``; :class:`fullband.training.sft.SFTConfig` extends
it), :func:`config_field` (a field with its help text and resume rules: ``traj`` = changing it changes the
trajectory, refused on ``--resume``; ``branch`` = a feedback setting that may change while the checkpoint precedes
the feedback start), :func:`read_config_file` / :func:`make_config` (defaults < a resumed run's saved options <
config file < command line, for any config class), and :func:`check_resume` (what a resumed run may change).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from typing import ClassVar

from ..model.feedback import check_fusion_name
from ..model.lean import TOKEN_STEPS
from ..utils.argtypes import (FRACTION, NONNEG_FLOAT, NONNEG_INT, OPEN_FRACTION, POSITIVE_FLOAT, POSITIVE_INT,
                              int_at_least)
from ..utils.errors import UsageError
from . import distributed as D
from .presets import get_preset
from .schedule import FeedbackSchedule, SwitchOn, lr_at, parse_pass_mix

LR_SCHEDULES = ("cosine", "wsd", "constant")
PRECISIONS = ("auto", "fp32", "bf16")


def config_field(default, help, *, traj=True, branch=False, hidden=False, cli=True, **kw):
    """A config field: ``traj`` = changing it changes the training trajectory (refused on --resume);
    ``branch`` = a feedback setting that may change on --resume while the checkpoint precedes the feedback start;
    ``hidden`` = a test hook (no help, not in config files); ``persist=False`` = not taken from a checkpoint;
    ``arg`` = the command-line type of a numeric option (:mod:`fullband.utils.argtypes`: its range), required of
    every ``int`` / ``float`` field that has a flag."""
    meta = {"help": help, "traj": traj, "branch": branch, "hidden": hidden, "cli": cli, **kw}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def flag_name(name: str) -> str:
    """The command-line spelling of a field name (``feedback_start`` -> ``feedback-start``)."""
    return name.replace("_", "-")


@dataclass
class TrainConfig:
    """Every option of ``fullband train`` (the CLI flags are these names with dashes)."""

    #: the section a config file may wrap its options in (``train:`` / ``[train]``)
    config_section: ClassVar[str] = "train"
    #: fields that are not options of this command (no flag, refused in a config file, not taken from a checkpoint)
    skip_options: ClassVar[tuple] = ()

    # ---- run
    out: str | None = config_field(None, "output directory: checkpoints, metrics.jsonl, the final model and tokenizer", traj=False, group="run")
    steps: int = config_field(200, "optimizer steps (the LR and feedback schedules are fractions of this)", group="run", arg=POSITIVE_INT)
    seed: int = config_field(0, "seed of the model init, data split and order, prefix mixing and jitter", group="run", arg=NONNEG_INT)
    save_every: int = config_field(0, "write a checkpoint every N steps (0: only when stopping early); the last --keep-checkpoints are kept", traj=False, group="run", arg=NONNEG_INT)
    keep_checkpoints: int = config_field(1, "how many checkpoints to keep", traj=False, group="run", arg=POSITIVE_INT)
    stop_after: int | None = config_field(None, "stop cleanly after this step, writing a checkpoint (continue later with --resume; not remembered by it)", traj=False, persist=False, group="run", arg=POSITIVE_INT)
    # ---- data
    data: str = config_field("shakespeare", "training text: 'shakespeare' (embedded corpus), a text file, a folder, a .jsonl with a 'text' field, a datasets directory, or a directory of `fullband data prepare` (read lazily; its tokenizer and split apply)", group="data")
    tokenizer: str | None = config_field(None, "local HF tokenizer directory (default: train a byte-level BPE on the training documents; with --init-from, that checkpoint's tokenizer)", group="data")
    vocab_size: int = config_field(4096, "vocabulary size of a BPE trained here", group="data", arg=int_at_least(300))
    seq_len: int = config_field(256, "tokens per packed row", group="data", arg=int_at_least(2))
    val_fraction: float = config_field(0.1, "fraction of documents held out for validation", group="data", arg=OPEN_FRACTION)
    batch_size: int = config_field(16, "global batch in rows per optimizer step (split over processes and --grad-accum micro-batches)", group="data", arg=POSITIVE_INT)
    grad_accum: int = config_field(1, "micro-batches per optimizer step (per process)", group="data", arg=POSITIVE_INT)
    data_offset: int = config_field(0, "skip the first N batches of the data order (continue where an --init-from run stopped reading)", group="data", arg=NONNEG_INT)
    unique_batches: int = config_field(0, "read only the rows of the first N batches of the data order (from --data-offset on), re-read in a fresh seeded order each epoch until --steps: the same unique tokens as an N-step run, for more FLOPs (0: off)", group="data", arg=NONNEG_INT)
    # ---- model
    preset: str = config_field("tiny", "backbone size from scratch: tiny (~3M), small (~25M), gpt2-small (~125M at a 50k vocabulary); micro (d64, tests)", group="model")
    tie_embeddings: bool | None = config_field(None, "tie the LM head to the input embeddings (one tensor) of a backbone built from --preset (default: the preset's choice, tied for gpt2-small and llama-1b); an --init-from checkpoint keeps its own tying, and asking to change it is refused", group="model")
    layers: int | None = config_field(None, "decoder layers of a backbone built from --preset (default: the preset's own: micro 2, tiny 4, small 6; e.g. plain models of 2x and 4x an FBT's depth); not with --init-from", group="model", arg=POSITIVE_INT)
    init_from: str | None = config_field(None, "local HF causal-LM checkpoint to retrofit (or a fullband model to continue) instead of a preset", group="model")
    fusion: str = config_field("residual", "fusion of h_{t-1} and e_t: residual (u = e + GLU(h, e), measured best), glu (paper), concat, add", group="model")
    feedback_weight: float = config_field(1.0, "lambda in loss = L_1 + lambda * mean(L_2..L_K) (not with --exact-states / --full-backprop: no plain pass)", branch=True, group="model", arg=NONNEG_FLOAT)
    jitter: float = config_field(0.02, "uniform noise on the fed-back state, +-jitter * RMS(state)", branch=True, group="model", arg=NONNEG_FLOAT)
    detach_state: bool = config_field(False, "stop gradients through the fed-back state (cheaper; not in the paper)", branch=True, group="model")
    # ---- optimisation
    lr: float | None = config_field(None, "peak learning rate (default: the preset's, 3e-4 with --init-from)", group="optim", arg=POSITIVE_FLOAT)
    min_lr_ratio: float = config_field(0.1, "final LR as a fraction of the peak", group="optim", arg=FRACTION)
    lr_schedule: str = config_field("wsd", "wsd (warmup-stable-decay: feedback switches on at the full LR), cosine or constant", group="optim")
    warmup_fraction: float = config_field(0.05, "fraction of steps of linear warmup", group="optim", arg=OPEN_FRACTION)
    decay_fraction: float = config_field(0.1, "WSD: fraction of steps of the final linear decay", group="optim", arg=FRACTION)
    weight_decay: float = config_field(0.1, "AdamW weight decay (matrices only)", group="optim", arg=NONNEG_FLOAT)
    beta1: float = config_field(0.9, "AdamW beta1", group="optim", arg=OPEN_FRACTION)
    beta2: float = config_field(0.95, "AdamW beta2", group="optim", arg=OPEN_FRACTION)
    grad_clip: float = config_field(1.0, "clip the global gradient norm to this (0: no clipping)", group="optim", arg=NONNEG_FLOAT)
    fusion_lr_mult: float = config_field(10.0, "LR multiplier of the fusion weights' parameter groups", branch=True, group="optim", arg=NONNEG_FLOAT)
    fusion_warmup: float = config_field(0.1, "fraction of the feedback phase over which the fusion LR warms up linearly from 0", branch=True, group="optim", arg=FRACTION)
    z_loss: float = config_field(0.0, "PaLM z-loss: add this x mean(logsumexp(logits)^2) over the supervised tokens to every pass's loss (reported as z_loss; 0: off)", group="optim", arg=NONNEG_FLOAT)
    clip_per_group: bool = config_field(True, "clip the backbone's and the fusion's gradient norms separately (each to --grad-clip)", branch=True, group="optim")
    precision: str = config_field("auto", "auto (bf16 autocast on a GPU that supports it, else fp32), fp32 or bf16", group="optim")
    # ---- feedback schedule
    num_passes: int = config_field(2, "K once feedback is on (1: a plain baseline)", branch=True, group="feedback", arg=POSITIVE_INT)
    feedback_start: float = config_field(0.7, "fraction of the steps trained plain before feedback switches on", branch=True, group="feedback", arg=FRACTION)
    deep_passes: int = config_field(4, "K of the deep steps", branch=True, group="feedback", arg=POSITIVE_INT)
    deep_fraction: float = config_field(0.1, "fraction of the feedback steps that use --deep-passes", branch=True, group="feedback", arg=FRACTION)
    prefix_mix: float = config_field(0.25, "probability that a document keeps a random plain prefix on feedback steps", branch=True, group="feedback", arg=FRACTION)
    feedback_ramp: float = config_field(0.2, "fraction of the feedback phase over which lambda ramps linearly from 0 to --feedback-weight (not with --exact-states / --full-backprop)", branch=True, group="feedback", arg=FRACTION)
    fusion_only: float = config_field(0.0, "fraction of the feedback phase, at its start, in which only the fusion trains (backbone frozen)", branch=True, group="feedback", arg=FRACTION)
    # ---- long recurrences (K up to the row length: K = seq_len is the exact recurrence)
    grad_passes: int = config_field(0, "truncated gradients: passes 1..K-N run without gradient, the last N backpropagate (0: all K)", branch=True, group="feedback", arg=NONNEG_INT)
    pass_tol: float = config_field(0.0, "stop the passes early once max|h_k - h_{k-1}| / max|h_{k-1}| < this (the gradient passes still run; 0: off)", branch=True, group="feedback", arg=NONNEG_FLOAT)
    pass_mix: str | None = config_field(None, "K of each feedback step drawn from K:P pairs, e.g. 1:0.75,2:0.22,3:0.03 (the paper's per-batch mix; a function of --seed and the step alone); --num-passes must be its largest K and --deep-fraction 0", branch=True, group="feedback")
    exact_states: bool = config_field(False, "the exact recurrence at linear cost: each fed-back step runs the token-by-token recurrence without gradient for the exact states, then --grad-passes N teacher-forced passes with gradient from them (K of the schedule then only says which steps are fed back)", branch=True, group="feedback")
    full_backprop: bool = config_field(False, "full backpropagation through the token-by-token recurrence: each fed-back step runs the exact recurrence with gradient through every step's state and KV cache (its gradient: the last of K = T + 1 passes' gradient, at the cost of about 4/3 of a plain step's FLOPs; memory linear in T: see --backprop-chunk); K of the schedule then only says which steps are fed back", branch=True, group="feedback")
    backprop_chunk: int = config_field(8, "--full-backprop: blocks of this many tokens, each recomputed in the backward (memory kept: the hidden states and keys/values of the row, plus one block's insides over the row's keys; 0: no recomputation, memory quadratic in the row length)", traj=False, group="feedback", arg=NONNEG_INT)
    pass_curriculum: float = config_field(0.0, "fraction of the feedback phase over which K climbs linearly from 2 to --num-passes (0: off)", branch=True, group="feedback", arg=FRACTION)
    # ---- stability guard
    spike_factor: float = config_field(3.0, "skip a step whose loss (the mean of the passes it trains) exceeds this times its running average and that average by 0.1 nats (0: off)", group="guard", arg=NONNEG_FLOAT)
    max_bad_steps: int = config_field(5, "after this many bad steps in a row (skipped, or a second finite spike in a row trained on): stop; but when every one is a finite spike and their mean is below the level the run started from (the model's loss moved: skipping cannot undo it), re-base the running loss on them and train on", traj=False, group="guard", arg=POSITIVE_INT)
    # ---- evaluation and logging
    eval_every: int = config_field(0, "validation loss every N steps (0: ten times per run)", traj=False, group="log", arg=NONNEG_INT)
    eval_rows: int = config_field(32, "validation rows used by the periodic evaluation", traj=False, group="log", arg=POSITIVE_INT)
    progress: bool = config_field(True, "progress bar (tokens/s, loss per pass, ETA)", traj=False, group="log")
    tensorboard: bool = config_field(True, "TensorBoard logs under OUT/tb when tensorboard is installed", traj=False, group="log")
    plot: bool = config_field(True, "write OUT/curves.png at the end", traj=False, group="log")
    # ---- hardware
    device: str = config_field("auto", "auto, cpu, cuda or cuda:N", traj=False, group="hw")
    parallel: str = config_field("ddp", "under torchrun: ddp, or fsdp (FSDP2, for large models)", traj=False, group="hw")
    # memory and speed: the same losses up to float rounding (not part of the trajectory)
    token_step: str = config_field("auto", "the token-by-token pass of --exact-states and exact evaluation: lean (the backbone's decoder layers called directly, keys and values in buffers allocated once), compiled (that step through torch.compile: seconds to compile, then faster per token; fullband bench token measures both), off (the backbone's full forward at every token), auto (lean on CPU, compiled on CUDA); the states are the same", traj=False, group="hw")
    compile: bool = config_field(False, "torch.compile the backbone's decoder layers (their attention, MLP and norms; the K-pass loop stays eager); the first steps are slow while it compiles", traj=False, group="hw")
    activation_checkpointing: bool = config_field(False, "recompute each decoder layer in the backward instead of keeping its activations (passes with gradient; less memory, about one more forward of compute)", traj=False, group="hw")
    loss_chunk: int = config_field(0, "compute each pass's loss N positions at a time from the final hidden states, each chunk's logits recomputed in the backward: no full [tokens, vocab] fp32 logits (0: off)", traj=False, group="hw", arg=NONNEG_INT)
    # ---- test hooks (hidden)
    debug_nan_steps: list = config_field([], "", traj=False, hidden=True)
    debug_kill_at_step: int | None = config_field(None, "", traj=False, hidden=True, arg=POSITIVE_INT)

    # -------------------------------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def schedule(self) -> FeedbackSchedule:
        return FeedbackSchedule.from_options(self)  # --num-passes 1: a plain baseline, no deep steps, no pass mix

    def pass_options(self) -> dict:
        """The K-pass forward's long-recurrence arguments of a fed-back training step (``grad_passes``,
        ``pass_tol``; with ``--exact-states``, ``exact_states`` instead: the N gradient passes are then the
        forward's ``num_passes``, :meth:`step_passes`; with ``--full-backprop``, ``full_backprop`` and
        ``backprop_chunk``: the recurrence is then the forward's one pass)."""
        if self.full_backprop:
            return {"full_backprop": True, "backprop_chunk": self.backprop_chunk}
        if self.exact_states:
            return {"exact_states": True}
        return {"grad_passes": self.grad_passes or None, "pass_tol": self.pass_tol or None}

    def fed_back_evaluation(self) -> tuple[str, int | str]:
        """The periodic evaluation's fed-back mode and its label: ``("passes", K)``, or with ``--exact-states``
        (trained on the exact recurrence, never on K teacher-forced passes from a plain start) ``("exact",
        "exact")``."""
        exact = self.exact_states or self.full_backprop
        return ("exact", "exact") if exact else ("passes", self.num_passes)

    def step_passes(self, num_passes: int) -> int:
        """The forward's ``num_passes`` on a step whose schedule says K = ``num_passes``: K itself, or with
        ``--exact-states`` on a fed-back step (K > 1) the ``--grad-passes`` N gradient passes after the exact
        states; with ``--full-backprop``, 1: the recurrence with gradient is one pass."""
        if self.full_backprop and num_passes > 1:
            return 1
        return self.grad_passes if self.exact_states and num_passes > 1 else num_passes

    def weighs_passes(self) -> bool:
        """Whether λ (``--feedback-weight``, ramped over ``--feedback-ramp``) weighs a fed-back step's passes
        (``L_1 + λ·mean(L_2..L_K)``): not with ``--exact-states`` (every gradient pass is the exact recurrence's, the
        loss their mean) or ``--full-backprop`` (one pass, its loss): there is no plain pass to weigh them against."""
        return not (self.exact_states or self.full_backprop)

    def check_weight_applies(self) -> None:
        """``ValueError`` (one line) when λ or its ramp is set away from its defaults (1.0; a ramp of 0.2 or 0) where
        it does not apply (:meth:`weighs_passes`): an option that would do nothing is refused."""
        ramp_default = TrainConfig.__dataclass_fields__["feedback_ramp"].default
        if TrainConfig.weighs_passes(self) or (self.feedback_weight == 1.0
                                               and self.feedback_ramp in (0.0, ramp_default)):
            return
        mode = "--exact-states (the loss is the mean of its gradient passes, all of them the exact recurrence's)" if (
            self.exact_states) else "--full-backprop (the loss is the recurrence's, one pass)"
        raise ValueError(f"--feedback-weight and --feedback-ramp do not apply with {mode}: there is no plain pass to "
                         f"weigh against; leave them at 1.0 and {ramp_default} (got {self.feedback_weight} and "
                         f"{self.feedback_ramp})")

    def loss_options(self) -> dict:
        """The K-pass forward's loss arguments of every training step (``loss_chunk``, ``z_loss``; ``None``: off)."""
        return {"loss_chunk": self.loss_chunk or None, "z_loss": self.z_loss or None}

    def switch_on(self) -> SwitchOn:
        return SwitchOn(feedback_ramp=self.feedback_ramp, fusion_warmup=self.fusion_warmup, fusion_only=self.fusion_only)

    @property
    def feedback_ever(self) -> bool:
        sched = self.schedule()
        return sched.start_step(self.steps) < self.steps and max(sched.num_passes, sched.deep_passes if sched.deep_fraction > 0 else 1) > 1

    def resolved_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        if self.init_from:
            return 3e-4
        return get_preset(self.preset).lr

    def validate(self, world_size: int = 1) -> TrainConfig:
        """Raise ``ValueError`` for any bad value (before anything is written)."""
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            t = f.type if isinstance(f.type, str) else str(f.type)
            if v is None:
                need("None" in t, f"--{flag_name(f.name)} must be given")
                continue
            if t.startswith("int"):
                need(isinstance(v, int) and not isinstance(v, bool), f"--{flag_name(f.name)} must be an integer, got {v!r}")
            elif t.startswith("float"):
                need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                     f"--{flag_name(f.name)} must be a number, got {v!r}")
            elif t.startswith("bool"):
                need(isinstance(v, bool), f"--{flag_name(f.name)} must be true or false, got {v!r}")
            elif t.startswith("str"):
                need(isinstance(v, str), f"--{flag_name(f.name)} must be a string, got {v!r}")
        need(self.out is not None and str(self.out).strip() != "", "--out DIR is required")
        need(self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        need(self.save_every >= 0, f"--save-every must be >= 0, got {self.save_every}")
        need(self.keep_checkpoints >= 1, f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")
        need(self.stop_after is None or 1 <= self.stop_after, f"--stop-after must be >= 1, got {self.stop_after}")
        need(self.vocab_size >= 300, f"--vocab-size must be >= 300, got {self.vocab_size}")
        need(self.seq_len >= 2, f"--seq-len must be >= 2, got {self.seq_len}")
        need(0.0 <= self.val_fraction < 1.0, f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        need(self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}")
        need(self.data_offset >= 0, f"--data-offset must be >= 0, got {self.data_offset}")
        need(self.unique_batches >= 0, f"--unique-batches must be >= 0 (0: off), got {self.unique_batches}")
        need(self.batch_size % (world_size * self.grad_accum) == 0,
             f"--batch-size {self.batch_size} must be divisible by processes x --grad-accum = {world_size} x {self.grad_accum}")
        if self.init_from is None:
            get_preset(self.preset)
        need(self.layers is None or self.layers >= 1, f"--layers must be >= 1, got {self.layers}")
        need(self.layers is None or self.init_from is None, "--layers shapes a backbone built from --preset: an "
             "--init-from checkpoint keeps its own layers")
        check_fusion_name(self.fusion)
        need(self.feedback_weight >= 0, f"--feedback-weight must be >= 0, got {self.feedback_weight}")
        need(self.jitter >= 0, f"--jitter must be >= 0, got {self.jitter}")
        need(self.lr is None or self.lr > 0, f"--lr must be > 0, got {self.lr}")
        need(0.0 <= self.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        need(self.lr_schedule in LR_SCHEDULES, f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        need(0.0 <= self.warmup_fraction < 1.0, f"--warmup-fraction must be in [0, 1), got {self.warmup_fraction}")
        need(0.0 <= self.decay_fraction <= 1.0, f"--decay-fraction must be in [0, 1], got {self.decay_fraction}")
        need(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        need(0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0, "--beta1 and --beta2 must be in [0, 1)")
        need(self.grad_clip >= 0, f"--grad-clip must be >= 0, got {self.grad_clip}")
        need(self.z_loss >= 0, f"--z-loss must be >= 0 (0: off), got {self.z_loss}")
        need(self.loss_chunk >= 0, f"--loss-chunk must be >= 0 positions (0: off), got {self.loss_chunk}")
        need(self.fusion_lr_mult >= 0, f"--fusion-lr-mult must be >= 0, got {self.fusion_lr_mult}")
        need(self.precision in PRECISIONS, f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        need(0.0 <= self.prefix_mix <= 1.0, f"--prefix-mix must be in [0, 1], got {self.prefix_mix}")
        for name in ("fusion_warmup", "feedback_ramp", "fusion_only"):
            v = getattr(self, name)
            need(0.0 <= v <= 1.0, f"--{flag_name(name)} must be in [0, 1], got {v}")
        need(self.grad_passes >= 0, f"--grad-passes must be >= 0 (0: all passes), got {self.grad_passes}")
        need(self.pass_tol >= 0, f"--pass-tol must be >= 0 (0: off), got {self.pass_tol}")
        need(not self.exact_states or self.grad_passes >= 1, "--exact-states needs --grad-passes N >= 1: the number "
             "of gradient passes run from the exact states (2 is the usual choice)")
        need(not (self.exact_states and self.pass_tol), "--exact-states computes the exact states directly: "
             "--pass-tol (which stops the passes once they converge) does not apply; leave it 0")
        if self.full_backprop:
            need(not self.exact_states, "--full-backprop and --exact-states are two ways to train the recurrence: "
                 "choose one")
            need(not self.grad_passes and not self.pass_tol, "--full-backprop backpropagates through the whole "
                 "recurrence: --grad-passes and --pass-tol (options of the K passes) do not apply; leave them 0")
            need(not (self.parallel == "fsdp" and world_size > 1), "--full-backprop does not run under FSDP2 (its "
                 "blocks recompute sharded layers in the backward): use --parallel ddp")
        self.check_weight_applies()
        need(self.backprop_chunk >= 0, f"--backprop-chunk must be >= 0 tokens (0: no recomputation), got "
             f"{self.backprop_chunk}")
        need(0.0 <= self.pass_curriculum <= 1.0, f"--pass-curriculum must be in [0, 1], got {self.pass_curriculum}")
        self.schedule()  # start fraction, passes, deep fraction, curriculum
        need(self.spike_factor == 0 or self.spike_factor > 1, f"--spike-factor must be 0 (off) or > 1, got {self.spike_factor}")
        need(self.max_bad_steps >= 1, f"--max-bad-steps must be >= 1, got {self.max_bad_steps}")
        need(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        need(self.eval_rows >= 1, f"--eval-rows must be >= 1, got {self.eval_rows}")
        need(self.token_step in TOKEN_STEPS, f"--token-step must be one of {', '.join(TOKEN_STEPS)}, got {self.token_step!r}")
        need(self.parallel in D.PARALLEL_MODES, f"--parallel must be one of {', '.join(D.PARALLEL_MODES)}, got {self.parallel!r}")
        D.resolve_device(self.device)
        need(isinstance(self.debug_nan_steps, list) and all(isinstance(s, int) for s in self.debug_nan_steps),
             "debug_nan_steps must be a list of step numbers")
        if self.init_from is not None and not os.path.isdir(self.init_from):
            raise FileNotFoundError(f"--init-from directory {self.init_from!r} does not exist")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise FileNotFoundError(f"--tokenizer directory {self.tokenizer!r} does not exist")
        if self.data not in (None, "shakespeare") and not os.path.exists(self.data):
            raise FileNotFoundError(f"--data {self.data!r} does not exist (a text file, folder, .jsonl, datasets "
                                    "directory, or 'shakespeare')")
        return self


def field_map(cls=TrainConfig) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def option_names(cls=TrainConfig) -> list[str]:
    """The fields of ``cls`` that are options of its command (hidden test hooks included, skipped ones not)."""
    return [f.name for f in dataclasses.fields(cls) if f.name not in cls.skip_options]


def read_config_file(path: str, cls=TrainConfig) -> dict:
    """Options from a YAML or TOML file (keys as on the command line, with dashes or underscores; optionally inside
    one ``cls.config_section`` table). ``ValueError`` / ``FileNotFoundError`` for anything wrong, one line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    with open(path, "rb") as f:
        raw = f.read()
    toml = _toml_module() if path.endswith(".toml") else None
    try:
        text = raw.decode("utf-8")
        if toml is not None:
            data = toml.loads(text)
        else:
            import yaml  # a dependency, but only config files need it

            data = yaml.safe_load(text)
    except Exception as err:  # noqa: BLE001 - any parse error is a user error
        raise ValueError(f"config file {path!r} could not be parsed: {str(err).splitlines()[0]}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of option names to values")
    if isinstance(data.get(cls.config_section), dict) and len(data) == 1:
        data = data[cls.config_section]
    fields_ = field_map(cls)
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in fields_ or fields_[name].metadata.get("hidden") or name in cls.skip_options:
            raise ValueError(f"config file {path!r}: unknown option {key!r}")
        out[name] = value
    return out


def _toml_module():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError("TOML config files need Python 3.11+ (or `pip install tomli`); use a YAML file") from None
    return tomllib


def make_config(explicit: dict, config_file: str | None = None, base: dict | None = None, cls=TrainConfig):
    """Defaults < ``base`` (a resumed run's saved config) < config file < explicit command-line options."""
    values = cls().to_dict()
    for layer in (base or {}), (read_config_file(config_file, cls) if config_file else {}), explicit:
        for k, v in layer.items():
            if k in values:
                values[k] = v
    # ints written as floats in a file (1e3) are accepted when integral
    for name, f in field_map(cls).items():
        v = values[name]
        if str(f.type).startswith("int") and isinstance(v, float) and v.is_integer():
            values[name] = int(v)
    return cls(**values)


def saved_options(saved_config: dict, cls=TrainConfig) -> dict:
    """The options of a checkpoint's saved config that a resumed run takes over (not hidden test hooks, not
    ``persist=False`` ones such as ``--stop-after``)."""
    fields_ = field_map(cls)
    return {k: v for k, v in saved_config.items()
            if k in fields_ and k not in cls.skip_options and not fields_[k].metadata.get("hidden")
            and fields_[k].metadata.get("persist", True)}


def same_value(name: str, a, b) -> bool:
    """Whether option ``name`` has the same meaning at values ``a`` and ``b``: a pass mix compares by its pairs (in
    any order, ``.75`` as ``0.75``), everything else by value."""
    if name == "pass_mix" and a != b:
        try:
            return parse_pass_mix(a) == parse_pass_mix(b)
        except (UsageError, ValueError):  # a malformed mix is refused elsewhere, by name
            return False
    return a == b


def trajectory_diff(old, new) -> tuple[list[str], list[str]]:
    """(fields that change the trajectory, feedback fields among them)."""
    diff, branch = [], []
    for f in dataclasses.fields(type(new)):
        if not f.metadata.get("traj"):
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        if f.name == "lr":
            a, b = old.resolved_lr(), new.resolved_lr()
        if not same_value(f.name, a, b):
            (branch if f.metadata.get("branch") else diff).append(f.name)
    return diff, branch


# the length of a run and the shape of its LR schedule: a run may continue from another's checkpoint with other
# values when everything before the checkpoint stays the same (:func:`same_path`)
SCHEDULE_FIELDS = ("steps", "warmup_fraction", "decay_fraction", "min_lr_ratio", "lr_schedule")


def same_path(old, new, step: int) -> bool:
    """Whether runs ``old`` and ``new`` take the same first ``step`` steps: the same LR at each and no feedback
    before ``step`` in either (both plain, or ``step`` at or before both feedback starts)."""
    plain = old.num_passes == new.num_passes == 1
    if not plain and (step > old.schedule().start_step(old.steps) or step > new.schedule().start_step(new.steps)):
        return False
    return all(lr_at(i, old) == lr_at(i, new) for i in range(step))


def check_resume(cfg, trainer_state: dict, world_size: int, is_main: bool = True) -> None:
    """Refuse a resumed run that changes its trajectory (``ValueError``); warn when the number of processes differs.
    The run's length and LR-schedule shape (:data:`SCHEDULE_FIELDS`) may change when the steps already taken are
    the same in both (:func:`same_path`): a longer run branched off a shorter one's checkpoint."""
    cls = type(cfg)
    old = cls(**{k: v for k, v in trainer_state["config"].items() if k in field_map(cls)})
    diff, branch = trajectory_diff(old, cfg)
    if diff and set(diff) <= set(SCHEDULE_FIELDS) and same_path(old, cfg, trainer_state["step"]):
        diff = []
    if diff:
        raise ValueError(f"--resume: {', '.join('--' + flag_name(d) for d in diff)} differ from the checkpoint's run; "
                         "a resumed run must keep them (start a new --out to change them)")
    if branch:
        c = trainer_state["step"]
        if c > old.schedule().start_step(old.steps) or c > cfg.schedule().start_step(cfg.steps):
            raise ValueError(f"--resume: {', '.join('--' + flag_name(d) for d in branch)} differ from the checkpoint's "
                             "run; feedback settings may only change while the checkpoint precedes the feedback start")
    if trainer_state.get("world_size", world_size) != world_size and is_main:
        print(f"warning: the checkpoint was written by {trainer_state['world_size']} process(es), this run has "
              f"{world_size}; per-rank jitter streams differ, so the run will not be bitwise identical",
              file=sys.stderr)


DEFAULT_FUSION = TrainConfig.__dataclass_fields__["fusion"].default  # what --fusion is when not given
