"""The SFT recipe (``fullband sft``): instruction tuning on chat conversations, loss on the assistant's tokens only.

Owns what supervised fine-tuning adds to :mod:`fullband.training.engine` (which runs the loop, the optimizer and
LR schedule, clipping, the stability guard, checkpoints and ``--resume``, DDP/FSDP2 and the metrics log):

* :class:`SFTConfig`: :class:`fullband.training.config.TrainConfig`'s options with SFT defaults
  (``--feedback-start`` 0: the checkpoint was pre-trained), plus the chat and final-evaluation options;
* the starting point (``--init-from DIR``, :func:`load_init`): a saved fullband model (``fullband train`` output,
  or an earlier ``fullband sft``), a ``fullband train`` run directory or one of its checkpoints
  (``OUT/checkpoints/step-N``), or a plain Hugging Face causal LM directory, retrofitted with a new fusion;
* batches (:mod:`fullband.training.chat`): one conversation per row, labels only on assistant tokens; the loss is
  the mean over the step's assistant tokens (exact under gradient accumulation and DDP: every micro-batch's loss is
  its sum over the whole step's token count); the objective is pre-training's (``L_1 + λ·mean(L_2..L_K)``, deep
  steps, prefix mixing per conversation, jitter);
* evaluation: held-out assistant-token loss per mode (:func:`evaluate_sft_loss`) and greedy replies to held-out
  conversations, graded where the reference ends in ``#### answer`` (:func:`generate_replies`);
* output in ``--out``: the model (``save_pretrained``) and its tokenizer with the chat template, ``metrics.jsonl``,
  ``summary.json`` (:func:`format_summary` renders it), ``curves.png``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from ..data.corpus import batch_rows, load_tokenizer, special_ids
from ..eval.problems import ANSWER_MARKER
from ..eval.reasoning import extract_answer, grade
from ..eval.scoring import MODES as EVAL_MODES
from ..eval.scoring import mode_logits
from ..model.generation import MODES as DECODE_MODES
from ..model.generation import generate
from ..model.modeling import FullBandwidthForCausalLM, load_model, max_positions
from ..utils.argtypes import FRACTION, NONNEG_INT, POSITIVE_FLOAT, POSITIVE_INT, int_at_least
from ..utils.io import atomic_save_pretrained
from . import distributed as D
from .chat import (
    BUILTIN_DATA,
    Encoded,
    check_conversation,
    collate,
    encode_conversations,
    load_conversations,
    padded_micro_batches,
    render_ids,
    set_chat_template,
    split_conversations,
)
from .checkpoint import find_checkpoint, load_model_state, load_trainer_state
from .config import DEFAULT_FUSION, TrainConfig, config_field, flag_name
from .engine import Recipe, StepBatch, run
from .pretrain import build_model

# ============================================================================================== config


@dataclass
class SFTConfig(TrainConfig):
    """Options of ``fullband sft``: :class:`fullband.training.config.TrainConfig`'s (same flags, same meaning) with SFT
    defaults, plus the chat options below. ``preset`` and ``vocab_size`` do not apply (the model comes from
    ``--init-from``)."""

    config_section: ClassVar[str] = "sft"
    skip_options: ClassVar[tuple] = ("preset", "vocab_size", "data_offset", "unique_batches", "debug_nan_steps", "debug_kill_at_step")

    steps: int = config_field(100, "optimizer steps (the LR and feedback schedules are fractions of this)", group="run", arg=POSITIVE_INT)
    data: str = config_field("arithmetic", "chat jsonl ({'messages': [{'role', 'content'}, ...]} a line), a folder of them, "
                   "'example' (the shipped file), or synthetic conversations: arithmetic, state, permutation, mixed",
                   group="data")
    num_examples: int = config_field(2000, "conversations generated for a synthetic --data", group="data", arg=POSITIVE_INT)
    chat_template: str | None = config_field(None, "Jinja chat-template file (default: fullband's; 'tokenizer': keep the "
                                   "tokenizer's own)", group="data")
    seq_len: int = config_field(256, "longest conversation in tokens (longer ones are truncated)", group="data", arg=int_at_least(2))
    init_from: str | None = config_field(None, "the model to tune: a saved fullband model, a `fullband train` run or "
                               "checkpoint directory, or a plain HF causal-LM directory (retrofitted)", group="model")
    lr: float | None = config_field(None, "peak learning rate (default: 3e-4)", group="optim", arg=POSITIVE_FLOAT)
    feedback_start: float = config_field(0.0, "fraction of the steps trained plain before feedback switches on (0: the "
                               "checkpoint was pre-trained with feedback)", branch=True, group="feedback", arg=FRACTION)
    eval_rows: int = config_field(64, "held-out conversations used by the periodic evaluation", traj=False, group="log", arg=POSITIVE_INT)
    final_eval: int = config_field(256, "held-out conversations for the final loss per mode (0: none)", traj=False, group="log", arg=NONNEG_INT)
    eval_exact: bool = config_field(True, "include the exact token-by-token recurrence in the final evaluation", traj=False,
                          group="log")
    gen_eval: int = config_field(32, "held-out conversations answered greedily at the end, per decode mode (0: none)",
                       traj=False, group="log", arg=NONNEG_INT)
    gen_modes: str = config_field("auto", "decode modes of --gen-eval, comma-separated (auto: standard, plus the model's "
                        "default feedback mode when it was trained with feedback)", traj=False, group="log")
    max_new_tokens: int = config_field(96, "longest greedy reply of --gen-eval", traj=False, group="log", arg=POSITIVE_INT)

    def validate(self, world_size: int = 1) -> SFTConfig:
        if self.init_from is None:
            raise ValueError("--init-from DIR is required: the fullband model, `fullband train` run or checkpoint, "
                             "or HF causal LM to tune")
        # TrainConfig's checks, with a built-in --data name standing for an existing source
        TrainConfig.validate(dataclasses.replace(self, data="shakespeare" if self.data in BUILTIN_DATA else self.data),
                             world_size)
        if self.num_examples < 1:
            raise ValueError(f"--num-examples must be >= 1, got {self.num_examples}")
        for name in ("final_eval", "gen_eval"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{flag_name(name)} must be >= 0, got {getattr(self, name)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.chat_template not in (None, "tokenizer") and not os.path.isfile(self.chat_template):
            raise FileNotFoundError(f"--chat-template file {self.chat_template!r} does not exist")
        self.resolved_gen_modes(None)
        return self

    def resolved_gen_modes(self, model) -> list[str]:
        if self.gen_modes != "auto":
            modes = [m.strip() for m in self.gen_modes.split(",") if m.strip()]
            bad = [m for m in modes if m not in DECODE_MODES]
            if bad or not modes:
                raise ValueError(f"--gen-modes: unknown mode(s) {bad or modes}; choose from {', '.join(DECODE_MODES)}")
            return modes
        if model is None:
            return ["standard"]
        default = getattr(model.config, "default_feedback_mode", "standard")
        return ["standard"] + ([default] if default != "standard" else [])


SKIP_FLAGS = SFTConfig.skip_options  # TrainConfig fields that are no options of `fullband sft`


# ============================================================================================== model


def resolve_init(path: str) -> tuple[str, str]:
    """``(kind, path)``: ``fullband`` (a saved fullband model), ``checkpoint`` (a ``fullband train`` checkpoint
    directory; a run directory without a final model resolves to its newest checkpoint) or ``hf`` (a plain causal
    LM, to retrofit)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--init-from directory {path!r} does not exist")
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            model_type = json.load(f).get("model_type")
        return ("fullband" if model_type == "fullband" else "hf"), path
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        return "checkpoint", path
    ckpt = find_checkpoint(path)
    if ckpt is not None:
        return "checkpoint", ckpt
    raise FileNotFoundError(f"--init-from {path!r} holds neither a saved model (config.json) nor a `fullband train` "
                            "checkpoint")


