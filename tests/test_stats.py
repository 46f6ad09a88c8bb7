"""Statistics over training seeds (``fullband.utils.stats``): which unit is resampled and tested, checked against
p-values and confidence intervals worked out by hand or by enumerating every resample in the test itself."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from fullband.utils.stats import (
    bootstrap_ci,
    bootstrap_ci_shared_problems,
    bootstrap_ci_within_seeds,
    mcnemar_exact,
    paired_test_shared_problems,
    sign_flip_exact,
)

# ----------------------------------------------------------------------------- tests on shared problems


def test_one_seed_sign_flip_is_exact_mcnemar_3_vs_10():
    # The example: 3 problems only A got right, 10 only B. Exact McNemar conditions on the 13 discordant
    # pairs: min(b, c) = 3 ~ Binomial(13, 1/2), p = 2 * (C(13,0) + C(13,1) + C(13,2) + C(13,3)) / 2^13
    # = 2 * (1 + 13 + 78 + 286) / 8192 = 756 / 8192 = 0.09229. The sign-flip test of d_i in {-1, 0, +1} gives the
    # same: T = 3 - 10 = -7 and T* = 2X - 13 with X ~ Binomial(13, 1/2), |T*| >= 7 <=> X <= 3 or X >= 10.
    d = [1] * 3 + [-1] * 10 + [0] * 7
    assert sign_flip_exact(d) == 756 / 8192 == mcnemar_exact(3, 10)
    assert sign_flip_exact([0, 0]) == 1.0 and sign_flip_exact([]) == 1.0
    assert sign_flip_exact([1, -1, 1, -1]) == 1.0  # T = 0: every assignment is at least as extreme
    with pytest.raises(ValueError):
        sign_flip_exact([0.5, 1])
    # Bug caught: counting each problem once per seed. The same records duplicated as a second seed (perfectly
    # correlated seeds) carry no new evidence: the per-problem differences are 2·d_i, so the sign-flip p is
    # still 756/8192. Pooling both seeds' 26 discordant pairs into one McNemar test would give 6 vs 20:
    # 2 * (1 + 26 + 325 + 2600 + 14950 + 65780 + 230230) / 2^26 = 627824 / 67108864 = 0.00936.
    a = [True] * 3 + [False] * 10 + [True] * 4 + [False] * 3
    b = [False] * 3 + [True] * 10 + [True] * 4 + [False] * 3
    out = paired_test_shared_problems([a, a], [b, b])
    assert out["p"] == 756 / 8192
    assert mcnemar_exact(6, 20) == 627824 / 2**26 != out["p"]
    assert out["per_seed"] == [{"a_only": 3, "b_only": 10, "mcnemar_p": 756 / 8192}] * 2
    assert out["problems"] == 20 and out["discordant_problems"] == 13 and "sign-flip" in out["method"]


def test_two_seeds_three_problems_by_hand():
    # Seed 0: A right on problems 0, 1, 2, B on none; seed 1: A right on 0, 1, B on none. Per problem
    # d = (1 + 1, 1 + 1, 1 + 0) = (2, 2, 1), T = 5. The 2^3 sign assignments give ±2 ±2 ±1 =
    # 5, 3, 1, -1, 1, -1, -3, -5; |T*| >= 5 in 2 of 8: p = 0.25. Pooled McNemar (5 vs 0 pairs) would say
    # 2 / 2^5 = 0.0625; McNemar per seed: 3 vs 0 -> 2/8 = 0.25, 2 vs 0 -> 2/4 = 0.5.
    out = paired_test_shared_problems([[1, 1, 1], [1, 1, 0]], [[0, 0, 0], [0, 0, 0]])
    assert out["p"] == 0.25
    assert [s["mcnemar_p"] for s in out["per_seed"]] == [0.25, 0.5]
    assert mcnemar_exact(5, 0) == 0.0625
    # Mixed signs: d = (2, -1, 1, 1), T = 3. ±1 ±1 ±1 takes 3, 1, -1, -3 in 1, 3, 3, 1 ways; with +2: 5, 3, 1, -1;
    # with -2: 1, -1, -3, -5. |T*| >= 3: (1 + 3) + (3 + 1) = 8 of 16, p = 0.5.
    assert sign_flip_exact([2, -1, 1, 1]) == 0.5
    assert sign_flip_exact([-2, 1, -1, -1]) == 0.5  # two-sided
    with pytest.raises(ValueError):  # the seeds must share their problems
        paired_test_shared_problems([[1, 0], [1]], [[0, 0], [0]])


def test_sign_flip_matches_enumerating_every_assignment():
    # Bug caught: a wrong dynamic programme (ties, zeros, repeated magnitudes). The reference enumerates all
    # 2^m sign assignments directly, in exact fractions.
    rng = np.random.default_rng(0)
    for _ in range(25):
        d = rng.integers(-3, 4, size=int(rng.integers(1, 11))).tolist()
        nz = [v for v in d if v]
        t = abs(sum(d))
        signs_all = itertools.product((1, -1), repeat=len(nz))
        hits = sum(abs(sum(s * v for s, v in zip(signs, nz))) >= t for signs in signs_all)
        assert sign_flip_exact(d) == pytest.approx(float(Fraction(hits, 2 ** len(nz))) if nz else 1.0, abs=0, rel=1e-15)


# ----------------------------------------------------------------------------- bootstrap: exact references


def _exact_quantile(values: list[float], probs: list[Fraction], q: float) -> float:
    """The q-quantile of a discrete distribution (value -> probability), refusing a q within 0.01 of a jump of the
    distribution function, where a Monte-Carlo percentile could land on either neighbouring value."""
    cdf = Fraction(0)
    for v, p in sorted(zip(values, probs)):
        cdf += p
        assert abs(float(cdf) - q) > 0.01, "choose a level away from the jumps"
        if cdf > q:
            return v
    raise AssertionError("unreachable")


def _enumerate(stat, n: int, draws: int) -> tuple[list[float], list[Fraction]]:
    """Every ``draws``-tuple of index vectors of length n (each of the n^(n·draws) outcomes equally likely)."""
    dist: dict[float, Fraction] = {}
    outcomes = list(itertools.product(range(n), repeat=n))
    for combo in itertools.product(outcomes, repeat=draws):
        v = round(stat(*combo), 12)
        dist[v] = dist.get(v, Fraction(0)) + Fraction(1, len(outcomes) ** draws)
    return list(dist), list(dist.values())


def test_joint_resampling_differs_from_within_seed_resampling():
    # Two seeds on the same 3 problems with anti-correlated differences: seed 0 (0, 0, 3), seed 1 (3, 0, 0).
    # Joint resampling (one index vector for both seeds): the mean over seeds is the mean of the per-problem
    # averages (1.5, 0, 1.5) = 0.5·K, K ~ Binomial(3, 2/3): P(0, 0.5, 1, 1.5) = (1, 6, 12, 8)/27, so at 90% the
    # 5% quantile is 0.5 (CDF 0.037 -> 0.259) and the 95% quantile 1.5 (CDF 0.704 -> 1).
    # Within-seed resampling (independent draws) averages two independent means k_s ~ Binomial(3, 1/3):
    # (k0 + k1)/2 with k0 + k1 ~ Binomial(6, 1/3), CDF 0.088, 0.351, 0.680, 0.900, 0.982, ...: [0, 2].
    # Both references are enumerated below (27 and 729 equally likely outcomes); the package draws 40,000.
    x = [[0.0, 0.0, 3.0], [3.0, 0.0, 0.0]]
    joint = _enumerate(lambda i: np.mean([np.mean([x[s][k] for k in i]) for s in (0, 1)]), 3, 1)
    within = _enumerate(lambda i, j: (np.mean([x[0][k] for k in i]) + np.mean([x[1][k] for k in j])) / 2, 3, 2)
    assert [_exact_quantile(*joint, q) for q in (0.05, 0.95)] == [0.5, 1.5]
    assert [_exact_quantile(*within, q) for q in (0.05, 0.95)] == [0.0, 2.0]
    ci = bootstrap_ci_shared_problems(x, seed=0, n_resamples=40_000, confidence=0.9, resample_seeds=False)
    assert (ci["estimate"], ci["low"], ci["high"]) == (1.0, 0.5, 1.5)
    ci = bootstrap_ci_within_seeds(x, seed=0, n_resamples=40_000, confidence=0.9, resample_seeds=False)
    assert (ci["estimate"], ci["low"], ci["high"]) == (1.0, 0.0, 2.0)


def test_perfectly_correlated_seeds_keep_the_one_seed_interval():
    # Identical seeds (0, 0, 3): jointly resampled, the mean over seeds is one seed's resampled mean, k ~
    # Binomial(3, 1/3): CDF 0.296, 0.741, 0.963, 1 -> at 76% (quantiles 0.12 / 0.88) [0, 2]. Resampled within
    # each seed it is (k0 + k1)/2: CDF 0.088, 0.351, 0.680, 0.900 -> [0.5, 1.5], too narrow: it treats the second
    # seed's copy of each problem as new evidence.
    x = [0.0, 0.0, 3.0]
    joint = _enumerate(lambda i: np.mean([x[k] for k in i]), 3, 1)
    within = _enumerate(lambda i, j: (np.mean([x[k] for k in i]) + np.mean([x[k] for k in j])) / 2, 3, 2)
    assert [_exact_quantile(*joint, q) for q in (0.12, 0.88)] == [0.0, 2.0]
    assert [_exact_quantile(*within, q) for q in (0.12, 0.88)] == [0.5, 1.5]
    ci = bootstrap_ci_shared_problems([x, x], seed=1, n_resamples=40_000, confidence=0.76, resample_seeds=False)
    assert (ci["low"], ci["high"]) == (0.0, 2.0)
    ci = bootstrap_ci_within_seeds([x, x], seed=1, n_resamples=40_000, confidence=0.76, resample_seeds=False)
    assert (ci["low"], ci["high"]) == (0.5, 1.5)
    # one seed, and a seed duplicated: the very draws of the one-seed bootstrap
    one = bootstrap_ci([1.0, 4.0, -2.0, 0.5], seed=5, n_resamples=3000)
    for seeds in ([[1.0, 4.0, -2.0, 0.5]], [[1.0, 4.0, -2.0, 0.5]] * 2):
        ci = bootstrap_ci_shared_problems(seeds, seed=5, n_resamples=3000, resample_seeds=len(seeds) == 1)
        assert (ci["estimate"], ci["low"], ci["high"]) == pytest.approx((one.estimate, one.low, one.high), abs=1e-12)


def test_undefined_differences_by_enumeration():
    # NaN = not defined for that seed and problem (a trace difference where not both were right). Seed 0 has
    # (1, -, 3), seed 1 (-, 2, -): estimate = mean(mean(1, 3), 2) = 2. A resample's statistic averages the seeds
    # that drew a defined entry; the reference enumerates the 27 index vectors: at 90% -> [1.5, 2.5].
    nan = float("nan")
    x = [[1.0, nan, 3.0], [nan, 2.0, nan]]

    def stat(i):
        means = [np.mean(v) for v in ([x[s][k] for k in i if not math.isnan(x[s][k])] for s in (0, 1)) if v]
        return np.mean(means)

    ref = _enumerate(stat, 3, 1)
    lo, hi = (_exact_quantile(*ref, q) for q in (0.05, 0.95))
    ci = bootstrap_ci_shared_problems(x, seed=2, n_resamples=40_000, confidence=0.9, resample_seeds=False)
    assert (ci["estimate"], ci["low"], ci["high"]) == (2.0, lo, hi) == (2.0, 1.5, 2.5)
    with pytest.raises(ValueError):  # a seed with nothing defined
        bootstrap_ci_shared_problems([[1.0, 2.0], [nan, nan]])
    with pytest.raises(ValueError):  # the seeds must share their problems
        bootstrap_ci_shared_problems([[1.0, 2.0], [1.0]])


def test_two_level_bootstrap_holds_the_seed_spread_by_enumeration():
    # Two seeds whose rows do not overlap: seed 0 (0, 2), seed 1 (4, 6). Two-level: draw 2 seeds with replacement,
    # then each drawn seed's 2 rows with replacement (independently per slot): 4 x 16 equally likely outcomes,
    # enumerated below. At 80% (quantiles 0.10 / 0.90) that is [1.0, 5.0]; rows within the seeds only: [2.5, 3.5],
    # an interval that excludes both seeds' own means (1 and 5).
    x = [[0.0, 2.0], [4.0, 6.0]]
    ref = _enumerate(lambda i, j, k: (np.mean([x[i[0]][r] for r in j]) + np.mean([x[i[1]][r] for r in k])) / 2, 2, 3)
    lo, hi = (_exact_quantile(*ref, q) for q in (0.10, 0.90))
    ci = bootstrap_ci_within_seeds(x, seed=0, n_resamples=40_000, confidence=0.8)
    assert (ci["estimate"], ci["low"], ci["high"]) == (3.0, lo, hi) == (3.0, 1.0, 5.0)
    assert (ci["seeds"], ci["resamples"]) == (2, "seeds, then rows within each drawn seed")
    fixed = bootstrap_ci_within_seeds(x, seed=0, n_resamples=40_000, confidence=0.8, resample_seeds=False)
    assert (fixed["low"], fixed["high"]) == (2.5, 3.5)
    # shared problems: seeds (0, 2) and (4, 6) on the same two problems; the problem draw is shared, the seed draw
    # is not: mean over 2 seed slots of the drawn seeds' means over one index vector (4 x 4 outcomes)
    ref = _enumerate(lambda i, j: np.mean([np.mean([x[s][r] for r in j]) for s in i]), 2, 2)
    lo, hi = (_exact_quantile(*ref, q) for q in (0.10, 0.90))
    ci = bootstrap_ci_shared_problems(x, seed=0, n_resamples=40_000, confidence=0.8)
    assert (ci["estimate"], ci["low"], ci["high"]) == (3.0, lo, hi) and ci["seeds"] == 2


def test_bootstrap_within_seeds_basics():
    groups = [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]  # seed means 0.5 and 1/6 (rows not shared)
    ci = bootstrap_ci_within_seeds(groups, seed=3, n_resamples=4000)
    assert ci["estimate"] == pytest.approx((0.5 + 1 / 6) / 2)
    assert ci == bootstrap_ci_within_seeds(groups, seed=3, n_resamples=4000)  # seeded
    const = bootstrap_ci_within_seeds([[2.0, 2.0], [4.0]], n_resamples=100)
    assert (const["low"], const["estimate"], const["high"]) == (2.0, 3.0, 4.0)  # 2.5% of draws: seed 0 twice
    const = bootstrap_ci_within_seeds([[2.0, 2.0], [4.0]], n_resamples=100, resample_seeds=False)
    assert (const["estimate"], const["low"], const["high"]) == (3.0, 3.0, 3.0)  # nothing to resample: zero width
    with pytest.raises(ValueError):
        bootstrap_ci_within_seeds([[1.0], []])
