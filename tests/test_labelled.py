"""Labelled tasks end to end: prepare, train (loss only at the targets; --exact-states), score per mode, bad input.

Tasks: ``identity`` (target at every position: the input letter upper-cased; learnable in seconds, and a label
layout off by one position leaves chance accuracy) and ``sparse`` (targets only at some positions). Everything
runs through the CLI on the ``micro`` preset.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fullband import cli
from fullband.data.corpus import load_tokenizer
from fullband.data.labelled import load_labelled
from fullband.model.modeling import load_model
from fullband.training.config import TrainConfig
from fullband.training.pretrain import build_model
from fullband.utils.io import read_jsonl

from conftest import assert_losses_close, reorder_rtol

LETTERS = "abcdefgh"


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def identity_rows(n, lo, hi, seed, exclude=()):
    rng, seen, out = random.Random(seed), {tuple(x) for x in exclude}, []
    while len(out) < n:
        x = [rng.choice(LETTERS) for _ in range(rng.randint(lo, hi))]
        if tuple(x) not in seen:
            seen.add(tuple(x))
            out.append({"input": x, "target": [c.upper() for c in x]})
    return out


def train_args(data, out, *extra, steps=40):
    return ["train", "--data", str(data), "--out", str(out), "--preset", "micro", "--steps", str(steps),
            "--seq-len", "24", "--batch-size", "16", "--lr", "3e-3", "--seed", "0", "--no-progress",
            "--no-tensorboard", "--no-plot", *extra]


def train_records(out):
    return [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("split") == "train"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Identity rows of 4..8 inputs, prepared, trained 40 steps (feedback K=2 from step 21)."""
    root = tmp_path_factory.mktemp("labelled")
    rows = identity_rows(200, 4, 8, seed=0)
    src = write_jsonl(root / "train.jsonl", rows)
    prep = root / "prep"
    assert cli.main(["data", "prepare", src, "--out", str(prep)]) == 0  # the format is detected
    out = root / "run"
    assert cli.main(train_args(prep, out, "--feedback-start", "0.5")) == 0
    return {"root": root, "rows": rows, "src": src, "prep": str(prep), "out": str(out)}


def test_prepared_directory_counts_and_vocabulary(trained):
    manifest = json.load(open(os.path.join(trained["prep"], "manifest.json")))
    splits = manifest["splits"]
    assert splits["train"]["rows"] + splits["val"]["rows"] == 200 and splits["val"]["rows"] > 0
    assert splits["train"]["ids"] + splits["val"]["ids"] == sum(len(r["input"]) + 2 for r in trained["rows"])
    assert splits["train"]["targets"] + splits["val"]["targets"] == sum(len(r["input"]) for r in trained["rows"])
    tok = load_tokenizer(os.path.join(trained["out"]))
    vocab = tok.get_vocab()
    assert set(vocab) == {"<|pad|>", "<|bos|>", "<|eos|>", *LETTERS, *LETTERS.upper()}
    assert manifest["vocab_size"] == len(vocab) == 19


def test_trains_and_scores_per_mode_beyond_training_lengths(trained, tmp_path, capsys):
    test = write_jsonl(tmp_path / "test.jsonl", identity_rows(30, 4, 14, seed=1, exclude=[r["input"] for r in
                                                                                         trained["rows"]]))
    report_path = tmp_path / "report.json"
    capsys.readouterr()
    rc = cli.main(["eval", "labelled", trained["out"], "--data", test, "--modes", "standard,passes,exact,soft,fused",
                   "--passes", "2", "--prompt-tokens", "3", "--buckets", "8", "--resamples", "500", "--json",
                   "--out", str(report_path)])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.load(open(report_path))
    assert "resampling ROWS" in report["ci"] and report["train_max_length"] == 8
    assert report["overlap_check"]["train_rows_compared"] == 200  # the run's own --data, both splits
    n_targets = sum(len(json.loads(line)["input"]) for line in open(test))
    by_mode = {r["mode"]: r for r in report["results"]}
    assert set(by_mode) == {"standard", "passes", "exact", "soft", "fused"}
    for mode, r in by_mode.items():
        # soft / fused score the predictions a decode makes: inputs P..T (P = 3)
        want = n_targets - (2 * 30 if mode in ("soft", "fused") else 0)
        assert r["overall"]["targets"] == want
        assert [b["lengths"] for b in r["by_length"]] == ["1-8", "9-14"]
        assert sum(b["targets"] for b in r["by_length"]) == want
        assert r["beyond_training_lengths"]["rows"] == sum(len(json.loads(x)["input"]) > 8 for x in open(test))
        acc = r["within_training_lengths"]["accuracy"]
        # learned: a label layout one position off would leave chance (1/8)
        assert acc["estimate"] > 0.9 and acc["low"] <= acc["estimate"] <= acc["high"]
    assert by_mode["passes"]["num_passes"] == 2 and by_mode["soft"]["by_position"][0]["position"] == 3


