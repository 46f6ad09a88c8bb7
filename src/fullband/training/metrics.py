"""What a training run reports, and the stability guard that reads it.

Owns :class:`MetricsLog` (rank 0's sinks: ``OUT/metrics.jsonl`` one JSON object a line, TensorBoard under
``OUT/tb`` when installed, a tqdm progress bar with the loss per pass, LR and tokens/s; messages go to stderr
above the bar), :func:`finite_or_none` (NaN/inf logged as ``null``), :func:`plot_run` (``OUT/curves.png``) and
:class:`Guard` (a step whose loss or gradient norm is NaN/inf, or whose watched loss -- the mean loss of the passes
that are trained, :func:`fullband.training.engine.trained_loss` -- exceeds ``spike_factor`` × its running average
and the running average by :data:`SPIKE_MIN_NATS`, is skipped -- a second finite spike in a row is trained on instead,
:meth:`Guard.trains_through` --; the engine stops after ``--max-bad-steps`` bad steps in a row).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import ClassVar

from tqdm.auto import tqdm

from ..utils.io import append_jsonl
from ..utils.plotting import plot_loss_curves
from .checkpoint import METRICS


# a spike must also sit this many nats above the running loss: near zero loss the ratio alone reads noise as spikes
# (the state experiment's FBT run, trained to a loss printed as 0.000, had steps skipped as "0.000 > 3 x running 0.000");
# a rise of under 0.1 nats a token is batch-to-batch noise at any loss level this guard watches
SPIKE_MIN_NATS = 0.1


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


class MetricsLog:
    """Rank 0's sinks: metrics.jsonl, TensorBoard, the progress bar (other ranks: no-ops)."""

    def __init__(self, cfg, is_main: bool, start_step: int, name: str):
        self.main = is_main
        self.path = os.path.join(cfg.out, METRICS)
        self.tb = None
        self.bar = None
        if not self.main:
            return
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional: needs tensorboard installed

                self.tb = SummaryWriter(os.path.join(cfg.out, "tb"), purge_step=start_step + 1)
            except Exception:  # noqa: BLE001 - tensorboard not installed or unusable: skip it
                self.tb = None
        if cfg.progress:
            self.bar = tqdm(total=cfg.steps, initial=start_step, desc=name, unit="step", dynamic_ncols=True,
                            file=sys.stderr, smoothing=0.1)

    def record(self, rec: dict) -> None:
        if not self.main:
            return
        append_jsonl(self.path, rec)
        if self.tb is not None:
            step = rec["step"]
            if rec.get("split") == "val":
                for k in ("val_loss", "val_loss_passes"):
                    if rec.get(k) is not None:
                        self.tb.add_scalar(f"val/{k}", rec[k], step)
            elif rec.get("split") == "train" and not rec.get("skipped"):
                self.tb.add_scalar("train/loss", rec["loss"], step)
                for i, v in enumerate(rec["pass_losses"], 1):
                    self.tb.add_scalar(f"train/pass_{i}", v, step)
                self.tb.add_scalar("train/lr", rec["lr"], step)
                self.tb.add_scalar("train/grad_norm", rec["grad_norm"], step)
                self.tb.add_scalar("train/tokens_per_s", rec["tokens_per_s"], step)

    def progress(self, rec: dict, tok_s: float) -> None:
        if self.bar is None:
            return
        post = {"K": rec.get("num_passes")}
        if rec.get("skipped"):
            post["skipped"] = rec["skipped"][:20]
        else:
            for i, v in enumerate(rec["pass_losses"], 1):
                post[f"L{i}"] = f"{v:.3f}"
        post["lr"] = f"{rec['lr']:.2e}"
        post["tok/s"] = f"{tok_s:,.0f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def write(self, msg: str) -> None:
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def plot_run(out: str, default_name: str, title: str | None = None) -> None:
    """``OUT/curves.png`` from ``OUT/metrics.jsonl``; a failure is a warning (not worth failing a finished run)."""
    try:
        kwargs = {"title": title} if title else {}
        plot_loss_curves({os.path.basename(os.path.normpath(out)) or default_name: os.path.join(out, METRICS)},
                         os.path.join(out, "curves.png"), **kwargs)
    except Exception as err:  # noqa: BLE001 - a plot is not worth failing a finished run
        print(f"warning: could not draw curves.png: {err}", file=sys.stderr)


