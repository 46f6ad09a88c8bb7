"""The table of a set of one-arm probes of the state experiment (``fullband experiment state --arms ONE``), gathered
into one results file by ``docs/gen/collect_runs.py --results``: which LR and length curriculum let the arm learn a
task, one line per probe and task. Rendering only; the numbers are the probes' own ``table`` rows
(:mod:`fullband.experiments.state`). Kept out of :mod:`~fullband.experiments.state_report`, so a change here does not
mark the state experiment's own committed tables stale.
"""

from __future__ import annotations


def probe_table(collection: dict) -> str:
    """One line per run of a set of one-arm probes (``docs/gen/collect_runs.py --results``): its LR, curriculum,
    tasks, steps and seed, then each task's exact-mode per-position accuracy at every length (the probes' own
    ``table`` rows; one seed each, so no CI is printed). A probe whose arm has no exact rows shows standard mode."""
    reports = [r["report"] for r in collection["reports"]]
    lengths = sorted({row["length"] for rep in reports for row in rep["table"]})
    out = ["| arm | LR | length curriculum | tasks | steps | seed | task | mode | "
           + " | ".join(f"T={n}" for n in lengths) + " |",
           "| --- | ---: | --- | --- | ---: | --- | --- | --- |" + " ---: |" * len(lengths)]
    for rep in reports:
        s = rep["settings"]
        curriculum = ("none" if s.get("length_curriculum") is None else
                      f"{s['curriculum_start']} -> {s['length']} over the first {s['length_curriculum']:g}")
        for arm in rep["arms"]:
            for task in s["tasks"].split(","):
                rows = [r for r in rep["table"] if r["arm"] == arm and r["task"] == task]
                mode = "exact" if any(r["mode"] == "exact" for r in rows) else "standard"
                by_len = {r["length"]: r for r in rows if r["mode"] == mode}
                out.append(f"| {arm} | {s['lr']:g} | {curriculum} | {s['tasks']} | {s['steps']} | "
                           f"{', '.join(map(str, rep['seeds']))} | {task} | {mode} | " + " | ".join(
                               f"{by_len[n]['pos']['estimate']:.2f}" if n in by_len else "" for n in lengths) + " |")
    out += ["", "The probes' commands, in the table's order:", ""]
    for i, r in enumerate(collection["reports"], 1):
        prov = r["report"].get("provenance") or {}
        when = (f" ({prov['date'][:16].replace('T', ' ')} UTC, commit {str(prov.get('git_commit'))[:12]}"
                + (", tracked files modified" if prov.get("git_dirty") else "") + ")") if prov.get("date") else ""
        out.append(f"{i}. `{r['command']}`{when}")
    return "\n".join(out)
