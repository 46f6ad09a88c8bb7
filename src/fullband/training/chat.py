"""Chat data for ``fullband sft``: conversations, the chat template, assistant-token masks and batches.

Owns:

* data: chat jsonl, one conversation a line, ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...},
  ...]}`` (at least one assistant message; a ``system`` message only first); or an offline built-in set:
  ``arithmetic`` / ``state`` / ``permutation`` / ``mixed`` (conversations generated from the synthetic reasoning
  tasks of :mod:`fullband.eval.reasoning`, the assistant answering with its chain of thought and ``#### answer``),
  or ``example`` (the small file shipped in ``fullband/tasks/sft/example.jsonl``). Conversations are split into
  training and held-out ones (seeded, by conversation; a held-out conversation identical to a training one is
  dropped);
* the chat template (:data:`CHAT_TEMPLATE`, Jinja, set as ``tokenizer.chat_template`` and saved with the
  tokenizer)::

      <bos>System: {system}\\n\\nUser: {user}\\n\\nAssistant: {assistant}<eos>\\n\\nUser: ...

  A generation prompt ends in ``Assistant:``; the assistant's turn is ``" " + content + eos`` inside a
  ``{% generation %}`` block, so ``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks exactly
  the tokens the loss is taken on (the reply and the EOS that ends it). A template without generation blocks gets
  its assistant tokens by rendering the conversation incrementally;
* batches: one conversation per row (truncated to the longest allowed), right padding with an attention mask,
  labels ``-100`` everywhere but on assistant tokens (:func:`collate`); the feedback mask with per-conversation
  prefix mixing (:func:`sft_feedback_mask`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from dataclasses import dataclass
from importlib import resources

import torch

from ..eval.problems import format_target, make_problems
from ..model.feedback import build_feedback_mask, document_starts, prefix_mixing_mask, prefix_row_seeds
from ..utils.io import iter_jsonl_objects
from . import distributed as D

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


def render_ids(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template."""
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
    ids = render_ids(tokenizer, messages)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_ids(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render_ids(tokenizer, messages[:i + 1])
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


def sft_feedback_mask(batch: dict, doc_start_id: int | None, prefix_mix: float, row_seeds) -> torch.Tensor:
    """Feedback mask of a right-padded batch, with per-conversation prefix mixing (the padding is a segment of
    its own, so a plain prefix is drawn over the conversation's length), row i's draws seeded by
    ``row_seeds[i]`` (:func:`fullband.model.feedback.prefix_row_seeds`)."""
    ids, attn = batch["input_ids"], batch["attention_mask"]
    mask = build_feedback_mask(ids, attn, doc_start_id)
    if prefix_mix > 0:
        starts = document_starts(ids, doc_start_id, attn)
        real = attn.bool()
        starts[:, 1:] |= ~real[:, 1:] & real[:, :-1]  # first padding position starts a segment
        mask &= ~prefix_mixing_mask(starts, prefix_mix, row_seeds)
    return mask


def padded_micro_batches(collate_rows, index: list, step: int, num_passes: int, cfg, doc_start_id: int | None,
                         env: D.DistEnv) -> tuple[list[dict], int, int]:
    """This rank's micro-batches of a step of right-padded rows (SFT conversations, labelled rows), as
    ``(micro_batches, predicted tokens of the step, real tokens of the step)``. ``index`` is the step's global batch
    (row indices, in order) and ``collate_rows(indices)`` collates rows into ``input_ids`` / ``attention_mask`` /
    ``labels``. Only this rank's rows are collated; a row's feedback mask (prefix mixing on fed-back steps) depends
    on that row and its place in the global batch alone; the step's loss is a mean over every rank's predicted
    tokens, whose count is all-reduced (``num_items_in_batch`` of every micro-batch), not recounted from the global
    batch on every rank."""
    per_rank = cfg.batch_size // env.world_size
    micro = per_rank // cfg.grad_accum
    lo = env.rank * per_rank
    local, counts = [], torch.zeros(2, dtype=torch.float64)
    for i in range(lo, lo + per_rank, micro):
        b = collate_rows(index[i:i + micro])
        b["feedback_mask"] = (sft_feedback_mask(b, doc_start_id, cfg.prefix_mix,
                                                prefix_row_seeds(cfg.seed, step, range(i, i + micro)))
                              if num_passes > 1 else build_feedback_mask(b["input_ids"], b["attention_mask"],
                                                                        doc_start_id))
        counts += torch.tensor([predicted_tokens(b["labels"]), int(b["attention_mask"].sum())], dtype=torch.float64)
        local.append(b)
    num_items, step_tokens = (int(x) for x in D.all_reduce_sum(counts.to(env.device), env).tolist())
    items = torch.tensor(float(num_items))
    return ([{k: v.to(env.device) for k, v in {**b, "num_items_in_batch": items}.items()} for b in local],
            num_items, step_tokens)
