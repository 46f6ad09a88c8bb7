"""One K = 2 step of ``FullBandwidthTrainer`` on a fixed 4-row global batch, on however many processes run it
(``torchrun --nproc-per-node N tests/hf_trainer_ranks.py OUT``, or :func:`run` in-process): each process saves
what it saw and did to ``OUT/rank{R}.pt`` -- its rows and feedback masks, its gradients after clipping, the
weights after the step and the trainer's log (used by tests/test_hf_trainer_world.py)."""

from __future__ import annotations

import os
import sys

import torch
from transformers import TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import Rows, random_ids, tiny_model  # noqa: E402

from fullband.training.hf_trainer import FullBandwidthTrainer, PassSchedule  # noqa: E402

ROWS, T, LR, MAX_GRAD_NORM = 4, 24, 1e-3, 0.01
SCHEDULE = dict(feedback_start=0.0, num_passes=2, deep_fraction=0.0, prefix_mix=0.5, feedback_ramp=0.0,
                feedback_weight=0.7, fusion_lr_mult=10.0, fusion_warmup=0.0, clip_per_group=True,
                reset_fusion=False, seed=3)


def global_batch() -> torch.Tensor:
    ids = random_ids(ROWS, T, seed=11)
    ids[0, 9] = ids[2, 15] = 1  # BOS inside two rows: a second document there
    return ids


def initial_model():
    model = tiny_model(fusion="residual", jitter=0.0)
    with torch.no_grad():  # a trained-looking fusion: the residual entry's output gain away from 0
        model.feedback.out_norm.weight.fill_(0.5)
    return model


class KeepGrads(TrainerCallback):
    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):  # after clipping
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run(out: str, world: int = 1, rank: int = 0) -> None:
    model = initial_model()
    args = TrainingArguments(output_dir=out, max_steps=1, per_device_train_batch_size=ROWS // world,
                             learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.1,
                             adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=MAX_GRAD_NORM,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, optim="adamw_torch",
                             seed=0, disable_tqdm=True, dataloader_drop_last=True)
    keep = KeepGrads()
    trainer = FullBandwidthTrainer(model=model, args=args, train_dataset=Rows(global_batch()),
                                   pass_schedule=PassSchedule(**SCHEDULE), callbacks=[keep])
    seen, masks = [], []
    real_mask = trainer.feedback_mask

    def feedback_mask(m, inputs, step, micro):
        mask = real_mask(m, inputs, step, micro)
        seen.append(inputs["input_ids"].detach().cpu().clone())
        masks.append(mask.detach().cpu().clone())
        return mask

    trainer.feedback_mask = feedback_mask
    trainer.train()
    torch.save({"rows": torch.cat(seen), "masks": torch.cat(masks), "grads": keep.grads,
                "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
                "log": trainer.state.log_history[0]}, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(sys.argv[1], int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")))
    if torch.distributed.is_initialized():  # the Trainer's group: left to exit, gloo's threads can abort the rank
        torch.distributed.destroy_process_group()  # ("terminate called without an active exception", SIGABRT)