def test_validation_split_is_by_row_content(tmp_path, capsys):
    """A file whose rows repeat: no validation input is a training input (compared as token tuples, not by the
    package's key), every copy of a row lands in one split, the split is the same twice over and for the prepared
    directory, and the duplicate count (counted here) is in the manifest, prepare's output and the training log."""
    distinct = identity_rows(30, 2, 4, seed=7)
    rng = random.Random(1)
    rows = [rng.choice(distinct) for _ in range(120)]
    want_dup = len(rows) - len({tuple(r["input"]) for r in rows})
    src = write_jsonl(tmp_path / "dup.jsonl", rows)

    def splits(data):
        words = {i: w for w, i in data.tokenizer.get_vocab().items()}
        return [[tuple(words[int(t)] for t in rows_.row(i)[0][1:-1]) for i in range(len(rows_))]
                for rows_ in (data.train, data.val)]

    data = load_labelled(src, seed=0, val_fraction=0.3)
    train, val = splits(data)
    assert len(train) + len(val) == len(rows) and len(val) > 0 and len(train) > 0
    assert not set(val) & set(train)
    assert sorted(train + val) == sorted(tuple(r["input"]) for r in rows)  # every copy kept
    assert data.info["duplicate_rows"] == want_dup > 0
    again = load_labelled(src, seed=0, val_fraction=0.3)
    assert again.fingerprint == data.fingerprint and splits(again) == [train, val]
    capsys.readouterr()
    prep = tmp_path / "prep"
    assert cli.main(["data", "prepare", src, "--out", str(prep), "--val-fraction", "0.3"]) == 0
    assert f"{want_dup} repeat an earlier row's inputs" in capsys.readouterr().out
    prepared = load_labelled(str(prep))
    assert prepared.info["duplicate_rows"] == want_dup and prepared.fingerprint == data.fingerprint
    assert cli.main(train_args(src, tmp_path / "run", "--val-fraction", "0.3", steps=1)) == 0
    assert f"{len(val)} val rows ({want_dup} rows of the file repeat" in capsys.readouterr().err


def test_loss_is_only_at_the_targets(tmp_path):
    """The logged loss of step 1 (plain, --grad-accum 2) equals the cross-entropy at the target positions, computed
    here from the initial model's logits: the logits at input t scored against target t, nothing else counted."""
    rng = random.Random(3)
    rows = []
    for _ in range(16):
        x = [rng.choice(LETTERS) for _ in range(rng.randint(3, 9))]
        y = [c.upper() if rng.random() < 0.4 else None for c in x]
        y[-1] = x[0].upper()  # at least one target: the first input, recalled at the end
        rows.append({"input": " ".join(x), "target": " ".join(v or "_" for v in y)})
    src = write_jsonl(tmp_path / "sparse.jsonl", rows)
    out = tmp_path / "run"
    assert cli.main(train_args(src, out, "--val-fraction", "0", "--grad-accum", "2", steps=1)) == 0
    logged = train_records(out)[0]["loss"]
    tok = load_tokenizer(str(out))
    vocab = tok.get_vocab()
    model = build_model(TrainConfig(out=str(out), preset="micro", seq_len=24, seed=0), tok).eval()
    nll, count, nll_all, count_all, nll_early = 0.0, 0, 0.0, 0, 0.0
    for r in rows:
        x, y = r["input"].split(), r["target"].split()
        ids = torch.tensor([[vocab["<|bos|>"], *(vocab[w] for w in x), vocab["<|eos|>"]]])
        with torch.no_grad():
            logp = model(ids).logits[0].double().log_softmax(-1)
        for t, target in enumerate(y, start=1):  # ids[t] is input t
            if target != "_":
                nll -= float(logp[t, vocab[target]])
                nll_early -= float(logp[t - 1, vocab[target]])  # a layout one position early
                count += 1
        nll_all -= float(logp[:-1].gather(1, ids[0, 1:, None]).sum())
        count_all += ids.shape[1] - 1
    assert logged == pytest.approx(nll / count, rel=1e-5)
    # the other layouts are other numbers (at init every loss is near log V: by far more than the tolerance)
    for other in (nll_all / count_all, nll_early / count):
        assert abs(logged - other) > 1e-3 * logged


