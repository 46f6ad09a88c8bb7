"""``fullband bench llamacpp``: how close and how fast the llama.cpp engine (:mod:`.llamacpp`) is.

Owns two measurements and their report:

* **agreement** (:func:`agreement`): for each prompt and decode mode, the engine's greedy continuation against
  :func:`fullband.model.generation.generate`'s on the same model (its export), and the per-step logit error with
  both fed the same tokens (the engine teacher-forced with ``generate()``'s tokens). A continuation that differs is
  explained when it first differs at a near-tie: ``generate()``'s top-2 logit gap at that step is at most twice the
  measured error there (two logits each off by up to the error can swap only then). tests/test_llamacpp.py asserts
  it for f32; the benchmark reports it for f32, f16 and q8_0 on a given run.
* **speed** (:func:`speed`): decode tokens/s at batch 1 of the engine in ``soft`` mode against plain llama.cpp
  decoding of the same GGUF (token ids, a context without the embedding output, the same loop otherwise) and against
  the package's own lean PyTorch loop in ``soft`` mode, on randomly initialised Llama backbones of the given sizes
  (speed does not depend on the weights' values). Goal: soft / plain llama.cpp >= 0.9 at d256 L4 and d768 L12.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

from ..model.configuration import FEEDBACK_MODES
from ..model.generation import generate
from ..model.modeling import FullBandwidthForCausalLM, load_model
from ..utils.argtypes import NONNEG_INT, POSITIVE_INT
from ..utils.provenance import provenance
from .gguf_export import TYPES, export_gguf
from .llamacpp import LlamaCppEngine

SIZES = {"d256-L4": (256, 4), "d768-L12": (768, 12)}


def agreement(model, engine: LlamaCppEngine, prompts, modes=FEEDBACK_MODES, new_tokens: int = 32,
              prefill_passes: int = 1) -> dict:
    """Greedy continuations of ``engine`` against ``generate(model)`` per (prompt, mode); see the module's text."""
    rows = []
    for mode in modes:
        for i, prompt in enumerate(prompts):
            ref = generate(model, torch.tensor([prompt]), mode=mode, max_new_tokens=new_tokens,
                           prefill_passes=prefill_passes, output_logits=True)
            want, ref_logits = ref.new_tokens[0].tolist(), ref.logits[0].numpy()
            got = engine.generate([prompt], mode=mode, max_new_tokens=new_tokens,
                                  prefill_passes=prefill_passes).new_tokens[0]
            forced = engine.generate([prompt], mode=mode, max_new_tokens=len(want), prefill_passes=prefill_passes,
                                     forced=[want], output_logits=True).logits[0]
            err = np.abs(forced - ref_logits[:len(forced)]).max(axis=-1)
            first = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), None)
            row = {"mode": mode, "prompt": i, "identical": first is None, "first_difference": first,
                   "max_logit_error": float(err.max()), "logit_scale": float(np.abs(ref_logits).max())}
            if first is not None:
                top = np.sort(ref_logits[first])[-2:]
                row["gap"] = float(top[1] - top[0])
                row["near_tie"] = bool(row["gap"] <= 2 * err[first])
            rows.append(row)
    differing = [r for r in rows if not r["identical"]]
    return {"pairs": len(rows), "identical": sum(r["identical"] for r in rows),
            "identical_fraction": sum(r["identical"] for r in rows) / len(rows),
            "differing_all_near_ties": all(r["near_tie"] for r in differing),
            "max_logit_error": max(r["max_logit_error"] for r in rows),
            "per_mode": {m: {"identical": sum(r["identical"] for r in rows if r["mode"] == m),
                             "pairs": sum(r["mode"] == m for r in rows),
                             "max_logit_error": max(r["max_logit_error"] for r in rows if r["mode"] == m)}
                         for m in modes},
            "rows": rows}


def _timed(fn, repeats: int) -> float:
    """The best of ``repeats`` timings of ``fn`` (which returns its own decode seconds)."""
    return min(fn() for _ in range(repeats))


