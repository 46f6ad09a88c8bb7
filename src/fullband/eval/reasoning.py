"""Generative reasoning, offline: synthetic multi-step tasks, GSM8K-format files, grading, trace length, reports.

Owns
* the problems: :class:`Problem` and seeded generators for multi-step arithmetic (:func:`arithmetic_problems`,
  with or without a chain of thought), state tracking through variable assignments (:func:`state_problems`)
  and through a sequence of swaps (:func:`permutation_problems`), and :func:`read_gsm8k` for GSM8K-format jsonl
  files on disk (``question``, ``answer`` ending in ``#### N``); :func:`make_problems` picks one by name;
* the text format shared by evaluation and fine-tuning: :func:`format_prompt` (``"Q: {question}\\nA:"``, after
  optional solved examples) and :func:`format_target` (``" {chain of thought} #### {answer}"``, or
  ``" #### {answer}"`` without one); a training example is ``format_prompt(p) + format_target(p)``;
* grading: :func:`extract_answer` (the text after the ``####`` marker; a flexible fallback takes the last number)
  and :func:`grade` / :func:`is_correct` with ``math-verify``;
* the reasoning-trace length: :func:`trace_length` = generated tokens before the answer marker (all generated
  tokens until EOS / the stop when there is none);
* decoding: :func:`generate_completions` (greedy, per decode mode ``standard`` / ``soft`` / ``fused`` /
  ``exact``, through :func:`fullband.generation.generate`);
* runs: :func:`evaluate_reasoning` (per-problem records), :func:`summarize`, :func:`compare_runs` (exact McNemar
  on correctness and a bootstrap CI of the trace-length difference, see :mod:`fullband.stats`),
  :func:`run_reasoning` (several models x modes with their comparisons) and the ``fullband reason``
  sub-command, which writes JSON + markdown.
"""

from __future__ import annotations

import os
import random
import re
import statistics
import threading
from dataclasses import asdict, dataclass, field

import torch
from transformers import StoppingCriteria

from ..model.configuration import has_feedback
from ..model.generation import MODES, generate
from ..model.modeling import max_positions
from ..utils.io import iter_jsonl_objects
from ..utils.stats import compare_paired

ANSWER_MARKER = "####"
TASKS = ("arithmetic", "state", "permutation", "gsm8k")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


# ----------------------------------------------------------------------------------------------- problems


@dataclass(frozen=True)
class Problem:
    """One question with its gold final answer and (optionally) a worked solution.

    ``answer`` is the final answer as text (``"6"``); ``solution`` the chain of thought without the answer
    marker (``"4*2=8; 3+8=11; 11-5=6."``), empty when there is none; ``meta`` what generated it.
    """

    id: str
    task: str
    question: str
    answer: str
    solution: str = ""
    meta: dict = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        return asdict(self)


def _rng(seed: int, task: str) -> random.Random:
    return random.Random(f"{task}:{seed}")


def _check_range(name: str, value) -> tuple[int, int]:
    lo, hi = (value, value) if isinstance(value, int) else tuple(value)
    if lo < 1 or hi < lo:
        raise ValueError(f"{name} must be a positive integer or a range (lo, hi) with 1 <= lo <= hi, got {value!r}")
    return lo, hi


def solve_arithmetic(numbers: list[int], ops: list[str]) -> tuple[int, list[str]]:
    """Evaluate ``n0 op0 n1 op1 ...`` with ``*`` before ``+``/``-`` (then left to right); returns the value and
    the steps (``"4*2=8"``, ...) in the order a person would do them."""
    nums, ops = list(numbers), list(ops)
    steps = []
    i = 0
    while i < len(ops):
        if ops[i] == "*":
            value = nums[i] * nums[i + 1]
            steps.append(f"{nums[i]}*{nums[i + 1]}={value}")
            nums[i:i + 2] = [value]
            del ops[i]
        else:
            i += 1
    while ops:
        a, op, b = nums[0], ops[0], nums[1]
        value = a + b if op == "+" else a - b
        steps.append(f"{a}{op}{b}={value}")
        nums[0:2] = [value]
        del ops[0]
    return nums[0], steps


