"""What a long recurrence costs: step time, activation memory and FLOPs of one training step per K, per
``--grad-passes`` and with the early stop (``--pass-tol``), for ``fullband experiment state``.

Owns :func:`measure_costs`: forward + backward of the K-pass objective on one batch of S3 rows at the state
experiment's size (the trained ``fbt-L-glu`` model when the experiment has one, so the early stop sees the trained
feedback map; else the untrained one), one untimed warm-up then the median of the timed steps. Activation memory
is the bytes autograd saves for the backward (:func:`saved_bytes`: every saved tensor's storage counted once; the
part of a step's memory that grows with K and falls with ``--grad-passes``), and on a GPU also the peak allocated
memory. FLOPs are :func:`fullband.eval.flops.training_flops` of the step as run, relative to a plain step.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from ..eval.flops import flop_parameters, training_flops
from ..eval.scoring import load_any_model
from ..eval.state_tasks import dense_labels, encode_state_rows, exact_passes, make_state_problems
from ..model.configuration import has_feedback
from ..model.modeling import FullBandwidthForCausalLM
from .synthetic import init_backbone


def saved_bytes(fn) -> tuple[object, int]:
    """``(fn(), bytes of the tensors autograd saved for the backward while it ran)`` (each storage once)."""
    seen = {}

    def pack(t):
        try:
            storage = t.untyped_storage()
            seen[(storage.data_ptr(), t.device)] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without a storage (sparse, nested)
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def cost_settings(K: int, tol: float) -> list[tuple[int, int | None, float | None]]:
    """``(num_passes, grad_passes, pass_tol)``: K = 1, 2, about K/2 and K with every pass backpropagated, K with
    the last 2 and the last 1, and K with the early stop."""
    ks = sorted({1, 2, max(2, K // 2), K})
    return [(k, None, None) for k in ks] + [(K, 2, None), (K, 1, None), (K, None, tol), (K, 2, tol)]


def cost_model(args, tokenizer, device):
    """The trained ``fbt-L-glu`` of this experiment when there is one, else a fresh GLU model on the L-layer init."""
    trained = os.path.join(args.out, "runs", "fbt-L-glu")
    if os.path.isfile(os.path.join(trained, "summary.json")):
        model = load_any_model(trained)[0]
        if has_feedback(model):
            return model.to(device), "trained fbt-L-glu"
    torch.manual_seed(args.seed)
    plain = load_any_model(init_backbone(args, tokenizer, 1))[0]
    return (FullBandwidthForCausalLM.from_backbone(plain, fusion="glu", doc_start_token_id=tokenizer.bos_token_id)
            .to(device), "untrained GLU model")


def measure_costs(args, tokenizer, table, device, timed: int | None = None) -> list[dict]:
    model, source = cost_model(args, tokenizer, device)
    model.train()
    rows = encode_state_rows(tokenizer, make_state_problems(["s3"], args.batch_size, args.seed + 99, args.length))
    rows = rows.to(device)
    labels = dense_labels(rows, table)
    fp = flop_parameters(model)
    tokens = rows.numel()
    plain = training_flops([{"num_passes": 1}], tokens, rows.shape[1], fp)["flops"]
    timed = timed or (1 if args.quick else 3)
    cuda = torch.device(device).type == "cuda"
    out = []
    for K, grad, tol in cost_settings(exact_passes(args.length), args.pass_tol):
        times, ran, saved = [], [], 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(timed + 1):
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            res, saved = saved_bytes(lambda: model(rows, labels=labels, num_passes=K, grad_passes=grad, pass_tol=tol))
            res.loss.backward()
            if cuda:
                torch.cuda.synchronize(device)
            if i:  # the first step warms up
                times.append(time.perf_counter() - t)
                ran.append((res.passes_run, res.grad_passes_run))
        record = {"num_passes": K, "passes_run": sum(r for r, _ in ran) / len(ran),
                  "grad_passes_run": sum(g for _, g in ran) / len(ran)}
        out.append({"num_passes": K, "grad_passes": grad or K, "pass_tol": tol, "passes_run": record["passes_run"],
                    "step_seconds": statistics.median(times), "saved_mib": saved / 2**20,
                    "peak_gpu_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
                    "flops_ratio": training_flops([record], tokens, rows.shape[1], fp)["flops"] / plain,
                    "model": source, "rows": list(rows.shape)})
    model.zero_grad(set_to_none=True)
    return out