def speed(size: str, *, prompt_len: int, new_tokens: int, repeats: int, threads: int, vocab: int,
          seed: int = 0) -> dict:
    """Decode tokens/s at batch 1: the engine in ``soft`` mode, plain llama.cpp, the lean PyTorch loop (soft)."""
    width, layers = SIZES[size]
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                         num_attention_heads=width // 64, num_key_value_heads=width // 64,
                         max_position_embeddings=prompt_len + new_tokens, bos_token_id=1, eos_token_id=2)
    model = FullBandwidthForCausalLM.from_backbone(AutoModelForCausalLM.from_config(config), fusion="residual").eval()
    with torch.no_grad():  # a trained gain: the fused term is not zero (residual starts at u = e)
        model.feedback.out_norm.weight.fill_(model.config.embed_rms)
    prompt = torch.randint(3, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(seed + 1))
    prompt[0, 0] = 1
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(os.path.join(tmp, "model"))
        export_gguf(os.path.join(tmp, "model"), os.path.join(tmp, "gguf"), "f32")
        fb = LlamaCppEngine(os.path.join(tmp, "gguf"), threads=threads)
        plain = LlamaCppEngine(os.path.join(tmp, "gguf"), threads=threads, embeddings=False)
        ids = prompt[0].tolist()
        runs = {"llama.cpp soft": lambda: fb.generate([ids], mode="soft", max_new_tokens=new_tokens).decode_seconds,
                "llama.cpp plain": lambda: plain.generate([ids], mode="standard",
                                                          max_new_tokens=new_tokens).decode_seconds,
                "torch lean soft": lambda: generate(model, prompt, mode="soft",
                                                    max_new_tokens=new_tokens).decode_seconds}
        for fn in runs.values():  # warm-up
            fn()
        best = {name: float("inf") for name in runs}
        for _ in range(repeats):  # interleaved rounds, the best of each counts
            for name, fn in runs.items():
                best[name] = min(best[name], fn())
        fb.close()
        plain.close()
    rate = {name: (new_tokens - 1) / s for name, s in best.items()}
    return {"size": size, "width": width, "layers": layers, "vocab": vocab, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "tokens_per_s": rate,
            "soft_over_plain_llama_cpp": rate["llama.cpp soft"] / rate["llama.cpp plain"],
            "soft_over_torch_lean_soft": rate["llama.cpp soft"] / rate["torch lean soft"]}


def benchmark_llamacpp(args) -> dict:
    check_args(args)
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    report = {"provenance": provenance(), "threads": args.threads, "seed": args.seed, "agreement": {}, "speed": []}
    if args.model:
        model = load_model(args.model).float().eval()
        length = args.prompt_len
        g = torch.Generator().manual_seed(args.seed)
        vocab = model.get_input_embeddings().num_embeddings
        bos = getattr(model.config, "doc_start_token_id", None) or 1
        prompts = [[bos] + torch.randint(3, vocab, (length - 1,), generator=g).tolist() for _ in range(args.prompts)]
        report.update(model=os.path.abspath(args.model), prompts=args.prompts, agreement_new_tokens=args.new_tokens)
        with tempfile.TemporaryDirectory() as tmp:
            for kind in args.types:
                export_gguf(args.model, os.path.join(tmp, kind), kind)
                with LlamaCppEngine(os.path.join(tmp, kind), threads=args.threads) as engine:
                    t0 = time.perf_counter()
                    res = agreement(model, engine, prompts, new_tokens=args.new_tokens)
                    res["seconds"] = time.perf_counter() - t0
                report["agreement"][kind] = res
    for size in args.sizes:
        report["speed"].append(speed(size, prompt_len=args.prompt_len, new_tokens=args.speed_tokens,
                                     repeats=args.repeats, threads=args.threads, vocab=args.vocab,
                                     seed=args.seed))
    return report