def arithmetic_problems(n: int, seed: int = 0, num_ops=(2, 4), max_operand: int = 9, ops: str = "+-*") -> list[Problem]:
    """Multi-step arithmetic: ``"3+4*2-5"`` with the worked steps ``"4*2=8; 3+8=11; 11-5=6."`` and answer ``"6"``.

    Each problem has ``num_ops`` operators (an int or an inclusive range) drawn from ``ops`` and operands in
    ``1..max_operand``; precedence is the usual one (``*`` first).
    """
    lo, hi = _check_range("num_ops", num_ops)
    if max_operand < 1 or not ops or set(ops) - set("+-*"):
        raise ValueError(f"max_operand must be >= 1 and ops a non-empty subset of '+-*', got {max_operand}, {ops!r}")
    rng = _rng(seed, "arithmetic")
    out = []
    for i in range(n):
        k = rng.randint(lo, hi)
        numbers = [rng.randint(1, max_operand) for _ in range(k + 1)]
        chosen = [rng.choice(ops) for _ in range(k)]
        value, steps = solve_arithmetic(numbers, chosen)
        expr = "".join(f"{a}{op}" for a, op in zip(numbers, chosen)) + str(numbers[-1])
        out.append(Problem(f"arithmetic-{seed}-{i}", "arithmetic", f"{expr}=?", str(value), "; ".join(steps) + ".",
                           {"num_ops": k, "steps": len(steps)}))
    return out


_VARS = "abcdefgh"


def state_problems(n: int, seed: int = 0, num_vars: int = 3, num_steps=(3, 5), max_value: int = 9) -> list[Problem]:
    """Track variables through assignments.

    ``"a=3, b=5, c=2. a=b+2; c=a-c; b=b+a. What is c?"`` with the trace ``"a=5+2=7; c=7-2=5; b=5+7=12."`` and
    answer ``"5"``: each assignment sets one variable to another variable plus or minus a constant or a variable.
    """
    lo, hi = _check_range("num_steps", num_steps)
    if not 2 <= num_vars <= len(_VARS):
        raise ValueError(f"num_vars must be in 2..{len(_VARS)}, got {num_vars}")
    rng = _rng(seed, "state")
    names = _VARS[:num_vars]
    out = []
    for i in range(n):
        values = {v: rng.randint(0, max_value) for v in names}
        init = ", ".join(f"{v}={values[v]}" for v in names)
        k = rng.randint(lo, hi)
        stmts, steps = [], []
        for _ in range(k):
            target, src = rng.choice(names), rng.choice(names)
            op = rng.choice("+-")
            if rng.random() < 0.5:
                other_name = rng.choice(names)
                other_text, other_value = other_name, values[other_name]
            else:
                other_value = rng.randint(1, max_value)
                other_text = str(other_value)
            a = values[src]
            value = a + other_value if op == "+" else a - other_value
            stmts.append(f"{target}={src}{op}{other_text}")
            steps.append(f"{target}={a}{op}{other_value}={value}")
            values[target] = value
        query = rng.choice(names)
        question = f"{init}. {'; '.join(stmts)}. What is {query}?"
        out.append(Problem(f"state-{seed}-{i}", "state", question, str(values[query]), "; ".join(steps) + ".",
                           {"num_vars": num_vars, "steps": k}))
    return out