def test_exact_states_loss_is_the_exact_recurrence_at_the_targets(trained, tmp_path):
    """--exact-states --grad-passes 1 on labelled rows: step 1 (fed back from the start, no jitter, no prefix
    mixing) logs the loss of the exact token-by-token recurrence at the targets."""
    out = tmp_path / "exact"
    assert cli.main(train_args(trained["src"], out, "--feedback-start", "0", "--exact-states", "--grad-passes", "1",
                               "--jitter", "0", "--prefix-mix", "0", "--batch-size", "200", "--val-fraction", "0",
                               steps=1)) == 0
    rec = train_records(out)[0]
    assert rec["exact_states"] is True and len(rec["pass_losses"]) == 1
    tok = load_tokenizer(str(out))
    vocab = tok.get_vocab()
    cfg = TrainConfig(out=str(out), preset="micro", seq_len=24, seed=0, feedback_start=0.0, jitter=0.0)
    model = build_model(cfg, tok).eval()
    nll, count = 0.0, 0
    for r in trained["rows"]:
        ids = torch.tensor([[vocab["<|bos|>"], *(vocab[w] for w in r["input"]), vocab["<|eos|>"]]])
        logits = model.recurrent_forward(ids).logits[0, 1:-1].double()
        target = torch.tensor([vocab[y] for y in r["target"]])
        nll += float(F.cross_entropy(logits, target, reduction="sum"))
        count += len(r["target"])
    assert rec["pass_losses"][0] == pytest.approx(nll / count, rel=1e-4)


BAD = {
    "count": ('{"input": ["a", "b"], "target": ["A"]}', "1 targets for 2 input tokens"),
    "empty": ('{"input": [], "target": []}', "empty row"),
    "json": ('{"input": ["a"], "target": ["A"]', "not valid JSON"),
    "no_target": ('{"input": "a b", "target": "_ _"}', "no target"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_rows_are_one_line_errors_and_nothing_is_written(kind, tmp_path, capsys):
    line, message = BAD[kind]
    src = write_jsonl(tmp_path / "bad.jsonl", ['{"input": "a b", "target": "A B"}', "", line])
    capsys.readouterr()
    prep, run = tmp_path / "prep", tmp_path / "run"
    assert cli.main(["data", "prepare", src, "--labelled", "--out", str(prep)]) == 2
    assert cli.main(train_args(src, run, "--labelled", steps=1)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(f"{src}:3:" in e and message in e for e in err), err
    assert not prep.exists() and not run.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary directory left behind


def test_unknown_test_token_and_overlap_are_refused(trained, tmp_path, capsys):
    report = tmp_path / "r.json"
    unknown = write_jsonl(tmp_path / "unknown.jsonl", ['{"input": "a b", "target": "A B"}',
                                                       '{"input": "a q", "target": "A Q"}'])
    seen = write_jsonl(tmp_path / "seen.jsonl", identity_rows(3, 10, 12, seed=5) + [trained["rows"][7]])
    capsys.readouterr()
    assert cli.main(["eval", "labelled", trained["out"], "--data", unknown, "--out", str(report)]) == 2
    assert cli.main(["eval", "labelled", trained["out"], "--data", seen, "--train", trained["src"],
                     "--out", str(report)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert f"{unknown}:2:" in err[0] and "'q' is not in the model's vocabulary" in err[0]
    assert f"{seen}:4:" in err[1] and "must not occur in training" in err[1]
    assert not report.exists()


def test_resume_continues_the_uninterrupted_run(trained, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    extra = ("--feedback-start", "0.5", "--save-every", "2")
    assert cli.main(train_args(trained["prep"], full, *extra, steps=6)) == 0
    assert cli.main(train_args(trained["prep"], part, *extra, "--stop-after", "3", steps=6)) == 0
    assert cli.main(train_args(trained["prep"], part, *extra, "--resume", steps=6)) == 0
    assert [r["loss"] for r in train_records(part)] == [r["loss"] for r in train_records(full)]
    a, b = load_model(str(full)).state_dict(), load_model(str(part)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_process_ddp_matches_single_process(trained, tmp_path):
    """The same global batch of 8 labelled rows (4 per process, prefix mixing drawn per row): the losses equal the
    single process's to the reordering error of their sums (:func:`conftest.reorder_rtol`; jitter off: each process
    draws its own noise)."""
    extra = ["--feedback-start", "0.5", "--prefix-mix", "0.5", "--jitter", "0", "--batch-size", "8"]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert cli.main(train_args(trained["prep"], single, *extra, steps=4)) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "fullband.cli"] + train_args(trained["prep"], ddp, *extra, steps=4)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = train_records(single), train_records(ddp)
    assert [r["num_passes"] for r in b] == [1, 1, 2, 2] and [r["targets"] for r in a] == [r["targets"] for r in b]
    for ra, rb in zip(a, b):
        rtol = reorder_rtol(ra["targets"], 64, 128, 19)
        assert_losses_close(rb["loss"], ra["loss"], rtol)
        assert_losses_close(rb["pass_losses"], ra["pass_losses"], rtol)
