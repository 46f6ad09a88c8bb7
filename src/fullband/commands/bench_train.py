"""``fullband bench train``: training step time and tokens/s for K = 1, K = 2 and K = 2 with a stop-gradient state,
and the memory and speed levers of ``fullband train`` against them.

Owns :func:`benchmark_train` (the full step: forward, backward, clip, AdamW, on random tokens, with the engine's
:func:`fullband.training.engine.forward_backward`, :func:`~fullband.training.engine.prepare_layers` and optimizer)
and :func:`format_benchmark`; ``fullband bench`` (:mod:`fullband.commands.bench`) registers the sub-command.
``--compile`` adds the rows ``K1_compile`` and ``K2_compile``, ``--activation-checkpointing`` the row ``K2_ac``,
``--loss-chunk N`` the row ``K2_chunk``, ``--exact N`` the row ``exact_gN`` (``--exact-states --grad-passes N``)
and with ``--exact-reference`` the row ``KT1_gN`` (K = T + 1 passes, the last N with gradient: the quadratic form
it replaces); ``full_backprop`` = C (an int or a list; ``--full-backprop C`` of ``fullband bench train``) the rows
``full_cC`` (``--full-backprop --backprop-chunk C``), with ``--exact-reference`` also ``KT1_full`` (K = T + 1
passes, all with gradient: the form whose last-pass gradient it equals); every row reports its training FLOPs
per step over K1's (:func:`fullband.eval.flops.training_flops` of the record the engine would log). ``--memory``
measures instead of times: each case's peak memory during one step above its memory before it (on CPU the
resident set: Linux ``VmHWM``, reset through ``/proc/self/clear_refs``, with glibc serving every block over 1 MiB by its own ``mmap`` so that freed tensors leave the resident set; on CUDA
``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import ctypes
import time

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from ..eval.flops import flop_parameters, training_flops
from ..model.feedback import build_feedback_mask
from ..model.modeling import FullBandwidthForCausalLM
from ..training import distributed as D
from ..training.config import TrainConfig
from ..training.device import autocast_context, load_average, tune_cpu_allocator
from ..training.engine import forward_backward, prepare_layers
from ..training.optimizer import build_optimizer
from ..training.presets import backbone_config

SEED = 0  # the random tokens' and every case's initial weights (each case starts from the same model)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"--memory needs Linux's /proc/self/status ({field} not found)")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def _mmap_big_blocks() -> bool:
    """glibc: every allocation over 1 MiB its own ``mmap``, unmapped when freed (so RSS follows live tensors)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 20))
    except (OSError, AttributeError):
        return False


