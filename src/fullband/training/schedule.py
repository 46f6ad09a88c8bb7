"""Step-indexed schedules: the learning rate, the number of passes K, and how feedback switches on.

Owns :func:`lr_at` (warmup, then cosine, WSD or constant), :class:`FeedbackSchedule` (K for a step: plain before a
start fraction, then ``num_passes`` -- reached through a curriculum in K when asked -- with a deterministic
``deep_fraction`` of the steps at ``deep_passes``) and
:class:`SwitchOn` (λ ramp, fusion LR warm-up, fusion-only phase). Each is a function of the step index and the
config alone, so a resumed run makes exactly the same choices.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def lr_at(step: int, cfg) -> float:
    """Learning rate of 0-based ``step``."""
    peak, floor, n = cfg.resolved_lr(), cfg.resolved_lr() * cfg.min_lr_ratio, cfg.steps
    warm = max(1, round(cfg.warmup_fraction * n)) if cfg.warmup_fraction > 0 else 0
    if step < warm:
        return peak * (step + 1) / warm
    if cfg.lr_schedule == "constant":
        return peak
    if cfg.lr_schedule == "cosine":
        progress = (step - warm) / max(1, n - warm - 1)
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    decay_start = max(warm, n - round(cfg.decay_fraction * n))
    if step < decay_start:
        return peak
    progress = (step - decay_start + 1) / max(1, n - decay_start)
    return peak + (floor - peak) * min(1.0, progress)


@dataclass(frozen=True)
class FeedbackSchedule:
    """Which number of passes K a training step uses.

    * steps before ``ceil(start_fraction · total_steps)`` use K = 1 (ordinary pre-training);
    * from then on K = ``num_passes``, except that a ``deep_fraction`` of those steps use ``deep_passes``.
      The deep steps are spread evenly and chosen from the step index alone (step i after the start is deep
      when ``floor((i+1)·f) > floor(i·f)``), so a resumed run makes exactly the same choices;
    * a curriculum in K (long recurrences: ``num_passes`` up to the row length): over the first ``curriculum``
      fraction of the feedback phase (``span = max(1, round(curriculum · (total - start)))`` steps) K climbs
      linearly from 2 to ``num_passes``, ``K_i = min(num_passes, 2 + floor(i · (num_passes - 1) / span))`` for
      step i after the start, each value held for about ``span / (num_passes - 1)`` steps; the deep steps are
      unaffected.
    """

    start_fraction: float = 0.75
    num_passes: int = 2
    deep_passes: int = 4
    deep_fraction: float = 0.1
    curriculum: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.start_fraction <= 1.0:
            raise ValueError(f"start_fraction must be in [0, 1], got {self.start_fraction}")
        if not isinstance(self.num_passes, int) or self.num_passes < 1:
            raise ValueError(f"num_passes must be an integer >= 1, got {self.num_passes!r}")
        if not isinstance(self.deep_passes, int) or self.deep_passes < 1:
            raise ValueError(f"deep_passes must be an integer >= 1, got {self.deep_passes!r}")
        if not 0.0 <= self.deep_fraction <= 1.0:
            raise ValueError(f"deep_fraction must be in [0, 1], got {self.deep_fraction}")
        if not 0.0 <= self.curriculum <= 1.0:
            raise ValueError(f"curriculum must be in [0, 1], got {self.curriculum}")

    def start_step(self, total_steps: int) -> int:
        return math.ceil(self.start_fraction * total_steps)

    def passes_at(self, step: int, total_steps: int) -> int:
        """K for 0-based ``step`` of a run of ``total_steps`` steps."""
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if not 0 <= step < total_steps:
            raise ValueError(f"step must be in [0, {total_steps}), got {step}")
        start = self.start_step(total_steps)
        if step < start:
            return 1
        i = step - start
        if self.deep_fraction > 0 and math.floor((i + 1) * self.deep_fraction) > math.floor(i * self.deep_fraction):
            return self.deep_passes
        if self.curriculum > 0 and self.num_passes > 2:
            span = max(1, round(self.curriculum * (total_steps - start)))
            if i < span:
                return min(self.num_passes, 2 + (i * (self.num_passes - 1)) // span)
        return self.num_passes

    __call__ = passes_at

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SwitchOn:
    """How feedback switches on: fractions of the feedback phase (the steps from the feedback start to the end).

    * ``feedback_ramp``: λ ramps linearly from 0 to its value over this fraction (the pass-2..K losses enter
      gradually instead of at full weight on a random fusion);
    * ``fusion_warmup``: the fusion's learning rate warms up linearly from 0 over this fraction;
    * ``fusion_only``: during this first fraction only the fusion trains; the backbone gets no update.

    All three are functions of the step index alone, so a resumed run makes the same choices.
    """

    feedback_ramp: float = 0.0
    fusion_warmup: float = 0.0
    fusion_only: float = 0.0

    @staticmethod
    def _progress(step: int, start: int, total_steps: int, fraction: float) -> float:
        if fraction <= 0 or step < start:
            return 1.0 if step >= start else 0.0
        span = max(1, round(fraction * (total_steps - start)))
        return min(1.0, (step - start + 1) / span)

    def feedback_weight_factor(self, step: int, start: int, total_steps: int) -> float:
        return self._progress(step, start, total_steps, self.feedback_ramp)

    def fusion_lr_factor(self, step: int, start: int, total_steps: int) -> float:
        return self._progress(step, start, total_steps, self.fusion_warmup)

    def backbone_frozen(self, step: int, start: int, total_steps: int) -> bool:
        if self.fusion_only <= 0 or step < start:
            return False
        return step - start < round(self.fusion_only * (total_steps - start))


def schedule_state(cfg, step: int) -> dict:
    """Where the (stateless, step-indexed) LR and feedback schedules stand after ``step`` steps: for people and
    tools reading a checkpoint; a resumed run recomputes them from the step and the config."""
    sched = cfg.schedule()
    nxt = min(step, cfg.steps - 1)
    return {"next_step": step, "total_steps": cfg.steps, "next_lr": lr_at(nxt, cfg),
            "next_num_passes": sched.passes_at(nxt, cfg.steps), "feedback_start_step": sched.start_step(cfg.steps),
            "lr_schedule": cfg.lr_schedule, "feedback": sched.to_dict()}
