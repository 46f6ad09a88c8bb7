"""Paired statistics for comparing two models (or two decode modes) on the same problems.

Owns
* :func:`mcnemar_exact` — the exact (conditional, binomial) two-sided McNemar test on the discordant counts;
* :func:`discordant_counts` — ``(b, c)`` from two per-problem correctness lists;
* :func:`bootstrap_ci` — a seeded percentile-bootstrap confidence interval of the mean of paired differences;
* :func:`compare_paired` — both at once for two runs over the same problems (accuracy difference with McNemar,
  mean difference of a per-problem number such as the reasoning-trace length with its bootstrap CI);
* :func:`stratified_bootstrap_ci` — the same CI for differences from several training seeds, resampled within each.

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


def stratified_bootstrap_ci(diffs_per_group: Sequence[Sequence[float]], seed: int = 0, n_resamples: int = 2000,
                            confidence: float = 0.95) -> dict:
    """Mean over groups (training seeds) of each group's mean paired difference, with a percentile-bootstrap CI
    that resamples the differences within each group (problems or rows, never across seeds); seeded and
    deterministic. Returns ``{"estimate", "low", "high"}``."""
    groups = [torch.tensor(list(d), dtype=torch.float64) for d in diffs_per_group]
    if not groups or any(g.numel() == 0 for g in groups):
        raise ValueError("stratified_bootstrap_ci needs at least one difference in every group")
    g = torch.Generator().manual_seed(seed)
    boots = torch.zeros(n_resamples, dtype=torch.float64)
    for d in groups:
        idx = torch.randint(0, d.numel(), (n_resamples, d.numel()), generator=g)
        boots += d[idx].mean(1)
    boots /= len(groups)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = torch.quantile(boots, torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64)).tolist()
    return {"estimate": float(sum(d.mean() for d in groups) / len(groups)), "low": lo, "high": hi}