def permutation_problems(n: int, seed: int = 0, num_items: int = 4, num_swaps=(3, 5)) -> list[Problem]:
    """Track items through swaps (composing transpositions).

    ``"Boxes 1-4 hold A B C D. Swap 1 3; swap 2 4; swap 1 2. Which box holds C?"`` with the trace
    ``"C B A D; C D A B; D C A B."`` (the contents after each swap) and answer ``"2"``.
    """
    lo, hi = _check_range("num_swaps", num_swaps)
    if not 2 <= num_items <= 9:
        raise ValueError(f"num_items must be in 2..9, got {num_items}")
    rng = _rng(seed, "permutation")
    items = [chr(ord("A") + j) for j in range(num_items)]
    out = []
    for i in range(n):
        boxes = list(items)
        k = rng.randint(lo, hi)
        swaps, states = [], []
        for _ in range(k):
            x, y = rng.sample(range(1, num_items + 1), 2)
            boxes[x - 1], boxes[y - 1] = boxes[y - 1], boxes[x - 1]
            swaps.append(f"swap {x} {y}")
            states.append(" ".join(boxes))
        item = rng.choice(items)
        question = (f"Boxes 1-{num_items} hold {' '.join(items)}. {'; '.join(swaps).capitalize()}. "
                    f"Which box holds {item}?")
        out.append(Problem(f"permutation-{seed}-{i}", "permutation", question, str(boxes.index(item) + 1),
                           "; ".join(states) + ".", {"num_items": num_items, "steps": k}))
    return out


def _clean_number(text: str) -> str:
    return text.strip().replace(",", "").replace("$", "").rstrip(".")


