"""Statistics of ``fullband bench serve`` (:func:`fullband.serving.benchmark.summarize_pairs`) on known inputs, and
its ``--profile`` op table (read back from a table torch's own profiler printed) and Markdown report.

References are worked out by hand from the definitions: the median of the paired ratios, the distribution-free
interval ``[x_(k), x_(n+1-k)]`` whose miss probability is ``2 · P(Binomial(n, 1/2) <= k - 1)``, and quartiles by
linear interpolation between order statistics. No vLLM needed.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fullband.serving.benchmark import markdown_tables, read_profile_table, summarize_pairs


def pairs(ratios, seed=0):
    """Paired tokens/s with the given ratios, the plain side varying widely (only the ratio may matter)."""
    rng = random.Random(seed)
    plain = [rng.uniform(50.0, 5000.0) for _ in ratios]
    return [r * p for r, p in zip(ratios, plain)], plain


def test_ten_pairs_median_interval_spread_and_verdict():
    ratios = [0.90, 1.00, 0.95, 1.10, 0.80, 1.05, 0.97, 0.99, 1.02, 0.93]
    s = summarize_pairs(*pairs(ratios))
    # sorted: 0.80 0.90 0.93 0.95 0.97 | 0.99 1.00 1.02 1.05 1.10
    assert s["ratio"] == pytest.approx((0.97 + 0.99) / 2)
    # n = 10: P(B <= 1) = 11/1024 (2x = 0.0215 <= 0.05), P(B <= 2) = 56/1024 (2x = 0.109 > 0.05) -> k = 2
    assert (s["ci_low"], s["ci_high"]) == pytest.approx((0.90, 1.05))
    assert s["ci_coverage"] == pytest.approx(1 - 22 / 1024)
    # quartiles at positions 9 * 0.25 = 2.25 and 9 * 0.75 = 6.75 (0-based) of the sorted ratios
    assert s["q1"] == pytest.approx(0.93 + 0.25 * (0.95 - 0.93))
    assert s["q3"] == pytest.approx(1.00 + 0.75 * (1.02 - 1.00))
    assert (s["min"], s["max"], s["pairs"]) == (pytest.approx(0.80), pytest.approx(1.10), 10)
    assert s["paired_ratios"] == pytest.approx(ratios)  # in run order
    # width 0.15 > 0.10: inconclusive, although the median is above the goal
    assert not s["conclusive"] and s["verdict"] == "inconclusive" and "0.150 > 0.1" in s["inconclusive_because"]
    # the same pairs with a looser threshold conclude: the interval holds 0.95
    assert summarize_pairs(*pairs(ratios), max_ci_width=0.2)["verdict"] == "at goal"


def test_twenty_pairs_interval_ranks():
    ratios = [1.0 + 0.01 * i for i in range(20)]
    random.Random(1).shuffle(ratios)
    s = summarize_pairs(*pairs(ratios, seed=3))
    # n = 20: #{B <= 5} = 1 + 20 + 190 + 1140 + 4845 + 15504 = 21700 (2x / 2^20 = 0.0414 <= 0.05),
    # #{B <= 6} = 21700 + 38760 = 60460 (0.1153 > 0.05) -> k = 6: [x_(6), x_(15)] = [1.05, 1.14]
    assert (s["ci_low"], s["ci_high"]) == pytest.approx((1.05, 1.14))
    assert s["ci_coverage"] == pytest.approx(1 - 2 * 21700 / 2**20)
    assert s["ratio"] == pytest.approx(1.095)
    assert s["conclusive"] and s["verdict"] == "meets goal"
    # at 90%: 2 * #{B <= 6} / 2^20 = 0.1153 > 0.10 still -> the same k
    assert summarize_pairs(*pairs(ratios), confidence=0.90)["ci_low"] == pytest.approx(1.05)
    # at 80%: 0.1153 <= 0.20, #{B <= 7} = 60460 + 77520 = 137980 (0.263 > 0.20) -> k = 7: [1.06, 1.13]
    s80 = summarize_pairs(*pairs(ratios), confidence=0.80)
    assert (s80["ci_low"], s80["ci_high"]) == pytest.approx((1.06, 1.13))


def test_below_goal_and_six_pairs_minimum():
    # n = 6: P(B <= 0) = 1/64, 2x = 0.031 <= 0.05 -> k = 1, the interval is [min, max]
    s = summarize_pairs(*pairs([0.80, 0.82, 0.81, 0.83, 0.80, 0.84]))
    assert (s["ci_low"], s["ci_high"]) == pytest.approx((0.80, 0.84))
    assert s["ci_coverage"] == pytest.approx(1 - 2 / 64)
    assert s["verdict"] == "below goal" and s["ratio"] == pytest.approx(0.815)


def test_the_issue_three_repeats_are_too_few_to_conclude():
    # the three paired batch-1 ratios the old benchmark reported as 1.12 (its ratio of medians)
    s = summarize_pairs(*pairs([1.28, 0.54, 1.33]))
    assert s["ratio"] == pytest.approx(1.28)
    # n = 3: even [min, max] covers only 1 - 2/8 = 0.75 < 0.95
    assert (s["ci_low"], s["ci_high"], s["ci_coverage"]) == pytest.approx((0.54, 1.33, 0.75))
    assert s["verdict"] == "inconclusive" and "too few pairs (3)" in s["inconclusive_because"]
    assert summarize_pairs([5.0], [4.0])["verdict"] == "inconclusive"


def test_ratio_is_per_pair_not_of_medians():
    # fullband's median run / plain's median run = 100 / 100 = 1, but every pair is 0.5 or 2 -> the pairs decide
    fb, pl = [50.0, 100.0, 200.0, 50.0, 100.0, 200.0, 50.0], [100.0, 200.0, 100.0, 100.0, 200.0, 100.0, 100.0]
    s = summarize_pairs(fb, pl)
    assert sorted(s["paired_ratios"]) == pytest.approx([0.5] * 5 + [2.0] * 2)
    assert s["ratio"] == pytest.approx(0.5)


@pytest.mark.parametrize("fb, pl, msg", [([1.0, 2.0], [1.0], "paired runs"), ([], [], "paired runs"),
                                         ([1.0, 0.0], [1.0, 1.0], "positive"), ([1.0], [float("nan")], "positive")])
def test_bad_input(fb, pl, msg):
    with pytest.raises(ValueError, match=msg):
        summarize_pairs(fb, pl)
    with pytest.raises(ValueError, match="confidence"):
        summarize_pairs([1.0], [1.0], confidence=1.0)


def test_profile_table_is_read_back_from_torch_profilers_own_table(tmp_path):
    """The table is the one vLLM writes (``key_averages().table(sort_by="self_cpu_time_total", row_limit=50)``);
    every row read back matches the profiler's own averages: name, calls, self CPU time to the table's rounding."""
    x, w = torch.randn(16, 64), torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(7):
            torch.relu(x @ w).sum()
    averages = prof.key_averages()
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "rank0.profiler_out.txt").write_text(
        averages.table(sort_by="self_cpu_time_total", row_limit=50))
    got = read_profile_table(str(tmp_path / "engine"))
    truth = {e.key: e for e in averages}
    assert {"aten::mm", "aten::relu", "aten::sum"} <= {name for name, _, _ in got["ops"]}
    for name, us, calls in got["ops"]:
        assert calls == truth[name].count
        assert us == pytest.approx(truth[name].self_cpu_time_total, rel=0.01, abs=0.01)
    assert got["ops"][0][1] == max(us for _, us, _ in got["ops"])  # in the table's order
    assert got["self_cpu_total_us"] == pytest.approx(sum(e.self_cpu_time_total for e in averages), rel=0.01)
    with pytest.raises(RuntimeError, match="no op table"):
        read_profile_table(str(tmp_path / "missing"))


def test_markdown_report_rows_and_profile_per_step():
    fb, pl = pairs([0.99] * 6 + [1.01] * 6)
    row = {"fullband_tokens_per_s": 990.0, "plain_tokens_per_s": 1000.0, **summarize_pairs(fb, pl)}
    report = {"size": {"d_model": 256, "layers": 4, "vocab": 4096}, "dtype": "float32", "enforce_eager": True,
              "prompt_len": 32, "new_tokens": 32, "repeats": 12, "load_average_before": [1.0, 0, 0],
              "load_average_after": [2.0, 0, 0], "batch": {"16": row},
              "profile": {"batch": 16, "steps": 32, "engines": {
                  "fullband": {"self_cpu_total_us": 3200.0, "ops": [["aten::mm", 640.0, 32], ["aten::where", 64.0, 32]]},
                  "plain": {"self_cpu_total_us": 2880.0, "ops": [["aten::mm", 320.0, 32]]}}}}
    text = markdown_tables(report)
    assert "| 16 | 990.0 | 1000.0 | 1.000 | [0.990, 1.010] |" in text and "meets goal" in text
    assert "| `aten::mm` | 20.0 | 1.0 | 10.0 | 1.0 |" in text  # 640 µs over 32 steps, against 320
    assert "| `aten::where` | 2.0 | 1.0 | - | - |" in text
    assert "| **all ops (self CPU time)** | 100.0 | | 90.0 | |" in text
