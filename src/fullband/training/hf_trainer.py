"""The K-pass objective in the trainers people already use: Hugging Face ``Trainer`` and TRL's ``SFTTrainer``.

Owns
* :class:`PassSchedule` -- what ``fullband train`` decides per step, for a trainer that is not the package's own:
  K from :class:`fullband.training.schedule.FeedbackSchedule` (plain steps, then ``num_passes`` with a spread
  fraction of ``deep_passes``, a curriculum in K, or K drawn per step from a pass mix: built from the same options
  as ``fullband train`` builds it), the switch-on of :class:`~fullband.training.schedule.SwitchOn` (λ ramp,
  the fusion's LR warm-up, the fusion-only phase), per-group gradient clipping, prefix mixing, and the fusion's
  re-initialisation at switch-on; the defaults are ``fullband train``'s;
* :class:`FeedbackTrainerMixin` -- ``compute_loss`` runs the model's K-pass forward with the step's K, feedback
  mask and λ (a function of ``state.global_step`` and ``state.max_steps`` alone, so a resumed trainer makes the
  same choices) and scales its loss as ``Trainer.compute_loss`` does (times the processes when
  ``num_items_in_batch`` counts every rank's tokens: DDP averages the gradients); ``create_optimizer`` gives the
  fusion its own parameter groups at ``fusion_lr_mult`` times the LR (norms and biases without weight decay, as
  the package's optimizer) and ``create_scheduler`` warms their LR up over ``fusion_warmup``; ``training_step``
  drops the fusion's gradients on plain steps and the backbone's in the fusion-only phase, ``_clip_grad_norm``
  clips backbone and fusion apart (``clip_per_group``), as the engine's step; ``log`` adds ``num_passes`` and
  ``loss_pass1..K`` (the last step's, over its micro-batches and every process, as the logged ``loss``; passes
  not scored, run without gradient under ``grad_passes``, are left out) to each logged record;
* :class:`FullBandwidthTrainer` (``transformers.Trainer``) and :func:`sft_trainer_class` (TRL's ``SFTTrainer``,
  imported only when asked for).

Packed rows (TRL's ``packing=True``: padding-free rows, ``position_ids`` restarting at 0 per sample and no
``attention_mask``): every packed sample starts a document for the feedback mask and prefix mixing.

What the package's own engine does and these do not: the stability guard, and SFTTrainer's entropy /
token-accuracy metrics (its ``compute_loss`` is replaced); options of the trainer that the K-pass loss would drop
(``label_smoothing_factor``, ``compute_loss_func``, SFT's ``loss_type`` other than ``nll``) are refused. Evaluation
runs the plain forward (K = 1), as the trainer's loss on held-out data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import math

import torch
from accelerate.utils import DistributedType
from torch.optim.lr_scheduler import LambdaLR
from transformers import Trainer

from ..model.feedback import build_feedback_mask, document_starts, prefix_mixing_mask, prefix_row_seeds
from .config import TrainConfig
from .optimizer import clip_gradients, param_groups
from .schedule import FeedbackSchedule, SwitchOn

_DEFAULTS = TrainConfig()


@dataclass(frozen=True)
class PassSchedule:
    """Per-step feedback choices of a run of ``max_steps`` steps (defaults: ``fullband train``'s)."""

    feedback_start: float = _DEFAULTS.feedback_start
    num_passes: int = _DEFAULTS.num_passes
    deep_passes: int = _DEFAULTS.deep_passes
    deep_fraction: float = _DEFAULTS.deep_fraction
    pass_curriculum: float = _DEFAULTS.pass_curriculum
    pass_mix: str | None = _DEFAULTS.pass_mix  # "1:0.75,2:0.22,3:0.03": K drawn per step (see FeedbackSchedule)
    prefix_mix: float = _DEFAULTS.prefix_mix
    feedback_weight: float = _DEFAULTS.feedback_weight
    feedback_ramp: float = _DEFAULTS.feedback_ramp
    fusion_lr_mult: float = _DEFAULTS.fusion_lr_mult
    fusion_warmup: float = _DEFAULTS.fusion_warmup  # the fusion's LR warms up from 0 over this fraction of feedback
    fusion_only: float = _DEFAULTS.fusion_only  # only the fusion trains over this first fraction of feedback
    clip_per_group: bool = _DEFAULTS.clip_per_group  # max_grad_norm clips backbone and fusion apart
    grad_passes: int = _DEFAULTS.grad_passes  # long recurrences: only the last N passes backpropagate (0: all)
    exact_states: bool = _DEFAULTS.exact_states  # fed-back steps: the exact states, then grad_passes gradient passes
    full_backprop: bool = _DEFAULTS.full_backprop  # fed-back steps: the exact recurrence, gradient through all of it
    backprop_chunk: int = _DEFAULTS.backprop_chunk  # full_backprop: blocks of this many tokens, recomputed
    pass_tol: float = _DEFAULTS.pass_tol  # skip the remaining no-gradient passes once the states stop changing
    loss_chunk: int = _DEFAULTS.loss_chunk  # the LM loss over chunks of N positions (no full logits kept)
    z_loss: float = _DEFAULTS.z_loss  # PaLM's z-loss coefficient (0: off)
    reset_fusion: bool = True  # re-initialise the fusion when feedback switches on (a fusion built, never trained)
    score_all_passes: bool = False  # log the loss of the grad_passes' no-gradient passes too (their logits computed)
    seed: int = 0

    def __post_init__(self):
        self.feedback()  # validates the pass counts and fractions
        if not 0.0 <= self.prefix_mix <= 1.0:
            raise ValueError(f"prefix_mix must be in [0, 1], got {self.prefix_mix}")
        if self.feedback_weight < 0 or self.fusion_lr_mult < 0:
            raise ValueError("feedback_weight and fusion_lr_mult must be >= 0")
        if min(self.grad_passes, self.pass_tol, self.loss_chunk, self.z_loss) < 0:
            raise ValueError("grad_passes, pass_tol, loss_chunk and z_loss must be >= 0 (0: off)")
        for name in ("fusion_warmup", "fusion_only"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.exact_states and (self.grad_passes < 1 or self.pass_tol):
            raise ValueError("exact_states needs grad_passes >= 1 (the gradient passes run from the exact states) "
                             "and no pass_tol")
        if self.backprop_chunk < 0:
            raise ValueError(f"backprop_chunk must be >= 0 tokens (0: no recomputation), got {self.backprop_chunk}")
        if self.full_backprop and (self.exact_states or self.grad_passes or self.pass_tol):
            raise ValueError("full_backprop backpropagates through the whole recurrence: exact_states, grad_passes "
                             "and pass_tol (options of the K passes) do not apply; leave them off")
        TrainConfig.check_weight_applies(self)

    def forward_options(self, num_passes: int) -> dict:
        """The K-pass forward's options of a step of ``num_passes`` passes, as ``fullband train`` passes them
        (:meth:`TrainConfig.loss_options` on every step, :meth:`TrainConfig.pass_options` on a fed-back one)."""
        options = TrainConfig.loss_options(self) | (TrainConfig.pass_options(self) if num_passes > 1 else {})
        if num_passes > 1 and self.score_all_passes:
            options["score_all_passes"] = True
        return {k: v for k, v in options.items() if v is not None}

    @classmethod
    def from_train_config(cls, cfg: TrainConfig, **overrides) -> "PassSchedule":
        """The schedule ``fullband train`` would run with ``cfg``: every field of ``cfg`` that is one of these."""
        names = {f.name for f in dataclasses.fields(cls)} & set(TrainConfig.field_names())
        return cls(**{**{n: getattr(cfg, n) for n in names}, **overrides})

    def switch_on(self) -> SwitchOn:
        return SwitchOn(feedback_ramp=self.feedback_ramp, fusion_warmup=self.fusion_warmup,
                        fusion_only=self.fusion_only)

    def feedback(self) -> FeedbackSchedule:
        return FeedbackSchedule.from_options(self)  # as `fullband train` builds it from its options

    def passes_at(self, step: int, total_steps: int) -> int:
        return self.feedback().passes_at(min(step, total_steps - 1), total_steps)

    def weight_at(self, step: int, total_steps: int) -> float | None:
        """λ at ``step``, ramped; ``None`` where it does not apply (:meth:`TrainConfig.weighs_passes`)."""
        if not TrainConfig.weighs_passes(self):
            return None
        start = self.feedback().start_step(total_steps)
        return self.feedback_weight * self.switch_on().feedback_weight_factor(step, start, total_steps)

    def backbone_frozen_at(self, step: int, total_steps: int) -> bool:
        return self.switch_on().backbone_frozen(step, self.feedback().start_step(total_steps), total_steps)


@dataclass
class FusionWarmup:
    """A fusion group's LR factor of ``LambdaLR``: the trainer's schedule times the fusion's warm-up (an object, so
    that ``LambdaLR.state_dict`` keeps it)."""

    schedule: object
    switch_on: SwitchOn
    start: int
    total_steps: int

    def __call__(self, step: int) -> float:
        return self.schedule(step) * self.switch_on.fusion_lr_factor(step, self.start, self.total_steps)


class FeedbackTrainerMixin:
    """Put before a ``transformers.Trainer`` subclass: ``class T(FeedbackTrainerMixin, Trainer)``."""

    def __init__(self, *args, pass_schedule: PassSchedule | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.pass_schedule = pass_schedule or PassSchedule()
        self._micro = (-1, 0)  # (step, micro-batches seen in it): seeds prefix mixing per micro-batch
        self._last = None  # (K, passes not scored, summed pass losses) of the last step, on this process, for the log
        for dropped, fix in ((self.label_smoother is not None, "label_smoothing_factor: set it to 0"),
                             (self.compute_loss_func is not None, "compute_loss_func: pass none"),
                             (getattr(self.args, "loss_type", "nll") != "nll", "loss_type: use 'nll'")):
            if dropped:
                raise ValueError(f"the K-pass objective computes its own loss and would ignore {fix}")

    # ------------------------------------------------------------------ per step

    def current_passes(self) -> int:
        return self.pass_schedule.passes_at(self.state.global_step, max(1, self.state.max_steps))

    def feedback_mask(self, model, inputs: dict, step: int, micro: int) -> torch.Tensor:
        """Where the step's micro-batch takes the fed-back state: no document start (BOS, or a packed sample's
        start by ``position_ids``), padding or right after padding, and prefix mixing: row i of this process's
        micro-batch draws from a seed of (seed, step, micro-batch, its place ``rank·B + i`` in the global
        micro-batch, in process order as the trainer's data loader shards it) alone
        (:func:`fullband.model.feedback.prefix_row_seeds`), so each process draws for its own rows and N processes
        mask them as one process holding the global micro-batch does."""
        ids, attn, pos = inputs["input_ids"], inputs.get("attention_mask"), inputs.get("position_ids")
        doc = model.config.doc_start_token_id
        mask = build_feedback_mask(ids, attn, doc, position_ids=pos)
        p = self.pass_schedule.prefix_mix
        if p > 0:
            first = self.accelerator.process_index * ids.shape[0]
            seeds = prefix_row_seeds(self.pass_schedule.seed, step, range(first, first + ids.shape[0]), micro)
            mask &= ~prefix_mixing_mask(document_starts(ids, doc, attn, position_ids=pos), p, seeds).to(mask.device)
        return mask

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        step, total = self.state.global_step, max(1, self.state.max_steps)
        K = self.pass_schedule.passes_at(step, total)
        unwrapped = self.accelerator.unwrap_model(model)
        sched = self.pass_schedule.feedback()
        # at the feedback start, whatever K that step draws (a pass mix may give it K = 1)
        if (sched.num_passes > 1 and self.pass_schedule.reset_fusion and step == sched.start_step(total) > 0
                and self._micro[0] != step):
            unwrapped.reset_feedback(torch.Generator().manual_seed(self.pass_schedule.seed * 31 + 7))
        micro = self._micro[1] + 1 if self._micro[0] == step else 0
        self._micro = (step, micro)
        extra = {}
        if K > 1:
            extra = {"feedback_mask": self.feedback_mask(unwrapped, inputs, step, micro),
                     "feedback_weight": self.pass_schedule.weight_at(step, total)}
        if num_items_in_batch is not None and self.model_accepts_loss_kwargs:
            extra["num_items_in_batch"] = num_items_in_batch
        outputs = model(**inputs, num_passes=TrainConfig.step_passes(self.pass_schedule, K), **extra,
                        **self.pass_schedule.forward_options(K))
        # as Trainer.compute_loss: num_items_in_batch counts every process's tokens (average_tokens_across_devices)
        # and DDP averages the gradients over the processes, so the loss is multiplied by their number
        loss, scale = outputs.loss, 1
        if (self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs
                and num_items_in_batch is not None):
            scale = self.accelerator.num_processes // self.get_tp_size() if self.args.n_gpu <= 1 else self.args.n_gpu
            loss = loss * scale
        # the pass losses as the logged loss: the same factor, summed over the step's micro-batches (a per-micro-batch
        # mean divided by the accumulation steps first, as training_step divides the loss)
        scaled_for_ga = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled_for_ga is None:
            scaled_for_ga = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        passes = outputs.pass_losses.detach().float() * scale
        if not scaled_for_ga:
            passes = passes / self.current_gradient_accumulation_steps
        options = self.pass_schedule.forward_options(K)
        unscored = K - min(options["grad_passes"], K) if options.get("grad_passes") and not options.get(
            "score_all_passes") else 0  # the passes run without gradient compute no loss (NaN in pass_losses)
        K = len(passes)  # the passes the forward ran (with exact_states: the gradient passes after the exact states)
        self._last = (K, unscored, passes if micro == 0 or self._last is None else self._last[2] + passes)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, *args, **kwargs):
        """The trainer's step, then as the engine's: no fusion gradient on a plain step (no update, no weight decay)
        and no backbone gradient in the fusion-only phase (``fusion_only``)."""
        loss = super().training_step(model, *args, **kwargs)
        step, total = self.state.global_step, max(1, self.state.max_steps)
        fusion, backbone = self._param_split(model)
        drop = (fusion if self.pass_schedule.passes_at(step, total) == 1 else []) + (
            backbone if self.pass_schedule.backbone_frozen_at(step, total) else [])
        for p in drop:
            p.grad = None
        return loss

    def _param_split(self, model) -> tuple[list, list]:
        """(fusion, backbone) parameters that train."""
        fusion = [p for p in self.accelerator.unwrap_model(model).feedback.parameters() if p.requires_grad]
        ids = {id(p) for p in fusion}
        return fusion, [p for p in model.parameters() if p.requires_grad and id(p) not in ids]

    def _clip_grad_norm(self, model):
        """``max_grad_norm`` on backbone and fusion apart (``clip_per_group``, as ``fullband train``), or together."""
        if not self.pass_schedule.clip_per_group:
            return super()._clip_grad_norm(model)
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise ValueError("clip_per_group: DeepSpeed clips the gradients itself; use PassSchedule(clip_per_group="
                             "False) with DeepSpeed")
        self.accelerator.unscale_gradients()
        fusion, backbone = self._param_split(model)
        norm = clip_gradients(backbone, self.args.max_grad_norm)
        if any(p.grad is not None for p in fusion):
            norm = math.hypot(norm, clip_gradients(fusion, self.args.max_grad_norm))
        return torch.tensor(norm)

    # ------------------------------------------------------------------ optimizer and logs

    def create_optimizer(self, model=None):
        """The trainer's optimizer class and settings over the package's parameter groups: backbone / fusion x
        decay / no-decay, the fusion's at ``fusion_lr_mult`` times the LR."""
        if self.optimizer is None:
            model = model if model is not None else self.model
            opt_cls, opt_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
            lr = opt_kwargs.get("lr", self.args.learning_rate)
            cfg = dataclasses.replace(_DEFAULTS, weight_decay=self.args.weight_decay,
                                      fusion_lr_mult=self.pass_schedule.fusion_lr_mult)
            groups = []
            for g in param_groups(model, cfg):
                g = dict(g)
                g["lr"] = lr * g.pop("lr_mult")
                groups.append(g)
            self.optimizer = opt_cls(groups, **opt_kwargs)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The trainer's LR schedule, the fusion groups' times their warm-up over ``fusion_warmup`` of the feedback
        phase (``SwitchOn.fusion_lr_factor`` of the step, as ``fullband train``)."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self.pass_schedule.fusion_warmup <= 0:
            return scheduler
        if not isinstance(scheduler, LambdaLR):
            raise ValueError(f"fusion_warmup needs a LambdaLR schedule, not {type(scheduler).__name__}; use "
                             "PassSchedule(fusion_warmup=0) with this lr_scheduler_type")
        start = self.pass_schedule.feedback().start_step(num_training_steps)
        groups = scheduler.optimizer.param_groups
        for i, group in enumerate(groups):
            if str(group.get("name", "")).startswith("fusion") and not isinstance(scheduler.lr_lambdas[i], FusionWarmup):
                scheduler.lr_lambdas[i] = FusionWarmup(scheduler.lr_lambdas[i], self.pass_schedule.switch_on(), start,
                                                       num_training_steps)
                group["lr"] = scheduler.base_lrs[i] * scheduler.lr_lambdas[i](scheduler.last_epoch)
        scheduler._last_lr = [g["lr"] for g in groups]
        return scheduler

    def log(self, logs: dict, *args, **kwargs):
        """A training record gets the last step's K and pass losses, averaged over the processes (every process logs
        a training record at the same step, so the gather is collective)."""
        if "loss" in logs and self._last is not None:
            K, unscored, passes = self._last
            passes = self.accelerator.gather(passes.reshape(1, K)).reshape(-1, K).mean(0).tolist()
            logs = {**logs, "num_passes": K, **{f"loss_pass{i + 1}": v for i, v in enumerate(passes) if i >= unscored}}
        return super().log(logs, *args, **kwargs)


class FullBandwidthTrainer(FeedbackTrainerMixin, Trainer):
    """``transformers.Trainer`` with the K-pass objective (``pass_schedule=PassSchedule(...)``)."""


def sft_trainer_class():
    """TRL's ``SFTTrainer`` with the K-pass objective (TRL imported here: an optional dependency)."""
    try:
        from trl import SFTTrainer
    except ImportError as err:
        raise ImportError(f"TRL is not installed ({err}); pip install trl") from None

    class FullBandwidthSFTTrainer(FeedbackTrainerMixin, SFTTrainer):
        """``trl.SFTTrainer`` with the K-pass objective (``pass_schedule=PassSchedule(...)``)."""

    return FullBandwidthSFTTrainer
