"""Step-indexed schedules: the learning rate, the number of passes K, and how feedback switches on.

Owns :func:`lr_at` (warmup, then cosine, WSD or constant), :class:`FeedbackSchedule` (K for a step: plain before a
start fraction, then ``num_passes`` -- reached through a curriculum in K when asked -- with a deterministic
``deep_fraction`` of the steps at ``deep_passes``; or K drawn per step from a pass mix, :func:`parse_pass_mix`) and
:class:`SwitchOn` (λ ramp, fusion LR warm-up, fusion-only phase). Each is a function of the step index and the
config alone, so a resumed run makes exactly the same choices.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

from ..utils.errors import UsageError


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
      unaffected;
    * a pass mix ``((K, p), ...)`` (the paper's per-batch mix, e.g. 75% K=1 / 22% K=2 / 3% K=3): every step from
      the start draws its K from the mix, independently, with a uniform ``u`` in [0, 1) that is a function of
      ``(seed, step)`` alone (:func:`step_uniform`), so a resumed run, every rank and a dry-run plan make the same
      draws; K is the first entry (in ascending K) whose cumulative probability exceeds ``u``. A mix replaces the
      deep steps and the curriculum (both must be off) and its largest K must be ``num_passes`` (the K the
      periodic evaluation and the memory plan use).
    """

    start_fraction: float = 0.75
    num_passes: int = 2
    deep_passes: int = 4
    deep_fraction: float = 0.1
    curriculum: float = 0.0
    pass_mix: tuple = ()  # ((K, probability), ...) in ascending K; () = off
    seed: int = 0  # of the pass-mix draws

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
        if self.pass_mix:
            mix = tuple((int(k), float(p)) for k, p in self.pass_mix)
            check_pass_mix(mix)
            object.__setattr__(self, "pass_mix", tuple(sorted(mix)))
            top = max(k for k, _ in mix)
            if self.num_passes != top:
                raise ValueError(f"--num-passes must be the largest K of --pass-mix ({top}), got {self.num_passes}")
            if self.deep_fraction > 0:
                raise ValueError("--pass-mix chooses K on every feedback step: give --deep-fraction 0 with it "
                                 f"(got {self.deep_fraction})")
            if self.curriculum > 0:
                raise ValueError(f"--pass-mix and --pass-curriculum {self.curriculum} both choose K: use one")

    @classmethod
    def from_options(cls, opts) -> "FeedbackSchedule":
        """The schedule of a run's options (``fullband train``'s :class:`~fullband.training.config.TrainConfig`,
        the HF trainers' ``PassSchedule``): ``--num-passes 1`` is a plain baseline, no deep steps and no pass mix."""
        plain, mix = opts.num_passes <= 1, parse_pass_mix(opts.pass_mix)  # a bad mix is refused either way
        return cls(start_fraction=opts.feedback_start, num_passes=opts.num_passes, deep_passes=opts.deep_passes,
                   deep_fraction=0.0 if plain else opts.deep_fraction, curriculum=opts.pass_curriculum,
                   pass_mix=() if plain else mix, seed=opts.seed)

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
        if self.pass_mix:
            u, total = step_uniform(self.seed, step), 0.0
            for k, p in self.pass_mix:
                total += p
                if u < total:
                    return k
            return self.pass_mix[-1][0]  # the probabilities sum to 1 within 1e-6: u in the rounding gap
        if self.deep_fraction > 0 and math.floor((i + 1) * self.deep_fraction) > math.floor(i * self.deep_fraction):
            return self.deep_passes
        if self.curriculum > 0 and self.num_passes > 2:
            span = max(1, round(self.curriculum * (total_steps - start)))
            if i < span:
                return min(self.num_passes, 2 + (i * (self.num_passes - 1)) // span)
        return self.num_passes

    __call__ = passes_at

    def histogram(self, total_steps: int) -> dict[int, int]:
        """How many of the ``total_steps`` steps use each K (ascending K)."""
        counts: dict[int, int] = {}
        for s in range(total_steps):
            k = self.passes_at(s, total_steps)
            counts[k] = counts.get(k, 0) + 1
        return dict(sorted(counts.items()))

    def describe(self) -> str:
        """K once feedback is on, in words (the run log's first line)."""
        if self.pass_mix:
            return "K drawn per step from " + ", ".join(f"K={k} {p:.0%}" for k, p in self.pass_mix)
        return f"K={self.num_passes}"

    def to_dict(self) -> dict:
        return asdict(self)


def step_uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) that depends on ``(seed, step)`` alone: the first 53 bits of a BLAKE2b digest of
    both (a counter-based draw: any step's value without drawing the steps before it; the same on every platform,
    process and Python version)."""
    digest = hashlib.blake2b(f"fullband pass mix {int(seed)} {int(step)}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) * 2.0 ** -53


def check_pass_mix(mix) -> None:
    """``ValueError`` unless ``mix`` is ``((K, p), ...)`` with distinct integer K >= 1, p in (0, 1], the p summing to
    1 within 1e-6 and a K >= 2 among them (the message names the bad entry)."""
    seen = set()
    for k, p in mix:
        if k < 1 or k in seen:
            raise ValueError(f"--pass-mix: bad entry {k}:{p}: each K must be an integer >= 1, given once")
        if not 0.0 < p <= 1.0:
            raise ValueError(f"--pass-mix: bad entry {k}:{p}: the probability must be in (0, 1] (leave out a K "
                             "that is never used)")
        seen.add(k)
    total = math.fsum(p for _, p in mix)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"--pass-mix: the probabilities sum to {total:.9g}, not 1 (within 1e-6)")
    if max(seen) < 2:
        raise ValueError("--pass-mix must give some probability to a K >= 2 (K=1 alone is a plain run: --num-passes 1)")


def parse_pass_mix(text: str | None) -> tuple:
    """``"1:0.75,2:0.22,3:0.03"`` -> ``((1, 0.75), (2, 0.22), (3, 0.03))`` (ascending K); ``None`` / ``""`` -> ``()``.
    A :class:`~fullband.utils.errors.UsageError` naming the bad entry for anything that is not ``K:P`` pairs."""
    if text is None or not str(text).strip():
        return ()
    mix = []
    for entry in str(text).split(","):
        k, sep, p = entry.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            pair = (int(k), float(p))
            if not math.isfinite(pair[1]):
                raise ValueError
        except ValueError:
            raise UsageError(f"--pass-mix: bad entry {entry.strip()!r}: give K:PROBABILITY pairs separated by commas, "
                             "e.g. 1:0.75,2:0.22,3:0.03") from None
        mix.append(pair)
    try:
        check_pass_mix(mix)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return tuple(sorted(mix))


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