def read_gsm8k(path: str, limit: int | None = None) -> list[Problem]:
    """Problems from a GSM8K-format jsonl file: ``{"question": ..., "answer": "... #### 72"}`` per line.

    The solution is the answer text before ``####`` with the ``<<48/2=24>>`` calculator annotations removed;
    the gold answer is the text after it (thousands separators dropped).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GSM8K-format file {path!r} does not exist")
    out = []
    for lineno, rec in iter_jsonl_objects(path, "a JSON object with 'question' and 'answer'"):
        if not isinstance(rec.get("question"), str) or not isinstance(rec.get("answer"), str):
            raise ValueError(f"{path}:{lineno}: each line needs string 'question' and 'answer' fields")
        if ANSWER_MARKER not in rec["answer"]:
            raise ValueError(f"{path}:{lineno}: the answer has no '{ANSWER_MARKER} N' final answer")
        solution, _, final = rec["answer"].rpartition(ANSWER_MARKER)
        solution = re.sub(r"<<[^>]*>>", "", solution).strip()
        pid = str(rec.get("id", f"gsm8k-{lineno}"))
        out.append(Problem(pid, "gsm8k", rec["question"].strip(), _clean_number(final), solution, {"line": lineno}))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path} holds no problems")
    return out


def make_problems(task: str, n: int = 100, seed: int = 0, data: str | None = None, **options) -> list[Problem]:
    """``n`` problems of ``task`` (``arithmetic``, ``state``, ``permutation``; ``gsm8k`` reads ``data``)."""
    if n < 1:
        raise ValueError(f"number of problems must be >= 1, got {n}")
    if task == "arithmetic":
        return arithmetic_problems(n, seed, **options)
    if task == "state":
        return state_problems(n, seed, **options)
    if task == "permutation":
        return permutation_problems(n, seed, **options)
    if task == "gsm8k":
        if not data:
            raise ValueError("task gsm8k reads a GSM8K-format jsonl file: give it with --data FILE")
        return read_gsm8k(data, limit=n)
    raise ValueError(f"unknown task {task!r}: choose one of {', '.join(TASKS)}")


# ----------------------------------------------------------------------------------------------- format


def format_target(problem: Problem, cot: bool = True) -> str:
    """What the model should write after the prompt: ``" {solution} #### {answer}"`` (``" #### {answer}"``
    without a chain of thought or when the problem has no solution). A multi-line solution puts the marker on
    its own line, as GSM8K does."""
    if cot and problem.solution:
        sep = "\n" if "\n" in problem.solution else " "
        return f" {problem.solution}{sep}{ANSWER_MARKER} {problem.answer}"
    return f" {ANSWER_MARKER} {problem.answer}"


def format_prompt(problem: Problem, shots=(), cot: bool = True) -> str:
    """``"Q: {question}\\nA:"``, after the solved ``shots`` (each ``prompt + target``), separated by blank lines."""
    parts = [f"Q: {s.question}\nA:{format_target(s, cot)}" for s in shots]
    parts.append(f"Q: {problem.question}\nA:")
    return "\n\n".join(parts)


def format_example(problem: Problem, cot: bool = True) -> str:
    """A complete training example: prompt followed by target."""
    return format_prompt(problem, cot=cot) + format_target(problem, cot)


# ----------------------------------------------------------------------------------------------- grading


def stop_index(text: str, marker: str = ANSWER_MARKER) -> int | None:
    """Where a completion ends, or ``None`` while it may go on: at a blank line, at the start of a new question
    (``"\\nQ:"``), or at the end of the line that holds the answer after the marker."""
    ends = [i for i in (text.find("\n\n"), text.find("\nQ:")) if i >= 0]
    m = text.find(marker)
    if m >= 0:
        nl = text.find("\n", m)
        if nl >= 0:
            ends.append(nl)
    return min(ends) if ends else None


def truncate_completion(text: str, marker: str = ANSWER_MARKER) -> str:
    i = stop_index(text, marker)
    return text if i is None else text[:i]


def extract_answer(completion: str, marker: str = ANSWER_MARKER) -> tuple[str | None, str | None]:
    """``(strict, flexible)`` answers of a completion.

    ``strict`` is the text after the first ``marker`` up to the end of that line (``None`` without a marker);
    ``flexible`` is the strict answer when there is one, else the last number in the completion.
    """
    text = truncate_completion(completion, marker)
    strict = None
    m = text.find(marker)
    if m >= 0:
        strict = text[m + len(marker):].split("\n", 1)[0].strip() or None
    if strict is not None:
        return strict, strict
    numbers = _NUMBER.findall(text)
    return None, (numbers[-1] if numbers else None)


def _timeouts() -> dict:
    # math-verify guards parse/verify with signal.alarm, which only works in the main thread
    main = threading.current_thread() is threading.main_thread()
    return {"parsing_timeout": 5 if main else None}, {"timeout_seconds": 5 if main else None}


def grade(prediction: str | None, gold: str) -> bool:
    """Whether ``prediction`` states the same value as ``gold``, by ``math_verify.parse`` + ``verify``."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if prediction is None or not str(prediction).strip():
        return False
    parse_kw, verify_kw = _timeouts()
    gold_parsed = parse(str(gold), extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()], **parse_kw)
    pred_parsed = parse(str(prediction), extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()],
                        **parse_kw)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, **verify_kw))


def is_correct(completion: str, gold: str, flexible: bool = False) -> bool:
    """Grade a whole completion: its strict (marker) answer, or with ``flexible`` its flexible one."""
    strict, loose = extract_answer(completion)
    return grade(loose if flexible else strict, gold)


def trace_length(token_ids, decode, marker: str = ANSWER_MARKER, eos_token_id: int | None = None) -> int:
    """Reasoning-trace length: the number of generated tokens before the answer ``marker``.

    ``token_ids`` are the generated tokens only (no prompt); ``decode`` is a tokenizer (its ``decode``) or a
    function of a token list. A token counts when its text ends before the marker starts, so a token that holds
    the first marker character is not part of the trace. Without a marker, every token up to EOS (or all of
    them when there is no EOS) is trace.
    """
    ids = [int(t) for t in token_ids]
    if eos_token_id is not None and eos_token_id in ids:
        ids = ids[: ids.index(eos_token_id)]
    dec = decode.decode if hasattr(decode, "decode") else decode
    text = dec(ids)
    start = text.find(marker)
    if start < 0:
        return len(ids)
    lo, hi = 0, len(ids)  # largest k with len(decode(ids[:k])) <= start, by bisection (prefix lengths grow)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(dec(ids[:mid])) <= start:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ----------------------------------------------------------------------------------------------- decoding


