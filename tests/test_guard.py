"""The stability guard watches the passes that are trained: with ``--grad-passes N < K`` pass 1 has no gradient, so a
spike in the passes that are stepped on must be skipped even when pass 1 is unchanged (the guard read pass 1 alone)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from fullband.training.checkpoint import find_checkpoint, load_trainer_state
from fullband.training.config import TrainConfig
from fullband.training.engine import run as run_recipe
from fullband.training.engine import trained_loss
from fullband.training.metrics import Guard
from fullband.training.pretrain import PretrainRecipe
from fullband.utils.io import read_jsonl

CORRUPT_AT = 30  # 0-based step before which the fusion is blown up (the loss has flattened by then)


class CorruptFusion(PretrainRecipe):
    """The ordinary pre-training recipe, except that the residual fusion's output gain is set to 100 just before step
    ``CORRUPT_AT`` (the fed-back term then swamps the token: a real spike in every fed-back pass; pass 1 takes no
    state and does not see it). The spike is ≈ 1.9x the running loss (the pre-norm backbone bounds what a blown-up
    input can do), so the test sets ``--spike-factor 1.3`` (and no prefix mixing: every position fed back)."""

    def setup(self, tokenizer):
        self.model, tok = super().setup(tokenizer)
        return self.model, tok

    def batch(self, step, num_passes, generator, env):
        if step == CORRUPT_AT:
            with torch.no_grad():
                self.model.feedback.out_norm.weight.fill_(100.0)
        return super().batch(step, num_passes, generator, env)


def run(data, out, **kw):
    cfg = TrainConfig(out=str(out), preset="micro", steps=34, seed=0, data=data, vocab_size=300, seq_len=32,
                      batch_size=4, progress=False, tensorboard=False, plot=False, jitter=0.0, num_passes=3,
                      deep_fraction=0.0, prefix_mix=0.0, max_bad_steps=2, spike_factor=1.3,
                      **({"feedback_start": 0.0} | kw))
    summary = run_recipe(CorruptFusion(cfg))
    rows = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("split") == "train"]
    return summary, rows


def test_a_spike_in_the_trained_passes_is_skipped_when_pass_1_has_no_gradient(data, tmp_path):
    summary, rows = run(data, tmp_path / "g", grad_passes=2)
    before, hit = rows[CORRUPT_AT - 1], rows[CORRUPT_AT]
    # the trained passes 2..3 jump (≈ 1.9x); pass 1 takes no state and has no gradient here
    assert trained_loss(hit["pass_losses"], 3, 2) > 1.5 * trained_loss(before["pass_losses"], 3, 2)
    assert hit.get("skipped", "").startswith("loss spike"), hit
    assert all("skipped" not in r for r in rows[:CORRUPT_AT])
    # the corrupted fusion stays (skipped steps do not update it), so the next step spikes too: a second batch
    # spiking on the same weights, so that step is trained on (Guard.trains_through), still counted bad; after
    # --max-bad-steps 2 finite spikes below the level the run started from the guard re-bases its running loss on
    # them (the model's loss moved: skipping cannot undo it) and the run trains on, and the fusion back down
    assert "skipped" not in rows[CORRUPT_AT + 1]
    assert rows[CORRUPT_AT + 1].get("trained_through", "").startswith("loss spike")
    events = [r for r in read_jsonl(os.path.join(tmp_path / "g", "metrics.jsonl")) if r.get("split") == "event"]
    assert [(e["step"], e["event"]) for e in events] == [(CORRUPT_AT + 2, "guard_rebased")], events
    assert summary["status"] == "done" and len(rows) == 34 and "skipped" not in rows[CORRUPT_AT + 2]
    # before the weights left the last good step's (the trained-on spike), that step was saved
    ckpt = find_checkpoint(str(tmp_path / "g"))
    assert ckpt.endswith(f"step-{CORRUPT_AT:07d}")
    assert load_trainer_state(ckpt)["guard_stop"]["step"] == CORRUPT_AT + 2
    assert trained_loss(rows[-1]["pass_losses"], 3, 2) < trained_loss(hit["pass_losses"], 3, 2)


def guard_after(losses, **kw):
    """A Guard fed ``losses`` (``None``: a non-finite gradient) as the engine feeds it: checked, then good or bad."""
    g = Guard(**kw)
    for x in losses:
        reason = "non-finite gradient" if x is None else g.check(x, x, 1.0)
        g.good(x) if reason is None else g.bad(x if x is not None else float("nan"), x is not None)
    return g


def test_the_guard_rebases_only_finite_spikes_below_where_the_run_started():
    """Start 2.0, trained down to ~0.05, then the model's loss jumps to ~0.9 on every batch (the state experiment's
    x2 arm at 900 steps: a large Adam step after a small-loss batch): skipping cannot undo it, the guard says the
    level changed. The same jump to above the start (a divergence), a row with a non-finite loss in it, or fewer
    bad steps than the row's length do not."""
    down = [2.0 * 0.6 ** i for i in range(8)] + [0.05] * 30
    g = guard_after(down + [0.9, 0.95, 0.85], warmup=10)
    assert g.bad_in_row == 3 and g.level_changed() and g.peak == pytest.approx(2.0)
    assert g.rebase() == pytest.approx(0.9) and g.ema == pytest.approx(0.9) and g.bad_in_row == 0
    assert g.check(1.0, 1.0, 1.0) is None and g.check(2.8, 2.8, 1.0) is not None  # spikes judged against 0.9 now
    assert not guard_after(down + [2.5, 2.6, 2.4], warmup=10).level_changed()  # above the start: a divergence
    assert not guard_after(down + [0.9, float("nan"), 0.9], warmup=10).level_changed()
    assert not guard_after(down + [0.9, None, 0.9], warmup=10).level_changed()  # a non-finite gradient in the row
    g = guard_after(down + [0.9, 0.9], warmup=10)
    g.restart()  # the switch-on forgets the level the run started from too: nothing to compare with yet
    assert not g.level_changed()


