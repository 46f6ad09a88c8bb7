"""``fullband bench gpu``: the prepared accelerator check, one command, one JSON: exactness on the device, training
throughput and MFU, decode tokens/s.

Owns :func:`benchmark_gpu` (sections :func:`exactness`, :func:`training`, :func:`decoding`, each written to the JSON
as soon as it ends, so that a run cut short keeps what it measured; a section that fails records its one-line
error and the next runs). ``--size full`` is the GPU check (d768 L12 T = 1024 and the paper's shape, 24 layers
d1536 GQA 16/8 T = 2048, bf16, SDPA, the largest batch that fits); ``--size micro`` runs the same code at a few
thousand parameters, which is what CI runs with ``--device cpu`` so that the check cannot rot.

Exactness: every decode mode (log-probabilities of a teacher-forced continuation, :func:`fullband.score`) and
every token step of the recurrence, and one ``--exact-states`` training forward/backward, on the device against
the same weights on the CPU in fp32 through the backbone's full forward (``token_step="off"``, the path the test
suite checks against the equations). fp32 (TF32 off) must agree within the reordering bound the tests use,
``eps32 * (d + d_mlp + V)`` relative to the largest |logit|. bf16 (autocast) is held to ``6 * L * 2^-8`` relative:
bf16 keeps 8 significant bits (unit roundoff 2^-8); a layer rounds about six of its results to bf16 (its norm
outputs, q/k/v, attention output, MLP input and output) and the residual stream adds the layers' errors, so L
layers give about 6·L roundings of relative size 2^-8 at most on the final hidden state, which the LM head carries
to the logits. Both are bounds on what the arithmetic alone can do; the report gives the measured error beside
each.
"""

from __future__ import annotations

import copy
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

from ..eval.flops import flop_parameters, training_flops
from ..model.feedback import build_feedback_mask
from ..model.generation import MODES, generate, score
from ..model.lean import TOKEN_STEPS
from ..model.modeling import FullBandwidthForCausalLM
from ..training import distributed as D
from ..training.config import TrainConfig
from ..training.device import autocast_context
from ..training.engine import forward_backward
from ..training.optimizer import build_optimizer
from ..utils.io import atomic_write_json

SEED = 0
FP32_EPS = torch.finfo(torch.float32).eps
BF16_U = 2.0 ** -8
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s of the SXM parts
PASS_MIX = {1: 0.75, 2: 0.22, 3: 0.03}  # the paper's per-batch mix of pass counts
SHAPES = {
    "micro": [dict(name="micro", hidden=64, layers=2, heads=4, kv=2, mlp=128, vocab=512, seq=32)],
    "full": [dict(name="d768-L12-T1024", hidden=768, layers=12, heads=12, kv=12, mlp=3072, vocab=32768, seq=1024),
             dict(name="paper-L24-d1536-T2048", hidden=1536, layers=24, heads=16, kv=8, mlp=4096, vocab=32768,
                  seq=2048)],
}
CHECK_SHAPE = {"micro": dict(hidden=32, layers=2, heads=4, kv=2, mlp=64, vocab=97, seq=24),
               "full": dict(hidden=256, layers=4, heads=8, kv=4, mlp=688, vocab=4096, seq=128)}
DECODE_SHAPE = {"micro": dict(hidden=64, layers=2, heads=4, kv=2, mlp=128, vocab=512, seq=64),
                "full": dict(hidden=768, layers=12, heads=12, kv=12, mlp=3072, vocab=32768, seq=512)}


def build(shape: dict, device, seed: int = SEED) -> FullBandwidthForCausalLM:
    """A randomly initialised Llama-style model of ``shape`` wrapped with the default fusion (BOS = 1)."""
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=shape["hidden"], intermediate_size=shape["mlp"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv"], vocab_size=shape["vocab"],
                         max_position_embeddings=max(2 * shape["seq"], 256), bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, attn_implementation="sdpa")
    backbone = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(seed + 1)
    return FullBandwidthForCausalLM.from_backbone(backbone, doc_start_token_id=1).to(device).eval()


def _rows(batch: int, length: int, vocab: int, device, seed: int = SEED) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    ids[:, 0] = 1
    ids[0, length // 2] = 1  # a document start inside a row
    return ids.to(device)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want.float().cpu()).abs().max() / want.float().abs().max().clamp_min(1e-12))