def load_init(cfg: SFTConfig, tokenizer=None):
    """``(model, tokenizer, kind)``: the model to tune (fp32, seeded by ``cfg.seed`` for a new fusion), its
    tokenizer (``--tokenizer`` or the checkpoint's) with the chat template set."""
    kind, path = resolve_init(cfg.init_from)
    feedback = dict(feedback_weight=float(cfg.feedback_weight), jitter=float(cfg.jitter),
                    detach_state=cfg.detach_state)
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path))) if kind == "checkpoint" else path
    if tokenizer is None:
        tok_path = cfg.tokenizer
        if tok_path is None:
            cands = [path, os.path.join(run_dir, "tokenizer"), run_dir]
            tok_path = next((c for c in cands if any(os.path.exists(os.path.join(c, n)) for n in
                                                     ("tokenizer.json", "tokenizer_config.json", "vocab.json"))), None)
            if tok_path is None:
                raise ValueError(f"--init-from {cfg.init_from!r} holds no tokenizer; give one with --tokenizer DIR")
        tokenizer = load_tokenizer(tok_path)
    set_chat_template(tokenizer, cfg.chat_template)
    torch.manual_seed(cfg.seed)
    if kind == "fullband":
        model = load_model(path, dtype=torch.float32)
        if model.config.fusion != cfg.fusion and cfg.fusion != DEFAULT_FUSION:  # the default: keep the model's
            raise ValueError(f"--init-from holds a fullband model with fusion {model.config.fusion!r}; "
                             f"--fusion {cfg.fusion!r} cannot change it")
        for k, v in feedback.items():
            setattr(model.config, k, v)
    elif kind == "checkpoint":
        saved = load_trainer_state(path)["config"]
        train_cfg = TrainConfig(**{k: v for k, v in saved.items() if k in TrainConfig.field_names()})
        train_cfg = dataclasses.replace(train_cfg, feedback_weight=cfg.feedback_weight, jitter=cfg.jitter,
                                        detach_state=cfg.detach_state)
        model = build_model(train_cfg, tokenizer)
        D.load_full_model_state(model, load_model_state(path))
        if not train_cfg.feedback_ever:
            model.config.default_feedback_mode = "standard"
    else:
        try:
            backbone = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"--init-from {path!r} is not a loadable HF causal LM: "
                             f"{str(err).splitlines()[0]}") from None
        bos, _ = special_ids(tokenizer)
        model = FullBandwidthForCausalLM.from_backbone(backbone, fusion=cfg.fusion, doc_start_token_id=bos, **feedback)
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer has {len(tokenizer)} entries but the model's vocabulary only {vocab}; give "
                         "the checkpoint's own tokenizer with --tokenizer")
    return model.float(), tokenizer, kind



