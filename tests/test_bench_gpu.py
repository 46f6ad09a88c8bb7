"""``fullband bench gpu`` as CI runs it (``--device cpu --size micro``): the same code as the GPU check, so that it
cannot rot; its exactness section must hold its stated bounds and every section must measure what it names."""

from __future__ import annotations

import json

from fullband.cli import main
from fullband.commands.bench_gpu import MODES


def test_the_prepared_gpu_check_runs_at_micro_size_on_cpu(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--device", "cpu", "--size", "micro", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert not [name for name, s in sections.items() if "error" in s], printed
    exact = sections["exactness"]["result"]
    assert set(exact["recurrence"]) == {"off", "lean", "compiled"} and set(exact["decode"]) == set(MODES)
    assert exact["fp32_within_bound"] and exact["bf16_within_bound"], exact
    assert exact["exact_states_training"]["grad"] <= exact["fp32_bound"]
    (row,) = sections["training"]["result"]
    assert set(row["cases"]) == {"K1", "K2", "K3", "exact_g2", "pass_mix"}
    cases = row["cases"]
    assert cases["K1"]["flops_per_step"] < cases["pass_mix"]["flops_per_step"] < cases["K2"]["flops_per_step"]
    assert cases["K1"]["tokens_per_s"] > cases["K3"]["tokens_per_s"]  # three passes cost more than one
    decode = sections["decoding"]["result"]
    assert {(r["batch"], r["token_step"], r["mode"]) for r in decode} == {
        (b, s, m) for b in (1, 32) for s in ("lean", "compiled") for m in ("standard", "soft", "exact")}
    assert "exactness" in printed and "FAILED" not in printed
