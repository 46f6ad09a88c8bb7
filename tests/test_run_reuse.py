"""Run reuse across the experiments: a finished run is reused only for the same options, data and initial model;
one that differs is kept (a one-line error naming the differences, exit 2) unless ``--overwrite``; a cached
decode is keyed by the decoded model's weights, so a changed model is decoded again."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fullband import cli
from fullband.training.checkpoint import model_fingerprint
from fullband.training.config import TrainConfig
from fullband.training.pretrain import build_tokenizer_and_corpus, data_fingerprint, run_differences


def _train(data, out, *extra, steps=2):
    argv = ["train", "--preset", "micro", "--steps", str(steps), "--out", str(out), "--seed", "0", "--data", data,
            "--vocab-size", "300", "--seq-len", "32", "--batch-size", "2", "--no-progress", "--no-tensorboard",
            "--no-plot", *extra]
    assert cli.main(argv) == 0


def _stamps(out) -> dict:
    return {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in sorted(os.listdir(out))
            if os.path.isfile(os.path.join(out, n))}


def test_model_fingerprint_follows_the_weights(tmp_path, data):
    out = tmp_path / "run"
    _train(data, out, "--num-passes", "1")
    before = model_fingerprint(str(out))
    assert model_fingerprint(str(out)) == before  # stable
    weights = load_file(str(out / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert model_fingerprint(str(out)) != before
    with pytest.raises(FileNotFoundError):
        model_fingerprint(str(tmp_path))  # no weights there


def test_run_differences_names_options_data_and_init(tmp_path, data):
    out = tmp_path / "run"
    _train(data, out, "--num-passes", "1")
    saved = json.loads((out / "run_config.json").read_text())
    cfg = TrainConfig(**saved)
    summary = json.loads((out / "summary.json").read_text())
    corpus = build_tokenizer_and_corpus(cfg)
    assert summary["data_sha256"] == data_fingerprint(corpus) and summary["init_sha256"] is None
    assert run_differences(cfg, corpus) == []
    assert run_differences(TrainConfig(**{**saved, "device": "cpu", "progress": True}), corpus) == []  # not the run
    assert run_differences(TrainConfig(**{**saved, "lr": 0.5}), corpus) == [f"--lr {saved['lr']!r} -> 0.5"]
    other = build_tokenizer_and_corpus(TrainConfig(**{**saved, "seed": 1}))  # another split of the documents
    assert run_differences(cfg, other) == ["the training data"]
    assert run_differences(TrainConfig(**{**saved, "out": str(tmp_path / "none")}), corpus) is None


def test_a_moved_run_is_the_same_run_and_its_init_model_counts_by_weights(tmp_path, data):
    """A finished run moved with its directory is reused there (where it lies is not what it trained); an
    --init-from model is compared by its weights: a copy elsewhere is the same start, changed weights are not,
    and starting from no model at all differs from starting from one."""
    init = tmp_path / "init"
    _train(data, init, "--num-passes", "1")
    out = tmp_path / "run"
    _train(data, out, "--num-passes", "1", "--init-from", str(init))
    moved, init_copy = tmp_path / "elsewhere" / "run", tmp_path / "elsewhere" / "init"
    shutil.copytree(out, moved)
    shutil.copytree(init, init_copy)
    saved = json.loads((out / "run_config.json").read_text())
    corpus = build_tokenizer_and_corpus(TrainConfig(**saved))
    same = TrainConfig(**{**saved, "out": str(moved), "init_from": str(init_copy)})
    assert run_differences(same, corpus) == []
    weights = load_file(str(init_copy / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(init_copy / "model.safetensors"), metadata={"format": "pt"})
    assert run_differences(same, corpus) == ["the --init-from model"]
    assert run_differences(TrainConfig(**{**saved, "out": str(moved), "init_from": None}), corpus) == [
        "--init-from True -> False"]


def test_experiments_keep_a_finished_run_of_other_options(tmp_path, data, capsys):
    """quickstart and data-efficiency find a finished run of other options where they would train: exit 2 with
    one line naming the differences, nothing written; --overwrite retrains it."""
    qs = tmp_path / "qs"
    _train(data, qs / "baseline", "--num-passes", "1")
    before = _stamps(qs / "baseline")
    capsys.readouterr()
    argv = ["quickstart", "--out", str(qs), "--preset", "micro", "--steps", "4", "--batch-size", "2", "--seq-len",
            "32", "--vocab-size", "300", "--eval-rows", "2", "--samples", "0", "--no-progress", "--quiet",
            "--no-flops-baseline", "--no-state"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(qs / "baseline") in err and "--steps 2 -> 4" in err and "--overwrite" in err
    assert _stamps(qs / "baseline") == before and not (qs / "fbt").exists()

    de = tmp_path / "de"
    _train(data, de / "runs" / "baseline-0.50x", "--num-passes", "1", steps=3)
    before = _stamps(de / "runs" / "baseline-0.50x")
    capsys.readouterr()
    argv = ["experiment", "data-efficiency", "--out", str(de), "--preset", "micro", "--steps", "2", "--batch-size",
            "2", "--seq-len", "32", "--vocab-size", "300", "--data", data, "--multipliers", "0.5,1", "--eval-rows",
            "2", "--feedback-start", "0.5", "--no-progress", "--quiet"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "baseline-0.50x" in err and "--steps 3 -> 1" in err
    assert _stamps(de / "runs" / "baseline-0.50x") == before and not (de / "runs" / "fbt-1.00x").exists()
    assert cli.main(argv + ["--overwrite"]) == 0
    recs = [json.loads(line) for line in (de / "runs" / "baseline-0.50x" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in recs) == 1
    # a second invocation reuses every run: nothing is retrained
    stamps = {d: _stamps(de / "runs" / d) for d in os.listdir(de / "runs")}
    assert cli.main(argv) == 0
    assert {d: _stamps(de / "runs" / d) for d in os.listdir(de / "runs")} == stamps


def test_quickstart_reuses_its_finished_runs(tmp_path, capsys):
    """A second quickstart of the same options trains nothing (all four runs reused, the same tables; one of other
    options is refused: the test above); the controls' directories are runs of their own (baseline-epochs
    re-reading the FBT run's rows: --unique-batches)."""
    out = tmp_path / "qs"
    argv = ["quickstart", "--out", str(out), "--preset", "micro", "--steps", "4", "--batch-size", "2", "--seq-len",
            "32", "--vocab-size", "300", "--eval-rows", "2", "--samples", "0", "--no-progress", "--quiet",
            "--state-steps", "2", "--state-test-rows", "2"]
    assert cli.main(argv) == 0
    runs = ("baseline", "fbt", "baseline-flops", "baseline-epochs") + tuple(
        os.path.join("state", "seed0", "runs", n) for n in ("baseline-L", "baseline-2L", "fbt-L-glu-x2"))
    stamps = {d: _stamps(out / d) for d in runs}
    first = json.loads((out / "results.json").read_text())
    saved = json.loads((out / "baseline-epochs" / "run_config.json").read_text())
    assert saved["unique_batches"] == 4 and saved["steps"] == first["baseline_epochs_steps"] > 4
    assert first["unique_train_tokens"]["baseline-epochs"] == first["unique_train_tokens"]["fbt"] == 4 * 2 * 32
    assert first["unique_train_tokens"]["baseline-flops"] == first["train_tokens"]["baseline-flops"] > 4 * 2 * 32
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert {d: _stamps(out / d) for d in runs} == stamps
    again = json.loads((out / "results.json").read_text())
    assert again["table"] == first["table"] and again["decode_table"] == first["decode_table"]


