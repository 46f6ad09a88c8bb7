"""``fullband analyze`` end to end: options, loading, the four measures, and the report (markdown, PNG, JSON).

The measures: (1) load-bearing test (:mod:`fullband.analysis.runs`), (2) layer probes, (3) logit lens and
(4) gate statistics (:mod:`fullband.analysis.probes`), for a fullband model and, optionally, a baseline scored as the
plain LM it is.
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass, field

import torch

from ..data.corpus import load_tokenizer
from ..model.feedback import max_positions
from ..utils.io import atomic_write_bytes
from .probes import PROBE_TARGETS, gate_statistics, layer_probes, logit_lens
from .runs import (
    INTERVENTIONS,
    AnalysisData,
    analysis_rows,
    backbone_of,
    collect,
    is_fullband,
    load_any_model,
    load_bearing,
    log,
    probe_selection,
)

DEFAULT_OUT = os.path.join("runs", "analyze")


# ----------------------------------------------------------------------------------------------- orchestration


@dataclass
class AnalyzeOptions:
    model: str
    baseline: str | None = None
    data: str | None = None
    tokenizer: str | None = None
    seq_len: int = 128
    max_tokens: int = 8192
    batch_size: int = 32
    num_passes: int = 2
    probe_samples: int = 4000
    seed: int = 0
    out: str = DEFAULT_OUT
    extra: dict = field(default_factory=dict)


def _tokenizer_for(model_dir: str, given: str | None = None):
    """``given`` (a tokenizer directory) or else the one saved in ``model_dir``."""
    if given:
        return load_tokenizer(given), given
    if not _has_tokenizer(model_dir):
        raise FileNotFoundError(f"no tokenizer in {model_dir!r}; pass --tokenizer DIR")
    return load_tokenizer(model_dir), model_dir


def _check_fits(model, data: AnalysisData, which: str) -> None:
    cfg = backbone_of(model).config
    limit = max_positions(cfg)
    if limit is not None and data.ids.shape[1] > limit:
        raise ValueError(f"--seq-len {data.ids.shape[1]} exceeds the {which}'s {limit} positions")
    vocab = backbone_of(model).get_input_embeddings().num_embeddings
    if int(data.ids.max()) >= vocab:
        raise ValueError(f"the text holds token id {int(data.ids.max())}, outside the {which}'s vocabulary of {vocab}; "
                         "use that model's own tokenizer")


def analyze_models(model, data: AnalysisData, baseline=None, baseline_data: AnalysisData | None = None,
                   tokenizer=None, num_passes: int = 2, probe_samples: int = 4000, batch_size: int = 32,
                   seed: int = 0) -> dict:
    """All four measures for a fullband ``model`` (and the probes / logit lens of ``baseline``) as a dict."""
    if not is_fullband(model):
        raise ValueError("--model must be a fullband model (one with latent feedback); give a plain LM as --baseline")
    model.eval()
    ids, doc_ids = data.ids, data.doc_ids
    N, T = ids.shape
    selection = probe_selection(ids, doc_ids, probe_samples, seed)
    log(f"real recurrence over {N} rows x {T} tokens (hidden states, logit lens)")
    c = collect(model, ids, doc_ids, selection, batch_size)
    log("load-bearing interventions")
    lb = load_bearing(model, ids, doc_ids, real=c, num_passes=num_passes, batch_size=batch_size, seed=seed)
    log("layer probes")
    results = {
        "load_bearing": lb,
        "probes": {"fbt": layer_probes(c, N, T, seed)},
        "logit_lens": {"fbt": logit_lens(c)},
        "gates": gate_statistics(model, ids, c.norm_ratio, tokenizer),
    }
    if baseline is not None:
        baseline.eval()
        bdata = baseline_data or data
        same = bdata.ids.shape == ids.shape and torch.equal(bdata.ids, ids)
        bsel = selection if same else probe_selection(bdata.ids, bdata.doc_ids, probe_samples, seed)
        log("baseline run (hidden states, logit lens, probes)")
        bc = collect(baseline, bdata.ids, bdata.doc_ids, bsel, batch_size)
        results["probes"]["baseline"] = layer_probes(bc, bdata.ids.shape[0], bdata.ids.shape[1], seed)
        results["logit_lens"]["baseline"] = logit_lens(bc)
        results["baseline_loss"] = float(bc.nll.mean())
        results["baseline_same_tokens"] = bool(same)
    return results


def run_analysis(opts: AnalyzeOptions) -> dict:
    """Load, analyze, and write the report; returns the results (also written as ``analysis.json``)."""
    if opts.num_passes < 0:
        raise ValueError(f"--num-passes must be >= 0 (0 or 1 skips the K-pass measurements), got {opts.num_passes}")
    if opts.probe_samples < 10:
        raise ValueError(f"--probe-samples must be >= 10, got {opts.probe_samples}")
    if opts.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {opts.batch_size}")
    torch.manual_seed(opts.seed)
    model = load_any_model(opts.model)
    if not is_fullband(model):
        raise ValueError(f"--model {opts.model!r} has no latent feedback (not a fullband model); "
                         "give a plain LM as --baseline")
    tokenizer, _ = _tokenizer_for(opts.model, opts.tokenizer)
    data = analysis_rows(tokenizer, opts.data, opts.seq_len, opts.max_tokens)
    _check_fits(model, data, "model")
    baseline = bdata = None
    if opts.baseline:
        # a baseline is the plain LM it is: a fullband checkpoint given as the baseline (e.g. one written before
        # baselines were saved plainly, with a fusion it never trained) is scored through its backbone alone
        baseline = backbone_of(load_any_model(opts.baseline))
        # the baseline reads the text with its own tokenizer when it has one (the same rows when they agree)
        btok = _tokenizer_for(opts.baseline)[0] if _has_tokenizer(opts.baseline) else tokenizer
        bdata = analysis_rows(btok, opts.data, opts.seq_len, opts.max_tokens)
        _check_fits(baseline, bdata, "baseline")
    results = analyze_models(model, data, baseline, bdata, tokenizer, opts.num_passes, opts.probe_samples,
                             opts.batch_size, opts.seed)
    results = {
        "version": 1,
        "model": os.path.abspath(opts.model),
        "baseline": os.path.abspath(opts.baseline) if opts.baseline else None,
        "baseline_kind": (None if baseline is None else ("fullband" if is_fullband(baseline) else "plain")),
        "data": {"source": data.source, "documents": len(data.doc_names), "rows": int(data.ids.shape[0]),
                 "rows_available": data.total_rows, "seq_len": int(data.ids.shape[1]), "tokens": data.tokens,
                 "documents_in_rows": int(data.doc_ids.unique().numel())},
        "settings": {"num_passes": opts.num_passes, "probe_samples": opts.probe_samples, "seed": opts.seed,
                     "batch_size": opts.batch_size},
        **results,
    }
    write_report(results, opts.out)
    return results


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


# ----------------------------------------------------------------------------------------------- report


def _save_figure(fig, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())


def _curves(per_model: dict):
    """``(data, label, line style, colour)`` of the FBT model and the baseline, for those present."""
    for who, label, style, color in (("fbt", "FBT", "-o", "C0"), ("baseline", "baseline", "--s", "C1")):
        if who in per_model:
            yield per_model[who], label, style, color


def make_plots(results: dict, out_dir: str) -> list[str]:
    """The four PNGs; returns their file names."""
    from matplotlib.figure import Figure

    names = []
    lb = results["load_bearing"]
    fig = Figure(figsize=(11, 4))
    ax1, ax2 = fig.subplots(1, 2)
    groups = [("recurrence", "exact recurrence")]
    if "passes" in lb:
        groups.append(("passes", f"{lb['passes']['num_passes']}-pass forward"))
    width = 0.8 / len(groups)
    conds = [c for c in INTERVENTIONS if c in lb["recurrence"]]
    for gi, (key, label) in enumerate(groups):
        vals = [lb[key].get(c, float("nan")) for c in conds]
        ax1.bar([i + gi * width for i in range(len(conds))], vals, width, label=label)
    ax1.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(conds))], conds)
    ax1.set_ylabel("next-token loss (nats)")
    ax1.set_title("Load-bearing test")
    lo = min(v for key, _ in groups for c, v in lb[key].items() if c in conds)
    ax1.set_ylim(bottom=max(0.0, lo - 0.5))
    ax1.legend()
    for c, curve in lb.get("recurrence_damage_by_position", {}).items():
        half = max(0, min(4, len(curve) // 16))
        smooth = [sum(curve[max(0, i - half):i + half + 1]) / len(curve[max(0, i - half):i + half + 1])
                  for i in range(len(curve))]
        ax2.plot(range(1, len(curve) + 1), smooth, label=c, lw=1)
    ax2.axhline(0, color="k", lw=0.5)
    ax2.set_xlabel("position in row (predicted token; centred mean over ±4)")
    ax2.set_ylabel("damage (nats)")
    ax2.set_title("Damage by position (exact recurrence)")
    ax2.legend()
    _save_figure(fig, os.path.join(out_dir, "load_bearing.png"))
    names.append("load_bearing.png")

    probes = results["probes"]
    fig = Figure(figsize=(14, 4))
    axes = fig.subplots(1, 3)
    titles = {"next_token": "(a) next token — accuracy", "two_ahead": "(b) token two ahead — accuracy",
              "prev_state": "(c) previous top-layer state — R²"}
    for ax, target in zip(axes, PROBE_TARGETS):
        for p, label, style, color in _curves(probes):
            ax.plot(p["layers"], p[target], style, label=label, ms=4)
            if target != "prev_state":
                ax.axhline(p[f"{target}_chance"], color=color, lw=0.7, ls=":")
        ax.set_title(titles[target])
        ax.set_xlabel("layer (0 = embedding output)")
        ax.legend()
    _save_figure(fig, os.path.join(out_dir, "probes.png"))
    names.append("probes.png")

    lens = results["logit_lens"]
    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    for lensed, label, style, _ in _curves(lens):
        ax1.plot(lensed["layers"], lensed["loss"], style, label=label, ms=4)
        ax2.plot(lensed["layers"], lensed["accuracy"], style, label=label, ms=4)
    ax1.set_title("Logit lens: next-token loss")
    ax1.set_ylabel("nats")
    ax2.set_title("Logit lens: top-1 accuracy")
    for ax in (ax1, ax2):
        ax.set_xlabel("layer (0 = embedding output)")
        ax.legend()
    _save_figure(fig, os.path.join(out_dir, "logit_lens.png"))
    names.append("logit_lens.png")

    gates = results["gates"]
    panels = [p for p in ("gate_histogram", "token_mean_gate_histogram") if gates.get(p)]
    if gates.get("norm_ratio"):
        panels.append("norm_ratio")
    if panels:
        fig = Figure(figsize=(4.5 * len(panels), 3.8))
        axes = fig.subplots(1, len(panels))
        axes = [axes] if len(panels) == 1 else list(axes)
        titles = {"gate_histogram": "gate values σ(W_G norm(e_t))", "token_mean_gate_histogram": "per-token mean gate",
                  "norm_ratio": "||u_t|| / ||e_t|| at fused positions"}
        for ax, p in zip(axes, panels):
            h = gates[p]["histogram"] if p == "norm_ratio" else gates[p]
            e = h["edges"]
            ax.bar(e[:-1], h["weights"], width=[b - a for a, b in zip(e[:-1], e[1:])], align="edge")
            ax.set_title(titles[p])
            ax.set_ylabel("fraction")
        _save_figure(fig, os.path.join(out_dir, "gates.png"))
        names.append("gates.png")
    return names


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if x != x:
            return "nan"
        return f"{x:.{digits}f}"
    return str(x)


def render_markdown(results: dict, images: list[str]) -> str:
    lb = results["load_bearing"]
    d = results["data"]
    lines = [
        "# fullband analysis: what the fed-back state carries", "",
        f"- model: `{results['model']}`",
        f"- baseline: `{results['baseline']}` ({results['baseline_kind']})" if results.get("baseline") else "- baseline: none",
        f"- data: {d['source']} — {d['rows']} rows × {d['seq_len']} tokens = {d['tokens']} tokens "
        f"(of {d['rows_available']} rows; {d['documents_in_rows']} documents in the rows)",
        "", "## 1. Load-bearing test", "",
        "Next-token loss (nats per predicted token, every position) with the real fed-back state and with it "
        "zeroed, shuffled across positions of the same row, or taken from the same position of a row of another "
        "document; `plain` = feedback off (ordinary forward on plain embeddings). Under the exact recurrence the "
        "substituted states (shuffle, other_doc) are the real run's; the zeroed run feeds zeros at every fused "
        "position. Damage = loss − real loss.", "",
    ]
    header = "| condition | exact recurrence | damage |"
    sep = "|---|---|---|"
    if "passes" in lb:
        header += f" {lb['passes']['num_passes']}-pass forward | damage |"
        sep += "---|---|"
    lines += [header, sep]
    for c in INTERVENTIONS:
        if c not in lb["recurrence"]:
            lines.append(f"| {c} | n/a (one document only) | |" + (" | |" if "passes" in lb else ""))
            continue
        row = f"| {c} | {_fmt(lb['recurrence'][c])} | {_fmt(lb['recurrence_damage'].get(c, 0.0), 4) if c != 'real' else ''} |"
        if "passes" in lb:
            row += f" {_fmt(lb['passes'].get(c))} | {_fmt(lb['passes_damage'].get(c), 4) if c != 'real' else ''} |"
        lines.append(row)
    lines += ["", f"Fused positions: {lb['fused_positions']} ({100 * lb['fused_fraction']:.1f}% of tokens); "
              f"other-document coverage {100 * lb['other_doc_coverage']:.1f}%.", ""]
    if "load_bearing.png" in images:
        lines += ["![load-bearing](load_bearing.png)", ""]

    probes = results["probes"]
    lines += ["## 2. Layer probes", "",
              "Ridge probes (closed form, penalty chosen on a holdout of the fit split) on each layer's residual "
              "stream (layer 0 = embedding output; for the FBT that is the fused input u_t), fitted on the even "
              "rows and scored on the odd rows. (a)/(b): accuracy of the argmax of a one-hot regression for the "
              "next token / the token two ahead; (c): R² for the previous position's top-layer state (for the FBT "
              "the fed-back state h_{t-1}; for the baseline its own previous final hidden state). FBT residual "
              "streams come from the exact recurrence.", ""]
    whos = [w for w in ("fbt", "baseline") if w in probes]
    head = "| layer |" + "".join(f" {('FBT' if w == 'fbt' else 'baseline')} {t} |" for t in ("(a)", "(b)", "(c) R²") for w in whos)
    lines += [head, "|---|" + "---|" * (3 * len(whos))]
    depth = max(len(probes[w]["layers"]) for w in whos)
    for layer in range(depth):
        row = f"| {layer} |"
        for t in PROBE_TARGETS:
            for w in whos:
                vals = probes[w][t]
                row += f" {_fmt(vals[layer]) if layer < len(vals) else ''} |"
        lines.append(row)
    chance = "; ".join(f"{'FBT' if w == 'fbt' else 'baseline'}: (a) {_fmt(probes[w]['next_token_chance'])}, "
                       f"(b) {_fmt(probes[w]['two_ahead_chance'])}" for w in whos)
    lines += ["", f"Majority-class accuracy (chance): {chance}. Positions: "
              + "; ".join(f"{w} {probes[w]['n_fit']} fit / {probes[w]['n_test']} test" for w in whos) + ".", ""]
    for w in whos:
        p = probes[w]
        best = {t: max(range(len(p[t])), key=lambda i: p[t][i] if p[t][i] == p[t][i] else -math.inf) for t in PROBE_TARGETS}
        lines.append(f"- {'FBT' if w == 'fbt' else 'baseline'}: best layer for (a) {best['next_token']}, "
                     f"(b) {best['two_ahead']}, (c) {best['prev_state']}; shallowest-half mean R² (c) "
                     f"{_fmt(sum(p['prev_state'][: max(1, len(p['prev_state']) // 2)]) / max(1, len(p['prev_state']) // 2))}.")
    lines.append("")
    if "probes.png" in images:
        lines += ["![probes](probes.png)", ""]

    lens = results["logit_lens"]
    lines += ["## 3. Logit lens", "",
              "The backbone's final norm and LM head applied to each layer's residual stream (the last layer is "
              "the model's own output). Next-token loss (nats) / top-1 accuracy.", ""]
    whos = [w for w in ("fbt", "baseline") if w in lens]
    lines += ["| layer |" + "".join(f" {('FBT' if w == 'fbt' else 'baseline')} loss | acc |" for w in whos),
              "|---|" + "---|---|" * len(whos)]
    depth = max(len(lens[w]["layers"]) for w in whos)
    for layer in range(depth):
        row = f"| {layer} |"
        for w in whos:
            if layer < len(lens[w]["loss"]):
                row += f" {_fmt(lens[w]['loss'][layer])} | {_fmt(lens[w]['accuracy'][layer])} |"
            else:
                row += " | |"
        lines.append(row)
    if "baseline_loss" in results:
        lines += ["", f"Baseline loss on its rows: {_fmt(results['baseline_loss'])} nats "
                  f"({'same tokens as the model' if results['baseline_same_tokens'] else 'its own tokenization'})."]
    lines.append("")
    if "logit_lens.png" in images:
        lines += ["![logit lens](logit_lens.png)", ""]

    g = results["gates"]
    lines += ["## 4. Gate statistics", ""]
    if g.get("gate_histogram"):
        lines += [f"Token gate σ(W_G norm(e_t)) over every token occurrence (all channels pooled): mean "
                  f"{_fmt(g['gate_mean'])}, std {_fmt(g['gate_std'])}, {100 * g['gate_frac_below_0.1']:.1f}% below 0.1, "
                  f"{100 * g['gate_frac_above_0.9']:.1f}% above 0.9. Per-token mean gate spread (max − min over "
                  f"{g['distinct_tokens']} distinct tokens): {_fmt(g['token_mean_gate_spread'])}.", "",
                  "| most open (mean gate) | most closed (mean gate) |", "|---|---|"]
        for a, b in zip(g["most_open_tokens"], g["most_closed_tokens"]):
            lines.append(f"| `{a['token']!r}` {_fmt(a['mean_gate'])} (×{a['count']}) | "
                         f"`{b['token']!r}` {_fmt(b['mean_gate'])} (×{b['count']}) |")
        lines.append("")
    else:
        lines += [g.get("note", "no gate"), ""]
    if g.get("norm_ratio"):
        r = g["norm_ratio"]
        lines += [f"Fused / plain input norm ratio ||u_t|| / ||e_t|| at {r['n']} fused positions: mean {_fmt(r['mean'])}, "
                  f"median {_fmt(r['median'])}, 5–95% {_fmt(r['p05'])}–{_fmt(r['p95'])}.", ""]
    if "gates.png" in images:
        lines += ["![gates](gates.png)", ""]
    lines += ["All numbers: `analysis.json`.", ""]
    return "\n".join(lines)


def write_report(results: dict, out_dir: str) -> list[str]:
    """``report.md``, ``analysis.json`` and the PNGs under ``out_dir`` (each written atomically)."""
    os.makedirs(out_dir, exist_ok=True)
    images = make_plots(results, out_dir)
    atomic_write_bytes(os.path.join(out_dir, "analysis.json"), json.dumps(results, indent=2).encode())
    atomic_write_bytes(os.path.join(out_dir, "report.md"), render_markdown(results, images).encode())
    return ["report.md", "analysis.json", *images]
