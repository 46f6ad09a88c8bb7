"""The reasoning experiment re-run into the same ``--out`` with other problems: the runs trained on the old problems
are not reused (the code of the README's first default run reused them: its ``finished()`` compared the training
options alone, and ``--task-option`` / ``--verbosity-mix`` change the problems but no option of a run, whose data is
always ``OUT/data/train.jsonl``); and an ``--overwrite`` re-run reproduces a fresh run's models and table."""

from __future__ import annotations

import hashlib
import json

from fullband import cli

QUICK = ["experiment", "reasoning", "--quick", "--num-seeds", "1", "--no-progress", "--quiet",
         "--styles", "free,full", "--fbt-modes", "standard"]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_runs_of_other_problems_are_not_reused(tmp_path, capsys):
    out = tmp_path / "r"
    assert cli.main([*QUICK, "--out", str(out), "--task-option", "num_ops=2,3"]) == 0
    weights = _sha(out / "seed0" / "baseline" / "model.safetensors")
    capsys.readouterr()
    # the default problems (3-4 operations) into the same directory: refused, the old runs kept as they are
    assert cli.main([*QUICK, "--out", str(out)]) == 2, "a run trained on other problems was reused"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the training data" in err and "--overwrite" in err
    assert _sha(out / "seed0" / "baseline" / "model.safetensors") == weights
    # --overwrite retrains them: the same models and results as a run into a fresh directory
    assert cli.main([*QUICK, "--out", str(out), "--overwrite"]) == 0
    fresh = tmp_path / "fresh"
    assert cli.main([*QUICK, "--out", str(fresh)]) == 0
    for run in ("baseline", "fbt", "baseline-flops", "baseline-epochs"):
        assert _sha(out / "seed0" / run / "model.safetensors") == _sha(fresh / "seed0" / run / "model.safetensors")
    a, b = (json.loads((d / "results.json").read_text()) for d in (out, fresh))
    assert a["table"] == b["table"] and a["comparisons"] == b["comparisons"]
    assert _sha(out / "seed0" / "baseline" / "model.safetensors") != weights
