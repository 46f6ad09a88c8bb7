"""The labelled-task recipe (``fullband train --data TASKS.jsonl|DIR``): the loss only where a row has a target.

Owns what training on a researcher's own labelled rows (:mod:`fullband.data.labelled`) changes in
:class:`fullband.training.pretrain.PretrainRecipe`; the model, the final save and everything of
:mod:`fullband.training.engine` (K passes and their schedule, ``--exact-states --grad-passes N``, checkpoints,
``--resume``, DDP / FSDP2, the guard) are pre-training's:

* data: a labelled jsonl file (split by row content by ``--seed`` / ``--val-fraction``: no validation input is a
  training input; the log counts the file's repeated rows) or a directory of
  ``fullband data prepare --labelled`` (memory-mapped, its own split); the vocabulary is the data's own
  (``--tokenizer`` does not apply; ``--init-from`` must hold the same vocabulary); ``--seq-len`` bounds a row's ids
  (``<bos>`` + inputs + ``<eos>``), a longer row is refused;
* batches: fixed rows, one a row, never packed, right-padded to the micro-batch's longest (attention mask 0 and
  label -100 on the padding); global batch ``step`` is :func:`fullband.data.order.batch_rows` of the training rows
  (``randperm`` in memory, ``feistel`` for a prepared directory; ``--data-offset`` and ``--unique-batches`` as in
  pre-training), each rank reading only its rows; on feedback steps the feedback mask with per-row prefix mixing
  (:func:`fullband.training.chat.sft_feedback_mask`, seeded by :func:`fullband.model.feedback.prefix_row_seeds` of
  the rows' places in the global batch); the loss is the mean over the step's targets (each micro-batch's sum over
  the whole step's all-reduced target count, as SFT: exact under gradient accumulation and DDP);
* validation: the mean NLL at the held-out rows' targets (``standard``, and ``passes`` at K once feedback is on),
  each rank scoring its share (:func:`fullband.training.distributed.rank_share`);
* the summary records the data's fingerprint and the longest training row (``train_max_length``: what
  ``fullband eval labelled`` calls beyond the training lengths).
"""

from __future__ import annotations

import os

import torch

from ..data.corpus import load_tokenizer
from ..data.labelled import collate_rows, is_labelled, load_labelled
from ..data.order import batch_rows, pool_batch_rows
from ..eval.labelled import target_loss
from . import distributed as D
from .chat import padded_micro_batches
from .config import TrainConfig
from .engine import StepBatch, run
from .pretrain import PretrainRecipe, fusion_was_trained, run_inputs


