"""The pre-training recipe (``fullband train``): corpus, tokenizer, model, batches and validation.

Owns what pre-training adds to :mod:`fullband.training.engine`:

* data: :func:`fullband.data.corpus.build_corpus` (embedded corpus by default; text files / folders, jsonl,
  ``datasets`` directories), a BPE trained on the training documents or a local tokenizer, packed rows, split by
  document; or a directory of ``fullband data prepare``, memory-mapped (:mod:`fullband.data.shards`); batch
  ``step`` is a seeded permutation's slice (:func:`fullband.data.order.batch_rows`, shifted by ``--data-offset``;
  each rank reads only its rows; ``--unique-batches N``: the rows of the first N batches re-read epoch after epoch,
  :func:`fullband.data.order.pool_batch_rows`), with per-document prefix mixing on feedback steps;
* model: a Llama-style backbone from a size preset (:mod:`fullband.training.presets`), or ``--init-from DIR`` (a
  local HF causal LM, retrofitted; or a saved fullband model, continued). A fusion built here (not trained) is
  re-initialised when feedback switches on, at the scale the embeddings have by then;
* validation: held-out loss (``standard``, and ``passes`` at K once feedback is on) on rows spread over the
  held-out documents (:func:`spread_rows`);
* output: the final model (``save_pretrained``; a run that never used feedback is saved as its plain backbone)
  and its tokenizer in ``OUT`` itself, loadable with ``AutoModelForCausalLM.from_pretrained(OUT)``; the summary
  records what the run read and started from (:func:`run_inputs`), so an experiment reuses a finished run only
  for the same data and the same initial model.

:func:`train` runs it: ``train(TrainConfig(...))`` returns the run's summary. :func:`run_differences` says whether
a finished run in ``OUT`` is the one a config asks for (reused), another (kept unless overwritten:
:func:`refuse_changed_runs`) or none.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..data.corpus import batch_rows, build_corpus, load_tokenizer, special_ids
from ..data.order import pool_batch_rows
from ..data.shards import is_prepared, open_prepared
from ..eval.scoring import row_losses
from ..model.configuration import FullBandwidthConfig
from ..model.feedback import PREFIX_DRAWS, build_feedback_mask, document_starts, prefix_mixing_mask, prefix_row_seeds
from ..model.modeling import FullBandwidthForCausalLM, load_model
from ..utils.errors import TrainingStopped
from ..utils.io import atomic_save_pretrained, read_jsonl
from .checkpoint import METRICS, RUN_CONFIG, SUMMARY, find_checkpoint, load_trainer_state, model_fingerprint
from .config import DEFAULT_FUSION, TrainConfig, flag_name, same_value
from . import distributed as D
from .engine import Recipe, StepBatch, run
from .presets import backbone_config


def build_tokenizer_and_corpus(cfg: TrainConfig, tokenizer=None):
    """The :class:`fullband.data.corpus.Corpus` of ``cfg`` (tokenizer: given, ``--tokenizer``, the
    ``--init-from`` checkpoint's, or a BPE trained on the training documents); or, when ``--data`` is a directory
    made by ``fullband data prepare``, its :class:`fullband.data.shards.PreparedCorpus` (read lazily; its own
    tokenizer, split and packing: ``--vocab-size`` and ``--val-fraction`` do not apply, and a given tokenizer must
    have the same vocabulary)."""
    if is_prepared(cfg.data):
        corpus = open_prepared(cfg.data, cfg.seq_len)
        other = tokenizer
        if other is None and (cfg.tokenizer or cfg.init_from):
            path = cfg.tokenizer or cfg.init_from
            if any(os.path.exists(os.path.join(path, n)) for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
                other = load_tokenizer(path)
        if other is not None and other.get_vocab() != corpus.tokenizer.get_vocab():
            raise ValueError(f"--data {cfg.data!r} was prepared with another tokenizer than the run's (--tokenizer / "
                             "--init-from); prepare it with `fullband data prepare ... --tokenizer DIR`")
        return corpus
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
                                 max_position_embeddings=max(2048, cfg.seq_len), tie_word_embeddings=cfg.tie_embeddings,
                                 num_hidden_layers=cfg.layers)
        backbone = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = FullBandwidthForCausalLM.from_backbone(backbone, fusion=cfg.fusion, doc_start_token_id=bos, **feedback)
    return model.float()


def rows_fingerprint(*tensors: torch.Tensor) -> str:
    """A sha256 over the token ids (and shapes) of ``tensors``: the identity of rows trained or scored on."""
    h = hashlib.sha256()
    for rows in tensors:
        t = rows.detach().to("cpu", torch.int64).contiguous()
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def data_fingerprint(corpus) -> str:
    """The identity of what a run reads: :func:`rows_fingerprint` of the corpus's training and held-out rows (for
    prepared data, its shards' sha256, recorded when they were written: no pass over the data)."""
    if hasattr(corpus, "fingerprint"):
        return corpus.fingerprint
    return rows_fingerprint(corpus.train_rows, corpus.val_rows)


def run_inputs(cfg: TrainConfig, corpus) -> dict:
    """What a run depends on besides its options, recorded in its ``summary.json``: the data it read
    (:func:`data_fingerprint`) and the model it started from (``--init-from``'s :func:`model_fingerprint`)."""
    init = model_fingerprint(cfg.init_from) if cfg.init_from is not None else None
    return {"data_sha256": data_fingerprint(corpus), "init_sha256": init}


def fusion_was_trained(cfg: TrainConfig) -> bool:
    """Whether the run starts from a fullband checkpoint, whose fusion may already be trained."""
    if cfg.init_from is None:
        return False
    try:
        with open(os.path.join(cfg.init_from, "config.json")) as f:
            return json.load(f).get("model_type") == "fullband"
    except (OSError, ValueError):
        return False


def feedback_mask_for(rows: torch.Tensor, doc_start_id: int | None, prefix_mix: float, row_seeds) -> torch.Tensor:
    """Feedback mask of packed ``rows`` with prefix mixing, row i's draws seeded by ``row_seeds[i]``
    (:func:`fullband.model.feedback.prefix_row_seeds` of the rows' places in the step's global batch)."""
    mask = build_feedback_mask(rows, None, doc_start_id)
    if prefix_mix > 0:
        mask &= ~prefix_mixing_mask(document_starts(rows, doc_start_id), prefix_mix, row_seeds)
    return mask


def spread_rows(rows: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` rows spread evenly over ``rows`` (all when there are fewer): every held-out document gets its share,
    where the first ``n`` rows would all come from the first document."""
    if n >= rows.shape[0]:
        return rows if isinstance(rows, torch.Tensor) else rows[:]  # lazily read rows: read them now
    return rows[torch.linspace(0, rows.shape[0] - 1, n).round().long()]


@torch.no_grad()
def split_loss(model, rows: torch.Tensor, env: D.DistEnv, mode: str, **options) -> float:
    """The mean loss over ``rows`` (equal lengths, all positions predicted) in ``mode``, each rank scoring its own
    share of them (:func:`fullband.training.distributed.rank_share`) and the sums all-reduced: the evaluation's work
    divided by the number of ranks, not repeated on each (``options``: :func:`fullband.eval.scoring.row_losses`'s)."""
    index, counted = D.rank_share(rows.shape[0], env)
    per_row = row_losses(model, rows[index], mode, **options)
    sums = D.all_reduce_sum(torch.stack([per_row[counted].sum(), counted.sum().double()]).to(env.device), env)
    return float(sums[0] / sums[1])


class PretrainRecipe(Recipe):
    """Packed rows of a corpus, all positions predicted; the global batch split over ranks and micro-batches."""

    def __init__(self, cfg: TrainConfig, corpus=None, name: str = "train"):
        self.cfg, self.corpus, self.name = cfg, corpus, name

    def setup(self, tokenizer):
        cfg = self.cfg
        if self.corpus is None:
            self.corpus = build_tokenizer_and_corpus(cfg, tokenizer)
        self.tokenizer = self.corpus.tokenizer
        self.inputs = run_inputs(cfg, self.corpus)
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
                f"{cfg.batch_size * cfg.seq_len:,} tokens, "
                + (f"re-reading the {cfg.unique_batches * cfg.batch_size} rows of batches {cfg.data_offset}.."
                   f"{cfg.data_offset + cfg.unique_batches - 1} of the data order each epoch, " if cfg.unique_batches
                   else ""))

    def batch(self, step, num_passes, generator, env):
        cfg = self.cfg
        per_rank = cfg.batch_size // env.world_size
        micro = per_rank // cfg.grad_accum
        order = getattr(self.corpus, "order", "randperm")
        if cfg.unique_batches:  # re-read the rows of the ordinary order's batches data_offset .. +N-1, epoch after epoch
            index = pool_batch_rows(step, cfg.batch_size, self.train_rows.shape[0], cfg.seed, order,
                                    cfg.unique_batches, cfg.data_offset)
        else:
            index = batch_rows(step + cfg.data_offset, cfg.batch_size, self.train_rows.shape[0], cfg.seed, order)
        lo = env.rank * per_rank
        rows = self.train_rows[index[lo:lo + per_rank]]  # this rank's rows only: ranks read disjoint rows
        local_mask = None
        if num_passes > 1:
            # a row's mask depends on that row and on its place in the step's global batch alone: each rank draws
            # for its own rows and masks them as one process holding the whole batch would
            seeds = prefix_row_seeds(cfg.seed, step, range(lo, lo + per_rank))
            local_mask = feedback_mask_for(rows, self.doc_id, cfg.prefix_mix, seeds).to(env.device)
        local = rows.to(env.device)
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
        rec = {"val_loss": split_loss(model, rows, env, "standard", batch_size=bs), "val_tokens": rows[:, 1:].numel()}
        if cfg.num_passes > 1 and step > feedback_start:
            mode, label = cfg.fed_back_evaluation()
            rec["val_loss_passes"] = split_loss(model, rows, env, mode, num_passes=cfg.num_passes, batch_size=bs)
            rec["val_num_passes"] = label
        return rec

    finish_needs_model = False

    def final_model(self, model):
        # a plain run (feedback never on) is saved as the plain HF checkpoint of its backbone: its fusion was never
        # trained, and `lm_eval --model hf`, `pipeline(...)` and `--init-from` take it as the plain model it is
        return model if self.cfg.feedback_ever else model.backbone

    def finish(self, model, summary):
        atomic_save_pretrained(self.tokenizer, self.cfg.out, mode="merge")

    def summarize(self, summary):
        summary.update(self.inputs, prefix_draws=PREFIX_DRAWS)
        val = [r for r in read_jsonl(os.path.join(self.cfg.out, METRICS)) if r.get("split") == "val"]
        if val:
            summary["val_loss"] = val[-1]["val_loss"]


def train(cfg: TrainConfig, resume: bool = False, overwrite: bool = False, corpus=None, name: str = "train") -> dict:
    """Run (or continue) pre-training as ``cfg`` says; returns a summary dict (``status`` = ``done`` / ``stopped``
    / ``paused``). ``corpus`` (a :class:`fullband.data.corpus.Corpus`) skips loading and tokenizing the data."""
    return run(PretrainRecipe(cfg, corpus, name), resume, overwrite)


# ----------------------------------------------------------------------------------------------- reuse


_NOT_TRAJECTORY = ("progress", "tensorboard", "plot", "device", "eval_every", "eval_rows", "save_every",
                   "keep_checkpoints", "stop_after", "debug_kill_at_step")


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_summary(out: str) -> dict | None:
    """The ``summary.json`` of the run in ``out`` (``None`` when missing or unreadable)."""
    summary = _read_json(os.path.join(out, SUMMARY))
    return summary if isinstance(summary, dict) else None


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def run_differences(cfg: TrainConfig, corpus=None) -> list[str] | None:
    """How the finished run in ``cfg.out`` differs from ``cfg``: ``None`` when there is no finished run there, ``[]``
    when it is this very run (reused), else one entry per difference: an option that changes what is trained
    (logging, device and checkpoint options do not), ``the training data`` (other rows of ``corpus``), ``the
    --init-from model`` (other weights than the run started from)."""
    summary = read_summary(cfg.out)
    if summary is None or summary.get("status") != "done":
        return None
    return _differences(cfg, _read_json(os.path.join(cfg.out, RUN_CONFIG)), summary, corpus)


def _differences(cfg: TrainConfig, saved, summary: dict, corpus=None) -> list[str]:
    """:func:`run_differences` of a run whose options were ``saved`` and whose summary fields (what it read) are
    ``summary``."""
    saved = saved if isinstance(saved, dict) else {}
    # an option the run's saved config lacks is newer than the run: it ran as that option's default says
    saved = {**type(cfg)().to_dict(), **saved}
    # where the run lies and which path its initial model was read from are not what it trained: a run moved with
    # its directory (or an --init-from model copied elsewhere) is the same run; the initial model is compared by
    # its weights below, so only whether there is one counts here
    current = cfg.to_dict()
    saved["init_from"], current["init_from"] = saved.get("init_from") is not None, cfg.init_from is not None
    diffs = [f"--{flag_name(k)} {_short(saved.get(k))} -> {_short(v)}" for k, v in current.items()
             if k not in _NOT_TRAJECTORY and k != "out" and not same_value(k, saved.get(k), v)]
    if cfg.prefix_mix > 0 and cfg.feedback_ever and summary.get("prefix_draws", 1) != PREFIX_DRAWS:
        diffs.append(f"the prefix-mixing draws (layout {summary.get('prefix_draws', 1)} -> {PREFIX_DRAWS}: "
                     "that run was trained by an older version)")
    if corpus is not None and summary.get("data_sha256") != data_fingerprint(corpus):
        diffs.append("the training data" + ("" if summary.get("data_sha256") else " (not recorded by that run)"))
    if cfg.init_from is not None:
        try:
            init = model_fingerprint(cfg.init_from)
        except FileNotFoundError:
            init = None
        if init is None or summary.get("init_sha256") != init:
            diffs.append("the --init-from model")
    return diffs


def finished(cfg: TrainConfig, corpus=None) -> bool:
    """Whether ``cfg.out`` holds a finished run of exactly this configuration, data (``corpus``, when given) and
    initial model (a re-run of the experiment, or a second invocation with other arms or seeds, reuses it instead
    of training it again)."""
    return run_differences(cfg, corpus) == []


def stopped_checkpoint(cfg: TrainConfig, corpus=None) -> str | None:
    """The checkpoint to continue a run of exactly this configuration, data and initial model from
    (:func:`run_differences`' comparison), else ``None``: the last good step the stability guard left in ``cfg.out``
    when it stopped the run, or the last periodic checkpoint (``--save-every``) of a process that ended before the
    run did (killed, out of time). Both record what the run read."""
    try:
        ckpt = find_checkpoint(cfg.out) if os.path.isdir(cfg.out) else None
        state = load_trainer_state(ckpt) if ckpt is not None else None
    except (OSError, ValueError):  # an unreadable checkpoint is no place to resume from: the run starts over
        return None
    read = (state.get("guard_stop") or state.get("run_inputs")) if state is not None else None
    return ckpt if isinstance(read, dict) and _differences(cfg, state["config"], read, corpus) == [] else None


def require_done(summary: dict, name: str) -> dict:
    """``summary`` of a finished run; :class:`fullband.utils.errors.TrainingStopped` (one line naming run ``name``, the
    step and the checkpoint of its last good step) for a run the stability guard stopped."""
    if summary["status"] == "stopped":
        raise TrainingStopped(name, summary["out"], summary["stopped_at"], summary["last_good_step"],
                              summary["checkpoint"], summary["stop_reason"])
    if summary["status"] != "done":
        raise RuntimeError(f"{name}: training did not finish ({summary['status']}): {summary['message']}")
    return summary


def run_to_end(recipe: Recipe, corpus=None) -> dict:
    """An experiment's run of ``recipe`` (a :class:`PretrainRecipe`) to its end: continued from where the stability
    guard stopped the same run before, or from the last checkpoint of a process that ended mid-run
    (:func:`stopped_checkpoint`; ``corpus``: the data it reads), else trained from scratch, its directory
    overwritten. Returns the summary; :class:`fullband.utils.errors.TrainingStopped` when the
    guard stops it (:func:`require_done`)."""
    resume = stopped_checkpoint(recipe.cfg, corpus) is not None
    return require_done(run(recipe, resume=resume, overwrite=not resume), recipe.name)


def refuse_changed_runs(cfgs, corpus=None, overwrite: bool = False) -> None:
    """Before anything is trained: a one-line ``ValueError`` naming the differences when one of ``cfgs`` would
    replace a finished run of other options, data or initial model (``overwrite``: replace it)."""
    if overwrite:
        return
    for cfg in cfgs:
        diffs = run_differences(cfg, corpus)
        if diffs:
            raise ValueError(f"{cfg.out} holds a finished run that differs ({'; '.join(diffs)}); it is kept: pass "
                             "--overwrite to retrain it, or choose another --out")
