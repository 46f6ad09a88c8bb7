"""The training engine that pre-training and SFT share: one loop, a recipe plugged in.

A :class:`Recipe` supplies what differs between runs: the model and tokenizer (``setup``), the micro-batches of
step ``(step, K)`` (``batch``), the periodic evaluation (``evaluate``) and what is written at the end (``finish``).
:class:`Trainer` does the rest, in small steps:

* ``prepare``: validate the config, check the output directory, read a checkpoint to resume from (every file
  loaded safely and checked before anything is written), build the model through the recipe, write the tokenizer
  and run config, prepare the decoder layers (``--activation-checkpointing``, ``--compile``:
  :func:`prepare_layers`), wrap the model (DDP / FSDP2 under torchrun), build the optimizer, seed every RNG,
  restore the checkpoint's model, optimizer, RNG, guard and token count;
* ``train_step``: K from the feedback schedule, the LR schedule with the fusion's LR warm-up, the λ ramp and the
  fusion-only phase (:class:`fullband.training.schedule.SwitchOn`), forward + backward over the micro-batches
  (gradient accumulation, no all-reduce before the last), the guard, gradient clipping (global or per group),
  the optimizer step, the metrics record;
* ``after_step``: periodic evaluation, atomic checkpoints (only of good states), the stop on too many bad steps
  (the last good step saved then: :meth:`Trainer.snapshot` keeps what a skipped step advances -- RNG streams,
  guard, token count -- as it was after each good step; a skipped step leaves the model and optimizer as they were);
* ``finish``: the final model through the recipe, ``curves.png``, ``summary.json``.

The loop is deterministic given the config and the step: a run killed and resumed from a checkpoint logs the same
per-step losses as an uninterrupted one (bitwise on CPU in fp32 with the same number of processes).
"""

from __future__ import annotations

import gc
import math
import os
import random
import signal
import time
from dataclasses import dataclass, field

import torch
from transformers.utils import logging as hf_logging

