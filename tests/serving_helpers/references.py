"""References from ``generate()`` for the serving tests, beyond greedy fp32 tokens (which the test file computes).

:func:`forced_logprobs`: the model's own log-probabilities along a trajectory another decoder chose (a sampled
one), in decode mode ``soft``; :func:`reference_bf16`: greedy tokens of the model loaded in bf16 and the top-2 logit
gap at every step (how near a tie each choice was).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList


class _Force(LogitsProcessor):
    """Makes ``generate()`` follow given tokens (everything else at -inf) while ``output_logits`` keeps the raw
    logits: the model's own log-probabilities along a trajectory some other decoder chose."""

    def __init__(self, start: int, tokens: list[int]):
        self.start, self.tokens = start, tokens

    def __call__(self, input_ids, scores):
        out = torch.full_like(scores, float("-inf"))
        out[:, self.tokens[input_ids.shape[1] - self.start]] = 0.0
        return out


def forced_logprobs(path, prompt: list[int], tokens: list[int], pad: int) -> list[float]:
    """log p(tokens[k] | prompt + tokens[:k]) under ``generate(feedback_mode="soft")`` (fp32): each generated token
    fused with the state of the one before it, exactly as along a greedy run."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    out = model.generate(torch.tensor([prompt]), feedback_mode="soft", max_new_tokens=len(tokens), do_sample=False,
                         eos_token_id=None, pad_token_id=pad, output_logits=True, return_dict_in_generate=True,
                         logits_processor=LogitsProcessorList([_Force(len(prompt), tokens)]))
    assert out.sequences[0, len(prompt):].tolist() == tokens
    return [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, tokens)]


def reference_bf16(path, prompts, max_tokens, mode, pad: int):
    """Greedy ``generate()`` tokens of the model loaded in bf16 (``mode`` None: a plain backbone) and the top-2
    logit gap at every step."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    outs, gaps = [], []
    for ids, n in zip(prompts, max_tokens):
        kw = dict(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=pad, output_logits=True,
                  return_dict_in_generate=True, **({"feedback_mode": mode} if mode else {}))
        out = model.generate(torch.tensor([ids]), **kw)
        outs.append(out.sequences[0, len(ids):].tolist())
        gaps.append([float(v[0] - v[1]) for v in (step[0].float().topk(2).values for step in out.logits)])
    return outs, gaps
