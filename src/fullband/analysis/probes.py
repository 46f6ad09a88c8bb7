"""Probes, logit lens and gate statistics of ``fullband analyze``.

Owns the closed-form ridge probes of every layer's residual stream (next token, token two ahead, previous top
state), the logit lens (final norm + LM head on every layer) and the statistics of the GLU token gate and of the
fused/plain input norm ratio.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..model.feedback import GLUFusion
from .runs import Collected

PROBE_TARGETS = ("next_token", "two_ahead", "prev_state")
ALPHAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


# ----------------------------------------------------------------------------------------------- 2. probes


def _split_fit_test(rows: torch.Tensor, n_rows: int, t_index: torch.Tensor, T: int):
    """Fit on even rows, test on odd rows (a single row: first half of the positions vs second half)."""
    if n_rows >= 2:
        fit = rows % 2 == 0
    else:
        fit = t_index < (T // 2)
    return fit, ~fit


@torch.no_grad()
def ridge_probe(x_fit: torch.Tensor, y_fit: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                kind: str = "class", alphas=ALPHAS, holdout: float = 0.2, seed: int = 0) -> dict:
    """A linear probe fitted by ridge regression in closed form (float64, with intercept).

    ``kind="class"``: ``y`` are integer labels, regressed as one-hot vectors; the score is the accuracy of the
    argmax on the test split, next to ``chance`` = accuracy of always predicting the fit split's most frequent
    label. ``kind="regression"``: ``y`` ``[n, k]``; the score is R² on the test split,
    ``1 - sum (y - ŷ)² / sum (y - mean_test(y))²`` over all k outputs. The penalty is ``alpha · tr(XᵀX)/d``
    (scale-free); ``alpha`` is chosen from ``alphas`` on a seeded ``holdout`` fraction of the fit split, then the
    probe is refitted on the whole fit split.
    """
    if kind not in ("class", "regression"):
        raise ValueError(f"unknown probe kind {kind!r}")
    if x_fit.shape[0] < 2 or x_test.shape[0] < 1:
        raise ValueError(f"too few positions to fit a probe ({x_fit.shape[0]} fit, {x_test.shape[0]} test); "
                         "raise --max-tokens")
    x_fit, x_test = x_fit.double(), x_test.double()

    def fit(x, y):
        mu = x.mean(0)
        xc = x - mu
        g = xc.T @ xc
        evals, q = torch.linalg.eigh(g)
        scale = float(g.diagonal().sum()) / g.shape[0]
        scale = scale if scale > 0 else 1.0
        if kind == "class":
            classes, idx = torch.unique(y, return_inverse=True)
            b = torch.zeros(x.shape[1], classes.numel(), dtype=x.dtype).index_add_(1, idx, xc.T)
            offset = torch.bincount(idx, minlength=classes.numel()).double() / idx.numel()
        else:
            y = y.double()
            offset = y.mean(0)
            b = xc.T @ (y - offset)
            classes = None
        qb = q.T @ b

        def predictor(alpha):
            w = q @ (qb / (evals.clamp_min(0) + alpha * scale).unsqueeze(1))
            return lambda xt: (xt - mu) @ w + offset
        return predictor, classes

    def score(pred, classes, x, y):
        if kind == "class":
            hits = 0
            for j in range(0, x.shape[0], 1024):
                hits += int((classes[pred(x[j:j + 1024]).argmax(1)] == y[j:j + 1024]).sum())
            return hits / x.shape[0]
        y = y.double()
        sst = float(((y - y.mean(0)) ** 2).sum())
        sse = float(((y - pred(x)) ** 2).sum())
        return 1.0 - sse / sst if sst > 0 else float("nan")

    n = x_fit.shape[0]
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    n_hold = max(1, int(round(holdout * n))) if n >= 5 else 0
    best_alpha = alphas[len(alphas) // 2]
    if n_hold and len(alphas) > 1:
        hold, inner = perm[:n_hold], perm[n_hold:]
        predictor, classes = fit(x_fit[inner], y_fit[inner])
        scores = [score(predictor(a), classes, x_fit[hold], y_fit[hold]) for a in alphas]
        scores = [s if s == s else -math.inf for s in scores]
        best_alpha = alphas[max(range(len(alphas)), key=lambda i: (scores[i], alphas[i]))]
    predictor, classes = fit(x_fit, y_fit)
    result = {"score": score(predictor(best_alpha), classes, x_test, y_test), "alpha": best_alpha,
              "n_fit": int(n), "n_test": int(x_test.shape[0])}
    if kind == "class":
        values, counts = torch.unique(y_fit, return_counts=True)
        result["chance"] = float((y_test == values[counts.argmax()]).double().mean())
    else:
        result["chance"] = 0.0
    return result


def layer_probes(c: Collected, n_rows: int, T: int, seed: int = 0) -> dict:
    """Per layer, the three probes of :func:`ridge_probe` on a model's collected residual streams."""
    fit, test = _split_fit_test(c.probe_rows, n_rows, c.probe_pos, T)
    out = {"layers": list(range(len(c.probe_features))), "n_fit": int(fit.sum()), "n_test": int(test.sum())}
    targets = {"next_token": ("class", c.probe_next), "two_ahead": ("class", c.probe_two),
               "prev_state": ("regression", c.probe_prev_state)}
    for name, (kind, y) in targets.items():
        scores, alphas, chance = [], [], None
        for x in c.probe_features:
            r = ridge_probe(x[fit], y[fit], x[test], y[test], kind=kind, seed=seed)
            scores.append(r["score"])
            alphas.append(r["alpha"])
            chance = r["chance"]
        out[name] = scores
        out[f"{name}_alpha"] = alphas
        out[f"{name}_chance"] = chance
    return out