# ============================================================================================== evaluation


@torch.no_grad()
def evaluate_sft_loss(model, enc: Encoded, mode: str = "standard", num_passes: int = 2, batch_size: int = 16,
                      max_examples: int | None = None, env: D.DistEnv | None = None) -> dict:
    """Mean cross-entropy on the assistant tokens of ``enc`` (``standard`` / ``passes`` / ``exact`` as in
    :func:`fullband.eval.scoring.evaluate_loss`). Under ``env`` with several ranks each rank scores its own share of
    the conversations (:func:`fullband.training.distributed.rank_share`) and the sums are all-reduced."""
    if mode not in EVAL_MODES:
        raise ValueError(f"unknown evaluation mode {mode!r}: choose one of {', '.join(EVAL_MODES)}")
    n = len(enc) if max_examples is None else min(len(enc), max_examples)
    if n == 0:
        raise ValueError("no held-out conversations to evaluate")
    env = env or D.DistEnv()
    share, counted = D.rank_share(n, env)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    pad = 0
    total, count = 0.0, 0
    try:
        for i in range(0, len(share), batch_size):
            b = collate(enc, share[i:i + batch_size].tolist(), pad)
            b["labels"][~counted[i:i + batch_size]] = -100  # a repeat that evens the ranks' shares: not counted
            b = {k: v.to(device) for k, v in b.items()}
            logits = mode_logits(model, b["input_ids"], mode, num_passes, b["attention_mask"])
            targets = b["labels"][:, 1:]
            total += float(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
                                           ignore_index=-100, reduction="sum"))
            count += int((targets != -100).sum())
    finally:
        model.train(was_training)
    total, count = D.all_reduce_sum(torch.tensor([total, float(count)], dtype=torch.float64, device=device), env).tolist()
    count = int(count)
    loss = total / max(1, count)
    return {"mode": mode, "num_passes": num_passes if mode == "passes" else (1 if mode == "standard" else None),
            "loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}


@torch.no_grad()
def generate_replies(model, tokenizer, convs: list[list[dict]], mode: str, max_new_tokens: int = 64,
                     batch_size: int = 8) -> list[dict]:
    """Greedy replies to the last user turn of each conversation (its final assistant message is the reference),
    graded with :func:`fullband.eval.reasoning.grade` where the reference ends in ``#### answer``."""
    device = next(model.parameters()).device
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    limit = max_positions(model.config.text_config)
    was_training = model.training
    model.eval()
    out = []
    try:
        for i in range(0, len(convs), batch_size):
            chunk = convs[i:i + batch_size]
            prompts, refs = [], []
            for conv in chunk:
                last = max(j for j, m in enumerate(conv) if m["role"] == "assistant")
                prompts.append(render_ids(tokenizer, conv[:last], add_generation_prompt=True))
                refs.append(conv[last]["content"])
            P = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), P), pad, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for r, p in enumerate(prompts):  # left padding
                ids[r, P - len(p):] = torch.tensor(p)
                attn[r, P - len(p):] = 1
            n = max_new_tokens if limit is None else min(max_new_tokens, limit - P)
            if n < 1:
                raise ValueError(f"a prompt of {P} tokens leaves no room to generate in {limit} positions")
            res = generate(model, ids.to(device), attn.to(device), mode=mode, max_new_tokens=n, eos_token_id=eos,
                           pad_token_id=pad)
            for conv, ref, toks in zip(chunk, refs, res.new_tokens.tolist()):
                hit = eos is not None and eos in toks
                toks = toks[: toks.index(eos)] if hit else toks
                reply = tokenizer.decode(toks, skip_special_tokens=True).strip()
                last = max(j for j, m in enumerate(conv) if m["role"] == "assistant")
                rec = {"prompt": conv[last - 1]["content"] if last else "", "reference": ref, "reply": reply,
                       "hit_eos": hit, "exact_match": reply == ref.strip()}
                if ANSWER_MARKER in ref:
                    gold = ref.rsplit(ANSWER_MARKER, 1)[1].strip()
                    strict, _ = extract_answer(reply)
                    rec["gold"], rec["answer"], rec["correct"] = gold, strict, grade(strict, gold)
                out.append(rec)
    finally:
        model.train(was_training)
    return out


