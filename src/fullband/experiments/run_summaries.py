"""One line per committed run, for the README's generated summary tables: several runs of one experiment (seeds,
recipes) side by side, each line read from that run's own ``results.json`` (``docs/gen/results_tables.py`` fills
the ``<!-- runs-table:NAME,NAME:start -->`` blocks of the README and the docs pages with them). Rendering only; kept out of the
experiments' own report modules, so a change here does not mark their committed tables stale.
"""

from __future__ import annotations

import shlex

from .data_efficiency import _ci_text, _multiplier_ci_text


def _delta(value: float | None, ci: dict | None) -> str:
    if value is None or ci is None:
        return "-"
    return f"{value:+.4f} {_ci_text(ci)}"


def _set_options(command: str) -> dict[str, str]:
    """The ``--set NAME=VALUE`` options of a recorded command line (what the experiment's own record leaves out)."""
    words, out = shlex.split(command), {}
    for flag, value in zip(words, words[1:]):
        if flag == "--set" and "=" in value:
            name, _, v = value.partition("=")
            out[name.replace("-", "_")] = v
    return out


def data_efficiency_header() -> str:
    return ("| run | seed | FBT trained | FBT exact loss | Δ vs baseline, equal tokens | Δ vs baseline-flops | "
            "Δ vs baseline-epochs | token multiplier | compute multiplier | commit, CPU |\n"
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")


def data_efficiency_row(name: str, res: dict, meta: dict, stale: bool, link: str) -> str:
    """The headline (exact-mode) comparison of one data-efficiency run: Δ held-out loss against its three controls
    (negative: FBT better) with the paired 95% CIs over held-out rows, and the two multipliers with theirs."""
    c, r = res["comparisons"][res["headline_mode"]], res["recipe"]
    extra = _set_options(meta["command"])
    how = (f"K = {r['num_passes']}, feedback from {r['feedback_start']:g} of the steps, {r['fusion']}"
           + (", exact states + " + extra.get("grad_passes", "?") + " gradient passes"
              if extra.get("exact_states", "").lower() in ("1", "true", "yes") else ""))
    token = f"{c['token_multiplier_text']} {_multiplier_ci_text(c['token_multiplier_ci'], *c['token_range'])}"
    compute = (f"{c['compute_multiplier_text']} "
               f"{_multiplier_ci_text(c['compute_multiplier_ci'], *c['compute_range'])}")
    cpu = (meta.get("cpu") or "CPU not recorded").split(" (")[0]
    return (f"| [{name}]({link}) | {res['seed']} | {how} | {c['fbt_loss']:.4f} | "
            f"{_delta(c['delta_same_tokens'], c['delta_same_tokens_ci'])} | {_delta(c['delta_flops'], c['delta_flops_ci'])} | "
            f"{_delta(c['delta_epochs'], c['delta_epochs_ci'])} | {token} | {compute} | "
            f"`{meta['commit'][:7]}`{' (STALE)' if stale else ''}, {cpu} |")


SUMMARIES = {"data-efficiency": (data_efficiency_header, data_efficiency_row)}