def markdown_tables(res: dict) -> str:
    lines = []
    if res.get("agreement"):
        lines += [f"Agreement with `generate()` on `{os.path.basename(res['model'].rstrip('/'))}`: "
                  f"{res['prompts']} prompts x {res['agreement_new_tokens']} new tokens x soft / fused / exact, "
                  "greedy; error = the largest logit difference with both fed the same tokens.", "",
                  "| GGUF type | identical continuations | soft | fused | exact | every difference at a near-tie "
                  "| max logit error |", "| --- | ---: | ---: | ---: | ---: | --- | ---: |"]
        for kind, a in res["agreement"].items():
            per = [f"{a['per_mode'][m]['identical']}/{a['per_mode'][m]['pairs']}" for m in FEEDBACK_MODES]
            lines.append(f"| {kind} | {a['identical']}/{a['pairs']} ({a['identical_fraction']:.0%}) | "
                         + " | ".join(per) + f" | {'yes' if a['differing_all_near_ties'] else 'no'} | "
                         f"{a['max_logit_error']:.2e} |")
        lines.append("")
    if res.get("speed"):
        lines += [f"Decode tokens/s at batch 1 ({res['threads']} thread(s); best of interleaved rounds):", "",
                  "| size | llama.cpp plain | llama.cpp soft | torch lean soft | soft / plain llama.cpp (goal >= 0.9) "
                  "| llama.cpp soft / torch soft |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for s in res["speed"]:
            r = s["tokens_per_s"]
            lines.append(f"| {s['size']} (vocab {s['vocab']}, prompt {s['prompt_len']}, {s['new_tokens']} new) | "
                         f"{r['llama.cpp plain']:.1f} | {r['llama.cpp soft']:.1f} | {r['torch lean soft']:.1f} | "
                         f"{s['soft_over_plain_llama_cpp']:.3f} | {s['soft_over_torch_lean_soft']:.2f} |")
    return "\n".join(lines) + "\n"


def markdown_reports(res: dict) -> str:
    """Several ``bench llamacpp`` reports (``docs/gen/collect_runs.py``'s ``{"reports": [{"command", "report"}]}``),
    each under its command."""
    lines = []
    for e in res["reports"]:
        lines += [f"`{e['command']}`", "", markdown_tables(e["report"]), ""]
    return "\n".join(lines)


def add_bench_parser(sub):
    p = sub.add_parser("llamacpp", help="llama.cpp engine: agreement with generate() and decode tokens/s",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--model", default=None, help="a saved fullband model for the agreement part (skipped if none)")
    p.add_argument("--types", type=lambda t: [x for x in t.split(",") if x], default=list(TYPES),
                   help=f"comma list of GGUF types for the agreement part ({', '.join(TYPES)})")
    p.add_argument("--prompts", type=POSITIVE_INT, default=8, help="prompts of the agreement part")
    p.add_argument("--prompt-len", type=POSITIVE_INT, default=32, help="prompt tokens (agreement and speed)")
    p.add_argument("--new-tokens", type=POSITIVE_INT, default=32, help="new tokens of the agreement part")
    p.add_argument("--sizes", type=lambda t: [x for x in t.split(",") if x], default=list(SIZES),
                   help=f"comma list of speed sizes ({', '.join(SIZES)}); empty to skip")
    p.add_argument("--vocab", type=POSITIVE_INT, default=4096, help="vocabulary of the speed models")
    p.add_argument("--speed-tokens", type=POSITIVE_INT, default=128, help="new tokens of each speed run")
    p.add_argument("--repeats", type=POSITIVE_INT, default=5, help="interleaved timed rounds (the best counts)")
    p.add_argument("--threads", type=NONNEG_INT, default=1, help="threads of llama.cpp and torch alike")
    p.add_argument("--seed", type=NONNEG_INT, default=0, help="seed of the prompts and of the random speed models")
    return p


def check_args(args) -> None:
    """One-line errors for the lists argparse cannot check."""
    bad = sorted(set(args.types) - set(TYPES))
    if bad:
        raise ValueError(f"unknown GGUF type(s) {bad}: choose from {', '.join(TYPES)}")
    bad = sorted(set(args.sizes) - set(SIZES))
    if bad:
        raise ValueError(f"unknown size(s) {bad}: choose from {', '.join(SIZES)}")
    if not args.model and not args.sizes:
        raise ValueError("nothing to measure: give --model (agreement) and/or --sizes (speed)")