def available_modes(model) -> tuple[str, ...]:
    """Decode modes this model supports: all of :data:`fullband.generation.MODES` for a fullband model,
    ``standard`` for a plain causal LM."""
    return tuple(MODES) if has_feedback(model) else ("standard",)


def default_modes(model) -> list[str]:
    """``standard`` plus the model's default feedback mode (``config.default_feedback_mode``, else ``exact``)."""
    modes = available_modes(model)
    if len(modes) == 1:
        return ["standard"]
    preferred = getattr(model.config, "default_feedback_mode", None)
    return ["standard", preferred if preferred in modes and preferred != "standard" else "exact"]


class _StopOnText(StoppingCriteria):
    """A stopping criterion: a row stops once its completion (after ``prompt_len`` tokens) reaches
    :func:`stop_index`."""

    def __init__(self, tokenizer, prompt_len: int):
        self.tokenizer, self.prompt_len = tokenizer, prompt_len

    def __call__(self, input_ids, scores=None, **kwargs):
        done = [stop_index(self.tokenizer.decode(row[self.prompt_len:], skip_special_tokens=True)) is not None
                for row in input_ids.tolist()]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def generate_completions(model, tokenizer, prompts: list[str], mode: str = "standard", max_new_tokens: int = 128,
                         batch_size: int = 8, prefill_passes: int = 1) -> list[list[int]]:
    """Greedy completions of ``prompts`` in decode ``mode``: the generated token ids of each, cut after EOS (kept)
    or after the token that reaches the stop point (:func:`stop_index`).

    Decodes with :func:`fullband.generation.generate` (left-padded batches of ``batch_size``; ``prefill_passes``
    for ``fused``). New tokens are capped so that prompt + completion fit the backbone's positions.
    """
    modes = available_modes(model)
    if mode not in modes:
        kind = "this fullband model" if has_feedback(model) else "a model without latent feedback"
        raise ValueError(f"decode mode {mode!r} is not available for {kind}; available: {', '.join(modes)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    limit = max_positions(model.config.text_config if has_feedback(model) else model.config)
    was_training = model.training
    model.eval()
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    results: list[list[int]] = []
    try:
        for i in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True)
            ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
            n = max_new_tokens if limit is None else min(max_new_tokens, limit - ids.shape[1])
            if n < 1:
                raise ValueError(f"a prompt of {ids.shape[1]} tokens leaves no room in the backbone's {limit} "
                                 "positions; use fewer shots or shorter problems")
            res = generate(model, ids, mask, mode=mode, max_new_tokens=n, prefill_passes=prefill_passes,
                           eos_token_id=eos, pad_token_id=pad, stopping=_StopOnText(tokenizer, ids.shape[1]))
            results.extend(_cut(toks, tokenizer, eos) for toks in res.new_tokens.tolist())
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    return results


def _cut(toks: list[int], tokenizer, eos: int | None) -> list[int]:
    """The generated tokens up to EOS (kept) or through the token that reached the stop point."""
    if eos is not None and eos in toks:
        toks = toks[: toks.index(eos) + 1]
    lo, hi = 1, len(toks)
    if not toks or stop_index(tokenizer.decode(toks, skip_special_tokens=True)) is None:
        return toks
    while lo < hi:  # the first prefix whose text reaches the stop point
        mid = (lo + hi) // 2
        if stop_index(tokenizer.decode(toks[:mid], skip_special_tokens=True)) is None:
            lo = mid + 1
        else:
            hi = mid
    return toks[:lo]


# ----------------------------------------------------------------------------------------------- evaluation


