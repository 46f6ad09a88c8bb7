"""The K-pass objective inside HF ``Trainer`` and TRL ``SFTTrainer``: the logged passes follow the schedule, and one
trainer step equals one step of the package's own engine on the same batch."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments

import fullband
from fullband.training.config import TrainConfig
from fullband.training.engine import forward_backward
from fullband.training.hf_trainer import FullBandwidthTrainer, PassSchedule, sft_trainer_class
from fullband.training.optimizer import build_optimizer, set_learning_rates

from conftest import TEXTS, Rows, random_ids, tiny_backbone_config, tiny_model


def trainer_args(tmp_path, steps, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=1, learning_rate=1e-3,
                lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                adam_epsilon=1e-8, max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no",
                use_cpu=True, optim="adamw_torch", seed=0, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def _trainer_and_engine_step(tmp_path, ids, sched: PassSchedule, **engine_options):
    """One step of ``sched`` through ``Trainer`` and through the package's engine (its forward_backward and its fused
    AdamW with the fusion at 10x the LR) from the same trained-looking residual model on the same row and mask:
    (trainer's model, its logged record, the engine's model, the engine's loss and pass losses, the mask)."""
    model = tiny_model(fusion="residual", jitter=0.0)
    with torch.no_grad():  # a trained-looking fusion: the residual entry's output gain away from 0
        model.feedback.out_norm.weight.fill_(0.5)
    reference = copy.deepcopy(model)
    trainer = FullBandwidthTrainer(model=model, args=trainer_args(tmp_path, 1), train_dataset=Rows(ids),
                                   pass_schedule=sched)
    mask = trainer.feedback_mask(model, {"input_ids": ids}, step=0, micro=0)
    trainer.train()
    cfg = TrainConfig(out="x", lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, fusion_lr_mult=10.0)
    reference.train()
    opt = build_optimizer(reference, cfg, torch.device("cpu"))
    set_learning_rates(opt, 1e-3, 1e-3)
    loss, passes = forward_backward(reference, [{"input_ids": ids, "labels": ids, "feedback_mask": mask}],
                                    sched.num_passes, contextlib.nullcontext, feedback_weight=sched.feedback_weight,
                                    **engine_options)
    opt.step()
    logged = trainer.state.log_history[0]
    assert logged["num_passes"] == sched.num_passes
    assert logged["loss"] == pytest.approx(float(loss), rel=1e-5)
    scored = [i for i in range(sched.num_passes) if not torch.isnan(passes[i])]  # unscored passes: not logged
    assert [logged.get(f"loss_pass{i + 1}") for i in range(sched.num_passes)] == [
        pytest.approx(float(passes[i]), rel=1e-5) if i in scored else None for i in range(sched.num_passes)]
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    return model, logged, reference, loss, passes, mask


def test_trainer_step_equals_the_engine_step(tmp_path):
    """A K=2 step with prefix mixing through ``Trainer`` and through the package's engine on the same row and mask:
    same loss, same weights after the optimizer step. Bugs caught: the trainer running K=1 (a plain forward: other
    loss, fusion gets no update), λ or the mask not passed, the fusion group at the trainer's plain LR, weight decay
    on norms."""
    ids = random_ids(1, 24, seed=3)
    ids[0, 12] = 1  # BOS: a second document inside the row: no state across it
    sched = PassSchedule(feedback_start=0.0, num_passes=2, deep_fraction=0.0, prefix_mix=0.5, feedback_ramp=0.0,
                         feedback_weight=0.7, fusion_lr_mult=10.0, reset_fusion=False)
    model, _, _, loss, passes, mask = _trainer_and_engine_step(tmp_path, ids, sched)
    assert not mask[0, 12] and not mask[0, 0] and mask.sum() < 22  # document start, position 0, a mixed prefix
    assert float(loss) == pytest.approx(float(passes[0] + 0.7 * passes[1]), rel=1e-6)
    assert not torch.equal(model.feedback.value_proj.weight, tiny_model(fusion="residual").feedback.value_proj.weight)


def test_trainer_takes_the_long_recurrence_and_loss_levers(tmp_path):
    """``PassSchedule(grad_passes=, pass_tol=, loss_chunk=, z_loss=)`` reach the K-pass forward as ``fullband train``
    passes them: a K=4 step with 2 gradient passes, a chunked loss and a z-loss through ``Trainer`` equals the
    engine's step with the same options (same loss and pass losses, same weights after the optimizer step); the
    z-loss is in the loss (it exceeds the pass losses' combination)."""
    sched = PassSchedule(feedback_start=0.0, num_passes=4, deep_fraction=0.0, prefix_mix=0.0, feedback_ramp=0.0,
                         feedback_weight=1.0, fusion_lr_mult=10.0, reset_fusion=False, grad_passes=2, loss_chunk=7,
                         z_loss=0.01)
    assert sched.forward_options(4) == {"grad_passes": 2, "loss_chunk": 7, "z_loss": 0.01}
    assert sched.forward_options(1) == {"loss_chunk": 7, "z_loss": 0.01}  # a plain step: no recurrence options
    with pytest.raises(ValueError):
        PassSchedule(z_loss=-1.0)
    _, logged, _, loss, passes, _ = _trainer_and_engine_step(tmp_path, random_ids(1, 24, seed=5), sched,
                                                             grad_passes=2, loss_chunk=7, z_loss=0.01)
    assert torch.isnan(passes[:2]).all() and "loss_pass1" not in logged  # the no-gradient passes: not scored
    assert float(loss) > float(passes[2:].sum() / 3) + 1e-4  # the z-loss term is in the (trained part of the) loss


def test_trainer_takes_the_exact_states(tmp_path):
    """``PassSchedule(exact_states=True, grad_passes=2)``: a fed-back step through ``Trainer`` runs the exact states
    and then 2 gradient passes, as the engine's step with ``exact_states`` does (same loss and pass losses, same
    weights after the step); both gradient passes score the exact recurrence's loss."""
    sched = PassSchedule(feedback_start=0.0, num_passes=2, deep_fraction=0.0, prefix_mix=0.0, feedback_ramp=0.0,
                         fusion_lr_mult=10.0, reset_fusion=False, grad_passes=2, exact_states=True)
    assert sched.forward_options(2) == {"exact_states": True} and sched.forward_options(1) == {}
    with pytest.raises(ValueError, match="exact_states"):
        PassSchedule(exact_states=True)  # no gradient passes
    ids = random_ids(1, 24, seed=7)
    _, logged, _, loss, passes, _ = _trainer_and_engine_step(tmp_path, ids, sched, exact_states=True)
    assert passes.shape == (2,) and not torch.isnan(passes).any() and logged["num_passes"] == 2
    assert float(loss) == pytest.approx(float(passes.mean()), rel=1e-6)


def test_trainer_takes_full_backprop(tmp_path):
    """``PassSchedule(full_backprop=True, backprop_chunk=5)``: a fed-back step through ``Trainer`` backpropagates
    through the whole recurrence in blocks of 5, as the engine's step with those options does (same loss, one pass
    loss, same weights after the step) -- with HF's own activation checkpointing on, which the blocks switch off
    inside (else the layers would drop their cache and attend to the current token only)."""
    sched = PassSchedule(feedback_start=0.0, num_passes=2, deep_fraction=0.0, prefix_mix=0.0, feedback_ramp=0.0,
                         fusion_lr_mult=10.0, reset_fusion=False, full_backprop=True, backprop_chunk=5)
    assert sched.forward_options(2) == {"full_backprop": True, "backprop_chunk": 5} and sched.forward_options(1) == {}
    assert TrainConfig.step_passes(sched, 2) == 1 and TrainConfig.step_passes(sched, 1) == 1
    ids = random_ids(1, 23, seed=11)
    ids[0, 9] = 1  # a second document: the recurrence restarts there
    model = tiny_model(fusion="residual", jitter=0.0)
    with torch.no_grad():
        model.feedback.out_norm.weight.fill_(0.5)
    reference = copy.deepcopy(model)
    trainer = FullBandwidthTrainer(model=model, args=trainer_args(tmp_path, 1, activation_checkpointing=True,
                                                                   activation_checkpointing_kwargs={"use_reentrant": False}),
                                   train_dataset=Rows(ids), pass_schedule=sched)
    mask = trainer.feedback_mask(model, {"input_ids": ids}, step=0, micro=0)
    trainer.train()
    assert all(layer.gradient_checkpointing for layer in model.backbone.model.layers)  # HF's checkpointing was on
    cfg = TrainConfig(out="x", lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, fusion_lr_mult=10.0)
    reference.train()
    opt = build_optimizer(reference, cfg, torch.device("cpu"))
    set_learning_rates(opt, 1e-3, 1e-3)
    loss, passes = forward_backward(reference, [{"input_ids": ids, "labels": ids, "feedback_mask": mask}], 1,
                                    contextlib.nullcontext, full_backprop=True, backprop_chunk=5)
    opt.step()
    logged = trainer.state.log_history[0]
    assert passes.shape == (1,) and logged["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert logged["loss_pass1"] == pytest.approx(float(passes[0]), rel=1e-5) and "loss_pass2" not in logged
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(model.feedback.value_proj.weight, tiny_model(fusion="residual").feedback.value_proj.weight)


def test_trainer_logs_the_pass_schedule(tmp_path):
    """Four steps, feedback from the middle with a deep step: the logged K per step is the schedule's, and each
    logged loss is L_1 + λ·mean(L_2..L_K). Bug caught: a trainer stuck at K=1 (``forward`` defaults to one pass)."""
    ids = random_ids(4, 16, seed=5)
    sched = PassSchedule(feedback_start=0.5, num_passes=2, deep_passes=3, deep_fraction=0.5, feedback_ramp=0.0,
                         prefix_mix=0.0)
    trainer = FullBandwidthTrainer(model=tiny_model(fusion="residual"), args=trainer_args(tmp_path, 4),
                                   train_dataset=Rows(ids), pass_schedule=sched)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "num_passes" in r]
    assert [r["num_passes"] for r in logs] == [sched.passes_at(s, 4) for s in range(4)] == [1, 1, 2, 3]
    for r in logs:
        losses = [r[f"loss_pass{i + 1}"] for i in range(r["num_passes"])]
        expect = losses[0] + (sum(losses[1:]) / (len(losses) - 1) if len(losses) > 1 else 0.0)
        assert r["loss"] == pytest.approx(expect, rel=1e-4)


def test_trl_sft_trainer_runs_the_pass_schedule(tmp_path):
    """TRL's SFTTrainer on prompt/completion pairs (loss on the completion only): K > 1 from the schedule's start."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from fullband.data.corpus import train_tokenizer

    tok = train_tokenizer(TEXTS * 4, vocab_size=300)
    cfg = tiny_backbone_config("llama", vocab_size=len(tok))
    torch.manual_seed(0)
    model = fullband.FullBandwidthForCausalLM.from_backbone(AutoModelForCausalLM.from_config(cfg), fusion="residual",
                                                            doc_start_token_id=tok.bos_token_id)
    pairs = [{"prompt": t.split("\n")[0], "completion": " " + t.split("\n")[1]} for t in TEXTS] * 3
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3,
                         logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, max_length=64,
                         disable_tqdm=True, seed=0)
    sched = PassSchedule(feedback_start=0.5, num_passes=2, deep_fraction=0.0)
    trainer = sft_trainer_class()(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                                  processing_class=tok, pass_schedule=sched)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "num_passes" in r]
    assert [r["num_passes"] for r in logs] == [1, 1, 2, 2]
    assert all("loss_pass2" in r for r in logs[2:]) and not any("loss_pass2" in r for r in logs[:2])


def test_trainer_follows_a_pass_mix_and_resets_the_fusion_at_a_plain_start(tmp_path):
    """A pass mix through ``Trainer``: the logged K per step is what ``fullband train`` would draw with the same
    options (``TrainConfig.schedule()``), and the fusion is re-initialised once, at the feedback start, even when
    that step draws K = 1 (a reset tied to a K > 1 step would never happen then, leaving the fusion as it was built
    at step 0). The seed is chosen here as the first whose start step draws K = 1 and whose later steps hold K > 1."""
    steps, mix = 8, dict(feedback_start=0.25, num_passes=2, deep_fraction=0.0, pass_mix="1:0.5,2:0.5")
    for seed in range(100):
        cfg = TrainConfig(out="x", steps=steps, seed=seed, **mix)
        want = [cfg.schedule().passes_at(s, steps) for s in range(steps)]
        if want[2] == 1 and 2 in want[3:]:
            break
    else:
        raise AssertionError("no seed of 100 draws K = 1 at the start and K = 2 later")
    sched = PassSchedule.from_train_config(cfg, feedback_ramp=0.0, prefix_mix=0.0)
    model = tiny_model(fusion="residual")
    resets = []
    real_reset = model.reset_feedback
    model.reset_feedback = lambda *a, **k: (resets.append(1), real_reset(*a, **k))[1]
    trainer = FullBandwidthTrainer(model=model, args=trainer_args(tmp_path, steps), train_dataset=Rows(random_ids(8, 16)),
                                   pass_schedule=sched)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "num_passes" in r]
    assert [r["num_passes"] for r in logs] == want
    assert len(resets) == 1


def test_switch_on_and_clipping_options_reach_the_trainer(tmp_path):
    """``fusion_only``, ``fusion_warmup`` and ``clip_per_group`` of a ``TrainConfig`` are carried by
    ``PassSchedule.from_train_config`` (they were dropped) and done by the trainer: in the fusion-only phase the
    backbone does not move and the fusion does; the fusion groups' LR at step 0 is the warm-up's fraction of
    ``fusion_lr_mult`` x LR (span round(0.5 x 4) = 2 steps: 1/2); bad fractions are refused."""
    cfg = TrainConfig(out="x", steps=4, fusion_only=0.25, fusion_warmup=0.5, clip_per_group=False)
    sched = PassSchedule.from_train_config(cfg, feedback_start=0.0, num_passes=2, deep_fraction=0.0, prefix_mix=0.0,
                                           feedback_ramp=0.0, reset_fusion=False)
    assert (sched.fusion_only, sched.fusion_warmup, sched.clip_per_group) == (0.25, 0.5, False)
    with pytest.raises(ValueError, match="fusion_only"):
        PassSchedule(fusion_only=1.5)
    model = tiny_model(fusion="residual")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = FullBandwidthTrainer(model=model, args=trainer_args(tmp_path, 4, max_grad_norm=1.0),
                                   train_dataset=Rows(random_ids(4, 16)), pass_schedule=sched)
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    lrs = {g["name"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert lrs["fusion"] == pytest.approx(1e-3 * 10.0 * 0.5) and lrs["backbone"] == pytest.approx(1e-3)
    moved = []

    class AfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                moved.extend(n for n, p in model.named_parameters() if not torch.equal(p, before[n]))

    trainer.add_callback(AfterFirstStep())
    trainer.train()  # step 0 of 4: inside the fusion-only phase (round(0.25 x 4) = 1 step); steps 1..3 train all
    assert moved and all(n.startswith("feedback.") for n in moved)
    assert any(not torch.equal(p, before[n]) for n, p in model.backbone.named_parameters(prefix="backbone"))