@dataclass
class Guard:
    """Skips NaN/inf and spiking steps (a watched loss above ``spike_factor`` × the running loss and above it by
    :data:`SPIKE_MIN_NATS`); counts them.

    A skipped step leaves the weights as they were, so when ``n`` steps in a row spike, every one a finite loss on a
    batch of its own, the loss is the model's and not the batches': an update the guard had let through moved it (on
    tasks trained to near-zero loss, Adam's occasional large step at tiny second moments does this with a
    small-loss batch and a small gradient norm: nothing to see before the update). Skipping more cannot bring it
    back; training on can. :meth:`level_changed` says so when their mean is below ``peak``, the highest running loss
    since the running loss (re)started (the level the run started from): the engine then re-bases the running loss
    on them (:meth:`rebase`) and trains on, logging an event. A run whose skipped steps are non-finite or sit above
    where it started is stopped as before."""

    SPIKE: ClassVar[str] = "loss spike"
    spike_factor: float = 3.0
    warmup: int = 10
    beta: float = 0.9
    ema: float | None = None
    good_steps: int = 0
    bad_in_row: int = 0
    skipped: int = 0
    peak: float | None = None
    row: list = dataclasses.field(default_factory=list)  # the watched losses of the bad steps in a row (nan: non-finite)
    rebased: int = 0

    def check(self, loss: float, watched: float, grad_norm: float | None) -> str | None:
        """Why the step must be skipped, or ``None``; ``watched``: the loss of the passes the step trains."""
        if not math.isfinite(loss) or not math.isfinite(watched):
            return "non-finite loss"
        if grad_norm is not None and not math.isfinite(grad_norm):
            return "non-finite gradient"
        if (self.spike_factor > 0 and self.ema is not None and self.good_steps >= self.warmup
                and watched > self.spike_factor * self.ema
                and watched - self.ema > SPIKE_MIN_NATS):
            return f"{self.SPIKE} ({watched:.3f} > {self.spike_factor:g} x running {self.ema:.3f})"
        return None

    def trains_through(self, reason: str) -> bool:
        """Whether the step whose skip ``reason`` this is is trained on instead: a finite loss spike when the bad
        steps before it in the row are finite spikes too. A skipped step leaves the weights as they were, so a second
        batch spiking on them says the spike is the weights' (an accepted update put them there), not a batch's:
        skipping cannot undo it, an update can. Measured on the exact-states pure-GLU run of a program-tracking task
        (micro, LR 3e-3, 3 seeds x fusion LR x1 / x10): 4 runs of 6 jumped from 2.3 to 7.0-8.8 nats in one step;
        trained on, each was back at 2.3-2.4 within 1-4 steps, while skipping froze the weights there and stopped
        the run after ``--max-bad-steps`` (the report this answers). The step still counts as bad: a run whose
        spikes go on for ``--max-bad-steps`` in a row is stopped (or re-based, :meth:`level_changed`) as before."""
        return (reason.startswith(self.SPIKE) and bool(self.row) and len(self.row) == self.bad_in_row
                and all(math.isfinite(x) for x in self.row))

    def good(self, watched: float) -> None:
        self.ema = watched if self.ema is None else self.beta * self.ema + (1 - self.beta) * watched
        self.peak = self.ema if self.peak is None else max(self.peak, self.ema)
        self.good_steps += 1
        self.bad_in_row = 0
        self.row = []

    def bad(self, watched: float = float("nan"), finite_gradient: bool = True) -> None:
        """A skipped step; ``watched``: its loss, ``finite_gradient``: False when its gradient was not finite."""
        self.bad_in_row += 1
        self.skipped += 1
        self.row.append(watched if finite_gradient and math.isfinite(watched) else float("nan"))

    def level_changed(self) -> bool:
        """Whether the bad steps in a row are finite spikes whose mean sits below ``peak``: the model's loss moved
        (see the class), not a run of bad batches or a divergence."""
        return (bool(self.row) and len(self.row) == self.bad_in_row and all(math.isfinite(x) for x in self.row)
                and self.peak is not None and sum(self.row) / len(self.row) < self.peak)

    def rebase(self) -> float:
        """Take the bad steps' mean loss as the running loss (spikes still checked against it); returns it."""
        level = sum(self.row) / len(self.row)
        self.ema, self.bad_in_row, self.row = level, 0, []
        self.rebased += 1
        return level

    def restart(self) -> None:
        """Forget the running loss (it re-warms over ``warmup`` good steps, non-finite steps still skipped): at the
        feedback switch-on the watched loss changes regime by design -- a pure GLU entry replaces the token's input
        by a fusion just built, so its first fed-back steps sit far above the plain phase's loss without anything
        having gone wrong, and judged against the plain phase they would read as spikes and stop the run."""
        self.ema = None
        self.peak = None
        self.good_steps = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def restored(cls, spike_factor: float, saved: dict) -> Guard:
        """The guard of a resumed run: the saved counters, this run's ``spike_factor``."""
        return cls(spike_factor=spike_factor, **{k: v for k, v in saved.items() if k != "spike_factor"})