def evaluate_reasoning(model, tokenizer, problems: list[Problem], mode: str = "standard", max_new_tokens: int = 128,
                       cot: bool = True, shots=(), batch_size: int = 8, prefill_passes: int = 1) -> list[dict]:
    """Decode every problem greedily in ``mode`` and grade it; one record per problem, in order.

    A record holds ``id``, ``task``, ``gold``, ``completion`` (text up to the stop point), ``answer`` (strict,
    after ``####``) and ``answer_flexible``, ``correct`` / ``correct_flexible`` (math-verify),
    ``marker_found``, ``trace_tokens`` (:func:`trace_length`), ``generated_tokens`` (tokens until the stop,
    EOS excluded) and ``hit_eos``.
    """
    prompts = [format_prompt(p, shots, cot) for p in problems]
    completions = generate_completions(model, tokenizer, prompts, mode, max_new_tokens, batch_size, prefill_passes)
    eos = tokenizer.eos_token_id
    records = []
    for p, toks in zip(problems, completions):
        hit_eos = eos is not None and bool(toks) and toks[-1] == eos
        body = toks[:-1] if hit_eos else toks
        text = truncate_completion(tokenizer.decode(body, skip_special_tokens=True))
        strict, loose = extract_answer(text)
        records.append({
            "id": p.id, "task": p.task, "gold": p.answer, "completion": text,
            "answer": strict, "answer_flexible": loose,
            "correct": grade(strict, p.answer), "correct_flexible": grade(loose, p.answer),
            "marker_found": strict is not None,
            "trace_tokens": trace_length(body, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)),
            "generated_tokens": len(body), "hit_eos": hit_eos,
        })
    return records


def summarize(records: list[dict]) -> dict:
    """Accuracy (strict and flexible), answer-marker rate and trace-length statistics of one run."""
    n = len(records)
    if n == 0:
        raise ValueError("no records to summarize")
    traces = [r["trace_tokens"] for r in records]
    correct_traces = [r["trace_tokens"] for r in records if r["correct"]]
    return {
        "n": n,
        "accuracy": sum(r["correct"] for r in records) / n,
        "accuracy_flexible": sum(r["correct_flexible"] for r in records) / n,
        "marker_rate": sum(r["marker_found"] for r in records) / n,
        "mean_trace_tokens": statistics.fmean(traces),
        "median_trace_tokens": statistics.median(traces),
        "mean_trace_tokens_correct": statistics.fmean(correct_traces) if correct_traces else None,
        "mean_generated_tokens": statistics.fmean(r["generated_tokens"] for r in records),
    }


def compare_runs(records_a: list[dict], records_b: list[dict], seed: int = 0, n_resamples: int = 10_000) -> dict:
    """Paired comparison of two runs over the same problems (A - B): exact McNemar on strict correctness, and
    the mean trace-length difference with a percentile-bootstrap 95% CI (all problems, and both-correct ones)."""
    if [r["id"] for r in records_a] != [r["id"] for r in records_b]:
        raise ValueError("the two runs did not see the same problems in the same order")
    return compare_paired([r["correct"] for r in records_a], [r["correct"] for r in records_b],
                          [r["trace_tokens"] for r in records_a], [r["trace_tokens"] for r in records_b],
                          seed=seed, n_resamples=n_resamples)


# ----------------------------------------------------------------------------------------------- report


def _fmt(x, digits=3):
    if x is None:
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _span(v: dict | None) -> str:
    return "–" if v is None else f"{v['estimate']:+.1f} [{v['low']:+.1f}, {v['high']:+.1f}]"


