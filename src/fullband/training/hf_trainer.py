"""The K-pass objective in the trainers people already use: Hugging Face ``Trainer`` and TRL's ``SFTTrainer``.

Owns
* :class:`PassSchedule` -- what ``fullband train`` decides per step, for a trainer that is not the package's own:
  K from :class:`fullband.training.schedule.FeedbackSchedule` (plain steps, then ``num_passes`` with a spread
  fraction of ``deep_passes``, a curriculum in K, or K drawn per step from a pass mix: built from the same options
  as ``fullband train`` builds it), the λ ramp of :class:`~fullband.training.schedule.SwitchOn`, prefix mixing,
  and the fusion's re-initialisation at switch-on; the defaults are ``fullband train``'s;
* :class:`FeedbackTrainerMixin` -- ``compute_loss`` runs the model's K-pass forward with the step's K, feedback
  mask and λ (a function of ``state.global_step`` and ``state.max_steps`` alone, so a resumed trainer makes the
  same choices), ``create_optimizer`` gives the fusion its own parameter groups at ``fusion_lr_mult`` times the LR
  (norms and biases without weight decay, as the package's optimizer), and ``log`` adds ``num_passes`` and
  ``loss_pass1..K`` to each logged record;
* :class:`FullBandwidthTrainer` (``transformers.Trainer``) and :func:`sft_trainer_class` (TRL's ``SFTTrainer``,
  imported only when asked for).

What the package's own engine does and these do not: the fusion's LR warm-up (the fusion group follows the
trainer's LR schedule times ``fusion_lr_mult``), per-group gradient clipping (the trainer's ``max_grad_norm`` clips
all parameters together), the stability guard, and SFTTrainer's entropy / token-accuracy metrics (its
``compute_loss`` is replaced). Evaluation runs the plain forward (K = 1), as the trainer's loss on held-out data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import Trainer

from ..model.feedback import build_feedback_mask, document_starts, prefix_mixing_mask
from .config import TrainConfig
from .optimizer import param_groups
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
    grad_passes: int = _DEFAULTS.grad_passes  # long recurrences: only the last N passes backpropagate (0: all)
    pass_tol: float = _DEFAULTS.pass_tol  # skip the remaining no-gradient passes once the states stop changing
    loss_chunk: int = _DEFAULTS.loss_chunk  # the LM loss over chunks of N positions (no full logits kept)
    z_loss: float = _DEFAULTS.z_loss  # PaLM's z-loss coefficient (0: off)
    reset_fusion: bool = True  # re-initialise the fusion when feedback switches on (a fusion built, never trained)
    seed: int = 0

    def __post_init__(self):
        self.feedback()  # validates the pass counts and fractions
        if not 0.0 <= self.prefix_mix <= 1.0:
            raise ValueError(f"prefix_mix must be in [0, 1], got {self.prefix_mix}")
        if self.feedback_weight < 0 or self.fusion_lr_mult < 0:
            raise ValueError("feedback_weight and fusion_lr_mult must be >= 0")
        if min(self.grad_passes, self.pass_tol, self.loss_chunk, self.z_loss) < 0:
            raise ValueError("grad_passes, pass_tol, loss_chunk and z_loss must be >= 0 (0: off)")

    def forward_options(self, num_passes: int) -> dict:
        """The K-pass forward's options of a step of ``num_passes`` passes, as ``fullband train`` passes them
        (:meth:`TrainConfig.loss_options` on every step, :meth:`TrainConfig.pass_options` on a fed-back one)."""
        options = TrainConfig.loss_options(self) | (TrainConfig.pass_options(self) if num_passes > 1 else {})
        return {k: v for k, v in options.items() if v is not None}

    @classmethod
    def from_train_config(cls, cfg: TrainConfig, **overrides) -> "PassSchedule":
        """The schedule ``fullband train`` would run with ``cfg``."""
        names = {f.name for f in dataclasses.fields(cls)} - {"reset_fusion"}
        return cls(**{**{n: getattr(cfg, n) for n in names}, **overrides})

    def feedback(self) -> FeedbackSchedule:
        return FeedbackSchedule.from_options(self)  # as `fullband train` builds it from its options

    def passes_at(self, step: int, total_steps: int) -> int:
        return self.feedback().passes_at(min(step, total_steps - 1), total_steps)

    def weight_at(self, step: int, total_steps: int) -> float:
        start = self.feedback().start_step(total_steps)
        return self.feedback_weight * SwitchOn(feedback_ramp=self.feedback_ramp).feedback_weight_factor(
            step, start, total_steps)


class FeedbackTrainerMixin:
    """Put before a ``transformers.Trainer`` subclass: ``class T(FeedbackTrainerMixin, Trainer)``."""

    def __init__(self, *args, pass_schedule: PassSchedule | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.pass_schedule = pass_schedule or PassSchedule()
        self._micro = (-1, 0)  # (step, micro-batches seen in it): seeds prefix mixing per micro-batch
        self._last = None  # (K, pass losses) of the last training micro-batch, for the log

    # ------------------------------------------------------------------ per step

    def current_passes(self) -> int:
        return self.pass_schedule.passes_at(self.state.global_step, max(1, self.state.max_steps))

    def feedback_mask(self, model, inputs: dict, step: int, micro: int) -> torch.Tensor:
        """Where the step's micro-batch takes the fed-back state: no document start, padding or right after
        padding, and prefix mixing drawn from a generator seeded by (seed, step, micro-batch)."""
        ids, attn = inputs["input_ids"], inputs.get("attention_mask")
        doc = model.config.doc_start_token_id
        mask = build_feedback_mask(ids, attn, doc)
        p = self.pass_schedule.prefix_mix
        if p > 0:
            gen = torch.Generator().manual_seed(self.pass_schedule.seed * 1_000_003 + step * 1_009 + micro)
            mask &= ~prefix_mixing_mask(document_starts(ids, doc, attn), p, gen).to(mask.device)
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
        outputs = model(**inputs, num_passes=K, **extra, **self.pass_schedule.forward_options(K))
        self._last = (K, outputs.pass_losses.detach().float().tolist())
        return (outputs.loss, outputs) if return_outputs else outputs.loss

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

    def log(self, logs: dict, *args, **kwargs):
        if "loss" in logs and self._last is not None:
            K, pass_losses = self._last
            logs = {**logs, "num_passes": K, **{f"loss_pass{i + 1}": v for i, v in enumerate(pass_losses)}}
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
