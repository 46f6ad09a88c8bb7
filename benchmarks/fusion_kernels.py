"""What the served fusion's small ops cost a decode step, per call, on this machine: the output RMSNorm by
``F.rms_norm`` against vLLM's own ``torch.ops._C.rms_norm`` kernel (what ``serving/vllm_model.py`` runs where the
vLLM build has it), ``W_U h`` by ``F.linear`` against vLLM's prepacked oneDNN GEMM, and the document-start
``torch.where`` against the ``any()`` check that skips it; with the largest absolute difference of each pair's
outputs. Runs in the vLLM venv (it imports vLLM's kernels).

usage: OMP_NUM_THREADS=2 python benchmarks/fusion_kernels.py [--calls N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import vllm._custom_ops as ops  # loads vLLM's kernels (torch.ops._C)


def per_call_us(fn, calls: int) -> float:
    for _ in range(max(100, calls // 20)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(d: int, rows: int, calls: int) -> dict:
    torch.manual_seed(0)
    v, w, W = torch.randn(rows, d), torch.rand(d) + 0.5, torch.randn(d, d) / d ** 0.5
    tokens, e = torch.randint(3, 4096, (rows,)), torch.randn(rows, d)
    out = torch.empty_like(v)
    handler = ops.create_onednn_mm(W.t(), 32)

    def vllm_rms():
        o = torch.empty_like(v)
        torch.ops._C.rms_norm(o, v, w, 1e-6)
        return o

    def skip_where():
        doc = tokens == 1
        return torch.where(doc.unsqueeze(-1), e, v) if bool(doc.any()) else v

    torch.ops._C.rms_norm(out, v, w, 1e-6)
    return {"d": d, "rows": rows,
            "rms_norm_torch_us": per_call_us(lambda: F.rms_norm(v, (d,), w, eps=1e-6), calls),
            "rms_norm_vllm_us": per_call_us(vllm_rms, calls),
            "rms_norm_max_abs_diff": (out - F.rms_norm(v, (d,), w, eps=1e-6)).abs().max().item(),
            "linear_torch_us": per_call_us(lambda: F.linear(v, W), calls),
            "linear_onednn_us": per_call_us(lambda: ops.onednn_mm(handler, v, None), calls),
            "linear_max_abs_diff": (F.linear(v, W) - ops.onednn_mm(handler, v, None)).abs().max().item(),
            "where_us": per_call_us(lambda: torch.where((tokens == 1).unsqueeze(-1), e, v), calls),
            "any_then_skip_us": per_call_us(skip_where, calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000, help="timed calls per op and shape (default 20000)")
    ap.add_argument("--json", action="store_true", help="print one JSON report")
    args = ap.parse_args()
    rows = [measure(d, m, args.calls) for d in (256, 768) for m in (1, 16)]
    report = {"threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "load_average": list(os.getloadavg()), "calls": args.calls, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    keys = [k for k in rows[0] if k.endswith("_us")]
    print("| d | rows | " + " | ".join(k[:-3] for k in keys) + " |")
    print("| ---: | ---: |" + " ---: |" * len(keys))
    for r in rows:
        print(f"| {r['d']} | {r['rows']} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
    print(f"\n{report['threads']} thread(s), load average {report['load_average'][0]:.2f}; max |diff| rms_norm "
          f"{max(r['rms_norm_max_abs_diff'] for r in rows):.1e}, linear {max(r['linear_max_abs_diff'] for r in rows):.1e}")


if __name__ == "__main__":
    main()
