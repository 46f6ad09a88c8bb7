"""The pre-training recipe (``fullband train``): corpus, tokenizer, model, batches and validation.

Owns what pre-training adds to :mod:`fullband.training.engine`:

* data: :func:`fullband.data.corpus.build_corpus` (embedded corpus by default; text files / folders, jsonl,
  ``datasets`` directories), a BPE trained on the training documents or a local tokenizer, packed rows, split by
  document; batch ``step`` is a seeded permutation's slice (:func:`fullband.data.corpus.batch_rows`, shifted by
  ``--data-offset``), with per-document prefix mixing on feedback steps;
* model: a Llama-style backbone from a size preset (:mod:`fullband.training.presets`), or ``--init-from DIR`` (a
  local HF causal LM, retrofitted; or a saved fullband model, continued). A fusion built here (not trained) is
  re-initialised when feedback switches on, at the scale the embeddings have by then;
* validation: held-out loss (``standard``, and ``passes`` at K once feedback is on) on rows spread over the
  held-out documents (:func:`spread_rows`);
* output: the final model (``save_pretrained``; a run that never used feedback is saved as its plain backbone)
  and its tokenizer in ``OUT`` itself, loadable with ``AutoModelForCausalLM.from_pretrained(OUT)``.

:func:`train` runs it: ``train(TrainConfig(...))`` returns the run's summary.
"""

from __future__ import annotations

import json
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..data.corpus import batch_rows, build_corpus, load_tokenizer, special_ids
from ..eval.scoring import evaluate_loss
from ..model.configuration import FullBandwidthConfig
from ..model.feedback import build_feedback_mask, document_starts, prefix_mixing_mask
from ..model.modeling import FullBandwidthForCausalLM, load_model
from ..utils.io import atomic_save_pretrained, read_jsonl
from .checkpoint import METRICS
from .config import DEFAULT_FUSION, TrainConfig
from .engine import Recipe, StepBatch, run
from .presets import backbone_config


