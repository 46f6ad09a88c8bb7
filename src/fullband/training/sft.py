"""``fullband sft``: instruction tuning on chat conversations, loss on the assistant's tokens only.

Owns supervised fine-tuning of a full-bandwidth model:

* data: chat jsonl, one conversation a line, ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...},
  ...]}`` (at least one assistant message; a ``system`` message only first); or an offline built-in set:
  ``arithmetic`` / ``state`` / ``permutation`` / ``mixed`` (conversations generated from the synthetic reasoning
  tasks of :mod:`fullband.reasoning`, the assistant answering with its chain of thought and ``#### answer``), or
  ``example`` (the small file shipped in ``fullband/tasks/sft/example.jsonl``). Conversations are split into
  training and held-out ones (seeded, by conversation; a held-out conversation identical to a training one is
  dropped);
* the chat template (:data:`CHAT_TEMPLATE`, Jinja, set as ``tokenizer.chat_template`` and saved with the
  tokenizer)::

      <bos>System: {system}\\n\\nUser: {user}\\n\\nAssistant: {assistant}<eos>\\n\\nUser: ...

  A generation prompt ends in ``Assistant:``; the assistant's turn is ``" " + content + eos`` inside a
  ``{% generation %}`` block, so ``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks exactly
  the tokens the loss is taken on (the reply and the EOS that ends it). ``--chat-template FILE`` uses another
  template (``tokenizer``: keep the tokenizer's own); one without generation blocks gets its assistant tokens by
  rendering the conversation incrementally;
* batches: one conversation per row (truncated to ``--seq-len``), right padding with an attention mask, labels
  ``-100`` everywhere but on assistant tokens; the loss is the mean over the step's assistant tokens (exact under
  gradient accumulation and DDP: every micro-batch's loss is divided by the whole step's token count);
* the objective is pre-training's: :class:`fullband.FeedbackSchedule` (``--feedback-start`` defaults to 0 here,
  since the checkpoint was pre-trained), ``loss = L_1 + λ·mean(L_2..L_K)``, deep steps, prefix mixing per
  conversation, jitter;
* the starting point (``--init-from DIR``): a saved fullband model (``fullband train`` output, or an earlier
  ``fullband sft``), a ``fullband train`` run directory or one of its checkpoints (``OUT/checkpoints/step-N``),
  or a plain Hugging Face causal LM directory, retrofitted with a new fusion;
* everything else comes from :mod:`fullband.train`: the AdamW parameter groups, the LR schedule, gradient
  clipping, the stability guard, checkpoints and ``--resume``, the metrics log and progress bar;
* output in ``--out``: the model (``save_pretrained``) and its tokenizer with the chat template, ``metrics.jsonl``,
  ``summary.json`` (held-out assistant-token loss per mode; greedy answers to held-out conversations, graded
  where the reference ends in ``#### answer``), ``curves.png``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

from ..training import distributed as D
from ..utils.io import atomic_save_pretrained, atomic_write_json, read_jsonl, rewrite_jsonl
from .train import TrainConfig, _f, _flag

ROLES = ("system", "user", "assistant")
SYNTHETIC = ("arithmetic", "state", "permutation", "mixed")
EXAMPLE = "example"
BUILTIN_DATA = SYNTHETIC + (EXAMPLE,)

#: The chat template: ``<bos>``, then ``System: ...`` / ``User: ...`` blocks ended by a blank line, and assistant
#: turns ``Assistant: {content}<eos>`` (the generation block: the loss is taken on it). A generation prompt ends
#: in ``Assistant:`` so that the reply starts with a space, as in training.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ 'System: ' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant:' }}"
    "{% generation %}{{ ' ' + message['content'] + eos_token }}{% endgeneration %}{{ '\\n\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# (all literal text is in Jinja expressions: Hugging Face renders templates with trim_blocks, which would eat a
# newline written right after a block tag)

SYSTEM_PROMPTS = (
    "You are a careful assistant. Work step by step, then give the final answer after ####.",
    "Solve the problem. Show the steps.",
    "Answer with your working and the result after ####.",
)
USER_PREFIXES = ("", "Solve: ", "Compute ", "Please work this out: ", "Question: ")


# ============================================================================================== data


def example_path() -> str:
    """The small chat jsonl shipped with the package (``--data example``)."""
    from importlib import resources

    return str(resources.files("fullband") / "tasks" / "sft" / "example.jsonl")


def check_conversation(conv, where: str = "conversation") -> list[dict]:
    """The messages of ``conv`` (a dict with ``messages``, or the list itself), checked; ``ValueError`` otherwise."""
    messages = conv.get("messages") if isinstance(conv, dict) else conv
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: needs a non-empty 'messages' list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} must be an object with string 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {i} has role {m['role']!r}; roles are {', '.join(ROLES)}")
        if m["role"] == "system" and i != 0:
            raise ValueError(f"{where}: a system message may only come first (message {i})")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where}: has no assistant message (nothing to learn from)")
    return out


def read_chat_jsonl(path: str) -> list[list[dict]]:
    """Conversations (lists of messages) from a chat jsonl file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"chat data file {path!r} does not exist")
    from ..utils.io import iter_jsonl_objects

    convs = [check_conversation(record, f"{path}:{n}") for n, record in
             iter_jsonl_objects(path, "an object with a 'messages' list")]
    if not convs:
        raise ValueError(f"chat data file {path!r} holds no conversations")
    return convs