def test_a_reasoning_decode_is_not_reused_after_the_weights_change(tmp_path, capsys):
    out = tmp_path / "rs"
    argv = ["experiment", "reasoning", "--quick", "--out", str(out), "--no-progress", "--num-seeds", "1",
            "--no-flops-baseline", "--styles", "free", "--fbt-modes", "exact", "--test-problems", "3"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    cache = json.loads((out / "seed0" / "decodes.json").read_text())
    assert cache["FBT/exact/free"]["key"]["model_sha256"] == model_fingerprint(str(out / "seed0" / "fbt"))
    # the same invocation again: training and decodes reused
    assert cli.main(argv) == 0
    assert "decoding" not in capsys.readouterr().err
    # the FBT model's weights change (its run's files otherwise untouched): decoded again, the baseline not
    path = out / "seed0" / "fbt" / "model.safetensors"
    weights = load_file(str(path))
    for k in weights:
        if k.startswith("feedback."):
            weights[k] = torch.zeros_like(weights[k])
    save_file(weights, str(path), metadata={"format": "pt"})
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "FBT in exact mode" in err and "baseline in standard mode" not in err
    cache = json.loads((out / "seed0" / "decodes.json").read_text())
    assert cache["FBT/exact/free"]["key"]["model_sha256"] == model_fingerprint(str(out / "seed0" / "fbt"))


def test_a_pass_mix_written_in_another_order_is_the_same_run(tmp_path, data, capsys):
    """--pass-mix compares by its pairs: a run resumed with the mix reordered (and ``.75`` for ``0.75``) continues
    bitwise as the uninterrupted one, and the finished run is reused for it; another mix is refused on --resume."""
    mix = ("--num-passes", "3", "--deep-fraction", "0", "--feedback-start", "0", "--seed", "2")
    full, part = tmp_path / "full", tmp_path / "part"
    _train(data, full, *mix, "--pass-mix", "1:0.75,2:0.22,3:0.03", steps=8)
    _train(data, part, *mix, "--pass-mix", "1:0.75,2:0.22,3:0.03", "--save-every", "4", "--stop-after", "4", steps=8)
    _train(data, part, *mix, "--pass-mix", "3:0.03,1:.75,2:0.22", "--resume", steps=8)

    def losses(out):
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [(r["num_passes"], r["loss"]) for r in recs if r.get("split", "train") == "train" and "loss" in r]

    assert losses(part) == losses(full) and len(losses(full)) == 8
    saved = json.loads((full / "run_config.json").read_text())
    corpus = build_tokenizer_and_corpus(TrainConfig(**saved))
    assert run_differences(TrainConfig(**{**saved, "pass_mix": "2:0.22,3:0.03,1:0.75"}), corpus) == []
    assert run_differences(TrainConfig(**{**saved, "pass_mix": "1:0.5,2:0.25,3:0.25"}), corpus) == [
        "--pass-mix '1:0.75,2:0.22,3:0.03' -> '1:0.5,2:0.25,3:0.25'"]
    argv = ["train", "--preset", "micro", "--steps", "8", "--out", str(part), "--data", data, "--vocab-size", "300",
            "--seq-len", "32", "--batch-size", "2", "--no-progress", "--no-tensorboard", "--no-plot", *mix,
            "--pass-mix", "1:0.5,2:0.25,3:0.25", "--resume", "--save-every", "4", "--stop-after", "4"]
    shutil.rmtree(part)
    _train(data, part, *mix, "--pass-mix", "1:0.75,2:0.22,3:0.03", "--save-every", "4", "--stop-after", "4", steps=8)
    capsys.readouterr()
    assert cli.main(argv) == 2
    assert "--pass-mix" in capsys.readouterr().err
