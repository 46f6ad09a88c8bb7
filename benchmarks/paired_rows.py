"""Paired held-out comparison of saved models on the same rows (what `fullband quickstart` prints, for any models).

Rows: `fullband eval`'s (all validation rows of the run's split, via fullband.eval.scoring.evaluation_rows) and
the quickstart's (128 of them spread evenly, fullband.training.pretrain.spread_rows). Per (model, mode) the mean
loss and, against each reference model in standard mode, a paired percentile bootstrap over rows
(fullband.utils.stats.bootstrap_ci) -- the quickstart's _score_table, for more models.
usage: python benchmarks/paired_rows.py OUT.json NAME=DIR[:modes] ... --refs baseline,baseline-flops,...
modes: comma list of standard, passesK, exact
"""
import json, os, sys, time
import torch
from fullband.eval.scoring import evaluation_rows, load_any_model, row_losses
from fullband.training.pretrain import spread_rows
from fullband.utils.stats import bootstrap_ci

torch.set_num_threads(1)
out = sys.argv[1]
refs = []
specs = []
for a in sys.argv[2:]:
    if a.startswith("--refs="):
        refs = a.split("=", 1)[1].split(",")
    else:
        name, rest = a.split("=", 1)
        d, _, modes = rest.partition(":")
        specs.append((name, d, (modes or "standard").split(",")))
cache_dir = os.path.join(os.path.dirname(out), "rowloss")
os.makedirs(cache_dir, exist_ok=True)
rows = None
per = {}
for name, d, modes in specs:
    model, tok = load_any_model(d, device="cpu")
    if rows is None:
        cfg = json.load(open(os.path.join(d, "run_config.json")))
        rows, info = evaluation_rows(tok, None, "val", cfg["seq_len"], cfg["val_fraction"], cfg["seed"])
        qs_idx = torch.linspace(0, rows.shape[0] - 1, 128).round().long()
        assert torch.equal(spread_rows(rows, 128), rows[qs_idx])
    for mode in modes:
        key = f"{name}|{mode}"
        path = os.path.join(cache_dir, key.replace("|", "__") + ".pt")
        if os.path.exists(path):
            per[key] = torch.load(path, weights_only=True)
            continue
        m, k = ("passes", int(mode[6:])) if mode.startswith("passes") else (mode, 1)
        t = time.perf_counter()
        per[key] = row_losses(model, rows, m, num_passes=k, batch_size=64)
        torch.save(per[key], path)
        print(f"{key}: {float(per[key].mean()):.4f} ({time.perf_counter() - t:.0f}s)", flush=True)
res = {"rows_all": int(rows.shape[0]), "rows_qs": 128, "seq_len": int(rows.shape[1]), "table": []}
for key, v in per.items():
    e = {"key": key}
    for label, sel in (("all", slice(None)), ("qs", qs_idx)):
        e[f"loss_{label}"] = float(v[sel].mean())
        for r in refs:
            rk = f"{r}|standard"
            if rk in per and rk != key:
                e[f"delta_{r}_{label}"] = bootstrap_ci((v[sel] - per[rk][sel]).tolist(), seed=0).as_dict()
    res["table"].append(e)
json.dump(res, open(out, "w"), indent=1)
fmt = lambda d: "" if d is None else f"{d['estimate']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"
for label in ("qs", "all"):
    n = 128 if label == "qs" else res["rows_all"]
    print(f"\n{label}: {n} rows x {res['seq_len']} tokens")
    print("| model | mode | loss | " + " | ".join(f"Δ vs {r} [95% CI]" for r in refs) + " |")
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in refs) + " |")
    for e in res["table"]:
        n_, m_ = e["key"].split("|")
        print(f"| {n_} | {m_} | {e['loss_' + label]:.4f} | " + " | ".join(fmt(e.get(f"delta_{r}_{label}")) for r in refs) + " |")