def synthetic_conversations(task: str, n: int, seed: int = 0, multi_turn: float = 0.2,
                            system: float = 0.3) -> list[list[dict]]:
    """``n`` conversations from the synthetic reasoning tasks: the user asks a question, the assistant answers
    with the chain of thought and ``#### answer`` (:func:`fullband.reasoning.format_target`). A ``system``
    fraction start with a system prompt; a ``multi_turn`` fraction have a second question and answer.
    ``task`` ``mixed`` draws from arithmetic, state and permutation in turn."""
    from ..eval.reasoning import format_target, make_problems

    if task not in SYNTHETIC:
        raise ValueError(f"unknown synthetic chat task {task!r}: choose one of {', '.join(SYNTHETIC)}")
    if n < 1:
        raise ValueError(f"number of conversations must be >= 1, got {n}")
    tasks = ["arithmetic", "state", "permutation"] if task == "mixed" else [task]
    pools = {t: iter(make_problems(t, 2 * n, seed)) for t in tasks}
    rng = random.Random(f"sft:{task}:{seed}")

    def turn(t):
        p = next(pools[t])
        prefix = rng.choice(USER_PREFIXES) if t == "arithmetic" else ""
        return [{"role": "user", "content": prefix + p.question},
                {"role": "assistant", "content": format_target(p, cot=True).strip()}]

    convs = []
    for i in range(n):
        t = tasks[i % len(tasks)]
        msgs = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < system else []
        msgs += turn(t)
        if rng.random() < multi_turn:
            msgs += turn(t)
        convs.append(msgs)
    return convs


def load_conversations(source: str, num_examples: int = 2000, seed: int = 0) -> list[list[dict]]:
    """Conversations from a chat jsonl file, a folder of them, or a built-in name (:data:`BUILTIN_DATA`)."""
    if source in SYNTHETIC:
        return synthetic_conversations(source, num_examples, seed)
    if source == EXAMPLE:
        return read_chat_jsonl(example_path())
    if os.path.isdir(source):
        convs = []
        for root, dirs, files in os.walk(source):
            dirs.sort()
            convs += [c for name in sorted(files) if name.endswith(".jsonl")
                      for c in read_chat_jsonl(os.path.join(root, name))]
        if not convs:
            raise ValueError(f"folder {source!r} holds no .jsonl chat files")
        return convs
    if not os.path.exists(source):
        raise FileNotFoundError(f"--data {source!r} does not exist (a chat .jsonl file with 'messages', a folder of "
                                f"them, or one of {', '.join(BUILTIN_DATA)})")
    return read_chat_jsonl(source)