class LabelledRecipe(PretrainRecipe):
    """Labelled rows, one a row, right-padded; the loss at the targets over the whole step's count."""

    val_label = "held-out target loss"
    plot_name = "labelled"
    plot_title = "fullband train (labelled targets)"

    def __init__(self, cfg: TrainConfig, data=None, name: str = "train"):
        super().__init__(cfg, None, name)
        self.data = data

    def setup(self, tokenizer):
        cfg = self.cfg
        if cfg.tokenizer is not None:
            raise ValueError("--tokenizer does not apply to labelled data: its vocabulary is built from its tokens")
        if self.data is None:
            self.data = load_labelled(cfg.data, cfg.seed, cfg.val_fraction)
        self.tokenizer = self.data.tokenizer
        vocab = self.tokenizer.get_vocab()
        if tokenizer is not None and tokenizer.get_vocab() != vocab:
            raise ValueError(f"--data {cfg.data!r} has another vocabulary than the run in {cfg.out!r} was started with")
        if cfg.init_from is not None and load_tokenizer(cfg.init_from).get_vocab() != vocab:
            raise ValueError(f"--init-from {cfg.init_from!r} holds another vocabulary than --data {cfg.data!r}: "
                             "continue only a model trained on labelled data of the same tokens")
        self.train_rows, self.val_rows = self.data.train, self.data.val
        longest = max(s["max_length"] for s in self.data.info["splits"].values()) + 2
        if longest > cfg.seq_len:
            raise ValueError(f"--data {cfg.data!r} has a row of {longest} ids (<bos> + inputs + <eos>) but --seq-len "
                             f"is {cfg.seq_len}: raise --seq-len to at least {longest}")
        self.inputs = {**run_inputs(cfg, self.data), "train_max_length": self.data.info["splits"]["train"]["max_length"]}
        self.order = "feistel" if os.path.isdir(cfg.data) else "randperm"
        model = self.build_model()
        self.doc_id = model.config.doc_start_token_id
        self.pad_id = self.tokenizer.pad_token_id
        fb_start = cfg.schedule().start_step(cfg.steps)
        self.fresh_fusion = cfg.feedback_ever and fb_start > 0 and not fusion_was_trained(cfg)
        return model, self.tokenizer

    def run_config(self):
        return {**self.cfg.to_dict(), "command": "train-labelled"}

    def describe(self, model):
        cfg, tr = self.cfg, self.data.info["splits"]["train"]
        n_params = sum(p.numel() for p in model.parameters())
        dup = self.data.info.get("duplicate_rows")
        dup = "" if dup is None else f" ({dup} rows of the file repeat an earlier row's inputs; split by content)"
        return (f"{self.name}: {n_params / 1e6:.2f}M parameters, {tr['rows']} labelled train rows ({tr['targets']:,} "
                f"targets), {len(self.val_rows)} val rows{dup}, vocabulary {len(self.tokenizer)}; {cfg.steps} steps "
                f"x {cfg.batch_size} rows, ")

    def batch(self, step, num_passes, generator, env):
        cfg = self.cfg
        n = len(self.train_rows)
        if cfg.unique_batches:
            index = pool_batch_rows(step, cfg.batch_size, n, cfg.seed, self.order, cfg.unique_batches, cfg.data_offset)
        else:
            index = batch_rows(step + cfg.data_offset, cfg.batch_size, n, cfg.seed, self.order)
        micro_batches, num_items, step_tokens = padded_micro_batches(
            lambda rows: collate_rows(self.train_rows, rows, self.pad_id), index.tolist(), step, num_passes, cfg,
            self.doc_id, env)
        # each micro-batch's loss is its share of the step's mean over the targets; DDP averages the ranks'
        # gradients, which the world size undoes
        return StepBatch(micro_batches, loss_weight=float(env.world_size), tokens=step_tokens,
                         record={"tokens_step": step_tokens, "targets": num_items})

    def held_out_loss(self, model, env, mode: str, num_passes: int = 2) -> float:
        rows = self.val_rows
        n = min(len(rows), self.cfg.eval_rows)
        spread = torch.linspace(0, len(rows) - 1, n).round().long() if n < len(rows) else torch.arange(len(rows))
        index, counted = D.rank_share(n, env)
        bs = max(1, self.cfg.batch_size // env.world_size)
        sums = torch.zeros(2, dtype=torch.float64, device=env.device)
        was_training = model.training
        model.eval()
        try:
            for s in range(0, index.numel(), bs):
                chunk, keep = index[s:s + bs], counted[s:s + bs]
                b = {k: v.to(env.device) for k, v in collate_rows(rows, spread[chunk].tolist(), self.pad_id).items()}
                b["labels"] = b["labels"].masked_fill(~keep.to(env.device)[:, None], -100)  # repeats: not counted
                sums += target_loss(model, b, mode, num_passes).to(env.device)
        finally:
            model.train(was_training)
        sums = D.all_reduce_sum(sums, env)
        return float(sums[0] / sums[1])

    def evaluate(self, model, step, feedback_start, env):
        cfg = self.cfg
        if len(self.val_rows) == 0:
            return None
        rec = {"val_loss": self.held_out_loss(model, env, "standard")}
        if cfg.num_passes > 1 and step > feedback_start:
            mode, label = cfg.fed_back_evaluation()
            rec["val_loss_passes"] = self.held_out_loss(model, env, mode, cfg.num_passes)
            rec["val_num_passes"] = label
        return rec

    def summarize(self, summary):
        super().summarize(summary)
        summary["data"] = {"format": "labelled", **self.data.info}


def train_labelled(cfg: TrainConfig, resume: bool = False, overwrite: bool = False, data=None,
                   name: str = "train") -> dict:
    """Run (or continue) training on labelled rows as ``cfg`` says (``data``: a loaded
    :class:`fullband.data.labelled.LabelledData` instead of ``cfg.data``); returns the summary."""
    return run(LabelledRecipe(cfg, data, name), resume, overwrite)


def wants_labelled(cfg: TrainConfig, labelled: bool = False) -> bool:
    """Whether ``fullband train`` runs this recipe: ``--labelled``, or ``--data`` is labelled (a prepared labelled
    directory, or a .jsonl file whose first row has ``input`` and ``target``)."""
    if labelled and not (os.path.isdir(cfg.data) or os.path.isfile(cfg.data)):
        raise FileNotFoundError(f"--labelled: --data {cfg.data!r} does not exist")
    return labelled or is_labelled(cfg.data)
