"""``fullband eval``: held-out loss / perplexity per mode, the evaluation text, the report and the command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TEXTS, random_ids, tiny_backbone, tiny_model
from torch import nn

from fullband.cli import main as cli_main
from fullband.data.corpus import embedded_corpus, load_documents, split_documents
from fullband.eval.scoring import (
    evaluate_loss,
    evaluate_model,
    evaluation_rows,
    load_any_model,
    report_markdown,
    split_settings,
    token_nll,
)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "held_out.jsonl"
    path.write_text("".join(json.dumps({"name": f"d{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    return str(path)


# ----------------------------------------------------------------------------- metrics with known answers


class FixedDistribution(nn.Module):
    """A 'language model' that always predicts the same next-token distribution ``probs``."""

    def __init__(self, probs):
        super().__init__()
        self.register_buffer("logp", torch.tensor(probs).log())
        self.anchor = nn.Parameter(torch.zeros(()))  # evaluate_loss reads the device off a parameter

    def forward(self, input_ids):
        B, T = input_ids.shape
        return type("Out", (), {"logits": self.logp.expand(B, T, -1).clone()})()


def test_hand_computed_perplexity():
    model = FixedDistribution([0.1, 0.2, 0.3, 0.4])
    rows = torch.tensor([[0, 1, 2, 3]])  # predicted tokens 1, 2, 3 with p = 0.2, 0.3, 0.4
    res = evaluate_loss(model, rows)
    assert res["tokens"] == 3
    assert res["loss"] == pytest.approx(-(math.log(0.2) + math.log(0.3) + math.log(0.4)) / 3, rel=1e-6)
    # perplexity = (0.2 * 0.3 * 0.4) ** (-1/3) = 0.024 ** (-1/3) = 3.4668...
    assert res["perplexity"] == pytest.approx(0.024 ** (-1 / 3), rel=1e-6)
    assert res["perplexity"] == pytest.approx(3.4668, abs=1e-4)
    # two rows: the mean is over all predicted tokens
    res2 = evaluate_loss(model, torch.tensor([[0, 3, 3], [0, 0, 0]]), batch_size=1)
    assert res2["tokens"] == 4
    assert res2["perplexity"] == pytest.approx((0.4 * 0.4 * 0.1 * 0.1) ** (-1 / 4), rel=1e-6)


def test_uniform_model_has_perplexity_vocab_in_every_mode():
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()  # every logit 0: uniform over the vocabulary
    V = model.get_output_embeddings().out_features
    rows = torch.randint(3, V, (3, 9), generator=torch.Generator().manual_seed(0))
    report = evaluate_model(model, rows, passes=(2, 3), batch_size=2)
    assert [(r["mode"], r["num_passes"]) for r in report["results"]] == [
        ("standard", 1), ("passes", 2), ("passes", 3), ("exact", None)]
    for r in report["results"]:
        assert r["loss"] == pytest.approx(math.log(V), rel=1e-6)
        assert r["perplexity"] == pytest.approx(V, rel=1e-5)
        assert r["tokens"] == 3 * 8


def test_modes_agree_with_the_model():
    model = tiny_model("llama")
    ids = random_ids(2, 10, seed=4)
    report = evaluate_model(model, ids, passes=(2,), batch_size=1)
    by_mode = {r["mode"]: r for r in report["results"]}

    def nll(logits):
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()

    with torch.no_grad():
        assert by_mode["standard"]["loss"] == pytest.approx(nll(model(ids).logits), rel=1e-5)
        assert by_mode["passes"]["loss"] == pytest.approx(nll(model(ids, num_passes=2).logits), rel=1e-5)
    assert by_mode["exact"]["loss"] == pytest.approx(nll(model.recurrent_forward(ids).logits), rel=1e-5)
    assert by_mode["exact"]["loss"] != by_mode["standard"]["loss"]


def test_plain_model_gets_standard_only_with_a_note():
    report = evaluate_model(tiny_backbone("llama"), random_ids(1, 6), passes=(2, 3))
    assert [r["mode"] for r in report["results"]] == ["standard"]
    assert report["feedback"] is False
    assert "only the standard mode" in report["notes"][0]
    assert "Note:" in report_markdown({**report, "model": "m"})


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_passes|passes"):
        evaluate_model(tiny_model("llama"), random_ids(1, 6), passes=(0,))
    with pytest.raises(ValueError, match="max_rows"):
        evaluate_model(tiny_model("llama"), random_ids(1, 6), max_rows=0)


# ----------------------------------------------------------------------------- evaluation text


def test_default_rows_are_the_training_validation_split(model_dir):
    tok = load_any_model(model_dir, device="cpu")[1]
    rows, info = evaluation_rows(tok, seq_len=64)
    _, val = split_documents(embedded_corpus(), 0.1, 0)
    assert info["documents"] == [d.name for d in val]
    assert info["split"] == "val" and rows.shape[1] == 64 and rows.shape[0] > 10
    other, info2 = evaluation_rows(tok, seq_len=64, seed=1)
    assert info2["documents"] != info["documents"]


def test_rows_from_a_file(model_dir, text_file):
    tok = load_any_model(model_dir, device="cpu")[1]
    rows, info = evaluation_rows(tok, text_file, split="all", seq_len=16)
    assert info["documents"] == ["d0", "d1", "d2"]
    assert int(rows[0, 0]) == tok.bos_token_id
    with pytest.raises(ValueError, match="empty"):
        evaluation_rows(tok, text_file, split="val", val_fraction=0.0)
    with pytest.raises(ValueError, match="split"):
        evaluation_rows(tok, text_file, split="test")


# ----------------------------------------------------------------------------- command


def test_eval_command_writes_json_and_markdown(model_dir, text_file, tmp_path, capsys):
    out = tmp_path / "report"
    code = cli_main(["eval", "--model", model_dir, "--data", text_file, "--split", "all", "--seq-len", "24",
                     "--max-rows", "3", "--device", "cpu", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "eval.json").read_text())
    assert [(r["mode"], r["num_passes"]) for r in report["results"]] == [
        ("standard", 1), ("passes", 2), ("passes", 3), ("passes", 4), ("exact", None)]
    for r in report["results"]:
        assert r["tokens"] == 3 * 23
        assert r["perplexity"] == pytest.approx(math.exp(r["loss"]))
        assert r["bits_per_byte"] > 0
    md = (out / "eval.md").read_text()
    assert "| exact recurrence |" in md and "| passes (K=3) |" in md
    assert "exact recurrence" in capsys.readouterr().out
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_split_settings_follow_the_training_run(model_dir, text_file, tmp_path):
    assert split_settings(model_dir) == ({"data": None, "seed": 0, "val_fraction": 0.1, "seq_len": 256}, None)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (run_dir / f).write_bytes((Path(model_dir) / f).read_bytes())
    (run_dir / "run_config.json").write_text(json.dumps({"data": text_file, "seed": 5, "val_fraction": 0.34,
                                                         "seq_len": 12, "steps": 3}))
    settings, source = split_settings(str(run_dir), seq_len=20)
    assert settings == {"data": text_file, "seed": 5, "val_fraction": 0.34, "seq_len": 20}
    assert source.endswith("run_config.json")
    out = tmp_path / "e.json"
    assert cli_main(["eval", "--model", str(run_dir), "--device", "cpu", "--no-exact", "--passes", "2",
                     "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    docs = [d.name for d in split_documents(load_documents(text_file), 0.34, 5)[1]]
    assert report["data"]["documents"] == docs and report["seq_len"] == 12
    assert report["data"]["settings_from"].endswith("run_config.json")


def test_eval_command_plain_model_and_json_path(plain_dir, text_file, tmp_path):
    out = tmp_path / "plain.json"
    assert cli_main(["eval", "--model", plain_dir, "--data", text_file, "--split", "all", "--seq-len", "24",
                     "--device", "cpu", "--passes", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["results"]] == ["standard"]
    assert report["notes"] and (tmp_path / "plain.md").exists()


def test_eval_command_errors(tmp_path, model_dir, capsys):
    assert cli_main(["eval", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["eval", "--model", model_dir, "--passes", "2,x", "--max-rows", "1"]) == 2
    assert "--passes" in capsys.readouterr().err


@pytest.mark.parametrize("fusion", ["glu", "residual"])
def test_soft_and_fused_score_a_whole_row_as_exact_does(fusion):
    """On a whole row (the first token as the prompt), ``soft`` and ``fused`` fuse every later token with the state
    before it: the token-by-token recurrence, so their scores equal ``exact``'s (why the data-efficiency experiment's
    ``exact`` column stands for all three); ``standard`` differs on a GLU model (the state is its input's value path)."""
    model = tiny_model(fusion=fusion).eval()
    ids = random_ids(3, 24)
    exact = token_nll(model, ids, "exact")
    for mode in ("soft", "fused"):
        torch.testing.assert_close(token_nll(model, ids, mode, prompt_length=1), exact, rtol=0, atol=1e-5)
    if fusion == "glu":
        assert (token_nll(model, ids, "standard") - exact).abs().max() > 0.05