def split_conversations(convs: list[list[dict]], val_fraction: float, seed: int):
    """``(train, val, dropped)``: a seeded split by conversation; held-out conversations identical to a training
    one are dropped (``dropped`` counts them)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    order = list(range(len(convs)))
    random.Random(seed * 1_000_003 + 7).shuffle(order)
    n_val = min(len(convs) - 1, math.ceil(val_fraction * len(convs))) if val_fraction > 0 else 0
    val_idx = set(order[:n_val])
    train = [c for i, c in enumerate(convs) if i not in val_idx]
    seen = {json.dumps(c, sort_keys=True) for c in train}
    val = [c for i, c in enumerate(convs) if i in val_idx]
    kept = [c for c in val if json.dumps(c, sort_keys=True) not in seen]
    return train, kept, len(val) - len(kept)


# ============================================================================================== template + tokens


def set_chat_template(tokenizer, template: str | None = None):
    """Put the chat template on ``tokenizer``: ``None`` = :data:`CHAT_TEMPLATE`, ``"tokenizer"`` = keep the
    tokenizer's own, a path = the Jinja file there. Returns the tokenizer."""
    if tokenizer.eos_token is None:
        raise ValueError("the tokenizer has no EOS token to end an assistant turn with")
    if template is None:
        tokenizer.chat_template = CHAT_TEMPLATE
    elif template == "tokenizer":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat-template tokenizer: the tokenizer has no chat template of its own")
    else:
        if not os.path.isfile(template):
            raise FileNotFoundError(f"--chat-template file {template!r} does not exist")
        with open(template, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    return tokenizer


def _has_generation_block(tokenizer) -> bool:
    t = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(t, str) and "generation" in t and "endgeneration" in t


def _render_ids(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                        return_dict=True)
    return list(out["input_ids"])


def encode_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """``(input_ids, assistant_mask)`` of a whole conversation under the tokenizer's chat template.

    With ``{% generation %}`` blocks, Hugging Face's ``return_assistant_tokens_mask``; otherwise by rendering
    incrementally: the tokens an assistant message adds after the generation prompt before it are its tokens
    (``ValueError`` when the template does not render prefixes stably)."""
    if _has_generation_block(tokenizer):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
        if any(mask):
            return ids, mask
    ids = _render_ids(tokenizer, messages)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render_ids(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render_ids(tokenizer, messages[:i + 1])
        if ids[:len(upto)] != upto or upto[:len(before)] != before:
            raise ValueError("the chat template does not render conversation prefixes as prefixes of the whole; "
                             "add {% generation %} blocks around the assistant turns")
        end = len(upto)
        added = upto[len(before):]
        if tokenizer.eos_token_id in added:  # the turn separator after the EOS is template text, not the reply
            end = len(before) + len(added) - added[::-1].index(tokenizer.eos_token_id)
        for j in range(len(before), end):
            mask[j] = 1
    return ids, mask


@dataclass
class Encoded:
    """Tokenized conversations: ``ids[i]`` and ``mask[i]`` (1 = assistant token, trained on)."""

    ids: list[list[int]]
    mask: list[list[int]]
    source: list[int] = dataclasses.field(default_factory=list)  # index of each in the conversations given
    truncated: int = 0
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def tokens(self) -> int:
        return sum(len(x) for x in self.ids)

    @property
    def assistant_tokens(self) -> int:
        return sum(sum(m[1:]) for m in self.mask)


def encode_conversations(tokenizer, convs: list[list[dict]], max_len: int) -> Encoded:
    """Every conversation, truncated to ``max_len`` tokens; one left with no assistant token is dropped."""
    enc = Encoded([], [])
    for n, conv in enumerate(convs):
        ids, mask = encode_conversation(tokenizer, conv)
        if len(ids) > max_len:
            ids, mask = ids[:max_len], mask[:max_len]
            enc.truncated += 1
        if sum(mask[1:]) == 0:
            enc.dropped += 1
            continue
        enc.ids.append(ids)
        enc.mask.append(mask)
        enc.source.append(n)
    return enc


def collate(enc: Encoded, indices, pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``labels`` (``-100`` off the assistant's tokens), right-padded to the
    longest of the batch."""
    indices = [int(i) for i in indices]
    T = max(len(enc.ids[i]) for i in indices)
    B = len(indices)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    for r, i in enumerate(indices):
        x, m = torch.tensor(enc.ids[i]), torch.tensor(enc.mask[i], dtype=torch.bool)
        n = x.numel()
        ids[r, :n] = x
        attn[r, :n] = 1
        labels[r, :n] = torch.where(m, x, torch.full_like(x, -100))
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def predicted_tokens(labels: torch.Tensor) -> int:
    """Tokens the loss is taken on (label positions 1.. that are not -100; the model shifts labels by one)."""
    return int((labels[:, 1:] != -100).sum())


def sft_feedback_mask(batch: dict, doc_start_id: int | None, prefix_mix: float,
                      generator: torch.Generator | None) -> torch.Tensor:
    """Feedback mask of a right-padded batch, with per-conversation prefix mixing (the padding is a segment of
    its own, so a plain prefix is drawn over the conversation's length)."""
    from ..model.feedback import build_feedback_mask, document_starts, prefix_mixing_mask

    ids, attn = batch["input_ids"], batch["attention_mask"]
    mask = build_feedback_mask(ids, attn, doc_start_id)
    if prefix_mix > 0:
        starts = document_starts(ids, doc_start_id, attn)
        real = attn.bool()
        starts[:, 1:] |= ~real[:, 1:] & real[:, :-1]  # first padding position starts a segment
        mask &= ~prefix_mixing_mask(starts, prefix_mix, generator)
    return mask


# ============================================================================================== evaluation


@torch.no_grad()
def evaluate_sft_loss(model, enc: Encoded, mode: str = "standard", num_passes: int = 2, batch_size: int = 16,
                      max_examples: int | None = None) -> dict:
    """Mean cross-entropy on the assistant tokens of ``enc`` (``standard`` / ``passes`` / ``exact`` as in
    :func:`fullband.evaluate.evaluate_loss`)."""
    import torch.nn.functional as F

    from ..eval.scoring import MODES

    if mode not in MODES:
        raise ValueError(f"unknown evaluation mode {mode!r}: choose one of {', '.join(MODES)}")
    n = len(enc) if max_examples is None else min(len(enc), max_examples)
    if n == 0:
        raise ValueError("no held-out conversations to evaluate")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    pad = 0
    total, count = 0.0, 0
    try:
        for i in range(0, n, batch_size):
            b = {k: v.to(device) for k, v in collate(enc, range(i, min(n, i + batch_size)), pad).items()}
            if mode == "exact":
                logits = model.recurrent_forward(b["input_ids"], b["attention_mask"]).logits
            else:
                logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                               num_passes=num_passes if mode == "passes" else 1).logits
            targets = b["labels"][:, 1:]
            total += float(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
                                           ignore_index=-100, reduction="sum"))
            count += int((targets != -100).sum())
    finally:
        model.train(was_training)
    loss = total / max(1, count)
    return {"mode": mode, "num_passes": num_passes if mode == "passes" else (1 if mode == "standard" else None),
            "loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}


@torch.no_grad()
def generate_replies(model, tokenizer, convs: list[list[dict]], mode: str, max_new_tokens: int = 64,
                     batch_size: int = 8) -> list[dict]:
    """Greedy replies to the last user turn of each conversation (its final assistant message is the reference),
    graded with :func:`fullband.reasoning.grade` where the reference ends in ``#### answer``."""
    from ..model.generation import generate
    from ..model.modeling import max_positions
    from ..eval.reasoning import ANSWER_MARKER, extract_answer, grade

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
                prompts.append(_render_ids(tokenizer, conv[:last], add_generation_prompt=True))
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


# ============================================================================================== config


@dataclass
class SFTConfig(TrainConfig):
    """Options of ``fullband sft``: :class:`fullband.train.TrainConfig`'s (same flags, same meaning) with SFT
    defaults, plus the chat options below. ``preset`` and ``vocab_size`` do not apply (the model comes from
    ``--init-from``)."""

    steps: int = _f(100, "optimizer steps (the LR and feedback schedules are fractions of this)", group="run")
    data: str = _f("arithmetic", "chat jsonl ({'messages': [{'role', 'content'}, ...]} a line), a folder of them, "
                   "'example' (the shipped file), or synthetic conversations: arithmetic, state, permutation, mixed",
                   group="data")
    num_examples: int = _f(2000, "conversations generated for a synthetic --data", group="data")
    chat_template: str | None = _f(None, "Jinja chat-template file (default: fullband's; 'tokenizer': keep the "
                                   "tokenizer's own)", group="data")
    seq_len: int = _f(256, "longest conversation in tokens (longer ones are truncated)", group="data")
    init_from: str | None = _f(None, "the model to tune: a saved fullband model, a `fullband train` run or "
                               "checkpoint directory, or a plain HF causal-LM directory (retrofitted)", group="model")
    lr: float | None = _f(None, "peak learning rate (default: 3e-4)", group="optim")
    feedback_start: float = _f(0.0, "fraction of the steps trained plain before feedback switches on (0: the "
                               "checkpoint was pre-trained with feedback)", branch=True, group="feedback")
    eval_rows: int = _f(64, "held-out conversations used by the periodic evaluation", traj=False, group="log")
    final_eval: int = _f(256, "held-out conversations for the final loss per mode (0: none)", traj=False, group="log")
    eval_exact: bool = _f(True, "include the exact token-by-token recurrence in the final evaluation", traj=False,
                          group="log")
    gen_eval: int = _f(32, "held-out conversations answered greedily at the end, per decode mode (0: none)",
                       traj=False, group="log")
    gen_modes: str = _f("auto", "decode modes of --gen-eval, comma-separated (auto: standard, plus the model's "
                        "default feedback mode when it was trained with feedback)", traj=False, group="log")
    max_new_tokens: int = _f(96, "longest greedy reply of --gen-eval", traj=False, group="log")

    def validate(self, world_size: int = 1) -> "SFTConfig":
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
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.chat_template not in (None, "tokenizer") and not os.path.isfile(self.chat_template):
            raise FileNotFoundError(f"--chat-template file {self.chat_template!r} does not exist")
        self.resolved_gen_modes(None)
        return self

    def resolved_gen_modes(self, model) -> list[str]:
        from ..model.generation import MODES

        if self.gen_modes != "auto":
            modes = [m.strip() for m in self.gen_modes.split(",") if m.strip()]
            bad = [m for m in modes if m not in MODES]
            if bad or not modes:
                raise ValueError(f"--gen-modes: unknown mode(s) {bad or modes}; choose from {', '.join(MODES)}")
            return modes
        if model is None:
            return ["standard"]
        default = getattr(model.config, "default_feedback_mode", "standard")
        return ["standard"] + ([default] if default != "standard" else [])


SKIP_FLAGS = ("preset", "vocab_size", "debug_nan_steps", "debug_kill_at_step")


def _sft_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(SFTConfig)}


def make_sft_config(explicit: dict, config_file: str | None = None, base: dict | None = None) -> SFTConfig:
    """Defaults < ``base`` (a resumed run's config) < config file (a ``sft:`` section or top-level keys) <
    explicit options."""
    fields_ = _sft_fields()
    values = SFTConfig().to_dict()
    file_values = _read_sft_config_file(config_file) if config_file else {}
    for layer in (base or {}), file_values, explicit:
        for k, v in layer.items():
            if k in values:
                values[k] = v
    for name, f in fields_.items():
        v = values[name]
        if str(f.type).startswith("int") and isinstance(v, float) and v.is_integer():
            values[name] = int(v)
    return SFTConfig(**values)


def _read_sft_config_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    with open(path, "rb") as f:
        raw = f.read().decode("utf-8")
    try:
        if path.endswith(".toml"):
            import tomllib

            data = tomllib.loads(raw)
        else:
            import yaml

            data = yaml.safe_load(raw)
    except Exception as err:  # noqa: BLE001 - any parse error is a user error
        raise ValueError(f"config file {path!r} could not be parsed: {str(err).splitlines()[0]}") from None
    data = data or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of option names to values")
    if isinstance(data.get("sft"), dict) and len(data) == 1:
        data = data["sft"]
    fields_ = _sft_fields()
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in fields_ or name in SKIP_FLAGS:
            raise ValueError(f"config file {path!r}: unknown option {key!r}")
        out[name] = value
    return out


# ============================================================================================== model


def resolve_init(path: str) -> tuple[str, str]:
    """``(kind, path)``: ``fullband`` (a saved fullband model), ``checkpoint`` (a ``fullband train`` checkpoint
    directory; a run directory without a final model resolves to its newest checkpoint) or ``hf`` (a plain causal
    LM, to retrofit)."""
    from .train import find_checkpoint

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
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ..data.corpus import load_tokenizer, special_ids
    from ..model.modeling import FullBandwidthForCausalLM, load_model
    from .train import build_model, load_checkpoint_state

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
        if model.config.fusion != cfg.fusion and cfg.fusion != "glu":
            raise ValueError(f"--init-from holds a fullband model with fusion {model.config.fusion!r}; "
                             f"--fusion {cfg.fusion!r} cannot change it")
        for k, v in feedback.items():
            setattr(model.config, k, v)
    elif kind == "checkpoint":
        saved = load_checkpoint_state(path)["config"]
        train_cfg = TrainConfig(**{k: v for k, v in saved.items() if k in TrainConfig.field_names()})
        train_cfg = dataclasses.replace(train_cfg, feedback_weight=cfg.feedback_weight, jitter=cfg.jitter,
                                        detach_state=cfg.detach_state)
        model = build_model(train_cfg, tokenizer)
        D.load_full_model_state(model, load_file(os.path.join(path, "model.safetensors")))
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


# ============================================================================================== training


def sft_forward_backward(model, micro_batches, num_passes: int, autocast, num_items: int, scale: float = 1.0):
    """Forward + backward of the step's micro-batches (dicts with ``input_ids``, ``attention_mask``, ``labels``,
    ``feedback_mask``). Every micro-batch's loss is its assistant-token sum over the step's ``num_items`` tokens,
    so the gradients add up to the mean over the step. Returns the summed ``(loss, pass_losses)``."""
    n = len(micro_batches)
    items = torch.tensor(float(num_items))
    loss_sum = pass_sum = None
    for i, b in enumerate(micro_batches):
        with D.no_sync(model, skip=i < n - 1), autocast():
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                        num_passes=num_passes, feedback_mask=b["feedback_mask"],
                        num_items_in_batch=items.to(b["input_ids"].device))
        (out.loss * scale).backward()
        ls, ps = out.loss.detach().float(), out.pass_losses.float()
        loss_sum = ls if loss_sum is None else loss_sum + ls
        pass_sum = ps if pass_sum is None else pass_sum + ps
    return loss_sum, pass_sum


def _check_resume(cfg: SFTConfig, saved: dict) -> None:
    old = SFTConfig(**{k: v for k, v in saved["config"].items() if k in _sft_fields()})
    diff, branch = [], []
    for f in dataclasses.fields(SFTConfig):
        if f.metadata.get("traj") and getattr(old, f.name) != getattr(cfg, f.name):
            (branch if f.metadata.get("branch") else diff).append(f.name)
    if diff:
        raise ValueError(f"--resume: {', '.join('--' + _flag(d) for d in diff)} differ from the checkpoint's run; "
                         "a resumed run must keep them (start a new --out to change them)")
    if branch and (saved["step"] > old.schedule().start_step(old.steps)
                   or saved["step"] > cfg.schedule().start_step(cfg.steps)):
        raise ValueError(f"--resume: {', '.join('--' + _flag(d) for d in branch)} differ from the checkpoint's run; "
                         "feedback settings may only change while the checkpoint precedes the feedback start")


def sft(cfg: SFTConfig, resume: bool = False, overwrite: bool = False, conversations=None,
        name: str = "sft") -> dict:
    """Run (or continue) supervised fine-tuning as ``cfg`` says; returns a summary dict (``status`` = ``done`` /
    ``stopped`` / ``paused``). ``conversations`` (lists of messages) replaces ``cfg.data``."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    env = D.init_distributed(cfg.device)
    try:
        return _sft(cfg, env, resume, overwrite, conversations, name)
    finally:
        D.shutdown(env)


def _sft(cfg: SFTConfig, env: D.DistEnv, resume: bool, overwrite: bool, conversations, name: str) -> dict:
    from safetensors.torch import load_file

    from ..data.corpus import batch_rows, load_tokenizer
    from .train import (METRICS, RUN_CONFIG, TOKENIZER_DIR, Guard, Run, _clean, _clear_outputs, _Log, _prepare_out,
                        _set_rng_state, autocast_context, build_optimizer, load_checkpoint_state, lr_at,
                        save_checkpoint)

    cfg.validate(env.world_size)
    ckpt = _prepare_out(cfg, resume, overwrite, env)
    saved = load_checkpoint_state(ckpt) if ckpt is not None else None
    if saved is not None:
        _check_resume(cfg, saved)

    # ---- data, tokenizer and model (nothing written yet: bad input fails here)
    tok_dir = os.path.join(cfg.out, TOKENIZER_DIR)
    resumed_tok = load_tokenizer(tok_dir) if (ckpt is not None and os.path.isdir(tok_dir)) else None
    template = resumed_tok.chat_template if resumed_tok is not None else None
    model, tokenizer, init_kind = load_init(cfg, resumed_tok)
    if template:  # a resumed run keeps the template it started with
        tokenizer.chat_template = template
    convs = conversations if conversations is not None else load_conversations(cfg.data, cfg.num_examples, cfg.seed)
    convs = [check_conversation(c, f"conversation {i}") for i, c in enumerate(convs)]
    train_convs, val_convs, dup = split_conversations(convs, cfg.val_fraction, cfg.seed)
    train_enc = encode_conversations(tokenizer, train_convs, cfg.seq_len)
    val_enc = encode_conversations(tokenizer, val_convs, cfg.seq_len)
    if len(train_enc) == 0:
        raise ValueError("no training conversation has an assistant token within --seq-len")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    # ---- output directory
    if env.is_main:
        if overwrite and ckpt is None:
            _clear_outputs(cfg.out)
        os.makedirs(cfg.out, exist_ok=True)
        if not os.path.isdir(tok_dir):
            atomic_save_pretrained(tokenizer, tok_dir)
        atomic_write_json(os.path.join(cfg.out, RUN_CONFIG), {**cfg.to_dict(), "command": "sft"})
    D.barrier(env)

    model.to(env.device).train()
    model = D.wrap_model(model, env, cfg.parallel) if env.distributed else model
    sharded = D.is_sharded(D.unwrap(model))
    optimizer = build_optimizer(D.unwrap(model), cfg, env.device, sharded)
    prefix_gen = torch.Generator().manual_seed(cfg.seed * 7919 + 17)
    torch.manual_seed(cfg.seed * 1_000_003 + 1 + env.rank)
    random.seed(cfg.seed + env.rank)
    guard = Guard(spike_factor=cfg.spike_factor)
    run = Run(cfg, env, model, optimizer, prefix_gen, guard)
    start = 0
    if ckpt is not None:
        D.load_full_model_state(model, load_file(os.path.join(ckpt, "model.safetensors")))
        D.load_full_optimizer_state(model, optimizer,
                                    torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=False))
        rng_file = os.path.join(ckpt, f"rng-rank{env.rank}.pt")
        if not os.path.exists(rng_file):
            rng_file = os.path.join(ckpt, "rng-rank0.pt")
        _set_rng_state(torch.load(rng_file, weights_only=False), prefix_gen)
        run.guard = guard = Guard(spike_factor=cfg.spike_factor,
                                  **{k: v for k, v in saved["guard"].items() if k != "spike_factor"})
        start = saved["step"]
        run.elapsed_before = saved.get("elapsed", 0.0)
        if env.is_main:
            rewrite_jsonl(os.path.join(cfg.out, METRICS),
                          [r for r in read_jsonl(os.path.join(cfg.out, METRICS)) if r.get("step", 0) <= start])
    D.barrier(env)

    sched = cfg.schedule()
    fb_start = sched.start_step(cfg.steps)
    doc_id = D.unwrap(model).config.doc_start_token_id
    autocast, precision = autocast_context(cfg.precision, env.device)
    per_rank = cfg.batch_size // env.world_size
    micro = per_rank // cfg.grad_accum
    eval_every = cfg.eval_every or max(1, cfg.steps // 10)
    fusion_params = [p for n, p in D.unwrap(model).named_parameters() if n.startswith("feedback.")]
    all_params = [p for p in model.parameters() if p.requires_grad]
    log = _Log(cfg, env, start, name)
    if env.is_main and start == 0:
        n_params = sum(p.numel() for p in D.unwrap(model).parameters())
        log.write(f"{name}: {n_params / 1e6:.2f}M parameters ({init_kind} {cfg.init_from}); {len(train_enc)} training "
                  f"conversations ({train_enc.assistant_tokens:,} assistant tokens of {train_enc.tokens:,}), "
                  f"{len(val_enc)} held out ({dup} duplicates of training ones dropped); "
                  f"{train_enc.truncated + val_enc.truncated} truncated to {cfg.seq_len} tokens, "
                  f"{train_enc.dropped + val_enc.dropped} dropped (no assistant token left); "
                  f"{cfg.steps} steps x {cfg.batch_size} conversations, "
                  + (f"feedback from step {fb_start + 1} (K={cfg.num_passes}), " if cfg.feedback_ever
                     else "no feedback (K=1), ")
                  + f"{env.world_size} process(es), {precision}, device {env.device}")
    run.t_start = time.perf_counter()
    status, message, last_ckpt = "done", "", ckpt
    stop_at = min(cfg.steps, cfg.stop_after) if cfg.stop_after is not None else cfg.steps
    tokens_seen = sum(r.get("tokens_step", 0) for r in read_jsonl(os.path.join(cfg.out, METRICS))
                      if r.get("split") == "train") if start else 0
    try:
        for step in range(start, stop_at):
            t0 = time.perf_counter()
            K = sched.passes_at(step, cfg.steps)
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)
            idx = batch_rows(step, cfg.batch_size, len(train_enc), cfg.seed).tolist()
            full = collate(train_enc, idx, pad_id)
            full["feedback_mask"] = (sft_feedback_mask(full, doc_id, cfg.prefix_mix, prefix_gen) if K > 1
                                     else build_feedback_mask_plain(full, doc_id))
            num_items = predicted_tokens(full["labels"])
            lo = env.rank * per_rank
            micro_batches = []
            for i in range(lo, lo + per_rank, micro):
                sub = [idx[j] for j in range(i, i + micro)]
                b = collate(train_enc, sub, pad_id)
                b["feedback_mask"] = full["feedback_mask"][i:i + micro, :b["input_ids"].shape[1]]
                micro_batches.append({k: v.to(env.device) for k, v in b.items()})
            loss_sum, pass_sum = sft_forward_backward(model, micro_batches, K, autocast, num_items,
                                                      scale=float(env.world_size))
            if K == 1:
                for p in fusion_params:
                    p.grad = None
            stats = D.all_reduce_mean(torch.cat([loss_sum.view(1), pass_sum]), env) * env.world_size
            stats = stats.tolist()
            loss, pass_losses = stats[0], stats[1:]
            reason = guard.check(loss, pass_losses[0], None)
            grad_norm = float("nan")
            if reason is None:
                norm = torch.nn.utils.clip_grad_norm_(all_params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
                if hasattr(norm, "full_tensor"):
                    norm = norm.full_tensor()
                grad_norm = float(norm)
                reason = guard.check(loss, pass_losses[0], grad_norm)
            if reason is None:
                optimizer.step()
                guard.good(pass_losses[0])
            else:
                guard.bad()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            step_tokens = int(full["attention_mask"].sum())
            tokens_seen += step_tokens
            rec = {"step": step + 1, "split": "train", "loss": _clean(loss),
                   "pass_losses": [_clean(v) for v in pass_losses], "num_passes": K, "lr": lr,
                   "grad_norm": _clean(grad_norm), "tokens": tokens_seen, "tokens_step": step_tokens,
                   "assistant_tokens": num_items, "step_time": dt, "tokens_per_s": step_tokens / dt,
                   "elapsed": run.elapsed()}
            if reason is not None:
                rec["skipped"] = reason
            log.record(rec)
            log.progress(rec, step_tokens / dt)
            if reason is not None:
                log.write(f"step {step + 1}: skipped ({reason}); {guard.bad_in_row} bad step(s) in a row")
                if guard.bad_in_row >= cfg.max_bad_steps:
                    status = "stopped"
                    message = (f"stopped after {guard.bad_in_row} bad steps in a row at step {step + 1}; "
                               + (f"last good checkpoint: {last_ckpt}" if last_ckpt else "no checkpoint was written"))
                    log.record({"step": step + 1, "split": "event", "event": "stopped", "reason": message})
                    break
            done = step + 1
            if len(val_enc) and (done % eval_every == 0 or done == cfg.steps):
                unwrapped = D.unwrap(model)
                val = {"step": done, "split": "val", "tokens": tokens_seen,
                       "val_loss": evaluate_sft_loss(unwrapped, val_enc, "standard", batch_size=max(1, micro),
                                                     max_examples=cfg.eval_rows)["loss"]}
                if cfg.num_passes > 1 and done > fb_start:
                    val["val_loss_passes"] = evaluate_sft_loss(unwrapped, val_enc, "passes", cfg.num_passes,
                                                               max(1, micro), cfg.eval_rows)["loss"]
                    val["val_num_passes"] = cfg.num_passes
                log.record(val)
                extra = f", K={cfg.num_passes}: {val['val_loss_passes']:.4f}" if "val_loss_passes" in val else ""
                log.write(f"step {done}: held-out assistant-token loss {val['val_loss']:.4f}{extra}")
            if (cfg.save_every and done % cfg.save_every == 0) or (done == stop_at and done < cfg.steps):
                if guard.bad_in_row == 0:
                    last_ckpt = save_checkpoint(run, done)
                else:
                    log.write(f"step {done}: no checkpoint while steps are being skipped")
        else:
            if stop_at < cfg.steps:
                status = "paused"
                message = f"paused after step {stop_at} of {cfg.steps}; continue with --resume"
    finally:
        log.close()

    summary = {"status": status, "message": message, "out": cfg.out, "init_from": cfg.init_from,
               "init_kind": init_kind, "checkpoint": last_ckpt, "elapsed": run.elapsed(),
               "skipped_steps": guard.skipped, "steps_done": cfg.steps if status == "done" else None,
               "data": {"source": cfg.data if conversations is None else "(given)", "train": len(train_enc),
                        "val": len(val_enc), "val_duplicates_dropped": dup,
                        "truncated": train_enc.truncated + val_enc.truncated,
                        "dropped_no_assistant_tokens": train_enc.dropped + val_enc.dropped,
                        "train_assistant_tokens": train_enc.assistant_tokens, "train_tokens": train_enc.tokens}}
    if status == "done":
        _finish_sft(run, tokenizer, [val_convs[i] for i in val_enc.source], val_enc, init_kind, summary)
    if env.is_main and status == "done":
        atomic_write_json(os.path.join(cfg.out, "summary.json"), summary)
    return summary


def build_feedback_mask_plain(batch: dict, doc_id: int | None) -> torch.Tensor:
    from ..model.feedback import build_feedback_mask

    return build_feedback_mask(batch["input_ids"], batch["attention_mask"], doc_id)


def _finish_sft(run, tokenizer, val_convs, val_enc: Encoded, init_kind: str, summary: dict) -> None:
    """Save the model and tokenizer into OUT; evaluate held-out loss per mode and greedy replies."""
    from ..utils.plotting import plot_loss_curves
    from .train import METRICS

    cfg, env = run.cfg, run.env
    if D.is_sharded(D.unwrap(run.model)):
        state = D.full_model_state(run.model)
        model = None
        if env.is_main:
            model, _, _ = load_init(cfg, tokenizer)
            D.load_full_model_state(model, state)
    else:
        model = D.unwrap(run.model)
    if env.is_main:
        model.eval()
        if not cfg.feedback_ever and init_kind == "hf":  # a retrofit whose fusion was never trained
            model.config.default_feedback_mode = "standard"
        atomic_save_pretrained(model, cfg.out, mode="merge")
        atomic_save_pretrained(tokenizer, cfg.out, mode="merge")
        evals = []
        if cfg.final_eval and len(val_enc):
            plan = [("standard", 1)]
            if max(cfg.num_passes, 1) > 1:
                plan.append(("passes", cfg.num_passes))
            if cfg.eval_exact:
                plan.append(("exact", None))
            for mode, k in plan:
                evals.append(evaluate_sft_loss(model, val_enc, mode, k or 2, batch_size=16,
                                               max_examples=cfg.final_eval))
        summary["eval"] = evals
        gens = {}
        if cfg.gen_eval and val_convs:
            for mode in cfg.resolved_gen_modes(model):
                recs = generate_replies(model, tokenizer, val_convs[: cfg.gen_eval], mode, cfg.max_new_tokens)
                graded = [r for r in recs if "correct" in r]
                gens[mode] = {"n": len(recs), "graded": len(graded),
                              "accuracy": (sum(r["correct"] for r in graded) / len(graded)) if graded else None,
                              "exact_match": sum(r["exact_match"] for r in recs) / len(recs),
                              "eos_rate": sum(r["hit_eos"] for r in recs) / len(recs), "records": recs}
        summary["generation"] = gens
        if cfg.plot:
            try:
                plot_loss_curves({os.path.basename(os.path.normpath(cfg.out)) or "sft": os.path.join(cfg.out, METRICS)},
                                 os.path.join(cfg.out, "curves.png"), title="fullband sft (assistant tokens)")
            except Exception as err:  # noqa: BLE001 - a plot is not worth failing a finished run
                print(f"warning: could not draw curves.png: {err}", file=sys.stderr)
        model.train()
    D.barrier(env)


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


# ============================================================================================== CLI


def add_parser(sub) -> None:
    from .train import add_config_arguments

    p = sub.add_parser(
        "sft", help="instruction-tune a model on chat conversations (loss on assistant tokens, K-pass objective)",
        description="Supervised fine-tuning on chat jsonl ({'messages': [{'role': 'system'|'user'|'assistant', "
                    "'content': ...}]} a line) with fullband's chat template; the loss is taken on the assistant's "
                    "tokens only, with pre-training's K-pass objective. Starts from --init-from: a fullband model, "
                    "a `fullband train` run or checkpoint, or a plain HF causal LM (retrofitted). Without --data it "
                    "tunes on synthetic arithmetic conversations (offline). Writes the model and tokenizer (with "
                    "the chat template) to --out, plus metrics.jsonl and summary.json.")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="YAML or TOML file of options (keys as the flags); flags given on the command line win")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="start over in an --out that already holds a run")
    add_config_arguments(p, SFTConfig, skip=SKIP_FLAGS)
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from .train import find_checkpoint, load_checkpoint_state

    names = set(_sft_fields()) - set(SKIP_FLAGS)
    explicit = {k: v for k, v in vars(args).items() if k in names}
    base = None
    if args.resume:
        out = explicit.get("out") or (_read_sft_config_file(args.config).get("out") if args.config else None)
        if out is None:
            raise ValueError("--resume needs --out DIR (the run to continue)")
        ckpt = find_checkpoint(out) if os.path.isdir(out) else None
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {os.path.join(out, 'checkpoints')!r} "
                                    "(tune with --save-every N, or start without --resume)")
        fields_ = _sft_fields()
        base = {k: v for k, v in load_checkpoint_state(ckpt)["config"].items()
                if k in names and k != "stop_after" and fields_[k].metadata.get("persist", True)}
    cfg = make_sft_config(explicit, args.config, base)
    summary = sft(cfg, resume=args.resume, overwrite=args.overwrite)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if summary["status"] == "stopped":
        print(f"fullband sft: {summary['message']}", file=sys.stderr)
        return 3
    if summary["status"] == "paused":
        print(f"fullband sft: {summary['message']}", file=sys.stderr)
        return 0
    table = format_summary(summary)
    if table:
        print(table)
    print(f"fullband sft: done, {cfg.steps} steps in {summary['elapsed']:.1f}s on {summary['data']['train']} "
          f"conversations; model in {cfg.out}")
    return 0
