"""Training: end to end, resume after SIGKILL (bitwise), the NaN guard, 2-process DDP, config errors, quickstart.

Everything runs a ``micro`` preset (d64, 2 layers) on a small generated jsonl corpus with a 300-entry BPE.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import fullband
from fullband import cli
from fullband.training.checkpoint import find_checkpoint
from fullband.training.config import TrainConfig, make_config, read_config_file
from fullband.training.pretrain import train
from fullband.training.schedule import lr_at
from fullband.utils.io import read_jsonl

from conftest import assert_losses_close, micro_rtol



def args(data, out, *extra, steps=6):
    return ["train", "--preset", "micro", "--steps", str(steps), "--out", str(out), "--seed", "0", "--data", data,
            "--vocab-size", "300", "--seq-len", "32", "--batch-size", "4", "--no-progress", "--no-tensorboard",
            *extra]


def cfg(data, out, **kw):
    base = dict(out=str(out), preset="micro", steps=6, seed=0, data=data, vocab_size=300, seq_len=32, batch_size=4,
                progress=False, tensorboard=False, plot=False)
    base.update(kw)
    return TrainConfig(**base)


def train_rows(out):
    return [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("split") == "train"]


def losses(out):
    return [(r["step"], r["loss"], r["pass_losses"], r["num_passes"]) for r in train_rows(out)]


def tree_hashes(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def subprocess_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory):
    """One finished 6-step run with feedback from step 4 (K=2, deep K=4), checkpoints every 3 steps."""
    out = tmp_path_factory.mktemp("run") / "fbt"
    rc = cli.main(args(data, out, "--save-every", "3", "--feedback-start", "0.5", "--deep-fraction", "0.34",
                       "--eval-every", "3"))
    assert rc == 0
    return str(out)


# ----------------------------------------------------------------------------------------------- end to end


def test_end_to_end(finished):
    rows = train_rows(finished)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        assert {"step", "loss", "pass_losses", "lr", "tokens", "num_passes", "grad_norm"} <= set(r)
        assert r["tokens"] == r["step"] * 4 * 32 and len(r["pass_losses"]) == r["num_passes"]
    assert [r["num_passes"] for r in rows] == [1, 1, 1, 2, 2, 4]  # plain, then K=2 with a deep step
    # K>1: loss = L_1 + mean(L_2..L_K)
    r = rows[-1]
    assert r["loss"] == pytest.approx(r["pass_losses"][0] + sum(r["pass_losses"][1:]) / 3, rel=1e-5)
    val = [r for r in read_jsonl(os.path.join(finished, "metrics.jsonl")) if r.get("split") == "val"]
    assert [v["step"] for v in val] == [3, 6] and "val_loss_passes" in val[-1]
    assert os.path.isfile(os.path.join(finished, "curves.png"))
    assert find_checkpoint(finished).endswith("step-0000006")
    # the final model and tokenizer load with plain HF entry points
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(finished)
    tok = AutoTokenizer.from_pretrained(finished)
    assert isinstance(model, fullband.FullBandwidthForCausalLM) and model.config.default_feedback_mode != "standard"
    ids = tok("the cat of", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids, num_passes=2).logits).all()


def test_lr_schedules():
    c = TrainConfig(out="x", steps=100, lr=1.0, warmup_fraction=0.1, min_lr_ratio=0.1, lr_schedule="cosine")
    assert lr_at(0, c) == pytest.approx(0.1) and lr_at(9, c) == pytest.approx(1.0)
    assert lr_at(99, c) == pytest.approx(0.1) and 0.1 < lr_at(50, c) < 1.0
    w = dataclasses.replace(c, lr_schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, w) == 1.0 and lr_at(79, w) == 1.0 and lr_at(99, w) == pytest.approx(0.1)


def test_baseline_matches_fbt_until_feedback_and_branching_is_exact(data, tmp_path):
    """The quickstart trains the shared K=1 prefix once; that must be exactly a from-scratch FBT run."""
    fb = dict(feedback_start=0.5, num_passes=2, deep_fraction=0.34, prefix_mix=0.5)
    fbt = train(cfg(data, tmp_path / "fbt", **fb))
    base = train(cfg(data, tmp_path / "base", **dict(fb, num_passes=1, deep_passes=1)))
    assert fbt["status"] == base["status"] == "done"
    a, b = losses(tmp_path / "fbt"), losses(tmp_path / "base")
    assert a[:3] == b[:3] and a[3:] != b[3:]
    # branch: baseline to the feedback start, then the FBT settings from its checkpoint
    from fullband.experiments.common import copy_branch as _copy_branch

    first = train(cfg(data, tmp_path / "b2", **dict(fb, num_passes=1, deep_passes=1), stop_after=3))
    assert first["status"] == "paused"
    _copy_branch(str(tmp_path / "b2"), str(tmp_path / "f2"), first["checkpoint"], 3)
    train(cfg(data, tmp_path / "f2", **fb), resume=True)
    assert losses(tmp_path / "f2") == a


def test_grad_accumulation_matches_full_batch(data, tmp_path):
    train(cfg(data, tmp_path / "a", steps=3, feedback_start=0.0, jitter=0.0))
    train(cfg(data, tmp_path / "b", steps=3, feedback_start=0.0, jitter=0.0, grad_accum=2))
    for (s1, l1, p1, _), (s2, l2, p2, _) in zip(losses(tmp_path / "a"), losses(tmp_path / "b")):
        assert_losses_close(l1, l2, micro_rtol(4 * 32))  # two micro-batch means averaged: another order
        assert_losses_close(p1, p2, micro_rtol(4 * 32))


def test_retrofit_init_from(data, tmp_path):
    from transformers import AutoModelForCausalLM

    from fullband.data.corpus import load_documents, train_tokenizer
    from fullband.training.presets import backbone_config

    tok = train_tokenizer((d.text for d in load_documents(data)), 300)
    torch.manual_seed(0)
    backbone = AutoModelForCausalLM.from_config(backbone_config("micro", len(tok), bos_token_id=1, eos_token_id=2,
                                                                pad_token_id=0))
    backbone.save_pretrained(tmp_path / "pre")
    tok.save_pretrained(tmp_path / "pre")
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    rc = cli.main(args(data, tmp_path / "out", "--init-from", str(tmp_path / "pre"), "--feedback-start", "0", steps=2))
    assert rc == 0
    model = fullband.model.modeling.load_model(str(tmp_path / "out"))
    after = model.backbone.state_dict()
    assert model.config.text_config.model_type == "llama"
    assert any(not torch.equal(before[k], after[k]) for k in before)
    (tmp_path / "nomodel").mkdir()
    assert cli.main(args(data, tmp_path / "o2", "--init-from", str(tmp_path / "nomodel"))) == 2


# ----------------------------------------------------------------------------------------------- resume


def test_sigkill_and_resume_is_bitwise(data, tmp_path):
    extra = ["--feedback-start", "0.25", "--deep-fraction", "0.5", "--prefix-mix", "0.5", "--jitter", "0.05",
             "--save-every", "2"]
    ref = tmp_path / "ref"
    killed = tmp_path / "killed"
    run = [sys.executable, "-m", "fullband.cli"]
    env = subprocess_env()
    assert cli.main(args(data, ref, *extra, steps=8)) == 0  # the uninterrupted reference, in this process
    # SIGKILL right after step 5 was logged: the checkpoint of step 4 is the latest
    p = subprocess.run(run + args(data, killed, *extra, "--debug-kill-at-step", "5", steps=8), env=env,
                       capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL
    assert find_checkpoint(str(killed)).endswith("step-0000004")
    assert [r["step"] for r in train_rows(killed)] == [1, 2, 3, 4, 5]
    p = subprocess.run(run + ["train", "--resume", "--out", str(killed)], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    a, b = losses(ref), losses(killed)
    assert [s for s, *_ in b] == list(range(1, 9))
    assert any(k > 1 for *_, k in a[4:])
    assert a == b  # bitwise: json floats round-trip exactly


# ----------------------------------------------------------------------------------------------- safe checkpoints


def copy_run(finished, tmp_path, name):
    import shutil

    dst = tmp_path / name
    shutil.copytree(finished, dst)
    return dst, find_checkpoint(str(dst))


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "rng-rank0.pt", "trainer_state.json"])
def test_truncated_checkpoint_file_is_a_one_line_error(finished, tmp_path, capsys, name):
    run, ckpt = copy_run(finished, tmp_path, "run")
    path = os.path.join(ckpt, name)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    rc = cli.main(["train", "--resume", "--out", str(run), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("fullband train: error:") and "\n" not in err and path in err, err


def test_checkpoint_loads_refuse_pickled_objects(finished, tmp_path, capsys):
    """Resume loads with weights_only=True: a pickle that would run code (or build a numpy array) is refused."""
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    run, ckpt = copy_run(finished, tmp_path, "run")
    rng = os.path.join(ckpt, "rng-rank0.pt")
    state = torch.load(rng, weights_only=True)  # the checkpoint as written loads weights-only
    assert isinstance(state["python"]["state"], list) and isinstance(state["numpy"]["state"], torch.Tensor)
    torch.save({**state, "extra": Boom()}, rng)
    assert cli.main(["train", "--resume", "--out", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and rng in err and not marker.exists(), err
    run2, ckpt2 = copy_run(finished, tmp_path, "run2")
    opt = os.path.join(ckpt2, "optimizer.pt")
    import numpy as np

    torch.save({**torch.load(opt, weights_only=True), "numpy": np.zeros(3)}, opt)
    assert cli.main(["train", "--resume", "--out", str(run2), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and opt in err, err


def test_resume_from_a_format_1_checkpoint(data, finished, tmp_path):
    """Checkpoints written before format 2 (numpy's RNG state as a pickled array) still resume, weights-only with
    exactly numpy's array reconstruction allowed, to the same losses."""
    import numpy as np

    out = tmp_path / "old"
    extra = ["--save-every", "3", "--feedback-start", "0.5", "--deep-fraction", "0.34", "--eval-every", "3"]
    assert cli.main(args(data, out, *extra, "--stop-after", "3")) == 0
    ckpt = find_checkpoint(str(out))
    rng_file = os.path.join(ckpt, "rng-rank0.pt")
    new = torch.load(rng_file, weights_only=True)
    py, npy = new["python"], new["numpy"]
    torch.save({"torch": new["torch"], "prefix": new["prefix"],
                "python": (py["version"], tuple(py["state"]), py["gauss"]),
                "numpy": (npy["key"], npy["state"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                          npy["cached_gaussian"])}, rng_file)
    state_file = os.path.join(ckpt, "trainer_state.json")
    state = json.loads(open(state_file).read())
    state["format"] = 1
    with open(state_file, "w") as f:
        json.dump(state, f)
    assert cli.main(["train", "--resume", "--out", str(out), "--no-progress"]) == 0
    assert losses(out) == losses(finished)


# ----------------------------------------------------------------------------------------------- guard


def test_nan_batch_is_skipped(data, tmp_path):
    s = train(cfg(data, tmp_path / "nan", debug_nan_steps=[3]))
    assert s["status"] == "done" and s["skipped_steps"] == 1
    rows = train_rows(tmp_path / "nan")
    assert rows[2]["skipped"] == "non-finite loss" and rows[2]["loss"] is None
    assert all("skipped" not in r for i, r in enumerate(rows) if i != 2)
    model = fullband.model.modeling.load_model(str(tmp_path / "nan"))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bad_steps_in_a_row_stop_and_keep_last_good_checkpoint(data, tmp_path, capsys):
    out = tmp_path / "stop"
    rc = cli.main(args(data, out, "--save-every", "2", "--max-bad-steps", "3", "--debug-nan-steps", "3,4,5,6"))
    assert rc == 3
    err = capsys.readouterr().err
    assert "stopped after 3 bad steps in a row at step 5" in err and "step-0000002" in err
    assert find_checkpoint(str(out)).endswith("step-0000002")
    assert not os.path.exists(out / "config.json")  # no final model from a stopped run
    assert [r.get("skipped") is not None for r in train_rows(out)] == [False, False, True, True, True]


# ----------------------------------------------------------------------------------------------- distributed


@pytest.mark.parametrize("states", [[], ["--exact-states", "--grad-passes", "2", "--token-step", "lean"]],
                         ids=["passes", "exact-states-lean"])
def test_two_process_ddp_matches_single_process(data, tmp_path, states):
    """Same global batch (4 rows: 2 per process). Reduction order differs, so the losses are equal to the worst-case
    error of their sums in another order (:func:`conftest.micro_rtol`), not bitwise. Jitter is off: each process
    draws its own jitter noise. Second case: the exact recurrence's states through the lean token step, whose
    per-position passes run inside each process's DDP-wrapped model."""
    extra = ["--feedback-start", "0.5", "--prefix-mix", "0.5", "--jitter", "0", *states]
    single = tmp_path / "single"
    assert cli.main(args(data, single, *extra, steps=4)) == 0
    ddp = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "fullband.cli"] + args(data, ddp, *extra, steps=4)
    p = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = losses(single), losses(ddp)
    assert [x[0] for x in b] == [1, 2, 3, 4] and [x[3] for x in b] == [1, 1, 2, 2]
    for (_, la, pa, _), (_, lb, pb, _) in zip(a, b):
        assert_losses_close(la, lb, micro_rtol(4 * 32))
        assert_losses_close(pa, pb, micro_rtol(4 * 32))
    ma = fullband.model.modeling.load_model(str(single)).state_dict()
    mb = fullband.model.modeling.load_model(str(ddp)).state_dict()
    assert max((ma[k] - mb[k]).abs().max().item() for k in ma) < 1e-4


def test_fsdp_pause_and_resume_is_bitwise(data, tmp_path):
    """FSDP2 over 2 processes: a run paused before the feedback start and resumed logs the same losses as an
    uninterrupted one (the fusion, never stepped before the checkpoint, starts its AdamW state afresh in both)."""
    extra = ["--feedback-start", "0.5", "--parallel", "fsdp", "--save-every", "2"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
              "fullband.cli"]
    full, part = tmp_path / "full", tmp_path / "part"
    for argv in (args(data, full, *extra, steps=4), args(data, part, *extra, "--stop-after", "2", steps=4),
                 ["train", "--resume", "--out", str(part), "--no-progress"]):
        p = subprocess.run(launch + argv, env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
    assert losses(full) == losses(part) and [x[3] for x in losses(part)] == [1, 1, 2, 2]


# ----------------------------------------------------------------------------------------------- errors


def test_config_file_yaml_and_toml(tmp_path):
    (tmp_path / "c.yaml").write_text("steps: 7\nnum-passes: 3\nlr: 1.0e-3\n")
    (tmp_path / "c.toml").write_text("steps = 9\nfeedback_start = 0.5\n")
    c = make_config({"steps": 11}, str(tmp_path / "c.yaml"))
    assert (c.steps, c.num_passes, c.lr) == (11, 3, 1e-3)  # the command line wins over the file
    c = make_config({}, str(tmp_path / "c.toml"))
    assert (c.steps, c.feedback_start) == (9, 0.5)
    (tmp_path / "bad.yaml").write_text("stepz: 3\n")
    with pytest.raises(ValueError, match="unknown option 'stepz'"):
        read_config_file(str(tmp_path / "bad.yaml"))


def test_bad_values_and_missing_files_leave_checkpoints_untouched(data, finished, tmp_path, capsys):
    before = tree_hashes(finished)
    (tmp_path / "bad_value.toml").write_text('steps = "ten"\n')
    (tmp_path / "unknown.yaml").write_text("no_such_option: 1\n")
    (tmp_path / "broken.yaml").write_text("steps: [1, 2\n")
    (tmp_path / "empty").mkdir()
    cases = [
        (["train", "--resume", "--out", finished, "--lr", "-1"], "argument --lr: must be a number > 0"),
        (["train", "--resume", "--out", finished, "--seq-len", "16"], "--seq-len differ"),
        (["train", "--resume", "--out", finished, "--batch-size", "3", "--grad-accum", "2"], "divisible"),
        (["train", "--resume", "--out", finished, "--prefix-mix", "0.1"], "precedes the feedback start"),
        (args(data, finished), "already holds a run"),
        (args(data, finished, "--steps", "0"), "argument --steps: must be an integer >= 1"),
        (args(data, finished, "--num-passes", "0"), "argument --num-passes: must be an integer >= 1"),
        (args(data, finished, "--prefix-mix", "1.5"), "--prefix-mix"),
        (args(data, finished, "--lr-schedule", "linear"), "--lr-schedule"),
        (args(data, finished, "--preset", "huge"), "unknown preset"),
        (["train", "--out", finished, "--config", str(tmp_path / "missing.yaml")], "does not exist"),
        (["train", "--out", finished, "--config", str(tmp_path / "bad_value.toml")], "--steps must be an integer"),
        (["train", "--out", finished, "--config", str(tmp_path / "unknown.yaml")], "unknown option"),
        (["train", "--out", finished, "--config", str(tmp_path / "broken.yaml")], "could not be parsed"),
        (args(str(tmp_path / "nope.jsonl"), finished, "--overwrite"), "does not exist"),
        (args(data, finished, "--overwrite", "--init-from", str(tmp_path / "nope")), "does not exist"),
        (args(data, finished, "--overwrite", "--tokenizer", str(tmp_path / "nope")), "does not exist"),
        (["train", "--resume", "--out", str(tmp_path / "empty")], "no checkpoint"),
        (["train", "--resume", "--out", str(tmp_path / "never")], "no checkpoint"),
    ]
    for argv, message in cases:
        rc = cli.main(argv)
        err = capsys.readouterr().err.strip()
        assert rc == 2, (argv, err)
        assert err.startswith("fullband train: error:") and "\n" not in err and message in err, (argv, err)
        assert tree_hashes(finished) == before, argv
    assert not os.path.exists(tmp_path / "never")


# ----------------------------------------------------------------------------------------------- bench, quickstart


def test_benchmark_train_times_real_k_pass_steps(monkeypatch):
    """The three cases really run what they are named after, and the times are of those steps. Bugs caught: a
    case built with the wrong K or without the stop-gradient (the K=2 / K=1 ratio would then be meaningless), a
    timed step that leaves out backward or the optimizer (weights unchanged), and a timer that measures
    something other than each step (cumulative, or in the wrong unit: the steps would not fit in the call)."""
    import time
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from fullband.commands.bench_train import benchmark_train, format_benchmark
    from fullband.model.modeling import FullBandwidthForCausalLM
    from fullband.training.presets import backbone_config

    seen = {}  # model -> [backbone passes, states fused with a gradient, states fused without]
    real_pass, real_fuse = FullBandwidthForCausalLM._backbone_pass, FullBandwidthForCausalLM.fuse

    def count_pass(self, *a, **k):
        seen.setdefault(self, [0, 0, 0])[0] += 1
        return real_pass(self, *a, **k)

    def count_fuse(self, state, *a, **k):
        seen.setdefault(self, [0, 0, 0])[1 if state.requires_grad else 2] += 1
        return real_fuse(self, state, *a, **k)

    monkeypatch.setattr(FullBandwidthForCausalLM, "_backbone_pass", count_pass)
    monkeypatch.setattr(FullBandwidthForCausalLM, "fuse", count_fuse)
    t0 = time.perf_counter()
    res = benchmark_train(SimpleNamespace(preset="micro", batch_size=2, seq_len=16, vocab_size=300, steps=3,
                                          warmup=1, device="cpu", precision="fp32"))
    wall = time.perf_counter() - t0
    # 4 steps a case: K=1 (4 passes, nothing fused), K=2 (8 passes, 4 fusions with a gradient through the state),
    # K=2 stop-gradient (8 passes, 4 fusions of a state without one)
    assert sorted(seen.values()) == [[4, 0, 0], [8, 0, 4], [8, 4, 0]]
    torch.manual_seed(0)  # the benchmark's own init of every case
    fresh = FullBandwidthForCausalLM.from_backbone(AutoModelForCausalLM.from_config(backbone_config(
        "micro", 300, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=2048)),
        doc_start_token_id=1).state_dict()
    for model in seen:  # every case's optimizer stepped: its weights left the init
        moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), fresh[n])]
        assert "backbone.model.embed_tokens.weight" in moved and "backbone.lm_head.weight" in moved
    steps = [t for r in res["results"].values() for t in r["step_s_all"]]
    assert len(steps) == 9 and sum(steps) < wall
    assert res["results"]["K2"]["tokens_per_s"] == pytest.approx(2 * 16 / res["results"]["K2"]["step_s"])
    text = format_benchmark(res)
    assert f"K=2 / K=1 = {res['ratio_K2_K1']:.2f}" in text and "| K2_detach |" in text