@torch.no_grad()
def exactness(device, size: str) -> dict:
    """The device's numbers against the CPU's fp32 full-forward path on the same weights (see the module docstring)."""
    shape = CHECK_SHAPE[size]
    ref = build(shape, "cpu")
    ref.token_step = "off"
    model = copy.deepcopy(ref).to(device)
    ids = _rows(3, shape["seq"], shape["vocab"], "cpu")
    mask = torch.ones_like(ids)
    mask[2, :4] = 0  # a left-padded row
    want = ref.recurrent_forward(ids, attention_mask=mask).logits
    real = mask.bool()
    fp32_bound = FP32_EPS * (shape["hidden"] + shape["mlp"] + shape["vocab"])
    bf16_bound = 6 * shape["layers"] * BF16_U
    out = {"shape": shape, "fp32_bound": fp32_bound, "bf16_bound": bf16_bound, "recurrence": {}, "decode": {}}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    autocast = torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    try:
        for step in (s for s in TOKEN_STEPS if s != "auto"):
            model.token_step = step
            got = model.recurrent_forward(ids.to(device), attention_mask=mask.to(device)).logits
            with autocast:
                low = model.recurrent_forward(ids.to(device), attention_mask=mask.to(device)).logits
            out["recurrence"][step] = {"fp32": _rel(got.cpu()[real], want[real]),
                                       "bf16": _rel(low.cpu()[real], want[real])}
        model.token_step = "auto"
        prompt, cont = ids[:, :shape["seq"] // 2], ids[:, shape["seq"] // 2:]
        for mode in MODES:
            want_lp = score(ref, prompt, cont, mode=mode)
            got_lp = score(model, prompt.to(device), cont.to(device), mode=mode)
            with autocast:
                low_lp = score(model, prompt.to(device), cont.to(device), mode=mode)
            out["decode"][mode] = {"fp32": _rel(got_lp, want_lp), "bf16": _rel(low_lp, want_lp)}
        with torch.enable_grad():
            labels = ids.clone()
            grads = []
            for m, dev in ((ref, "cpu"), (model, device)):  # evaluation mode: no jitter, no dropout to draw
                m.zero_grad(set_to_none=True)
                loss = m(input_ids=ids.to(dev), labels=labels.to(dev), num_passes=2, exact_states=True).loss
                loss.backward()
                grads.append((float(loss), torch.cat([p.grad.flatten().cpu() for p in m.parameters()
                                                      if p.grad is not None])))
        out["exact_states_training"] = {"loss": abs(grads[0][0] - grads[1][0]) / abs(grads[0][0]),
                                        "grad": _rel(grads[1][1], grads[0][1])}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    fp32 = [v["fp32"] for part in ("recurrence", "decode") for v in out[part].values()]
    bf16 = [v["bf16"] for part in ("recurrence", "decode") for v in out[part].values()]
    fp32 += [out["exact_states_training"]["grad"]]
    out["fp32_within_bound"] = max(fp32) <= fp32_bound
    out["bf16_within_bound"] = max(bf16) <= bf16_bound
    return out


def _peak(device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def training(device, size: str, steps: int = 2) -> list[dict]:
    """Training tokens/s and MFU per shape: K = 1, 2, 3 (the paper's pass mix weighs them), exact states + 2
    gradient passes; bf16 autocast on CUDA, the largest power-of-two batch (≤ 64) whose K = 2 step fits."""
    cuda = torch.device(device).type == "cuda"
    autocast, precision = autocast_context("auto", torch.device(device))  # bf16 on a GPU that has it, else fp32
    peak = _peak(device)
    rows = []
    for shape in SHAPES[size]:
        model = build(shape, device).train()
        opt = build_optimizer(model, TrainConfig(out="-", preset="micro"), torch.device(device))
        fp = flop_parameters(model)
        T = shape["seq"]

        def step(ids, K, model=model, opt=opt, **forward):
            mask = build_feedback_mask(ids, None, 1)
            forward_backward(model, [{"input_ids": ids, "labels": ids, "feedback_mask": mask}], K, autocast,
                             **forward)
            opt.step()
            opt.zero_grad(set_to_none=True)

        batch = None
        for b in ([64, 32, 16, 8, 4, 2, 1] if cuda else [2]):
            try:
                step(_rows(b, T, shape["vocab"], device), 2)
                batch = b
                break
            except torch.OutOfMemoryError:
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
        if batch is None:
            rows.append({"shape": shape, "error": "no batch of one row fits"})
            continue
        ids = _rows(batch, T, shape["vocab"], device)
        cases = {"K1": (1, {}, {"num_passes": 1}), "K2": (2, {}, {"num_passes": 2}),
                 "K3": (3, {}, {"num_passes": 3}),
                 "exact_g2": (2, {"exact_states": True},
                              {"num_passes": 2, "exact_states": True, "passes_run": 2, "grad_passes_run": 2})}
        res = {}
        for label, (K, forward, record) in cases.items():
            try:
                step(ids, K, **forward)  # warm-up (a compiled token step compiles here)
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(ids, K, **forward)
                _sync(device)
                sec = (time.perf_counter() - t0) / steps
                flops = training_flops([record], batch * T, T, fp)["flops"]
                res[label] = {"step_s": sec, "tokens_per_s": batch * T / sec, "flops_per_step": flops,
                              "mfu": flops / sec / peak if peak else None}
            except torch.OutOfMemoryError as err:
                res[label] = {"error": f"out of memory: {str(err).splitlines()[0]}"}
                torch.cuda.empty_cache()
        if all("step_s" in res.get(f"K{k}", {}) for k in PASS_MIX):
            sec = sum(p * res[f"K{k}"]["step_s"] for k, p in PASS_MIX.items())
            flops = sum(p * res[f"K{k}"]["flops_per_step"] for k, p in PASS_MIX.items())
            res["pass_mix"] = {"step_s": sec, "tokens_per_s": batch * T / sec, "flops_per_step": flops,
                               "mfu": flops / sec / peak if peak else None, "mix": PASS_MIX}
        rows.append({"shape": shape, "batch": batch, "precision": precision, "cases": res})
        del model, opt
        if cuda:
            torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def decoding(device, size: str, new_tokens: int = 64) -> list[dict]:
    """Decode tokens/s of standard, soft and exact at batch 1 and 32, with the token step eager (lean) and compiled
    (``compiled`` applies to the exact prefill; the decode steps are the lean loop's either way)."""
    shape = DECODE_SHAPE[size]
    model = build(shape, device)
    rows = []
    for batch in (1, 32):
        prompt = _rows(batch, shape["seq"] // 4, shape["vocab"], device)
        for step in ("lean", "compiled"):
            model.token_step = step
            for mode in ("standard", "soft", "exact"):
                generate(model, prompt, mode=mode, max_new_tokens=4)  # warm-up
                res = generate(model, prompt, mode=mode, max_new_tokens=new_tokens)
                rows.append({"batch": batch, "token_step": step, "mode": mode, "prompt_len": prompt.shape[1],
                             "new_tokens": new_tokens, "prefill_s": res.prefill_seconds,
                             "tokens_per_s": batch * (new_tokens - 1) / max(res.decode_seconds, 1e-9)})
    return rows


def benchmark_gpu(args) -> dict:
    """``fullband bench gpu``: the three sections in turn, the JSON rewritten after each (see the module docstring)."""
    hf_logging.disable_progress_bar()
    device = D.resolve_device(args.device)
    report = {"device": str(device), "size": args.size, "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "sections": {}}
    for name, fn in (("exactness", exactness), ("training", training), ("decoding", decoding)):
        t0 = time.perf_counter()
        try:
            report["sections"][name] = {"result": fn(device, args.size)}
        except Exception as err:  # recorded, and the next section runs: one JSON with all that could be measured
            report["sections"][name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        report["sections"][name]["seconds"] = time.perf_counter() - t0
        if args.out:
            atomic_write_json(args.out, report)
    return report


def format_gpu(report: dict) -> str:
    """A few lines per section (the JSON has everything)."""
    lines = [f"fullband bench gpu: {report['device_name']} ({report['device']}), size {report['size']}, "
             f"torch {report['torch']}"]
    for name, sec in report["sections"].items():
        head = f"{name} ({sec['seconds']:.0f} s)"
        if "error" in sec:
            lines.append(f"{head}: FAILED: {sec['error']}")
            continue
        res = sec["result"]
        if name == "exactness":
            worst = {p: max(v[p] for part in ("recurrence", "decode") for v in res[part].values())
                     for p in ("fp32", "bf16")}
            lines.append(f"{head}: worst relative error fp32 {worst['fp32']:.2e} (bound {res['fp32_bound']:.2e}: "
                         f"{'within' if res['fp32_within_bound'] else 'OUTSIDE'}), bf16 {worst['bf16']:.2e} (bound "
                         f"{res['bf16_bound']:.2e}: {'within' if res['bf16_within_bound'] else 'OUTSIDE'}); "
                         f"exact-states loss {res['exact_states_training']['loss']:.1e}, "
                         f"gradient {res['exact_states_training']['grad']:.1e}")
        elif name == "training":
            for row in res:
                cases = ", ".join(f"{k} {v['tokens_per_s']:,.0f} tok/s" + (f" MFU {v['mfu']:.1%}" if v.get("mfu")
                                                                              else "")
                                  for k, v in row.get("cases", {}).items() if "tokens_per_s" in v)
                lines.append(f"{head}: {row['shape']['name']} batch {row.get('batch')}: {cases or row.get('error')}")
        else:
            lines += [f"{head}: batch {r['batch']} {r['token_step']} {r['mode']}: {r['tokens_per_s']:,.0f} tok/s"
                      for r in res]
    return "\n".join(lines)
