"""Generative reasoning: grading, trace length, decoding per mode, runs, paired comparisons and reports.

Owns grading (:func:`extract_answer`: the text after the ``####`` marker, a flexible fallback taking the last
number; :func:`grade` / :func:`is_correct` with ``math-verify``), the reasoning-trace length (:func:`trace_length`:
generated tokens before the answer marker), decoding (:func:`generate_completions`: greedy, per decode mode, through
:func:`fullband.model.generation.generate`), runs (:func:`evaluate_reasoning`, :func:`summarize`,
:func:`compare_runs`: exact McNemar on correctness and a bootstrap CI of the trace-length difference;
:func:`run_reasoning`: several models x modes with their comparisons) and the markdown report. The problems and
their text format are :mod:`fullband.eval.problems`.
"""

from __future__ import annotations

import re
import statistics
import threading

import torch
from transformers import StoppingCriteria

from ..model.configuration import has_feedback
from ..model.generation import MODES, generate
from ..model.modeling import max_positions
from ..utils.stats import compare_paired
from .problems import (
    ANSWER_MARKER,
    VERBOSITIES,
    Problem,
    format_example,
    format_prompt,
)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


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


def generate_completions(model, tokenizer, prompts: list, mode: str = "standard", max_new_tokens: int = 128,
                         batch_size: int = 8, prefill_passes: int = 1) -> list[list[int]]:
    """Greedy completions of ``prompts`` (texts, or token-id lists with their BOS) in decode ``mode``: the generated
    token ids of each, cut after EOS (kept) or after the token that reaches the stop point (:func:`stop_index`).

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
            chunk = prompts[i:i + batch_size]
            enc = (tokenizer(chunk, return_tensors="pt", padding=True) if isinstance(chunk[0], str) else
                   tokenizer.pad({"input_ids": chunk}, return_tensors="pt", padding=True))
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


# ----------------------------------------------------------------------------------------------- verbosity


def style_openings(tokenizer, problem: Problem, pause: int = 0) -> dict[str, list[int]]:
    """For each verbosity of :data:`VERBOSITIES`, the shortest opening of its answer (token ids after the prompt, as
    the training text is tokenized) that no other verbosity's answer starts with: ``" ####"`` (or its first token)
    for ``direct``, ``" 3+8="`` vs ``" 3+8-5"`` for ``full`` vs ``partial``. A verbosity whose answer is the same as another's
    (a problem too short to shorten) shares its opening. Appended to the prompt, an opening makes a model continue
    in that verbosity; a completion that starts with one chose it. ``pause``: after that many filler tokens
    (:func:`~fullband.eval.problems.format_prompt`)."""
    prompt = tokenizer(format_prompt(problem, pause=pause), add_special_tokens=False)["input_ids"]
    answers = {}
    for v in VERBOSITIES:
        ids = tokenizer(format_example(problem, True, v, pause=pause), add_special_tokens=False)["input_ids"]
        if ids[: len(prompt)] != prompt:
            raise ValueError(f"the tokenizer splits the prompt of {problem.id!r} differently inside its answer")
        answers[v] = ids[len(prompt):]
    out = {}
    for v, ids in answers.items():
        others = [o for o in answers.values() if o != ids]
        j = 0
        while j < len(ids) and any(o[: j + 1] == ids[: j + 1] for o in others):
            j += 1
        out[v] = ids[: j + 1]
    return out


def chosen_verbosity(openings: dict[str, list[int]], completion: list[int]) -> str:
    """The verbosity a completion (its token ids) chose: the one whose opening it starts with, ``other`` if none."""
    for v, ids in openings.items():
        if completion[: len(ids)] == ids:
            return v
    return "other"


# ----------------------------------------------------------------------------------------------- evaluation


def evaluate_reasoning(model, tokenizer, problems: list[Problem], mode: str = "standard", max_new_tokens: int = 128,
                       cot: bool = True, shots=(), batch_size: int = 8, prefill_passes: int = 1,
                       verbosity: str | None = None, pause: int = 0) -> list[dict]:
    """Decode every problem greedily in ``mode`` and grade it; one record per problem, in order.

    ``verbosity`` (``full``, ``partial``, ``direct``) forces one: the prompt is followed by that verbosity's
    opening (:func:`style_openings`), which counts as part of the completion; ``None`` lets the model choose.
    A record holds ``id``, ``task``, ``gold``, ``completion`` (text up to the stop point), ``answer`` (strict,
    after ``####``) and ``answer_flexible``, ``correct`` / ``correct_flexible`` (math-verify),
    ``marker_found``, ``trace_tokens`` (:func:`trace_length`), ``generated_tokens`` (tokens until the stop,
    EOS excluded; a forced opening included), ``hit_eos`` and ``verbosity`` (the one chosen or forced:
    :func:`chosen_verbosity`, without shots only). ``pause``: each prompt ends in that many filler tokens
    (:func:`~fullband.eval.problems.format_prompt`; a pause-token model's), part of the prompt, not the trace.
    """
    if verbosity is not None and (verbosity not in VERBOSITIES or shots or not cot):
        raise ValueError(f"a forced verbosity is one of {', '.join(VERBOSITIES)}, zero-shot with a chain of thought; "
                         f"got {verbosity!r}")
    prompts = [format_prompt(p, shots, cot, pause) for p in problems]
    openings = [style_openings(tokenizer, p, pause) for p in problems] if not shots and cot else None
    forced = [[] for _ in problems]
    if verbosity is not None:
        forced = [o[verbosity] for o in openings]
        bos = special_bos(tokenizer)
        prompts = [bos + tokenizer(t, add_special_tokens=False)["input_ids"] + f for t, f in zip(prompts, forced)]
    completions = generate_completions(model, tokenizer, prompts, mode, max_new_tokens, batch_size, prefill_passes)
    eos = tokenizer.eos_token_id
    records = []
    for i, (p, gen) in enumerate(zip(problems, completions)):
        toks = forced[i] + gen
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
            "verbosity": chosen_verbosity(openings[i], body) if openings else None,
        })
    return records


def special_bos(tokenizer) -> list[int]:
    """What the tokenizer puts before a text (its BOS), as token ids."""
    with_special = tokenizer("x")["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    return with_special[: len(with_special) - len(plain)]


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