def report_markdown(report: dict) -> str:
    """The report of :func:`run_reasoning` (with its ``config``) as markdown: runs, then paired comparisons."""
    cfg = report["config"]
    source = f", {cfg['data']}" if cfg.get("data") else ""
    lines = [f"# Reasoning: {cfg['task']}", "",
             f"{cfg['num_problems']} problems (seed {cfg['seed']}{source}), "
             f"{'chain of thought' if cfg['cot'] else 'answer only'}, {cfg['shots']} shot(s), greedy, "
             f"at most {cfg['max_new_tokens']} new tokens. Trace = generated tokens before `{ANSWER_MARKER}`.", "",
             "| run | model | mode | accuracy | flexible acc. | marker rate | mean trace | median trace | "
             "mean generated |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        s = run["summary"]
        lines.append(f"| {run['name']} | {run['model_name']} | {run['mode']} | {_fmt(s['accuracy'])} | "
                     f"{_fmt(s['accuracy_flexible'])} | {_fmt(s['marker_rate'])} | {_fmt(s['mean_trace_tokens'], 1)} | "
                     f"{_fmt(float(s['median_trace_tokens']), 1)} | {_fmt(s['mean_generated_tokens'], 1)} |")
    if report["comparisons"]:
        lines += ["", "Paired comparisons (A − B): exact McNemar on correctness; mean trace-length difference with "
                      "a 95% percentile-bootstrap CI.", "",
                  "| A | B | acc. A | acc. B | b (A only) | c (B only) | McNemar p | Δ trace [95% CI] | "
                  "Δ trace, both correct |", "|---|---|---|---|---|---|---|---|---|"]
        for c in report["comparisons"]:
            d, dc = c.get("length_difference"), c.get("length_difference_both_correct")
            lines.append(f"| {c['a']} | {c['b']} | {_fmt(c['accuracy_a'])} | {_fmt(c['accuracy_b'])} | "
                         f"{c['b_count']} | {c['c_count']} | {c['mcnemar_p']:.4g} | {_span(d)} | {_span(dc)} |")
    for note in report.get("notes", []):
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


def run_reasoning(models: list[tuple[str, object, object]], problems: list[Problem], modes: list[str] | None,
                  max_new_tokens: int = 128, cot: bool = True, shots=(), batch_size: int = 8, seed: int = 0,
                  n_resamples: int = 10_000, prefill_passes: int = 1, progress=None) -> dict:
    """Every (model, mode) run over ``problems`` and their paired comparisons.

    ``models`` is a list of ``(name, model, tokenizer)``. ``modes`` ``None`` uses :func:`default_modes` of the
    first model. A mode a model does not support is skipped with a note. Within a model, the first mode is
    compared with each other one; with two models, the same modes are compared across them.
    """
    runs, notes = [], []
    for name, model, tokenizer in models:
        wanted = modes if modes else default_modes(models[0][1])
        supported = available_modes(model)
        for mode in wanted:
            if mode not in supported:
                notes.append(f"{name}: mode {mode!r} skipped (available: {', '.join(supported)})")
                continue
            if progress:
                progress(f"{name}: {mode}")
            records = evaluate_reasoning(model, tokenizer, problems, mode, max_new_tokens, cot, shots, batch_size,
                                         prefill_passes)
            runs.append({"name": f"{name}/{mode}", "model_name": name, "mode": mode,
                         "summary": summarize(records), "records": records})
    comparisons = []

    def add(a, b):
        c = compare_runs(a["records"], b["records"], seed=seed, n_resamples=n_resamples)
        c["b_count"], c["c_count"] = c.pop("b"), c.pop("c")
        comparisons.append({"a": a["name"], "b": b["name"], **c})

    by_model: dict[str, list[dict]] = {}
    for r in runs:
        by_model.setdefault(r["model_name"], []).append(r)
    for rs in by_model.values():
        for other in rs[1:]:
            add(rs[0], other)
    names = list(by_model)
    if len(names) >= 2:
        first = {r["mode"]: r for r in by_model[names[0]]}
        for other_name in names[1:]:
            for r in by_model[other_name]:
                if r["mode"] in first:
                    add(first[r["mode"]], r)
    return {"runs": runs, "comparisons": comparisons, "notes": notes}
