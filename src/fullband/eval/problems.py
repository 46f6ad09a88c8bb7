"""Reasoning problems, offline: seeded generators of synthetic multi-step tasks, GSM8K-format files, and the text
format shared by evaluation and fine-tuning.

Owns :class:`Problem`; the generators for multi-step arithmetic (:func:`arithmetic_problems`, with or without a chain
of thought), state tracking through variable assignments (:func:`state_problems`), through a sequence of swaps
(:func:`permutation_problems`) and through a product in the group S3 (:func:`s3_problems`, the running state the
state experiment's ``s3`` streams carry, written as a trace); :func:`read_gsm8k` for GSM8K-format jsonl files (``question``, ``answer`` ending in
``#### N``); :func:`make_problems` (one by name); and :func:`format_prompt` (``"Q: {question}\nA:"``, after optional
solved examples; ``pause`` filler tokens after it) / :func:`format_target` (``" {chain of thought} #### {answer}"``, or
``" #### {answer}"``; ``drop``: the trace's first steps removed, as stepwise internalization trains).
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import asdict, dataclass, field

from ..utils.io import iter_jsonl_objects
from .depth_tasks import compose_two, permutations_of

ANSWER_MARKER = "####"
TASKS = ("arithmetic", "state", "permutation", "s3", "gsm8k")
PAUSE = "_"  # the pause-token control's filler: one byte no problem text holds (one token of a byte-level BPE)
VERBOSITIES = ("full", "partial", "direct")


# ----------------------------------------------------------------------------------------------- problems


@dataclass(frozen=True)
class Problem:
    """One question with its gold final answer and (optionally) a worked solution.

    ``answer`` is the final answer as text (``"6"``); ``solution`` the chain of thought without the answer
    marker (``"4*2=8; 3+8=11; 11-5=6."``), empty when there is none; ``partial`` a shorter chain of thought that
    writes about half the steps (``"4*2=8; 3+8-5=6."``), empty when there is none; ``meta`` what generated it.
    """

    id: str
    task: str
    question: str
    answer: str
    solution: str = ""
    meta: dict = field(default_factory=dict, compare=False)
    partial: str = ""

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
    value, steps, _ = _solve(numbers, ops)
    return value, steps


def _solve(numbers: list[int], ops: list[str]) -> tuple[int, list[str], list[str]]:
    """:func:`solve_arithmetic` plus the partial steps: the products written as they are, the additions and
    subtractions two at a time (``"3+8-5=6"``: the intermediate ``11`` not written)."""
    nums, ops = list(numbers), list(ops)
    steps, partial = [], []
    i = 0
    while i < len(ops):
        if ops[i] == "*":
            value = nums[i] * nums[i + 1]
            steps.append(f"{nums[i]}*{nums[i + 1]}={value}")
            partial.append(steps[-1])
            nums[i:i + 2] = [value]
            del ops[i]
        else:
            i += 1
    lhs = str(nums[0])
    for j, op in enumerate(ops):
        a, b = nums[0], nums[1]
        value = a + b if op == "+" else a - b
        steps.append(f"{a}{op}{b}={value}")
        lhs += f"{op}{b}"
        if j % 2 == 1 or j == len(ops) - 1:
            partial.append(f"{lhs}={value}")
            lhs = str(value)
        nums[0:2] = [value]
    return nums[0], steps, partial


def _every_other(steps: list[str]) -> str:
    """A partial trace of independent steps: every second one written, the last one always."""
    kept = [s for j, s in enumerate(steps) if j % 2 == 1 or j == len(steps) - 1]
    return "; ".join(kept) + "."


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
        value, steps, partial = _solve(numbers, chosen)
        expr = "".join(f"{a}{op}" for a, op in zip(numbers, chosen)) + str(numbers[-1])
        out.append(Problem(f"arithmetic-{seed}-{i}", "arithmetic", f"{expr}=?", str(value), "; ".join(steps) + ".",
                           {"num_ops": k, "steps": len(steps), "partial_steps": len(partial)},
                           "; ".join(partial) + "."))
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
                           {"num_vars": num_vars, "steps": k, "partial_steps": (k + 1) // 2}, _every_other(steps)))
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
                           "; ".join(states) + ".", {"num_items": num_items, "steps": k, "partial_steps": (k + 1) // 2},
                           _every_other(states)))
    return out


def s3_problems(n: int, seed: int = 0, num_steps=(6, 10), every: int = 2) -> list[Problem]:
    """The running product of ``num_steps`` elements of S3 (numbered ``1..6`` in the order of
    :func:`fullband.eval.depth_tasks.permutations_of`, ``1`` the identity; the first applied first).

    ``"S3 product 3 2 5 1=?"`` with the trace ``"3*2=5; 5*5=1; 1*1=1."`` (the running product after every element),
    the partial trace writing it every ``every`` elements (``"3*2*5=1; 1*1=1."``) and the answer ``"1"``: the
    word problem of the state experiment's ``s3`` task, with an optional trace of the state.
    """
    lo, hi = _check_range("num_steps", num_steps)
    if lo < 2 or every < 2:
        raise ValueError(f"num_steps must be >= 2 and every >= 2, got {num_steps!r}, {every}")
    group = permutations_of(3)
    where = {g: i + 1 for i, g in enumerate(group)}
    rng = _rng(seed, "s3")
    out = []
    for i in range(n):
        xs = [rng.randint(1, 6) for _ in range(rng.randint(lo, hi))]
        acc, steps, partial, written, lhs = group[xs[0] - 1], [], [], 1, str(xs[0])
        for j, x in enumerate(xs[1:], start=1):
            nxt = compose_two(acc, group[x - 1])
            steps.append(f"{where[acc]}*{x}={where[nxt]}")
            acc, lhs = nxt, f"{lhs}*{x}"
            if j - written + 1 >= every or j == len(xs) - 1:
                partial.append(f"{lhs}={where[acc]}")
                lhs, written = str(where[acc]), j + 1
        out.append(Problem(f"s3-{seed}-{i}", "s3", f"S3 product {' '.join(map(str, xs))}=?", str(where[acc]),
                           "; ".join(steps) + ".", {"steps": len(steps), "partial_steps": len(partial)},
                           "; ".join(partial) + "."))
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
    """``n`` problems of ``task`` (``arithmetic``, ``state``, ``permutation``, ``s3``; ``gsm8k`` reads ``data``)."""
    if n < 1:
        raise ValueError(f"number of problems must be >= 1, got {n}")
    if task == "arithmetic":
        return arithmetic_problems(n, seed, **options)
    if task == "state":
        return state_problems(n, seed, **options)
    if task == "permutation":
        return permutation_problems(n, seed, **options)
    if task == "s3":
        return s3_problems(n, seed, **options)
    if task == "gsm8k":
        if not data:
            raise ValueError("task gsm8k reads a GSM8K-format jsonl file: give it with --data FILE")
        return read_gsm8k(data, limit=n)
    raise ValueError(f"unknown task {task!r}: choose one of {', '.join(TASKS)}")


# ----------------------------------------------------------------------------------------------- format


def trace_text(problem: Problem, verbosity: str = "full", drop: float = 0.0) -> str:
    """The chain of thought a completion of ``verbosity`` writes: the solution (``full``), the partial one
    (``partial``; the full one when the problem has none) or nothing (``direct``); ``drop`` in [0, 1] removes its
    first ``drop * steps`` steps (rounded half up) (``"; "``-separated; all of them: no trace), as a stage of stepwise
    internalization trains (Deng et al., *From explicit CoT to implicit CoT*)."""
    if verbosity not in VERBOSITIES:
        raise ValueError(f"unknown verbosity {verbosity!r}: choose one of {', '.join(VERBOSITIES)}")
    if not 0.0 <= drop <= 1.0:
        raise ValueError(f"drop must be in [0, 1], got {drop}")
    if verbosity == "direct":
        return ""
    text = problem.partial if verbosity == "partial" and problem.partial else problem.solution
    if drop == 0.0 or not text:
        return text
    steps = text.rstrip(".").split("; ")
    kept = steps[int(drop * len(steps) + 0.5):]  # half up
    return "; ".join(kept) + "." if kept else ""


def format_target(problem: Problem, cot: bool = True, verbosity: str = "full", drop: float = 0.0) -> str:
    """What the model should write after the prompt: ``" {trace} #### {answer}"`` with the trace of ``verbosity``
    (:func:`trace_text`), or ``" #### {answer}"`` without a chain of thought or when there is no trace. A
    multi-line trace puts the marker on its own line, as GSM8K does."""
    trace = trace_text(problem, verbosity, drop) if cot else ""
    if trace:
        sep = "\n" if "\n" in trace else " "
        return f" {trace}{sep}{ANSWER_MARKER} {problem.answer}"
    return f" {ANSWER_MARKER} {problem.answer}"


def format_prompt(problem: Problem, shots=(), cot: bool = True, pause: int = 0) -> str:
    """``"Q: {question}\\nA:"``, after the solved ``shots`` (each ``prompt + target``), separated by blank lines;
    ``pause`` filler tokens (:data:`PAUSE`) after it: the pause-token control's extra compute before it answers."""
    if pause < 0:
        raise ValueError(f"pause must be >= 0, got {pause}")
    parts = [f"Q: {s.question}\nA:{format_target(s, cot)}" for s in shots]
    parts.append(f"Q: {problem.question}\nA:" + PAUSE * pause)
    return "\n\n".join(parts)


def format_example(problem: Problem, cot: bool = True, verbosity: str = "full", pause: int = 0,
                   drop: float = 0.0) -> str:
    """A complete training example: prompt (with ``pause`` fillers) followed by the target of ``verbosity``
    (``drop``: :func:`trace_text`)."""
    return format_prompt(problem, cot=cot, pause=pause) + format_target(problem, cot, verbosity, drop)
