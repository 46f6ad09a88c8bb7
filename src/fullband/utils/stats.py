"""Paired statistics for comparing two models (or two decode modes) on the same problems.

Owns
* :func:`mcnemar_exact` — the exact (conditional, binomial) two-sided McNemar test on the discordant counts;
* :func:`discordant_counts` — ``(b, c)`` from two per-problem correctness lists;
* :func:`bootstrap_ci` — a seeded percentile-bootstrap confidence interval of the mean of paired differences;
* :func:`compare_paired` — both at once for two runs over the same problems (accuracy difference with McNemar,
  mean difference of a per-problem number such as the reasoning-trace length with its bootstrap CI);
* designs with several training seeds, two of them:
  - the seeds share their problems (every seed decodes the same held-out problems): the problem is the unit.
    :func:`sign_flip_exact` — the exact two-sided sign-flip test of per-problem differences summed over seeds
    (one seed: exact McNemar); :func:`paired_test_shared_problems` — that test on correctness, with McNemar per
    seed; :func:`bootstrap_ci_shared_problems` — one index draw per resample applied to every seed;
  - each seed has its own rows (e.g. a seeded validation split): :func:`bootstrap_ci_within_seeds` resamples
    each seed's rows independently.
  Both resample the seeds too by default (a two-level bootstrap: seeds with replacement, then rows / problems), so
  a headline interval holds the seed-to-seed spread; the result names what it resampled (``resamples``) and how
  many seeds it had (``seeds``: below 3 no interval can hold the seed variance).

Python, numpy and torch's seeded generator; scipy is not needed.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
import torch


class ConfidenceInterval(NamedTuple):
    """A point estimate and its interval (``low``, ``high``) at ``confidence``."""

    estimate: float
    low: float
    high: float
    confidence: float

    def as_dict(self) -> dict:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "confidence": self.confidence}


def _binom_cdf_half(k: int, n: int) -> float:
    """``P(X <= k)`` for ``X ~ Binomial(n, 1/2)``, exact in rational arithmetic up to the final division."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    # Python divides big integers with correct rounding, so this is exact up to the final float
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for discordant counts ``b`` (A right, B wrong) and ``c`` (A wrong, B right).

    Under the null hypothesis each discordant pair is equally likely to go either way, so
    ``min(b, c) ~ Binomial(b + c, 1/2)``; the p-value is ``min(1, 2 · P(X <= min(b, c)))`` (1 when ``b + c = 0``).
    Example: ``mcnemar_exact(1, 7) = 2 · (1 + 8) / 2^8 = 0.0703``.
    """
    for name, v in (("b", b), ("c", c)):
        if isinstance(v, bool) or int(v) != v or v < 0:
            raise ValueError(f"{name} must be a non-negative integer count, got {v!r}")
    b, c = int(b), int(c)
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2.0 * _binom_cdf_half(min(b, c), n))


def discordant_counts(correct_a: Sequence[bool], correct_b: Sequence[bool]) -> tuple[int, int]:
    """``(b, c)``: problems only A got right, problems only B got right (same problems, same order)."""
    if len(correct_a) != len(correct_b):
        raise ValueError(f"paired comparison needs the same problems: {len(correct_a)} vs {len(correct_b)} results")
    b = sum(1 for x, y in zip(correct_a, correct_b) if x and not y)
    c = sum(1 for x, y in zip(correct_a, correct_b) if y and not x)
    return b, c


def bootstrap_ci(diffs: Sequence[float], seed: int = 0, n_resamples: int = 10_000,
                 confidence: float = 0.95) -> ConfidenceInterval:
    """Percentile bootstrap CI of the mean of ``diffs`` (paired differences), seeded and deterministic.

    Resamples the differences with replacement ``n_resamples`` times and takes the ``(1 ± confidence) / 2``
    quantiles of the resampled means. A single difference (or identical ones) gives a zero-width interval.
    """
    x = np.asarray(list(diffs), dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError("bootstrap_ci needs at least one difference")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    rng = np.random.default_rng(seed)
    means = np.empty(n_resamples, dtype=np.float64)
    chunk = max(1, 2_000_000 // x.size)  # bound memory: resample in chunks of rows
    for start in range(0, n_resamples, chunk):
        stop = min(n_resamples, start + chunk)
        idx = rng.integers(0, x.size, size=(stop - start, x.size))
        means[start:stop] = x[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return ConfidenceInterval(float(x.mean()), float(low), float(high), confidence)


def compare_paired(correct_a: Sequence[bool], correct_b: Sequence[bool],
                   lengths_a: Sequence[float] | None = None, lengths_b: Sequence[float] | None = None,
                   seed: int = 0, n_resamples: int = 10_000, confidence: float = 0.95) -> dict:
    """Paired comparison of run A with run B on the same problems.

    Returns ``{"n", "accuracy_a", "accuracy_b", "accuracy_difference" (A - B), "b", "c", "mcnemar_p"}`` and, given
    per-problem lengths, ``"length_difference"`` (mean of A - B with its bootstrap CI) over all problems and
    ``"length_difference_both_correct"`` over the problems both got right (``None`` when there are none).
    """
    n = len(correct_a)
    b, c = discordant_counts(correct_a, correct_b)
    out = {
        "n": n,
        "accuracy_a": sum(map(bool, correct_a)) / n if n else float("nan"),
        "accuracy_b": sum(map(bool, correct_b)) / n if n else float("nan"),
        "b": b, "c": c, "mcnemar_p": mcnemar_exact(b, c),
    }
    out["accuracy_difference"] = out["accuracy_a"] - out["accuracy_b"]
    if lengths_a is not None and lengths_b is not None:
        if not (len(lengths_a) == len(lengths_b) == n):
            raise ValueError("lengths must be given for every problem of both runs")
        diffs = [float(x) - float(y) for x, y in zip(lengths_a, lengths_b)]
        out["length_difference"] = bootstrap_ci(diffs, seed, n_resamples, confidence).as_dict() if diffs else None
        both = [d for d, x, y in zip(diffs, correct_a, correct_b) if x and y]
        out["length_difference_both_correct"] = (bootstrap_ci(both, seed, n_resamples, confidence).as_dict()
                                                 if both else None)
    return out


SEEDS_THEN_ROWS = "seeds, then rows within each drawn seed"  # what a two-level interval resamples (its label)
ROWS_WITHIN_SEEDS = "rows within each seed, not the seeds"


def resamples_seeds(label) -> bool:
    """Whether an interval's ``resamples`` label says it drew the seeds too (results from before the two-level
    bootstrap have no label: ``None``, rows only)."""
    return str(label or "").startswith("seeds")


def seed_draw_counts(rng: np.random.Generator, n_seeds: int, n_resamples: int) -> np.ndarray:
    """``[n_seeds, n_resamples]``: how often each seed is drawn when each resample draws ``n_seeds`` seeds with
    replacement (the seed level of a two-level bootstrap over seeds that share their problems)."""
    picks = rng.integers(0, n_seeds, size=(n_resamples, n_seeds))
    return np.stack([np.bincount(p, minlength=n_seeds) for p in picks], axis=1)


def bootstrap_ci_within_seeds(diffs_per_group: Sequence[Sequence[float]], seed: int = 0, n_resamples: int = 2000,
                              confidence: float = 0.95, resample_seeds: bool = True) -> dict:
    """Mean over groups (training seeds) of each group's mean paired difference, with a percentile-bootstrap CI,
    for seeds that do NOT share their rows (each seed scored on rows of its own; seeds that score the same problems
    need :func:`bootstrap_ci_shared_problems`). Seeded and deterministic.

    ``resample_seeds`` (the default): a two-level bootstrap, so the interval holds the seed-to-seed spread: every
    resample draws as many seeds as there are, with replacement, and for each drawn seed resamples its rows (a
    seed drawn twice gets two independent row draws). ``False``: the rows within each seed only, the seeds fixed
    (the interval then says nothing about another seed). With fewer than 3 seeds no interval can hold the seed
    variance (two seeds give three seed draws); the result says how many seeds it saw.
    Returns ``{"estimate", "low", "high", "confidence", "seeds", "resamples"}``."""
    groups = [torch.tensor(list(d), dtype=torch.float64) for d in diffs_per_group]
    if not groups or any(g.numel() == 0 for g in groups):
        raise ValueError("bootstrap_ci_within_seeds needs at least one difference in every group")
    g = torch.Generator().manual_seed(seed)
    n = len(groups)
    copies = n if resample_seeds else 1
    # row-resample means: [seed, copy, resample]; one copy's draws at a time (the memory of one resampling of
    # one seed's rows, as with the seeds fixed)
    row_means = torch.stack([torch.stack([d[torch.randint(0, d.numel(), (n_resamples, d.numel()), generator=g)].mean(1)
                                          for _ in range(copies)]) for d in groups])
    if resample_seeds:
        drawn = torch.randint(0, n, (n, n_resamples), generator=g)  # [slot, resample]: which seed fills the slot
        slot = torch.arange(n).unsqueeze(1).expand(n, n_resamples)
        boots = row_means[drawn, slot, torch.arange(n_resamples)].mean(0)
    else:
        boots = row_means[:, 0, :].mean(0)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = torch.quantile(boots, torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64)).tolist()
    return {"estimate": float(sum(d.mean() for d in groups) / n), "low": lo, "high": hi, "confidence": confidence,
            "seeds": n, "resamples": SEEDS_THEN_ROWS if resample_seeds else ROWS_WITHIN_SEEDS}


def interval_scope(ci: dict, seeds: int, unit: str) -> str:
    """What a (mean over seeds) 95% CI resampled, for a caption: read from the interval itself (``resamples``, which
    intervals from before the two-level bootstrap lack), so a page rendered from an older results file says what
    that file's intervals are. ``unit``: what a seed's rows are (e.g. "test programs")."""
    if seeds == 1:
        return f"one seed: the 95% CI resamples its {unit}, not seeds, so it cannot hold the seed variance"
    if resamples_seeds(ci.get("resamples")):
        text = f"mean of {seeds} seeds; the 95% CI resamples the seeds, then the {unit} within each drawn seed"
        return text + (f" (with {seeds} seeds it cannot hold the seed variance)" if seeds < 3 else "")
    return f"mean of {seeds} seeds; the 95% CI resamples the {unit} within each seed, not the seeds"


# ---------------------------------------------------------------------------------------------- shared problems


def sign_flip_exact(diffs: Sequence[int]) -> float:
    """Exact two-sided sign-flip (permutation) p-value of integer per-problem differences ``d_i``.

    Under the null hypothesis A and B are exchangeable on every problem, so each ``d_i`` is as likely to be
    ``-d_i``: the statistic ``T = sum d_i`` is compared with all ``2^m`` sign assignments of the ``m`` non-zero
    differences, ``p = #{|T*| >= |T|} / 2^m`` (1 when every difference is 0), counted exactly in integers by
    dynamic programming over the reachable sums. With ``d_i = correct_A - correct_B`` on one seed this is exact
    McNemar (:func:`mcnemar_exact`); with ``d_i`` summed over seeds that share the problems, each problem is
    counted once however many seeds saw it.
    """
    vals = []
    for v in diffs:
        if isinstance(v, bool) or int(v) != v:
            raise ValueError(f"sign_flip_exact needs integer differences, got {v!r}")
        if int(v):
            vals.append(abs(int(v)))
    t_obs = abs(sum(int(v) for v in diffs))
    if not vals:
        return 1.0
    counts = {0: 1}  # reachable sum -> number of sign assignments reaching it
    for a in vals:
        nxt: dict[int, int] = {}
        for t, n in counts.items():
            nxt[t + a] = nxt.get(t + a, 0) + n
            nxt[t - a] = nxt.get(t - a, 0) + n
        counts = nxt
    extreme = sum(n for t, n in counts.items() if abs(t) >= t_obs)
    return min(1.0, extreme / 2 ** len(vals))  # big integers: exact up to the final, correctly rounded division


def _per_seed_matrix(per_seed: Sequence[Sequence[float]], name: str) -> np.ndarray:
    rows = [np.asarray(list(r), dtype=np.float64) for r in per_seed]
    if not rows or rows[0].size == 0:
        raise ValueError(f"{name} needs at least one seed with at least one problem")
    if any(r.shape != rows[0].shape for r in rows):
        raise ValueError(f"{name}: the seeds must share their problems (same count, same order), got "
                         f"{[r.size for r in rows]} per seed")
    return np.stack(rows)


def paired_test_shared_problems(correct_a: Sequence[Sequence[bool]], correct_b: Sequence[Sequence[bool]]) -> dict:
    """A vs B on correctness over seeds that decode the same problems (``correct_a[s][i]``: seed s, problem i, the
    same problem order in every seed and both arms).

    Returns ``{"p", "method", "problems", "discordant_problems", "per_seed": [{"a_only", "b_only", "mcnemar_p"}]}``:
    ``p`` is :func:`sign_flip_exact` on ``d_i = sum over seeds (A_si - B_si)``, which counts each problem once
    (pooling the seeds' discordant pairs into one McNemar test would count a problem once per seed);
    ``per_seed`` is exact McNemar on each seed alone."""
    a = _per_seed_matrix([[bool(x) for x in r] for r in correct_a], "paired_test_shared_problems")
    b = _per_seed_matrix([[bool(x) for x in r] for r in correct_b], "paired_test_shared_problems")
    if a.shape != b.shape:
        raise ValueError(f"paired comparison needs the same seeds and problems: {a.shape} vs {b.shape}")
    d = (a - b).sum(axis=0).astype(int).tolist()
    per_seed = []
    for ra, rb in zip(a, b):
        x, y = discordant_counts(ra.tolist(), rb.tolist())
        per_seed.append({"a_only": x, "b_only": y, "mcnemar_p": mcnemar_exact(x, y)})
    return {"p": sign_flip_exact(d), "problems": a.shape[1], "discordant_problems": sum(1 for v in d if v),
            "method": f"exact sign-flip test of per-problem differences summed over {a.shape[0]} seed(s) "
                      "(one seed: exact McNemar)", "per_seed": per_seed}


def bootstrap_ci_shared_problems(diffs_per_seed: Sequence[Sequence[float]], seed: int = 0, n_resamples: int = 10_000,
                                 confidence: float = 0.95, resample_seeds: bool = True) -> dict:
    """Mean over seeds of each seed's mean paired difference, with a percentile-bootstrap CI for seeds that share
    their problems: every resample draws ONE vector of problem indices (with replacement) and applies it to every
    seed, so a problem's seeds stay together. ``NaN`` marks a difference not defined for that seed and problem
    (e.g. a trace difference where not both were right): a seed's mean is over its defined entries, and a seed
    with none in a resample is left out of that resample's mean. Seeded and deterministic; with one seed it draws
    exactly what :func:`bootstrap_ci` draws. ``resample_seeds`` (the default, two seeds or more): each resample
    also draws the seeds with replacement (after its problem draw, from a generator of its own, so the problem draws
    stay those above), so the interval holds the seed-to-seed spread as well; ``False``: the seeds fixed.
    Returns ``{"estimate", "low", "high", "confidence", "seeds", "resamples"}``."""
    x = _per_seed_matrix(diffs_per_seed, "bootstrap_ci_shared_problems")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    defined = ~np.isnan(x)
    if not defined.any(axis=1).all():
        raise ValueError("bootstrap_ci_shared_problems needs at least one defined difference in every seed")
    vals, mask = np.where(defined, x, 0.0), defined.astype(np.float64)
    n = x.shape[1]
    rng = np.random.default_rng(seed)
    n_seeds = x.shape[0]
    two_level = resample_seeds and n_seeds > 1
    seed_rng = np.random.default_rng([seed, 1])
    means = np.empty(n_resamples, dtype=np.float64)
    chunk = max(1, 2_000_000 // n)  # the same draws as bootstrap_ci for one seed
    for start in range(0, n_resamples, chunk):
        stop = min(n_resamples, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        sums, cnts = vals[:, idx].sum(axis=2), mask[:, idx].sum(axis=2)  # [seeds, resamples]
        ok = cnts > 0
        seed_means = np.where(ok, sums / np.where(ok, cnts, 1.0), 0.0)
        # how often each seed is drawn in each resample ([seeds, resamples]; all ones when the seeds are fixed)
        weight = seed_draw_counts(seed_rng, n_seeds, stop - start) if two_level else np.ones_like(seed_means)
        used = (weight * ok).sum(axis=0)
        means[start:stop] = np.where(used > 0, (weight * seed_means).sum(axis=0) / np.maximum(used, 1), np.nan)
    alpha = (1.0 - confidence) / 2.0
    # a resample that drew no defined entry in any seed has no mean: left out (only possible with NaN entries)
    low, high = np.nanquantile(means, [alpha, 1.0 - alpha])
    estimate = float(np.mean(vals.sum(axis=1) / mask.sum(axis=1)))
    return {"estimate": estimate, "low": float(low), "high": float(high), "confidence": confidence, "seeds": n_seeds,
            "resamples": (SEEDS_THEN_ROWS if two_level else ROWS_WITHIN_SEEDS).replace("rows", "problems")}