def test_quickstart_smoke(tmp_path, capsys):
    out = tmp_path / "qs"
    rc = cli.main(["quickstart", "--out", str(out), "--preset", "micro", "--steps", "4", "--batch-size", "2",
                   "--seq-len", "32", "--vocab-size", "300", "--eval-rows", "2", "--samples", "1",
                   "--sample-tokens", "4", "--prompt-tokens", "4", "--no-progress", "--quiet", "--state-steps", "2",
                   "--state-test-rows", "3"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| baseline | standard |" in printed and "exact" in printed
    res = json.loads((out / "results.json").read_text())
    for key in ("baseline_val_loss", "fbt_val_loss", "fbt_standard_val_loss", "fbt_passes_val_loss", "fbt_exact_val_loss"):
        assert isinstance(res[key], float)
    assert res["fbt_val_loss"] == res["fbt_exact_val_loss"] and res["eval_tokens"] == 2 * 31
    # three whole-row FBT lines (standard, K passes, exact) and one per decode mode after a prompt
    assert (out / "report.md").read_text().count("| FBT |") == 3 + 4 and (out / "curves.png").is_file()
    assert [e["mode"] for e in res["decode_table"]] == ["standard", "standard", "soft", "fused", "exact"]
    for table in (res["table"], res["decode_table"]):  # both gaps, paired over the same rows
        assert all("delta" in e and "delta_flops" in e for e in table[1:])
    assert res["baseline_flops_steps"] >= 4 and set(res["targets"]) >= {"no_mode_collapses", "exact_minus_passes"}
    from transformers import AutoModelForCausalLM

    assert res["fbt_minus_baseline"]["exact"]["estimate"] == pytest.approx(res["fbt_val_loss"] - res["baseline_val_loss"])
    # the table's figures are fullband.eval.scoring's, on the same rows
    from fullband.data.corpus import load_tokenizer
    from fullband.eval.scoring import evaluate_loss, evaluation_rows
    from fullband.training.pretrain import spread_rows

    fbt_model = fullband.model.modeling.load_model(str(out / "fbt"))
    val_rows, _ = evaluation_rows(load_tokenizer(str(out / "fbt")), None, "val", seq_len=32)
    rows = spread_rows(val_rows, 2)
    for mode in ("standard", "passes", "exact"):
        assert evaluate_loss(fbt_model, rows, mode)["loss"] == pytest.approx(res[f"fbt_{mode}_val_loss"], abs=1e-6)
    for name in ("baseline", "fbt"):
        assert (out / name / "tokenizer.json").is_file()
    assert isinstance(AutoModelForCausalLM.from_pretrained(out / "fbt"), fullband.FullBandwidthForCausalLM)
    # the baseline never trained its fusion: it is saved as the plain HF checkpoint of its backbone
    baseline = AutoModelForCausalLM.from_pretrained(out / "baseline")
    assert not isinstance(baseline, fullband.FullBandwidthForCausalLM) and baseline.config.model_type == "llama"
    assert not any(k.startswith("feedback.") for k in baseline.state_dict())
    # same tokens for both runs; the baseline never ran more than one pass
    base, fbt = train_rows(out / "baseline"), train_rows(out / "fbt")
    assert [r["tokens"] for r in base] == [r["tokens"] for r in fbt]
    assert all(r["num_passes"] == 1 for r in base) and fbt[-1]["num_passes"] > 1
    # the running-state part: the state experiment's own runs and results (seed 0, the quickstart's), its compact
    # table printed and in the report; FBT trained with exact states + 2 gradient passes on every step, its
    # training FLOPs printed beside what K = T + 1 = 11 passes would cost (counted here from the model's shape)
    part = json.loads((out / "state" / "results.json").read_text())
    assert part["arms"] == ["baseline-L", "baseline-2L", "fbt-L-glu-x2"] and part["seeds"] == [0]
    assert part["settings"]["tasks"] == "s3,parity" and part["settings"]["steps"] == 2
    fbt_rows = train_rows(out / "state" / "seed0" / "runs" / "fbt-L-glu-x2")
    assert all(r["exact_states"] and r["passes_run"] == 2 == r["grad_passes_run"] for r in fbt_rows), fbt_rows
    x2 = fullband.model.modeling.load_model(str(out / "state" / "seed0" / "runs" / "fbt-L-glu-x2"))
    n_matmul = sum(m.weight.numel() for m in x2.backbone.modules() if isinstance(m, torch.nn.Linear))
    n_norm = sum(m.weight.numel() for n, m in x2.backbone.named_modules() if n.endswith("norm"))
    n_fusion = sum(p.numel() for p in x2.feedback.parameters())
    L, d = x2.backbone.config.num_hidden_layers, x2.backbone.config.hidden_size
    rows, T = 2 * 32, 12  # 2 steps x 32 rows of 12 tokens
    k_exact = rows * T * 11 * (6 * (n_matmul + n_norm) + 6 * L * T * d) + rows * T * 10 * 6 * n_fusion
    assert part["runs"]["fbt-L-glu-x2"]["train_flops_k_exact"] == pytest.approx(k_exact, rel=1e-9)
    plain = part["runs"]["baseline-L"]["train_flops"]
    table = res["running_state"]["table"]
    assert (f"fbt-L-glu-x2 {part['runs']['fbt-L-glu-x2']['train_flops'] / plain:.2f}x (K = 11 passes on the same "
            f"steps: {k_exact / plain:.2f}x)") in table
    assert table in printed and table in (out / "report.md").read_text()
    for r in part["table"]:
        if r["mode"] == "exact" or (r["mode"] == "standard" and r["arm"] != "fbt-L-glu-x2"):
            cell = f"{r['pos']['estimate']:.2f} [{r['pos']['low']:.2f}, {r['pos']['high']:.2f}] / {r['last']['estimate']:.2f}"
            line = next(x for x in table.splitlines() if x.startswith(f"| {r['task']} | {r['arm']} ({r['mode']}) |"))
            assert line.split(" | ")[2 + [10, 20, 40].index(r["length"])].strip(" |") == cell
    # the state replaced, the token kept (a zeroed state would zero the GLU entry's whole input): both interventions
    for label in ("mean state, token kept", "another row's state, token kept"):
        lines = [x for x in table.splitlines() if label in x]
        assert [x.split(" | ")[0] for x in lines] == ["| s3", "| parity"], label
    assert "state zeroed" not in table


# ----------------------------------------------------------------------------------------------- io


def test_atomic_writes_and_torn_jsonl(tmp_path):
    from fullband.utils.io import append_jsonl, atomic_directory, atomic_write_json

    atomic_write_json(str(tmp_path / "a.json"), {"x": 1})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]  # no temp files left
    d = tmp_path / "dir"
    with atomic_directory(str(d)) as tmp:
        open(os.path.join(tmp, "f"), "w").write("old")
    with pytest.raises(RuntimeError):
        with atomic_directory(str(d)) as tmp:
            open(os.path.join(tmp, "f"), "w").write("new")
            raise RuntimeError("killed half-way")
    assert (d / "f").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "dir"]
    log = str(tmp_path / "m.jsonl")
    append_jsonl(log, {"step": 1})
    with open(log, "a") as f:
        f.write('{"step": 2, "lo')  # a writer killed mid-line
    assert read_jsonl(log) == [{"step": 1}]