def test_the_watched_loss_is_the_mean_of_the_trained_passes():
    assert trained_loss([5.0], 1, 0) == 5.0
    assert trained_loss([5.0, 7.0, 9.0], 3, 0) == pytest.approx(7.0)  # every pass trained
    assert trained_loss([5.0, 7.0, 9.0], 3, 2) == pytest.approx(8.0)  # passes 2..3 trained
    assert trained_loss([5.0, 7.0, 9.0], 3, 1) == 9.0
    assert trained_loss([5.0, 7.0], 2, 4) == pytest.approx(6.0)  # N >= K: all
    assert math.isnan(trained_loss([5.0, float("nan")], 2, 1))


def test_the_running_loss_restarts_at_the_switch_on(data, tmp_path):
    """Feedback switched on at step ``CORRUPT_AT`` (``--feedback-start``) with the fused input blown up there (what
    a pure GLU entry does by design: its first fed-back steps sit far above the plain phase's loss). Judged against
    the plain phase, that step would be a spike and the run would stop after 2 (the depth experiment's ``fbt-L-glu``
    did, at the default size); the guard's running loss restarts at the switch-on instead, so the run finishes with
    no step skipped. The same jump mid-feedback is still a spike (the test above)."""
    summary, rows = run(data, tmp_path / "s", feedback_start=CORRUPT_AT / 34)
    assert [r["num_passes"] for r in rows[CORRUPT_AT - 1:CORRUPT_AT + 1]] == [1, 3]  # the switch-on is that step
    before, hit = rows[CORRUPT_AT - 1], rows[CORRUPT_AT]
    assert trained_loss(hit["pass_losses"], 3) > 1.3 * before["pass_losses"][0]  # a jump the old guard skipped
    assert summary["status"] == "done" and not any("skipped" in r for r in rows) and len(rows) == 34