# ============================================================================================== the recipe


class SFTRecipe(Recipe):
    """Conversations, one a row, right-padded; the loss on assistant tokens over the whole step's count."""

    val_label = "held-out assistant-token loss"
    plot_name = "sft"
    plot_title = "fullband sft (assistant tokens)"

    def __init__(self, cfg: SFTConfig, conversations=None, name: str = "sft"):
        self.cfg, self.conversations, self.name = cfg, conversations, name

    def setup(self, tokenizer):
        cfg = self.cfg
        template = tokenizer.chat_template if tokenizer is not None else None
        model, tokenizer, self.init_kind = load_init(cfg, tokenizer)
        if template:  # a resumed run keeps the template it started with
            tokenizer.chat_template = template
        convs = self.conversations
        if convs is None:
            convs = load_conversations(cfg.data, cfg.num_examples, cfg.seed)
        convs = [check_conversation(c, f"conversation {i}") for i, c in enumerate(convs)]
        train_convs, val_convs, self.duplicates = split_conversations(convs, cfg.val_fraction, cfg.seed)
        self.train_enc = encode_conversations(tokenizer, train_convs, cfg.seq_len)
        self.val_enc = encode_conversations(tokenizer, val_convs, cfg.seq_len)
        self.val_convs = [val_convs[i] for i in self.val_enc.source]
        if len(self.train_enc) == 0:
            raise ValueError("no training conversation has an assistant token within --seq-len")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.doc_id = model.config.doc_start_token_id
        self.tokenizer = tokenizer
        return model, tokenizer

    def build_model(self):
        template = self.tokenizer.chat_template
        model = load_init(self.cfg, self.tokenizer)[0]
        self.tokenizer.chat_template = template
        return model

    def run_config(self):
        return {**self.cfg.to_dict(), "command": "sft"}

    def describe(self, model):
        cfg, tr, va = self.cfg, self.train_enc, self.val_enc
        n_params = sum(p.numel() for p in model.parameters())
        return (f"{self.name}: {n_params / 1e6:.2f}M parameters ({self.init_kind} {cfg.init_from}); {len(tr)} training "
                f"conversations ({tr.assistant_tokens:,} assistant tokens of {tr.tokens:,}), "
                f"{len(va)} held out ({self.duplicates} duplicates of training ones dropped); "
                f"{tr.truncated + va.truncated} truncated to {cfg.seq_len} tokens, "
                f"{tr.dropped + va.dropped} dropped (no assistant token left); "
                f"{cfg.steps} steps x {cfg.batch_size} conversations, ")

    def batch(self, step, num_passes, generator, env):
        cfg, enc = self.cfg, self.train_enc
        idx = batch_rows(step, cfg.batch_size, len(enc), cfg.seed).tolist()
        micro_batches, num_items, step_tokens = padded_micro_batches(
            lambda rows: collate(enc, rows, self.pad_id), idx, step, num_passes, cfg, self.doc_id, env)
        # each micro-batch's loss is already its share of the step's mean; DDP averages the ranks' gradients,
        # which the world size undoes
        return StepBatch(micro_batches, loss_weight=float(env.world_size), tokens=step_tokens,
                         record={"tokens_step": step_tokens, "assistant_tokens": num_items})

    def evaluate(self, model, step, feedback_start, env):
        cfg = self.cfg
        if not len(self.val_enc):
            return None
        bs = max(1, cfg.batch_size // env.world_size // cfg.grad_accum)
        rec = {"val_loss": evaluate_sft_loss(model, self.val_enc, "standard", batch_size=bs,
                                             max_examples=cfg.eval_rows, env=env)["loss"]}
        if cfg.num_passes > 1 and step > feedback_start:
            rec["val_loss_passes"] = evaluate_sft_loss(model, self.val_enc, "passes", cfg.num_passes, bs,
                                                       cfg.eval_rows, env=env)["loss"]
            rec["val_num_passes"] = cfg.num_passes
        return rec

    def final_model(self, model):
        if not self.cfg.feedback_ever and self.init_kind == "hf":  # a retrofit whose fusion was never trained
            model.config.default_feedback_mode = "standard"
        return model

    def finish(self, model, summary):
        """Save the tokenizer into OUT (the model is saved); evaluate held-out loss per mode and greedy replies."""
        cfg = self.cfg
        atomic_save_pretrained(self.tokenizer, cfg.out, mode="merge")
        evals = []
        if cfg.final_eval and len(self.val_enc):
            plan = [("standard", 1)]
            if max(cfg.num_passes, 1) > 1:
                plan.append(("passes", cfg.num_passes))
            if cfg.eval_exact:
                plan.append(("exact", None))
            for mode, k in plan:
                evals.append(evaluate_sft_loss(model, self.val_enc, mode, k or 2, batch_size=16,
                                               max_examples=cfg.final_eval))
        summary["eval"] = evals
        gens = {}
        if cfg.gen_eval and self.val_convs:
            for mode in cfg.resolved_gen_modes(model):
                recs = generate_replies(model, self.tokenizer, self.val_convs[: cfg.gen_eval], mode, cfg.max_new_tokens)
                graded = [r for r in recs if "correct" in r]
                gens[mode] = {"n": len(recs), "graded": len(graded),
                              "accuracy": (sum(r["correct"] for r in graded) / len(graded)) if graded else None,
                              "exact_match": sum(r["exact_match"] for r in recs) / len(recs),
                              "eos_rate": sum(r["hit_eos"] for r in recs) / len(recs), "records": recs}
        summary["generation"] = gens

    def summarize(self, summary):
        cfg, tr, va = self.cfg, self.train_enc, self.val_enc
        summary.update({"init_from": cfg.init_from, "init_kind": self.init_kind, "data": {
            "source": cfg.data if self.conversations is None else "(given)", "train": len(tr), "val": len(va),
            "val_duplicates_dropped": self.duplicates, "truncated": tr.truncated + va.truncated,
            "dropped_no_assistant_tokens": tr.dropped + va.dropped, "train_assistant_tokens": tr.assistant_tokens,
            "train_tokens": tr.tokens}})


def sft(cfg: SFTConfig, resume: bool = False, overwrite: bool = False, conversations=None,
        name: str = "sft") -> dict:
    """Run (or continue) supervised fine-tuning as ``cfg`` says; returns a summary dict (``status`` = ``done`` /
    ``stopped`` / ``paused``). ``conversations`` (lists of messages) replaces ``cfg.data``."""
    return run(SFTRecipe(cfg, conversations, name), resume, overwrite)


def format_summary(summary: dict) -> str:
    """The final evaluation as markdown tables."""
    lines = []
    if summary.get("eval"):
        lines += ["| mode | held-out assistant-token loss | perplexity | tokens |", "| --- | ---: | ---: | ---: |"]
        for e in summary["eval"]:
            label = {"standard": "standard (K=1)", "exact": "exact recurrence"}.get(
                e["mode"], f"passes (K={e['num_passes']})")
            lines.append(f"| {label} | {e['loss']:.4f} | {e['perplexity']:.3f} | {e['tokens']:,} |")
    if summary.get("generation"):
        lines += ["", "| decode mode | replies | graded | accuracy | exact match | ended with EOS |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for mode, g in summary["generation"].items():
            acc = "–" if g["accuracy"] is None else f"{g['accuracy']:.3f}"
            lines.append(f"| {mode} | {g['n']} | {g['graded']} | {acc} | {g['exact_match']:.3f} | "
                         f"{g['eos_rate']:.3f} |")
        first = next(iter(summary["generation"].values()))["records"][:2]
        for r in first:
            lines += ["", f"> User: {r['prompt']}", f"> Reference: {r['reference']}", f"> Reply: {r['reply']}"]
    return "\n".join(lines)