def benchmark_train(args) -> dict:
    """``fullband bench train``: seconds per optimizer step and tokens/s for K = 1, K = 2 and K = 2 with a
    stop-gradient fed-back state, on random tokens (the full step: forward, backward, clip, AdamW), and the rows
    of the levers asked for (``--compile``, ``--activation-checkpointing``, ``--loss-chunk N``); with
    ``--memory``, each case's peak memory of one step instead of its time."""
    hf_logging.disable_progress_bar()
    memory = getattr(args, "memory", False)
    compile_, ac, chunk = (getattr(args, "compile", False), getattr(args, "activation_checkpointing", False),
                           getattr(args, "loss_chunk", 0))
    if chunk < 0:
        raise ValueError(f"--loss-chunk must be >= 0 (0: off), got {chunk}")
    load_before = load_average()
    preset = getattr(args, "preset", "tiny")
    batch = getattr(args, "batch_size", 16)
    seq = getattr(args, "seq_len", 256)
    vocab = getattr(args, "vocab_size", 4096)
    steps = getattr(args, "steps", 5)
    warmup = getattr(args, "warmup", 2)
    device = D.resolve_device(getattr(args, "device", "auto"))
    autocast, precision = autocast_context(getattr(args, "precision", "auto"), device)
    if memory and device.type != "cuda":
        _rss_kib("VmHWM")  # a one-line error off Linux
    tuned = _mmap_big_blocks() if memory else tune_cpu_allocator()  # timing: as `fullband train` does
    for name, v in (("--batch-size", batch), ("--seq-len", seq), ("--steps", steps)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    ids[:, 0] = 1
    ids = ids.to(device)
    # (label, K, detach, levers): the levers are prepare_layers' and the K-pass forward's loss options
    cases = [("K1", 1, False, {}), ("K2", 2, False, {}), ("K2_detach", 2, True, {})]
    if compile_:
        cases += [("K1_compile", 1, False, {"compile": True}), ("K2_compile", 2, False, {"compile": True})]
    if ac:
        cases.append(("K2_ac", 2, False, {"checkpointing": True}))
    if chunk:
        cases.append(("K2_chunk", 2, False, {"loss_chunk": chunk}))
    exact = getattr(args, "exact", 0)
    if exact < 0:
        raise ValueError(f"--exact must be >= 0 gradient passes (0: off), got {exact}")
    if exact:
        for step in getattr(args, "token_steps", None) or ["auto"]:  # one row per way of running the token pass
            cases.append((f"exact_g{exact}" + ("" if step == "auto" else f"_{step}"), exact, False,
                          {"forward": {"exact_states": True}, "token_step": step}))
        if getattr(args, "exact_reference", False):
            cases.append((f"KT1_g{exact}", seq + 1, False, {"forward": {"grad_passes": exact}}))
    full = getattr(args, "full_backprop", None)
    full = [] if full is None else [full] if isinstance(full, int) else list(full)
    if any(not isinstance(c, int) or c < 0 for c in full):
        raise ValueError(f"--full-backprop takes block sizes >= 0 tokens (0: no recomputation), got {full}")
    for c in full:  # the recurrence with gradient, as `fullband train --full-backprop --backprop-chunk C` runs it
        cases.append((f"full_c{c}", 1, False, {"forward": {"full_backprop": True, "backprop_chunk": c}}))
    if full and getattr(args, "exact_reference", False):  # K = T + 1 passes, all with gradient: what it equals
        cases.append(("KT1_full", seq + 1, False, {}))
    cfg = TrainConfig(out="-", preset=preset)
    setups = {}
    for label, K, detach, levers in cases:
        torch.manual_seed(SEED)
        backbone = AutoModelForCausalLM.from_config(backbone_config(preset, vocab, bos_token_id=1, eos_token_id=2,
                                                                    pad_token_id=0, max_position_embeddings=max(2048, seq)))
        model = FullBandwidthForCausalLM.from_backbone(backbone, doc_start_token_id=1, detach_state=detach).to(device).train()
        prepare_layers(model, levers.get("compile", False), levers.get("checkpointing", False))
        model.token_step = levers.get("token_step", "auto")
        setups[label] = (model, build_optimizer(model, cfg, device), K, levers.get("loss_chunk"),
                         levers.get("forward", {}))
    mask = build_feedback_mask(ids, None, 1)

    last_cpu = {}  # the process CPU time of each case's last step (immune to other processes' load, one thread)

    def one_step(label) -> float:
        model, opt, K, loss_chunk, forward = setups[label]
        if device.type == "cuda":
            torch.cuda.synchronize()
        c0, t0 = time.process_time(), time.perf_counter()
        forward_backward(model, [{"input_ids": ids, "labels": ids, "feedback_mask": mask}], K, autocast,
                         loss_chunk=loss_chunk, **forward)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        last_cpu[label] = time.process_time() - c0
        return time.perf_counter() - t0

    def peak_bytes(label) -> int:
        """Peak memory during one step of ``label`` above the memory before it: resident memory on CPU, the
        caching allocator's allocated bytes on CUDA."""
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            one_step(label)
            return torch.cuda.max_memory_allocated(device) - before
        _reset_peak_rss()
        before = _rss_kib("VmRSS")
        one_step(label)
        return (_rss_kib("VmHWM") - before) * 1024

    fp = flop_parameters(next(iter(setups.values()))[0])

    def flops_ratio(K: int, levers: dict) -> float:
        """The case's training FLOPs per step over K1's, from the record the engine logs for such a step."""
        forward = levers.get("forward", {})
        record = {"num_passes": K}
        if forward.get("full_backprop"):
            record.update(num_passes=2, full_backprop=True, backprop_chunk=forward["backprop_chunk"])
        elif forward.get("exact_states"):
            record.update(exact_states=True, passes_run=K, grad_passes_run=K)
        elif forward.get("grad_passes"):
            record.update(passes_run=K, grad_passes_run=forward["grad_passes"])
        return (training_flops([record], batch * seq, seq, fp)["flops"]
                / training_flops([{"num_passes": 1}], batch * seq, seq, fp)["flops"])

    if memory:  # the cases one after another (each case's warm-up first: compiled code, gradients, AdamW state)
        peaks = {}
        for label, *_ in cases:
            for _ in range(max(1, warmup)):
                one_step(label)
            peaks[label] = [peak_bytes(label) for _ in range(steps)]
        results = {label: {"num_passes": K, "detach_state": detach, **levers, "flops_vs_K1": flops_ratio(K, levers),
                           "peak_step_bytes": min(peaks[label]), "peak_step_bytes_all": peaks[label]}
                   for label, K, detach, levers in cases}
        return {"preset": preset, "batch_size": batch, "seq_len": seq, "vocab_size": vocab, "device": str(device),
                "precision": precision, "threads": torch.get_num_threads(), "steps": steps, "warmup": warmup,
                "seed": SEED, "memory": True, "mmap_big_blocks": tuned, "results": results,
                "load_average": [load_before, load_average()]}
    # rounds of one step per case, interleaved, so that a change in machine load hits every case alike
    times = {label: [] for label, *_ in cases}
    cpu_times = {label: [] for label, *_ in cases}
    for i in range(warmup + steps):
        for label, *_ in cases:
            t = one_step(label)
            if i >= warmup:
                times[label].append(t)
                cpu_times[label].append(last_cpu[label])
    results = {}
    for label, K, detach, levers in cases:
        ts = sorted(times[label])
        med = ts[len(ts) // 2]
        results[label] = {"num_passes": K, "detach_state": detach, **levers, "step_s": med,
                          "flops_vs_K1": flops_ratio(K, levers),
                          "tokens_per_s": batch * seq / med, "step_s_min": ts[0], "step_s_all": times[label],
                          "step_cpu_s": sorted(cpu_times[label])[len(ts) // 2], "step_cpu_s_all": cpu_times[label]}
    for label in list(results):  # a lever's speed against the same K without it (wall clock and CPU time)
        base = label.split("_")[0]
        if base in ("exact", "KT1", "full"):  # against the plain step instead: the cost of the whole recurrence
            results[label]["cpu_vs_K1"] = results[label]["step_cpu_s"] / results["K1"]["step_cpu_s"]
        elif label not in ("K2_detach", base):
            results[label]["speedup_vs_" + base] = results[base]["step_s"] / results[label]["step_s"]
            results[label]["cpu_speedup_vs_" + base] = results[base]["step_cpu_s"] / results[label]["step_cpu_s"]
    ratio = results["K2"]["step_s"] / results["K1"]["step_s"]
    return {"preset": preset, "batch_size": batch, "seq_len": seq, "vocab_size": vocab, "device": str(device),
            "precision": precision, "threads": torch.get_num_threads(), "steps": steps, "warmup": warmup,
            "seed": SEED, "allocator_tuned": tuned, "load_average": [load_before, load_average()],
            "results": results, "ratio_K2_K1": ratio,
            "ratio_K2_detach_K1": results["K2_detach"]["step_s"] / results["K1"]["step_s"],
            "goal_ratio_K2_K1": 2.1, "meets_goal": ratio <= 2.1}


def format_benchmark(res: dict) -> str:
    head = (f"fullband bench train: preset {res['preset']}, batch {res['batch_size']} x {res['seq_len']} tokens, "
            f"vocabulary {res['vocab_size']:,}, {res['device']} {res['precision']}, {res['threads']} thread(s), "
            f"load {res['load_average'][0]} -> {res['load_average'][1]}")
    if res.get("memory"):
        lines = [head + f", least of {res['steps']} steps", "",
                 "| case | peak memory of a step (MiB) | training FLOPs / K1 |", "| --- | ---: | ---: |"]
        lines += [f"| {label} | {r['peak_step_bytes'] / 2**20:,.1f} | {r['flops_vs_K1']:.2f} |"
                  for label, r in res["results"].items()]
        return "\n".join(lines)
    lines = [head + f", median of {res['steps']} steps",
             "", "| case | step (s) | CPU time (s) | tokens/s | training FLOPs / K1 | CPU time / K1 | speed-up over the "
                 "same K without the lever (wall, CPU) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, r in res["results"].items():
        gain = ", ".join(f"{v:.2f}x" for k, v in r.items() if "speedup_vs_" in k)
        cpu = r["step_cpu_s"] / res["results"]["K1"]["step_cpu_s"]
        lines.append(f"| {label} | {r['step_s']:.3f} | {r['step_cpu_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['flops_vs_K1']:.2f} | {cpu:.2f} | {gain} |")
    lines += ["", f"K=2 / K=1 = {res['ratio_K2_K1']:.2f} (goal <= {res['goal_ratio_K2_K1']}: "
                  f"{'met' if res['meets_goal'] else 'NOT met'}); K=2 detached / K=1 = {res['ratio_K2_detach_K1']:.2f}"]
    return "\n".join(lines)


EXACT_GOALS = {"flops_vs_K1": 3.0, "cpu_vs_K1": 4.0}  # exact states + N gradient passes, against a plain step
LEAN_GOALS = {"cpu_vs_K1": 2.6, "cpu_over_flops": 1.2}  # the same on the lean token step (the recurrence-speed issue)


def _exact_summary(reports: list[dict]) -> list[str]:
    """One row per (preset, row length) with an ``exact_gN`` row: its FLOPs and CPU time over K1's, the quadratic
    ``KT1_gN``'s where it ran, and the peak memory of a ``--memory`` report of the same shape."""
    timed = [r for r in reports if not r.get("memory") and any(k.startswith("exact_g") for k in r["results"])]
    if not timed:
        return []
    memory = {(r["preset"], r["batch_size"], r["seq_len"], r["vocab_size"]): r["results"]
              for r in reports if r.get("memory")}
    lines = ["| preset | T | token step | FLOPs / K1: exact | FLOPs / K1: K = T + 1 | CPU time / K1: exact | "
             "CPU time / K1: K = T + 1 | peak step memory (MiB): K1 / K2 / exact | goals (FLOPs <= "
             f"{EXACT_GOALS['flops_vs_K1']:g}x, CPU <= {EXACT_GOALS['cpu_vs_K1']:g}x) | lean goal (CPU <= "
             f"{LEAN_GOALS['cpu_vs_K1']:g}x and <= {LEAN_GOALS['cpu_over_flops']:g}x its FLOPs ratio) |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    rows = [(r, ex) for r in sorted(timed, key=lambda r: (r["preset"], r["seq_len"])) for ex in r["results"]
            if ex.startswith("exact_g")]
    for r, ex in rows:
        res = r["results"]
        ref = res.get("KT1_" + ex.split("_")[1], {})
        mem = memory.get((r["preset"], r["batch_size"], r["seq_len"], r["vocab_size"]))
        mib = " / ".join(f"{mem[k]['peak_step_bytes'] / 2**20:,.0f}" if k in mem else "-" for k in ("K1", "K2", ex)) \
            if mem else "-"
        met = [name for name, key in (("FLOPs", "flops_vs_K1"), ("CPU", "cpu_vs_K1"))
               if res[ex][key] <= EXACT_GOALS[key]]
        verdict = "both met" if len(met) == 2 else (f"{met[0]} met, " if met else "") + \
            " and ".join(n for n in ("FLOPs", "CPU") if n not in met) + " missed"
        token = res[ex].get("token_step", "auto")
        lean_goal = (res[ex]["cpu_vs_K1"] <= LEAN_GOALS["cpu_vs_K1"]
                     and res[ex]["cpu_vs_K1"] <= LEAN_GOALS["cpu_over_flops"] * res[ex]["flops_vs_K1"])
        lines.append(f"| {r['preset']} | {r['seq_len']} | {token} | {res[ex]['flops_vs_K1']:.2f} | "
                     + (f"{ref['flops_vs_K1']:.2f}" if ref else "not run") + f" | {res[ex]['cpu_vs_K1']:.2f} | "
                     + (f"{ref['cpu_vs_K1']:.2f}" if ref else "not run") + f" | {mib} | {verdict} | "
                     + ("met" if lean_goal else "missed") + " |")
    ex = rows[0][1]
    n = ex.split("_")[1][1:]
    return [f"`{ex.split('_')[0]}` = exact states (one token-by-token pass without gradient) then "
            f"{n} gradient passes; K = T + 1 = the teacher-forced passes it replaces, the last {n} with gradient; "
            "token step: how the token pass ran (`off`: the backbone's full forward at every token, `lean`: its "
            "decoder layers called directly, `compiled`: that step through torch.compile, `auto`: lean on CPU). CPU times: the process's, median of each case's steps.", "",
            *lines, ""]


def markdown_reports(res: dict) -> str:
    """A set of ``bench train`` reports (``{"reports": [{"command", "report"}, ...]}``, as
    ``docs/gen/collect_runs.py`` writes them): a summary of the exact-states rows across row lengths where there are
    any, then each report's own table under its command."""
    reports = [e["report"] for e in res["reports"]]
    lines = _exact_summary(reports)
    for e in res["reports"]:
        lines += [f"`{e['command']}`", "", format_benchmark(e["report"]), ""]
    return "\n".join(lines)