# ----------------------------------------------------------------------------------------------- 3. logit lens


def logit_lens(c: Collected) -> dict:
    """Per-layer next-token loss and accuracy of ``head(final_norm(h_l))`` (the last layer: the model itself)."""
    return {"layers": list(range(len(c.lens_nll))), "loss": list(c.lens_nll), "accuracy": list(c.lens_acc)}


# ----------------------------------------------------------------------------------------------- 4. gates


@torch.no_grad()
def gate_statistics(model, ids: torch.Tensor, norm_ratio: torch.Tensor | None = None, tokenizer=None,
                    bins: int = 50, top: int = 12) -> dict:
    """Distribution of the GLU token gate ``sigmoid(W_G norm(e_t))`` over the tokens of ``ids`` (every
    occurrence counts, all ``d`` gate channels pooled), per-token mean gates (mean over channels) with the most
    and least open frequent tokens, and the fused/plain norm ratio ``||u_t|| / ||e_t||`` at fused positions of the
    real recurrence (``norm_ratio``). Gate entries are ``None`` for a non-GLU fusion."""
    out: dict = {"fusion": model.config.fusion}
    tokens, counts = torch.unique(ids.flatten(), return_counts=True)
    edges = np.linspace(0.0, 1.0, bins + 1)
    if isinstance(model.feedback, GLUFusion):
        gates = model.feedback.gate(model.get_input_embeddings()(tokens)).float()  # [U, d]
        w = counts.double()
        total = float(w.sum()) * gates.shape[1]
        mean = float((gates.double().sum(1) * w).sum()) / total
        var = float((((gates.double() - mean) ** 2).sum(1) * w).sum()) / total
        values = gates.flatten().numpy()
        weights = np.repeat(counts.numpy().astype(np.float64), gates.shape[1])
        hist, _ = np.histogram(values, bins=edges, weights=weights)
        per_token = gates.mean(1)
        tok_hist, _ = np.histogram(per_token.numpy(), bins=edges, weights=counts.numpy().astype(np.float64))
        frequent = counts >= max(2, int(counts.float().quantile(0.5)))
        if int(frequent.sum()) < 2 * top:
            frequent = torch.ones_like(counts, dtype=torch.bool)
        idx = frequent.nonzero().flatten()
        order = idx[per_token[idx].argsort()]

        def describe(i):
            tid = int(tokens[i])
            text = tokenizer.decode([tid]) if tokenizer is not None else str(tid)
            return {"id": tid, "token": text, "mean_gate": float(per_token[i]), "count": int(counts[i])}

        out.update({
            "gate_mean": mean, "gate_std": math.sqrt(max(var, 0.0)),
            "gate_frac_below_0.1": float(weights[values < 0.1].sum() / weights.sum()),
            "gate_frac_above_0.9": float(weights[values > 0.9].sum() / weights.sum()),
            "gate_histogram": {"edges": edges.tolist(), "weights": (hist / hist.sum()).tolist()},
            "token_mean_gate_histogram": {"edges": edges.tolist(), "weights": (tok_hist / tok_hist.sum()).tolist()},
            "token_mean_gate_spread": float(per_token.max() - per_token.min()),
            "most_open_tokens": [describe(i) for i in order.flip(0)[:top].tolist()],
            "most_closed_tokens": [describe(i) for i in order[:top].tolist()],
            "distinct_tokens": int(tokens.numel()),
        })
    else:
        out.update({"gate_mean": None, "gate_histogram": None, "note": f"fusion {model.config.fusion!r} has no token gate"})
    if norm_ratio is not None and norm_ratio.numel():
        r = norm_ratio.double()
        q = torch.quantile(r, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
        hi = float(r.max())
        ratio_edges = np.linspace(0.0, max(hi * 1.05, 1e-6), bins + 1)
        rh, _ = np.histogram(r.numpy(), bins=ratio_edges)
        out["norm_ratio"] = {"mean": float(r.mean()), "p05": q[0], "median": q[1], "p95": q[2], "n": int(r.numel()),
                             "histogram": {"edges": ratio_edges.tolist(), "weights": (rh / rh.sum()).tolist()}}
    else:
        out["norm_ratio"] = None
    return out
