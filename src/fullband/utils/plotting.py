"""Loss curves as a PNG (matplotlib, headless), from ``metrics.jsonl`` records.

:func:`plot_loss_curves` draws, for every named run, the training loss of pass 1 (``L_1``, exponentially smoothed),
the last pass's loss on the steps that ran more than one pass (``L_K``), and the validation points, against tokens
seen. The combined objective ``L_1 + λ·mean(L_2..L_K)`` is not drawn: it jumps when feedback switches on and is not
comparable across runs.
"""

from __future__ import annotations

import io
import math

from .io import atomic_write_bytes, read_jsonl


def _smooth(values: list[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average; short series get less smoothing (a lag of at most ~5% of them)."""
    beta = max(0.0, min(beta, 1.0 - 20.0 / max(len(values), 1)))
    out, avg = [], 0.0
    for n, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** n))
    return out


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def plot_loss_curves(runs: dict[str, list[dict] | str], path: str, title: str | None = None,
                     smoothing: float = 0.9) -> str:
    """Write a PNG of train / validation curves for ``runs`` (name → records, or a metrics.jsonl path)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, records) in enumerate(runs.items()):
        if isinstance(records, str):
            records = read_jsonl(records)
        color = colors[i % len(colors)]
        z = 10 - i  # earlier runs on top: identical stretches of two runs stay visible
        train = [r for r in records if r.get("split", "train") == "train" and isinstance(r.get("pass_losses"), list)
                 and r["pass_losses"] and all(_finite(v) for v in r["pass_losses"]) and not r.get("skipped")]
        val = [r for r in records if r.get("split") == "val" and _finite(r.get("val_loss"))]
        if train:
            x = [r["tokens"] / 1e6 for r in train]
            ax.plot(x, _smooth([r["pass_losses"][0] for r in train], smoothing), color=color, lw=2.0 if i == 0 else 1.2,
                    zorder=z, label=f"{name}: train L_1")
            deep = [r for r in train if len(r["pass_losses"]) > 1]
            if deep:
                ax.plot([r["tokens"] / 1e6 for r in deep], _smooth([r["pass_losses"][-1] for r in deep], smoothing),
                        color=color, lw=1.0, ls="--", zorder=z, label=f"{name}: train L_K (K>1 steps)")
        if val:
            ax.plot([r["tokens"] / 1e6 for r in val], [r["val_loss"] for r in val], color=color, marker="o",
                    ms=6 if i == 0 else 4, lw=0.8, ls=":", zorder=z, label=f"{name}: validation (standard)")
            vp = [r for r in val if _finite(r.get("val_loss_passes"))]
            if vp:
                ax.plot([r["tokens"] / 1e6 for r in vp], [r["val_loss_passes"] for r in vp], color=color,
                        marker="s", ms=4, lw=0.8, ls=":", zorder=z, label=f"{name}: validation (K passes)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("loss (nats / token)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
        ys = [y for line in ax.lines for y in line.get_ydata()]
        lo, hi = min(ys), max(ys)
        # the first steps' loss (≈ ln V) would flatten the interesting part; clip the top
        tail = sorted(ys)[int(0.9 * (len(ys) - 1))]
        ax.set_ylim(lo - 0.05 * (tail - lo + 1e-6), min(hi, tail + 0.5 * (tail - lo) + 0.1))
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path
