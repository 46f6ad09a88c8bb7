"""``fullband analyze``: each measure on tiny models whose answer is known by construction."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import BOS, random_ids, tiny_backbone, tiny_model

import fullband
from fullband import analysis as A
from fullband.eval.scoring import evaluate_loss
from fullband.model.feedback import build_feedback_mask

SMALL_VOCAB = 24  # token ids 3..23 are "text"; with hidden 32 > 24 the embedding rows are linearly independent


def identity_layers(backbone):
    """Zero every layer's output projections, so each layer copies its input residual stream unchanged."""
    with torch.no_grad():
        for name, p in backbone.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
    return backbone


def fbt(backbone, seed=1, fusion="glu", **kw):
    """The paper's GLU entry: these tests construct states and gates with known answers through it."""
    torch.manual_seed(seed)
    return fullband.FullBandwidthForCausalLM.from_backbone(backbone, fusion=fusion, **kw).eval()


def docs_for(ids, n_docs=2):
    """Rows 0..N/2-1 in document 0, the rest in document 1."""
    doc_ids = torch.zeros_like(ids)
    doc_ids[ids.shape[0] // n_docs:] = 1
    return doc_ids


# ----------------------------------------------------------------------------------------------- runs


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_recurrence_and_passes_reproduce_the_model(fam):
    model = tiny_model(fam)
    ids = random_ids(3, 10, seed=3)
    ids[1, 4] = BOS  # a document start inside a row
    ref = model.recurrent_forward(ids)
    rec = A.recurrence(model, ids, state_hook=lambda t, prev: prev)
    assert torch.equal(rec.last_hidden, ref.last_hidden_state.float())
    ref_nll = F.cross_entropy(ref.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    torch.testing.assert_close(rec.nll.flatten(), ref_nll)
    for k in (1, 2, 3):
        logits = model(ids, num_passes=k).logits
        want = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
        torch.testing.assert_close(A.passes_forward(model, ids, k).flatten(), want)


def test_load_bearing_real_matches_evaluate_loss():
    model = tiny_model("llama")
    ids = random_ids(4, 12, seed=5)
    lb = A.load_bearing(model, ids, docs_for(ids), num_passes=2, batch_size=3)
    assert lb["recurrence"]["real"] == pytest.approx(evaluate_loss(model, ids, "exact")["loss"], abs=1e-5)
    assert lb["passes"]["real"] == pytest.approx(evaluate_loss(model, ids, "passes", num_passes=2)["loss"], abs=1e-5)
    assert lb["recurrence"]["plain"] == pytest.approx(evaluate_loss(model.backbone, ids)["loss"], abs=1e-5)
    assert set(lb["recurrence"]) == set(A.INTERVENTIONS)
    assert lb["other_doc_coverage"] == 1.0


# ----------------------------------------------------------------------------------------------- 1. load-bearing


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_zero_value_path_makes_every_intervention_harmless(fam):
    """W_U = 0: the fused input is norm(0 * gate) = 0 whatever the state, so no intervention changes anything."""
    model = tiny_model(fam)
    with torch.no_grad():
        model.feedback.value_proj.weight.zero_()
    ids = random_ids(4, 10, seed=1)
    lb = A.load_bearing(model, ids, docs_for(ids), num_passes=3, batch_size=4)
    for name in ("zero", "shuffle", "other_doc"):
        assert lb["recurrence_damage"][name] == pytest.approx(0.0, abs=1e-6)
        assert lb["passes_damage"][name] == pytest.approx(0.0, abs=1e-6)
    # the fused input (zeros) is not the plain embedding, so switching feedback off does change the loss
    assert abs(lb["recurrence_damage"]["plain"]) > 1e-4


def test_zeroed_state_feeds_zero_inputs():
    """GLU of a zero state is exactly 0: the zeroed recurrence = the backbone fed zeros at fused positions."""
    model = tiny_model("llama")
    ids = random_ids(3, 9, seed=2)
    lb = A.load_bearing(model, ids, docs_for(ids, 3), num_passes=0)
    mask = build_feedback_mask(ids, None, model.doc_start_token_id)
    embeds = model.get_input_embeddings()(ids).masked_fill(mask.unsqueeze(-1), 0.0)
    with torch.no_grad():
        logits = model.backbone(inputs_embeds=embeds).logits
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert lb["recurrence"]["zero"] == pytest.approx(float(want), abs=1e-5)
    assert "passes" not in lb


def test_zeroed_state_of_a_copying_model_is_uniform():
    """Identity layers: a zeroed state gives input 0, final norm 0, logits 0 (no head bias) → loss log V exactly
    at fused positions, while the real state gives something else."""
    model = fbt(identity_layers(tiny_backbone("llama")))
    ids = random_ids(2, 8, seed=4)
    mask = build_feedback_mask(ids, None, model.doc_start_token_id)
    nll = A.recurrence(model, ids, state_hook=lambda t, prev: torch.zeros_like(prev)).nll
    fused_pred = mask[:, :-1]  # position t predicts t+1 from the input at t
    torch.testing.assert_close(nll[fused_pred], torch.full_like(nll[fused_pred], math.log(model.config.text_config.vocab_size)))
    real = A.recurrence(model, ids).nll
    torch.testing.assert_close(nll[~fused_pred], real[~fused_pred])
    assert (nll[fused_pred] - real[fused_pred]).abs().max() > 1e-3


def test_shuffle_and_other_doc_maps():
    ids = random_ids(6, 12, seed=0)
    ids[2, 5] = BOS
    mask = build_feedback_mask(ids, None, BOS)
    src = A.shuffle_index(mask, torch.Generator().manual_seed(0))
    t = torch.arange(12).expand(6, 12)
    assert torch.equal(src[~mask], t[~mask])  # unfused positions untouched
    assert (src[mask] != t[mask]).all()  # a derangement of the fused positions
    assert mask.gather(1, src)[mask].all()  # the source is a fused position of the same row
    for b in range(6):
        assert sorted(src[b][mask[b]].tolist()) == sorted(t[b][mask[b]].tolist())  # a permutation
    doc_ids = torch.tensor([0, 0, 1, 1, 2, 2]).unsqueeze(1).expand(6, 12).clone()
    src_b, covered = A.other_doc_index(doc_ids, mask)
    assert torch.equal(covered, mask)
    rows = torch.arange(12)
    assert (doc_ids[src_b, rows][mask] != doc_ids[mask]).all()
    assert mask[src_b, rows][mask].all()
    _, covered = A.other_doc_index(torch.zeros_like(doc_ids), mask)
    assert not covered.any()
    states = torch.randn(6, 12, 4)
    moved = A.substitute_states(states, src_b=src_b, src_t=src)
    assert torch.equal(moved[1, 3], states[src_b[1, 3], src[1, 3]])


def test_single_document_has_no_other_doc_condition():
    model = tiny_model("llama")
    ids = random_ids(2, 8)
    lb = A.load_bearing(model, ids, torch.zeros_like(ids), num_passes=2)
    assert "other_doc" not in lb["recurrence"] and "other_doc" not in lb["passes"]
    assert lb["other_doc_coverage"] == 0.0


# ----------------------------------------------------------------------------------------------- 2. probes


def test_ridge_probe_known_answers():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 7, (600,), generator=g)
    x = F.one_hot(labels, 7).double() + 0.01 * torch.randn(600, 7, generator=g, dtype=torch.float64)
    x = torch.cat([x, torch.randn(600, 5, generator=g, dtype=torch.float64)], 1)  # plus distractors
    r = A.ridge_probe(x[:400], labels[:400], x[400:], labels[400:])
    assert r["score"] == 1.0 and r["n_fit"] == 400 and r["n_test"] == 200
    noise = torch.randn(600, 12, generator=g)
    r = A.ridge_probe(noise[:400], labels[:400], noise[400:], labels[400:])
    assert r["score"] < 0.3 and 0.0 < r["chance"] < 0.3
    w = torch.randn(12, 5, generator=g)
    y = noise @ w + 3.0
    assert A.ridge_probe(noise[:400], y[:400], noise[400:], y[400:], kind="regression")["score"] > 0.999
    y = torch.randn(600, 5, generator=g)
    assert A.ridge_probe(noise[:400], y[:400], noise[400:], y[400:], kind="regression")["score"] < 0.05


def _successor_rows(n, T, seed):
    """Rows of text ids 3..23 where each token determines the next: t+1 = 3 + (t - 3 + 5) mod 21."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(3, SMALL_VOCAB, (n, 1), generator=g)
    steps = torch.arange(T).unsqueeze(0)
    return 3 + (start - 3 + 5 * steps) % (SMALL_VOCAB - 3)


def _collect(model, ids, samples=10_000):
    doc_ids = torch.zeros_like(ids)
    doc_ids[ids.shape[0] // 2:] = 1
    sel = A.probe_selection(ids, doc_ids, samples)
    return A.collect(model, ids, doc_ids, sel, batch_size=16)


def test_probe_on_copying_layers_recovers_the_input():
    """Identity layers copy the embedding e_t into every residual stream: with a deterministic successor the next
    token and the one after are exact linear functions of every layer (accuracy 1); on random text they are not
    (about chance), and neither is the previous state (R² about 0)."""
    backbone = identity_layers(tiny_backbone("llama", vocab_size=SMALL_VOCAB))
    ids = _successor_rows(16, 24, seed=0)
    p = A.layer_probes(_collect(backbone, ids), 16, 24)
    assert p["layers"] == [0, 1, 2]
    assert p["next_token"] == [1.0, 1.0, 1.0] and p["two_ahead"] == [1.0, 1.0, 1.0]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, SMALL_VOCAB, (16, 24), generator=g)
    p = A.layer_probes(_collect(backbone, ids), 16, 24)
    assert max(p["next_token"] + p["two_ahead"]) < 0.2
    assert max(p["prev_state"]) < 0.1


def test_fed_back_state_is_linearly_recoverable_from_a_copying_fbt():
    """Identity layers, a constant gate (W_G = 0) and an orthogonal W_U: every residual stream of the FBT at a
    fused position is c · W_U h_{t-1}, so the previous top-layer state has R² ≈ 1 at every layer; the same
    backbone without feedback carries nothing of it on random text."""
    backbone = identity_layers(tiny_backbone("llama", vocab_size=SMALL_VOCAB))
    model = fbt(backbone)
    with torch.no_grad():
        model.feedback.gate_proj.weight.zero_()
        torch.nn.init.orthogonal_(model.feedback.value_proj.weight)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, SMALL_VOCAB, (16, 24), generator=g)  # no BOS: position 0 differs per row
    p = A.layer_probes(_collect(model, ids), 16, 24)
    assert min(p["prev_state"]) > 0.99
    p_base = A.layer_probes(_collect(model.backbone, ids), 16, 24)
    assert max(p_base["prev_state"]) < 0.1


# ----------------------------------------------------------------------------------------------- 3. logit lens


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_logit_lens_top_layer_is_the_model(fam):
    model = tiny_model(fam)
    ids = random_ids(4, 10, seed=6)
    for m in (model, model.backbone):
        c = _collect(m, ids)
        lens = A.logit_lens(c)
        assert len(lens["loss"]) == m.config.get_text_config().num_hidden_layers + 1
        assert lens["loss"][-1] == pytest.approx(float(c.nll.mean()), abs=1e-5)
        assert lens["accuracy"][-1] == pytest.approx(float(c.correct.float().mean()), abs=1e-6)


def test_logit_lens_of_copying_layers_is_flat():
    backbone = identity_layers(tiny_backbone("llama"))
    lens = A.logit_lens(_collect(backbone, random_ids(4, 10)))
    assert max(lens["loss"]) - min(lens["loss"]) < 1e-5


def test_final_norm_resolver():
    llama = tiny_backbone("llama")
    assert A.final_norm(llama) is llama.model.norm
    gpt2 = tiny_backbone("gpt2")
    assert A.final_norm(gpt2) is gpt2.transformer.ln_f
    with pytest.raises(ValueError, match="final norm"):
        A.final_norm(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------------------------- 4. gates


def test_gate_statistics_known_answers():
    """W_G = 0 → every gate is σ(0) = 0.5; embeddings of RMS r and an output norm gain c → ||u_t||/||e_t|| = c/r."""
    model = tiny_model("llama")
    r, c = 0.5, 2.0
    with torch.no_grad():
        model.feedback.gate_proj.weight.zero_()
        model.feedback.out_norm.weight.fill_(c)
        w = model.get_input_embeddings().weight
        w.copy_(w / w.pow(2).mean(-1, keepdim=True).sqrt() * r)
    ids = random_ids(4, 12, seed=7)
    col = _collect(model, ids)
    g = A.gate_statistics(model, ids, col.norm_ratio)
    assert g["gate_mean"] == pytest.approx(0.5, abs=1e-7) and g["gate_std"] == pytest.approx(0.0, abs=1e-6)
    assert g["token_mean_gate_spread"] == pytest.approx(0.0, abs=1e-7)
    hist = g["gate_histogram"]
    assert sum(hist["weights"]) == pytest.approx(1.0)
    peak = max(range(len(hist["weights"])), key=hist["weights"].__getitem__)
    assert hist["edges"][peak] <= 0.5 <= hist["edges"][peak + 1] and hist["weights"][peak] == pytest.approx(1.0)
    assert g["norm_ratio"]["n"] == int(build_feedback_mask(ids, None, BOS).sum())
    assert g["norm_ratio"]["mean"] == pytest.approx(c / r, rel=1e-3)
    assert g["norm_ratio"]["p05"] == pytest.approx(c / r, rel=1e-3)


def test_gate_statistics_non_glu_fusion():
    model = tiny_model("llama", fusion="add")
    ids = random_ids(2, 8)
    g = A.gate_statistics(model, ids, _collect(model, ids).norm_ratio)
    assert g["gate_histogram"] is None and "no token gate" in g["note"]
    assert g["norm_ratio"]["mean"] > 0


# ----------------------------------------------------------------------------------------------- CLI


def _saved_pair(tmp_path):
    from conftest import tiny_backbone_config
    from transformers import AutoModelForCausalLM

    from fullband.data.corpus import train_tokenizer

    texts = ["To be, or not to be, that is the question. " * 8, "All the world's a stage. " * 10,
             "Now is the winter of our discontent. " * 9]
    tok = train_tokenizer(texts, vocab_size=300)
    torch.manual_seed(0)
    cfg = tiny_backbone_config("llama", vocab_size=len(tok))
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    backbone = AutoModelForCausalLM.from_config(cfg)
    base_dir, fbt_dir = tmp_path / "base", tmp_path / "fbt"
    backbone.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    model = fullband.FullBandwidthForCausalLM.from_backbone(backbone, fusion="glu")
    model.save_pretrained(fbt_dir)
    tok.save_pretrained(fbt_dir)
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"name": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return str(fbt_dir), str(base_dir), str(data)


def test_cli_writes_the_report(tmp_path, capsys):
    from fullband.cli import main

    fbt_dir, base_dir, data = _saved_pair(tmp_path)
    out = tmp_path / "report"
    rc = main(["analyze", "--model", fbt_dir, "--baseline", base_dir, "--data", data, "--seq-len", "16",
               "--max-tokens", "192", "--probe-samples", "200", "--out", str(out)])
    assert rc == 0
    assert "damage" in capsys.readouterr().out
    for name in ("report.md", "analysis.json", "load_bearing.png", "probes.png", "logit_lens.png", "gates.png"):
        assert (out / name).is_file(), name
    res = json.loads((out / "analysis.json").read_text())
    assert res["data"]["rows"] == 12 and res["data"]["seq_len"] == 16
    assert res["baseline_kind"] == "plain" and res["baseline_same_tokens"]
    assert set(res["probes"]) == {"fbt", "baseline"} and len(res["probes"]["fbt"]["next_token"]) == 3
    assert res["load_bearing"]["recurrence"]["plain"] == pytest.approx(res["baseline_loss"], abs=1e-5)
    report = (out / "report.md").read_text()
    assert "## 1. Load-bearing test" in report and "![probes](probes.png)" in report
    assert not [f for f in os.listdir(out) if f.startswith(".")]  # no temp files left
    assert (out / "report.md").stat().st_mode & 0o044  # readable by others, not a private temp file

    # a plain LM as --model is a one-line user error
    assert main(["analyze", "--model", base_dir, "--data", data, "--out", str(out)]) == 2
    assert "no latent feedback" in capsys.readouterr().err
    assert main(["analyze", "--model", str(tmp_path / "missing"), "--out", str(out)]) == 2


def test_report_files_are_atomic_and_readable(tmp_path):
    from fullband.utils.io import atomic_write_bytes

    path = tmp_path / "sub" / "x.json"
    atomic_write_bytes(str(path), b"one")
    atomic_write_bytes(str(path), b"two")
    assert path.read_bytes() == b"two" and os.listdir(path.parent) == ["x.json"]
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777  # not mkstemp's 0600