def build_tokenizer_and_corpus(cfg: TrainConfig, tokenizer=None):
    """The :class:`fullband.data.corpus.Corpus` of ``cfg`` (tokenizer: given, ``--tokenizer``, the
    ``--init-from`` checkpoint's, or a BPE trained on the training documents)."""
    if tokenizer is None:
        path = cfg.tokenizer
        if path is None and cfg.init_from is not None:
            if not any(os.path.exists(os.path.join(cfg.init_from, n)) for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
                raise ValueError(f"--init-from {cfg.init_from!r} holds no tokenizer; give its tokenizer with --tokenizer DIR")
            path = cfg.init_from
        if path is not None:
            tokenizer = load_tokenizer(path)
    return build_corpus(cfg.data, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, val_fraction=cfg.val_fraction,
                        seed=cfg.seed, tokenizer=tokenizer)


def build_model(cfg: TrainConfig, tokenizer):
    """The model to train (fp32 weights), seeded by ``cfg.seed``."""
    bos, eos = special_ids(tokenizer)
    pad = tokenizer.pad_token_id
    feedback = dict(feedback_weight=float(cfg.feedback_weight), jitter=float(cfg.jitter), detach_state=cfg.detach_state)
    torch.manual_seed(cfg.seed)
    if cfg.init_from is not None:
        try:
            model_type = AutoConfig.from_pretrained(cfg.init_from).model_type
        except (OSError, ValueError) as err:
            raise ValueError(f"--init-from {cfg.init_from!r} is not a loadable HF checkpoint: {str(err).splitlines()[0]}") from None
        if model_type == FullBandwidthConfig.model_type:
            model = load_model(cfg.init_from, dtype=torch.float32)
            if model.config.fusion != cfg.fusion and cfg.fusion != DEFAULT_FUSION:  # the default: keep the model's
                raise ValueError(f"--init-from holds a fullband model with fusion {model.config.fusion!r}; "
                                 f"--fusion {cfg.fusion!r} cannot change it")
            for k, v in feedback.items():
                setattr(model.config, k, v)
        else:
            backbone = AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
            model = FullBandwidthForCausalLM.from_backbone(backbone, fusion=cfg.fusion, doc_start_token_id=bos, **feedback)
        vocab = model.get_input_embeddings().num_embeddings
        if len(tokenizer) > vocab:
            raise ValueError(f"the tokenizer has {len(tokenizer)} entries but the model's vocabulary only {vocab}; "
                             "give the checkpoint's own tokenizer with --tokenizer")
    else:
        config = backbone_config(cfg.preset, len(tokenizer), bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                                 max_position_embeddings=max(2048, cfg.seq_len))
        backbone = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = FullBandwidthForCausalLM.from_backbone(backbone, fusion=cfg.fusion, doc_start_token_id=bos, **feedback)
    return model.float()


def fusion_was_trained(cfg: TrainConfig) -> bool:
    """Whether the run starts from a fullband checkpoint, whose fusion may already be trained."""
    if cfg.init_from is None:
        return False
    try:
        with open(os.path.join(cfg.init_from, "config.json")) as f:
            return json.load(f).get("model_type") == "fullband"
    except (OSError, ValueError):
        return False


def feedback_mask_for(batch: torch.Tensor, doc_start_id: int | None, prefix_mix: float,
                      generator: torch.Generator) -> torch.Tensor:
    """Feedback mask of a global batch with prefix mixing (draws from ``generator``)."""
    mask = build_feedback_mask(batch, None, doc_start_id)
    if prefix_mix > 0:
        mask &= ~prefix_mixing_mask(document_starts(batch, doc_start_id), prefix_mix, generator)
    return mask


def spread_rows(rows: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` rows spread evenly over ``rows`` (all when there are fewer): every held-out document gets its share,
    where the first ``n`` rows would all come from the first document."""
    if n >= rows.shape[0]:
        return rows
    return rows[torch.linspace(0, rows.shape[0] - 1, n).round().long()]


class PretrainRecipe(Recipe):
    """Packed rows of a corpus, all positions predicted; the global batch split over ranks and micro-batches."""

    def __init__(self, cfg: TrainConfig, corpus=None, name: str = "train"):
        self.cfg, self.corpus, self.name = cfg, corpus, name

    def setup(self, tokenizer):
        cfg = self.cfg
        if self.corpus is None:
            self.corpus = build_tokenizer_and_corpus(cfg, tokenizer)
        self.tokenizer = self.corpus.tokenizer
        self.train_rows, self.val_rows = self.corpus.train_rows, self.corpus.val_rows
        if self.train_rows.shape[1] != cfg.seq_len:
            raise ValueError(f"the corpus has rows of {self.train_rows.shape[1]} tokens but --seq-len is {cfg.seq_len}")
        model = self.build_model()
        self.doc_id = model.config.doc_start_token_id
        fb_start = cfg.schedule().start_step(cfg.steps)
        # a fusion built at step 0 (from scratch, or retrofitted onto a plain checkpoint) is re-initialised when
        # feedback switches on, at the scale the embeddings have by then
        self.fresh_fusion = cfg.feedback_ever and fb_start > 0 and not fusion_was_trained(cfg)
        return model, self.tokenizer

    def build_model(self):
        return build_model(self.cfg, self.tokenizer)

    def describe(self, model):
        cfg, rows = self.cfg, self.train_rows
        n_params = sum(p.numel() for p in model.parameters())
        return (f"{self.name}: {n_params / 1e6:.2f}M parameters, {rows.shape[0]} train rows x {cfg.seq_len} "
                f"tokens ({rows.numel():,}), {self.val_rows.shape[0]} val rows; {cfg.steps} steps x "
                f"{cfg.batch_size * cfg.seq_len:,} tokens, ")

    def batch(self, step, num_passes, generator, env):
        cfg = self.cfg
        per_rank = cfg.batch_size // env.world_size
        micro = per_rank // cfg.grad_accum
        rows = self.train_rows[batch_rows(step + cfg.data_offset, cfg.batch_size, self.train_rows.shape[0], cfg.seed)]
        mask = feedback_mask_for(rows, self.doc_id, cfg.prefix_mix, generator) if num_passes > 1 else None
        lo = env.rank * per_rank
        local = rows[lo:lo + per_rank].to(env.device)
        local_mask = mask[lo:lo + per_rank].to(env.device) if mask is not None else None
        micro_batches = [{"input_ids": local[i:i + micro], "labels": local[i:i + micro],
                          "feedback_mask": local_mask[i:i + micro] if local_mask is not None else None}
                         for i in range(0, per_rank, micro)]
        return StepBatch(micro_batches, loss_weight=1.0 / len(micro_batches), tokens=cfg.batch_size * cfg.seq_len)

    def evaluate(self, model, step, feedback_start, env):
        cfg = self.cfg
        if self.val_rows.shape[0] == 0:
            return None
        rows = spread_rows(self.val_rows, cfg.eval_rows)
        bs = max(1, cfg.batch_size // env.world_size)
        rec = {"val_loss": evaluate_loss(model, rows, "standard", batch_size=bs)["loss"],
               "val_tokens": rows[:, 1:].numel()}
        if cfg.num_passes > 1 and step > feedback_start:
            rec["val_loss_passes"] = evaluate_loss(model, rows, "passes", num_passes=cfg.num_passes, batch_size=bs)["loss"]
            rec["val_num_passes"] = cfg.num_passes
        return rec

    def finish(self, model, summary):
        # a plain run (feedback never on) is saved as the plain HF checkpoint of its backbone: its fusion was never
        # trained, and `lm_eval --model hf`, `pipeline(...)` and `--init-from` take it as the plain model it is
        saved = model if self.cfg.feedback_ever else model.backbone
        atomic_save_pretrained(saved, self.cfg.out, mode="merge")
        atomic_save_pretrained(self.tokenizer, self.cfg.out, mode="merge")

    def summarize(self, summary):
        val = [r for r in read_jsonl(os.path.join(self.cfg.out, METRICS)) if r.get("split") == "val"]
        if val:
            summary["val_loss"] = val[-1]["val_loss"]


def train(cfg: TrainConfig, resume: bool = False, overwrite: bool = False, corpus=None, name: str = "train") -> dict:
    """Run (or continue) pre-training as ``cfg`` says; returns a summary dict (``status`` = ``done`` / ``stopped``
    / ``paused``). ``corpus`` (a :class:`fullband.data.corpus.Corpus`) skips loading and tokenizing the data."""
    return run(PretrainRecipe(cfg, corpus, name), resume, overwrite)