from ..data.corpus import load_tokenizer
from ..model.modeling import load_model
from ..utils.io import atomic_save_pretrained, atomic_write_json, read_jsonl, rewrite_jsonl
from . import distributed as D
from .checkpoint import (
    METRICS,
    RUN_CONFIG,
    SUMMARY,
    TOKENIZER_DIR,
    clear_outputs,
    fallback_seed,
    load_checkpoint,
    prepare_out,
    restore_model,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .config import check_resume
from .device import autocast_context
from .metrics import Guard, MetricsLog, finite_or_none, plot_run
from .optimizer import build_optimizer, clip_gradients, param_groups, set_learning_rates
from .presets import check_tying, embeddings_tied
from .schedule import lr_at, schedule_state
from .sharded import save_pretrained_sharded

EXIT_STOPPED = 3


@dataclass
class StepBatch:
    """What a recipe hands the engine for one optimizer step on this process."""

    micro: list[dict]          # model keyword arguments of each micro-batch (on the device)
    loss_weight: float = 1.0   # each micro-batch's loss is multiplied by this before backward
    tokens: int = 0            # tokens of the whole (global) step
    record: dict = field(default_factory=dict)  # extra fields of the step's metrics record


class Recipe:
    """What a kind of run supplies; :class:`Trainer` calls these (``cfg`` is set by the subclass)."""

    name = "train"
    val_label = "val loss"
    plot_name = "run"  # the curve's label when OUT has no basename
    plot_title = None
    fresh_fusion = False  # re-initialise the fusion when feedback switches on (it was built, not trained)

    def setup(self, tokenizer):
        """``(model, tokenizer)``: build data and model (fp32, seeded). ``tokenizer``: the run's own on resume."""
        raise NotImplementedError

    def build_model(self):
        """A fresh model of the same shape."""
        raise NotImplementedError

    def final_model(self, model):
        """The module saved (``save_pretrained``) into OUT at the end: ``model`` itself, or a part of it."""
        return model

    finish_needs_model = True  # False: finish() saves no more than the tokenizer (under FSDP it then gets None)

    def run_config(self) -> dict:
        return self.cfg.to_dict()

    def describe(self, model) -> str:
        """The start of the run's first log line: the model and data, up to ``{steps} steps x {batch}, ``."""
        return f"{self.name}: {self.cfg.steps} steps, "

    def batch(self, step: int, num_passes: int, generator: torch.Generator, env: D.DistEnv) -> StepBatch:
        raise NotImplementedError

    def evaluate(self, model, step: int, feedback_start: int, env: D.DistEnv) -> dict | None:
        """Validation fields (``val_loss``, ...) after ``step`` steps, or ``None``."""
        return None

    def finish(self, model, summary: dict) -> None:
        """Rank 0, after the last step, once :meth:`final_model` is saved: the tokenizer; final evaluations into
        ``summary``. ``model``: the trained model (under FSDP, the saved one loaded back, or ``None``)."""

    def summarize(self, summary: dict) -> None:
        """Add the recipe's fields to the run's summary (every status)."""


def prepare_layers(model, compile: bool = False, checkpointing: bool = False) -> None:
    """``--activation-checkpointing`` and ``--compile`` on the backbone's decoder layers, in place (parameter
    names unchanged), before DDP / FSDP2 wrapping.

    Checkpointing is Hugging Face's own (``activation_checkpointing_enable``, non-reentrant
    ``torch.utils.checkpoint``): each decoder layer's forward is recomputed in the backward, with FSDP2's hooks
    outside the checkpoint, and only in passes that keep a graph (no-gradient passes run the layer as it is).
    Compilation is ``nn.Module.compile`` of each layer's sub-modules (attention, MLP, norms), not of the layer:
    a compiled layer would trace the checkpoint as a higher-order op, which cannot take the graph break of HF's
    output-capturing hooks inside it and silently runs eager; the children compile with or without
    checkpointing, and the K-pass loop with its data-dependent ``--pass-tol`` branch stays eager."""
    backbone = getattr(model, "backbone", model)
    if checkpointing:
        if not getattr(backbone, "supports_gradient_checkpointing", False):
            raise ValueError(f"--activation-checkpointing: {type(backbone).__name__} does not support activation "
                             "checkpointing; train without it")
        backbone.activation_checkpointing_enable({"use_reentrant": False})
    if compile:
        layers = D.decoder_layers(model)
        if not layers:
            raise ValueError(f"--compile: no decoder layers found in {type(backbone).__name__}; train without it")
        for layer in layers:
            for child in layer.children():
                child.compile()


def forward_backward(model, micro_batches: list[dict], num_passes: int, autocast, loss_weight: float = 1.0,
                     nan: bool = False, feedback_weight: float | None = None, passes_run: list | None = None,
                     z_losses: list | None = None, **pass_options):
    """Forward + backward over micro-batches (each a dict of model arguments); each loss is multiplied by
    ``loss_weight`` before backward. Returns the summed ``(loss, pass_losses)`` tensors, unweighted.
    ``feedback_weight`` overrides the model's λ for these calls; ``pass_options`` (``grad_passes``, ``pass_tol``)
    go to the K-pass forward, and the passes each micro-batch ran are appended to ``passes_run`` when given;
    so are ``loss_chunk`` and ``z_loss``, each micro-batch's z-loss term appended to ``z_losses`` when given;
    ``nan`` poisons the loss (a test hook)."""
    n = len(micro_batches)
    loss_sum, pass_sum = None, None
    pass_options = {k: v for k, v in pass_options.items() if v is not None}
    for i, kwargs in enumerate(micro_batches):
        with D.no_sync(model, skip=i < n - 1), autocast():
            out = model(**kwargs, num_passes=num_passes, feedback_weight=feedback_weight, **pass_options)
            if passes_run is not None:
                passes_run.append((out.passes_run or num_passes, out.grad_passes_run or num_passes))
            if z_losses is not None and out.z_loss is not None:
                z_losses.append(out.z_loss.float())
            loss = out.loss
            if nan:
                loss = loss * float("nan")
        (loss * loss_weight).backward()
        ls, ps = loss.detach().float(), out.pass_losses.float()
        if nan:
            ps = ps * float("nan")
        loss_sum = ls if loss_sum is None else loss_sum + ls
        pass_sum = ps if pass_sum is None else pass_sum + ps
    return loss_sum, pass_sum


def trained_loss(pass_losses: list[float], num_passes: int, grad_passes: int = 0) -> float:
    """What the stability guard watches on a step of ``num_passes`` passes: the mean loss of the passes that are
    trained (have a gradient), i.e. the last ``grad_passes`` of them (``0``: all K). Pass 1 alone would be blind
    to the passes actually trained when ``--grad-passes N < K`` gives pass 1 no gradient (a spike in passes
    K-N+1..K would then be stepped on), and the combined loss ``L_1 + λ·mean(L_2..L_K)`` is not comparable between
    steps of different K; the mean of the trained passes is an LM loss on every step, whatever K."""
    n = num_passes if num_passes <= 1 or not grad_passes else min(grad_passes, num_passes)
    trained = pass_losses[len(pass_losses) - n:]
    return math.fsum(trained) / len(trained)


def run(recipe: Recipe, resume: bool = False, overwrite: bool = False) -> dict:
    """Run (or continue) ``recipe``'s training; returns the summary (``status`` = done / stopped / paused)."""
    hf_logging.disable_progress_bar()
    env = D.init_distributed(recipe.cfg.device)
    trainer = Trainer(recipe, env)
    trainer.prepare(resume, overwrite)
    summary = trainer.fit()
    # only a run every rank finished tears the group down together (D.shutdown: a barrier, then destroy): after an
    # error another rank may be inside a collective, and a collective teardown would wait on it; the process's exit
    # ends its part of the group then (torchtitan does the same). The trainer (its DDP / FSDP model) goes first, so
    # the group's last reference is not dropped by the model's destructor (see D.shutdown)
    del trainer
    gc.collect()
    D.shutdown(env)
    return summary


class Trainer:
    """One run of a recipe on this process (see the module docstring for the steps)."""

    def __init__(self, recipe: Recipe, env: D.DistEnv):
        self.recipe, self.cfg, self.env = recipe, recipe.cfg, env
        self.start = 0
        self.tokens = 0
        self.elapsed_before = 0.0
        self.t_start = time.perf_counter()
        self.last_ckpt = None
        self.good_state = None  # what the last good step left (:meth:`snapshot`): saved when the guard stops the run
        self.stopped = None  # {"step", "last_good", "reason"} of a run the guard stopped
        self.through = False  # whether the last step was a spike trained on (Guard.trains_through)

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t_start

    # ------------------------------------------------------------------------------------------- prepare

    def prepare(self, resume: bool, overwrite: bool) -> None:
        cfg, env = self.cfg, self.env
        cfg.validate(env.world_size)
        ckpt = prepare_out(cfg.out, resume, overwrite)
        restored = load_checkpoint(ckpt, env.rank) if ckpt is not None else None
        if restored is not None:
            check_resume(cfg, restored["state"], env.world_size, env.is_main)

        # ---- data, tokenizer and model (nothing written yet: bad input fails here)
        tok_dir = os.path.join(cfg.out, TOKENIZER_DIR)
        resumed_tok = load_tokenizer(tok_dir) if (ckpt is not None and os.path.isdir(tok_dir)) else None
        model, self.tokenizer = self.recipe.setup(resumed_tok)
        if cfg.init_from is not None:  # a preset's backbone is built with the tying asked for
            check_tying(getattr(cfg, "tie_embeddings", None), embeddings_tied(model), f"--init-from {cfg.init_from!r}")

        # ---- the output directory: from here on things are written
        if env.is_main:
            if overwrite and ckpt is None:
                clear_outputs(cfg.out)
            os.makedirs(cfg.out, exist_ok=True)
            if not os.path.isdir(tok_dir):
                atomic_save_pretrained(self.tokenizer, tok_dir)
            atomic_write_json(os.path.join(cfg.out, RUN_CONFIG), self.recipe.run_config())
        D.barrier(env)

        model.to(env.device).train()
        prepare_layers(model, cfg.compile, cfg.activation_checkpointing)
        if hasattr(model, "token_step"):
            model.token_step = cfg.token_step
        self.model = model = D.wrap_model(model, env, cfg.parallel) if env.distributed else model
        self.optimizer = build_optimizer(D.unwrap(model), cfg, env.device, D.is_sharded(D.unwrap(model)))
        self.prefix_gen = torch.Generator().manual_seed(cfg.seed * 7919 + 17)
        # every rank its own jitter stream; the model init used the shared seed
        torch.manual_seed(cfg.seed * 1_000_003 + 1 + env.rank)
        random.seed(cfg.seed + env.rank)
        self.guard = Guard(spike_factor=cfg.spike_factor)
        if restored is not None:
            self.restore(restored)
            self.last_ckpt = ckpt
            self.good_state = self.snapshot(self.start)  # a resumed run's start is a good state
        D.barrier(env)

    def restore(self, restored: dict) -> None:
        cfg, env, model = self.cfg, self.env, self.model
        restore_model(restored, model, self.optimizer, env)  # full or sharded, onto this run's parallelism
        # the saved groups carry the old run's options (lr_mult among them); options allowed to change win
        for group, fresh in zip(self.optimizer.param_groups, param_groups(D.unwrap(model), cfg)):
            group["lr_mult"] = fresh["lr_mult"]
        state = restored["state"]
        set_rng_state(restored["rng"], self.prefix_gen, fallback_seed(cfg.seed, env.rank, state["step"]))
        self.guard = Guard.restored(cfg.spike_factor, state["guard"])
        self.start = state["step"]
        self.elapsed_before = state.get("elapsed", 0.0)
        self.tokens = state.get("tokens", 0)
        if state.get("embed_rms") is not None:
            D.unwrap(model).config.embed_rms = state["embed_rms"]
        if env.is_main:  # forget what a killed run logged after its checkpoint
            path = os.path.join(cfg.out, METRICS)
            rewrite_jsonl(path, [r for r in read_jsonl(path) if r.get("step", 0) <= self.start])

    # ------------------------------------------------------------------------------------------- loop

    def fit(self) -> dict:
        cfg, env, model = self.cfg, self.env, self.model
        self.sched = cfg.schedule()
        self.fb_start = self.sched.start_step(cfg.steps)
        self.switch_on = cfg.switch_on()
        self.autocast, precision = autocast_context(cfg.precision, env.device)
        self.fusion_params = [p for n, p in D.unwrap(model).named_parameters() if n.startswith("feedback.")]
        fusion_ids = {id(p) for p in self.fusion_params}
        self.backbone_params = [p for p in model.parameters() if p.requires_grad and id(p) not in fusion_ids]
        self.all_params = [p for p in model.parameters() if p.requires_grad]
        self.eval_every = cfg.eval_every or max(1, cfg.steps // 10)
        self.log = MetricsLog(cfg, env.is_main, self.start, self.recipe.name)
        if env.is_main and self.start == 0:
            loss = (f"loss L_1 + λ·mean(L_2..L_K), λ {cfg.feedback_weight:g} ramped over {cfg.feedback_ramp:g} of the "
                    "feedback phase" if cfg.weighs_passes() else "loss the mean of the gradient passes from the exact "
                    "states, no λ" if cfg.exact_states else "loss the recurrence's, no λ")
            feedback = (f"feedback from step {self.fb_start + 1} ({self.sched.describe()}; {loss}), "
                        if cfg.feedback_ever else "no feedback (K=1), ")
            self.log.write(self.recipe.describe(D.unwrap(model)) + feedback
                           + f"{env.world_size} process(es), {precision}, device {env.device}")
        self.t_start = time.perf_counter()
        status, message = "done", ""
        stop_at = min(cfg.steps, cfg.stop_after) if cfg.stop_after is not None else cfg.steps
        try:
            for step in range(self.start, stop_at):
                reason = self.train_step(step)
                message = self.after_step(step + 1, reason, stop_at)
                if message:
                    status = "stopped"
                    break
            else:
                if stop_at < cfg.steps:
                    status = "paused"
                    message = f"paused after step {stop_at} of {cfg.steps}; continue with --resume"
        finally:
            self.log.close()
        return self.summarize(status, message)

    def train_step(self, step: int) -> str | None:
        """One optimizer step (or a skipped one); logs its record and returns the guard's reason to skip, if any."""
        cfg, env, model, optimizer, guard = self.cfg, self.env, self.model, self.optimizer, self.guard
        t0 = time.perf_counter()
        K = self.sched.passes_at(step, cfg.steps)
        if self.recipe.fresh_fusion and step == self.fb_start:
            D.unwrap(model).reset_feedback(torch.Generator().manual_seed(cfg.seed * 31 + 7))
        if step == self.fb_start > 0 and cfg.feedback_ever:
            guard.restart()  # the switch-on changes what the guard watches: its running loss restarts here
        lr = lr_at(step, cfg)
        set_learning_rates(optimizer, lr, lr * self.switch_on.fusion_lr_factor(step, self.fb_start, cfg.steps))
        frozen = self.switch_on.backbone_frozen(step, self.fb_start, cfg.steps)
        weight = (cfg.feedback_weight * self.switch_on.feedback_weight_factor(step, self.fb_start, cfg.steps)
                  if cfg.weighs_passes() else None)  # None: the model's loss takes no λ (exact states, full backprop)
        batch = self.recipe.batch(step, K, self.prefix_gen, env)
        ran, zs = [], []
        options = cfg.pass_options() if K > 1 else {}
        loss_sum, pass_sum = forward_backward(model, batch.micro, cfg.step_passes(K), self.autocast,
                                              batch.loss_weight, nan=(step + 1) in cfg.debug_nan_steps,
                                              feedback_weight=weight, passes_run=ran, z_losses=zs,
                                              **cfg.loss_options(), **options)
        if K == 1:
            for p in self.fusion_params:  # unused on a plain step: no update, no weight decay, as single-process
                p.grad = None
        if frozen:
            for p in self.backbone_params:  # fusion-only phase: the backbone is not updated
                p.grad = None
        z_sum = [torch.stack(zs).sum().view(1)] if zs else []  # the z-loss inside the loss (--z-loss)
        stats = D.all_reduce_mean(torch.cat([loss_sum.view(1), pass_sum, *z_sum]) * batch.loss_weight, env).tolist()
        loss, pass_losses = stats[0], stats[1:1 + len(pass_sum)]
        watched = trained_loss(pass_losses, len(pass_losses), options.get("grad_passes") or 0)
        reason = guard.check(loss, watched, None)
        # a finite spike on weights that already spiked another batch: the weights are the cause, and an update, not
        # a skip, repairs them (Guard.trains_through)
        self.through = reason is not None and guard.trains_through(reason)
        grad_norm, fusion_norm = float("nan"), None
        if reason is None or self.through:
            if cfg.clip_per_group:
                grad_norm = clip_gradients(self.backbone_params, cfg.grad_clip)
                if K > 1:
                    fusion_norm = clip_gradients(self.fusion_params, cfg.grad_clip)
                    grad_norm = math.hypot(grad_norm, fusion_norm)
            else:
                grad_norm = clip_gradients(self.all_params, cfg.grad_clip)
            checked = guard.check(loss, watched, grad_norm)
            if checked is not None and not checked.startswith(Guard.SPIKE):
                reason, self.through = checked, False  # a non-finite gradient is skipped, spike or not
        if self.through:  # the weights leave the last good step's: save it first (once)
            self.save_last_good(step + 1, reason)
        if reason is None or self.through:
            optimizer.step()
        if reason is None:
            guard.good(watched)
        else:
            guard.bad(watched, finite_gradient=reason != "non-finite gradient")
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        self.tokens += batch.tokens
        fusion_lr = next((g["lr"] for g in optimizer.param_groups if g["name"].startswith("fusion")), None)
        rec = {"step": step + 1, "split": "train", "loss": finite_or_none(loss),
               "pass_losses": [finite_or_none(v) for v in pass_losses], "num_passes": K, "lr": lr,
               "grad_norm": finite_or_none(grad_norm), "feedback_weight": weight if K > 1 else None,
               "fusion_lr": fusion_lr if K > 1 else None, "tokens": self.tokens, **batch.record,
               "step_time": dt, "tokens_per_s": batch.tokens / dt, "elapsed": self.elapsed()}
        if fusion_norm is not None:
            rec["fusion_grad_norm"] = finite_or_none(fusion_norm)
        if K > 1 and (cfg.grad_passes or cfg.pass_tol):  # what the long-recurrence options ran (FLOP counts)
            rec["passes_run"] = sum(r for r, _ in ran) / len(ran)
            rec["grad_passes_run"] = sum(g for _, g in ran) / len(ran)
        if K > 1 and cfg.exact_states:  # the token-by-token pass before the passes_run teacher-forced ones
            rec["exact_states"] = True
        if K > 1 and cfg.full_backprop:  # the recurrence with gradient, in blocks recomputed in the backward
            rec["full_backprop"] = True
            rec["backprop_chunk"] = cfg.backprop_chunk
        if zs:
            rec["z_loss"] = finite_or_none(stats[-1])
        if frozen:
            rec["backbone_frozen"] = True
        if reason is not None:
            rec["trained_through" if self.through else "skipped"] = reason
        self.log.record(rec)
        self.log.progress(rec, batch.tokens / dt)
        return reason

    def after_step(self, done: int, reason: str | None, stop_at: int) -> str:
        """The guard's stop, evaluation, checkpoint and test hooks after ``done`` steps; returns a stop message."""
        cfg, guard, log = self.cfg, self.guard, self.log
        if reason is not None:
            did = "trained on (the weights spiked the step before too)" if self.through else "skipped"
            log.write(f"step {done}: {did} ({reason}); {guard.bad_in_row} bad step(s) in a row")
            if guard.bad_in_row >= cfg.max_bad_steps and guard.level_changed():
                n, peak = guard.bad_in_row, guard.peak
                level = guard.rebase()
                note = (f"step {done}: {n} steps in a row spiked after a good step (mean {level:.3f}, below the "
                        f"level the run started from, {peak:.3f}): the model's loss moved, not the batches'; the "
                        "guard's running loss is re-based there and training goes on")
                log.write(note)
                log.record({"step": done, "split": "event", "event": "guard_rebased", "reason": note})
            elif guard.bad_in_row >= cfg.max_bad_steps:
                return self.stop(done, reason)
        if done % self.eval_every == 0 or done == cfg.steps:
            val = self.recipe.evaluate(D.unwrap(self.model), done, self.fb_start, self.env)
            if val is not None:
                log.record({"step": done, "split": "val", "tokens": self.tokens, **val})
                extra = f", K={val['val_num_passes']}: {val['val_loss_passes']:.4f}" if "val_loss_passes" in val else ""
                log.write(f"step {done}: {self.recipe.val_label} {val['val_loss']:.4f}{extra}")
        if (cfg.save_every and done % cfg.save_every == 0) or (done == stop_at and done < cfg.steps):
            if guard.bad_in_row == 0:  # what the run reads rides along: a re-run of it may continue here
                self.last_ckpt = self.save(done, run_inputs=self.run_inputs())
            else:  # only good states are checkpointed
                log.write(f"step {done}: no checkpoint while steps are being skipped")
        if reason is None:
            self.good_state = self.snapshot(done)
        if cfg.debug_kill_at_step is not None and done == cfg.debug_kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return ""

    def stop(self, done: int, reason: str) -> str:
        """The guard's stop after step ``done``: the last good step saved as a checkpoint (tagged ``guard_stop``, with
        what the run read, so that an experiment's re-run of the same run resumes there:
        :func:`fullband.training.pretrain.stopped_checkpoint`); returns the stop message."""
        good = self.good_state
        self.save_last_good(done, reason)
        last = good["step"] if good is not None else self.start
        self.stopped = {"step": done, "last_good": last, "reason": reason}
        message = (f"stopped after {self.guard.bad_in_row} bad steps in a row at step {done}; "
                   + (f"last good checkpoint: {self.last_ckpt} (step {last}); continue with --resume"
                      if self.last_ckpt else "no checkpoint was written (no good step)"))
        self.log.record({"step": done, "split": "event", "event": "stopped", "reason": message})
        return message

    def save_last_good(self, done: int, reason: str) -> None:
        """Checkpoint the last good step (once; the weights must still be its: only skipped steps since), tagged
        ``guard_stop`` with the step ``done`` where the guard acted and what the run read."""
        good = self.good_state
        if good is None or good.get("saved"):
            return
        self.last_ckpt = self.save(good["step"], good, guard_stop={"step": done, "reason": reason,
                                                                   **self.run_inputs()})
        good["saved"] = True

    def run_inputs(self) -> dict:
        """The data and initial model the run reads (its summary's fields), recorded in its checkpoints."""
        inputs = {}
        self.recipe.summarize(inputs)
        return inputs

    def snapshot(self, step: int) -> dict:
        """What a checkpoint of step ``step`` needs besides the model and optimizer, as it is now (after the step):
        a skipped step advances the RNG streams, the guard and the token count but not the weights, so this, taken
        after every good step, and the weights as they are make the last good step's checkpoint."""
        return {"step": step, "tokens": self.tokens, "guard": self.guard.to_dict(), "rng": rng_state(self.prefix_gen),
                # re-measured when feedback switched on (reset_feedback): config.json of a resumed run has it too
                "embed_rms": getattr(D.unwrap(self.model).config, "embed_rms", None)}

    def save(self, step: int, snap: dict | None = None, **extra) -> str:
        """Checkpoint ``step`` of the model and optimizer as they are, with ``snap`` (:meth:`snapshot` of that step;
        default: taken now) and ``extra`` fields in its trainer state."""
        cfg = self.cfg
        snap = snap if snap is not None else self.snapshot(step)
        state = {"tokens": snap["tokens"], "elapsed": self.elapsed(), "world_size": self.env.world_size,
                 "guard": snap["guard"], "config": cfg.to_dict(),
                 "data_position": {"next_batch": step, "seed": cfg.seed}, "schedule": schedule_state(cfg, step),
                 "embed_rms": snap["embed_rms"], **extra}
        return save_checkpoint(cfg.out, step, self.env, self.model, self.optimizer, self.prefix_gen, state,
                               keep=cfg.keep_checkpoints, rng=snap["rng"])

    # ------------------------------------------------------------------------------------------- finish

    def summarize(self, status: str, message: str) -> dict:
        cfg, env = self.cfg, self.env
        summary = {"status": status, "message": message, "out": cfg.out,
                   "steps_done": cfg.steps if status == "done" else None, "checkpoint": self.last_ckpt,
                   "elapsed": self.elapsed(), "skipped_steps": self.guard.skipped}
        if self.stopped is not None:
            summary["stopped_at"], summary["last_good_step"] = self.stopped["step"], self.stopped["last_good"]
            summary["stop_reason"] = self.stopped["reason"]
        if status == "done":
            self.finish(summary)
        self.recipe.summarize(summary)
        if env.is_main and status == "done":
            atomic_write_json(os.path.join(cfg.out, SUMMARY), summary)
        return summary

    def finish(self, summary: dict) -> None:
        """The final model (under FSDP written shard by shard, never gathered: :func:`save_pretrained_sharded`),
        the recipe's finish and the curves."""
        cfg, env = self.cfg, self.env
        model = D.unwrap(self.model)
        if D.is_sharded(model):
            save_pretrained_sharded(self.recipe.final_model(model), cfg.out, env)
            model = load_model(cfg.out, dtype=torch.float32) if env.is_main and self.recipe.finish_needs_model else None
        elif env.is_main:
            atomic_save_pretrained(self.recipe.final_model(model), cfg.out, mode="merge")
        if env.is_main:
            if model is not None:
                model.eval()
            self.recipe.finish(model, summary)
            if cfg.plot:
                plot_run(cfg.out, self.recipe.plot_name, self.recipe.plot_title)
            if model is not None:
                model.train()
        D.barrier(env)
