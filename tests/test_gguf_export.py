"""``fullband export gguf`` (:mod:`fullband.serving.gguf_export`): what the GGUF holds, read back with the ``gguf``
package's reader and compared with the saved model's own weights; the fusion sidecar; the refusals. Decoding the
export through llama.cpp is tests/test_llamacpp.py."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import fullband
from conftest import save_model_dir, tiny_backbone_config
from fullband import cli
from fullband.model.modeling import load_model
from fullband.serving.gguf_export import export_gguf

gguf = pytest.importorskip("gguf", reason="the gguf package (fullband[llamacpp] / [test]) is not installed")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("m"), fusion="residual")


def read(path):
    reader = gguf.GGUFReader(os.path.join(path, "model.gguf"))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    return fields, tensors


def values(t):
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)


def test_f32_export_holds_the_backbone_its_hyperparameters_vocabulary_and_fusion(saved, tmp_path):
    out = str(tmp_path / "g")
    manifest = export_gguf(saved, out, "f32")
    fields, tensors = read(out)
    model = load_model(saved)
    cfg = model.config.text_config
    assert fields["general.architecture"] == "llama" and fields["general.uuid"] == manifest["uuid"]
    assert (fields["llama.block_count"], fields["llama.embedding_length"], fields["llama.feed_forward_length"]) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size)
    assert (fields["llama.attention.head_count"], fields["llama.attention.head_count_kv"]) == (4, 2)
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.rms_norm_eps)
    assert fields["llama.context_length"] == cfg.max_position_embeddings
    assert fields["fullband.feedback"] is True and fields["fullband.fusion"] == "residual"
    assert fields["fullband.doc_start_token_id"] == model.doc_start_token_id
    # tensors: every weight of the backbone once, with its values (q/k rows only reordered: same multiset per row)
    sd = model.backbone.state_dict()
    assert len(tensors) == len(sd)
    np.testing.assert_array_equal(values(tensors["token_embd.weight"]), sd["model.embed_tokens.weight"].numpy())
    np.testing.assert_array_equal(values(tensors["output.weight"]), sd["lm_head.weight"].numpy())
    np.testing.assert_array_equal(values(tensors["blk.1.ffn_down.weight"]), sd["model.layers.1.mlp.down_proj.weight"].numpy())
    q, ref = values(tensors["blk.0.attn_q.weight"]), sd["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(q, ref) and np.array_equal(np.sort(q, axis=None), np.sort(ref, axis=None))
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    # vocabulary: the tokenizer's tokens in id order, as llama.cpp's gpt2 model
    tok = AutoTokenizer.from_pretrained(saved)
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.tokens"] == tok.convert_ids_to_tokens(list(range(len(tok))))
    assert fields["tokenizer.ggml.bos_token_id"] == tok.bos_token_id
    # the sidecar: the model's fusion weights, tied to this GGUF by its uuid
    with safe_open(os.path.join(out, "fusion.safetensors"), framework="pt") as f:
        meta = f.metadata()
        assert meta["gguf_uuid"] == manifest["uuid"] and meta["fusion"] == "residual"
        for name, w in model.feedback.state_dict().items():
            torch.testing.assert_close(f.get_tensor(name), w, rtol=0, atol=0)
    assert sorted(os.listdir(out)) == sorted(["model.gguf", "fusion.safetensors", "fullband-gguf.json",
                                              *manifest["tokenizer_files"]])


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_f16_and_q8_0_quantize_matrices_and_keep_norms_f32(saved, tmp_path, kind):
    out = str(tmp_path / kind)
    export_gguf(saved, out, kind)
    fields, tensors = read(out)
    want = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.0.ffn_up.weight"].tensor_type == want
    sd = load_model(saved).backbone.state_dict()
    ref = sd["model.layers.0.mlp.up_proj.weight"].numpy()
    err = np.abs(values(tensors["blk.0.ffn_up.weight"]) - ref).max() / np.abs(ref).max()
    assert err < {"f16": 1e-3, "q8_0": 1e-2}[kind]  # f16: 2^-11 relative; q8_0: a 127-step scale per 32 values
    assert fields["general.file_type"] == {"f16": gguf.LlamaFileType.MOSTLY_F16,
                                           "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind]


def test_qwen2_keeps_its_attention_biases_and_rows(tmp_path):
    torch.manual_seed(0)
    backbone = AutoModelForCausalLM.from_config(tiny_backbone_config("qwen2"))
    fullband.FullBandwidthForCausalLM.from_backbone(backbone).save_pretrained(tmp_path / "m")
    export_gguf(str(tmp_path / "m"), str(tmp_path / "g"))
    fields, tensors = read(tmp_path / "g")
    assert fields["general.architecture"] == "qwen2" and fields["tokenizer.ggml.model"] == "none"
    assert fields["qwen2.vocab_size"] == 97  # no tokenizer saved: llama.cpp's 'none' vocabulary of this size
    sd = backbone.state_dict()
    np.testing.assert_array_equal(values(tensors["blk.0.attn_q.bias"]), sd["model.layers.0.self_attn.q_proj.bias"])
    # Qwen2's rotary convention is llama.cpp's NEOX one: the rows are written as they are
    np.testing.assert_array_equal(values(tensors["blk.0.attn_q.weight"]), sd["model.layers.0.self_attn.q_proj.weight"])


def _saved(tmp_path, family, **config):
    cfg = tiny_backbone_config(family)
    for k, v in config.items():
        setattr(cfg, k, v)
    model = AutoModelForCausalLM.from_config(cfg)
    path = str(tmp_path / family)
    fullband.FullBandwidthForCausalLM.from_backbone(model).save_pretrained(path)
    return path


@pytest.mark.parametrize("family,config,message", [
    ("gpt2", {}, "supports Llama and Qwen2 backbones; this one is 'gpt2'"),
    ("mistral", {}, "this one is 'mistral'"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope scaling 'linear'"),
])
def test_backbones_llama_cpp_cannot_take_are_refused_in_one_line(tmp_path, capsys, family, config, message):
    path = _saved(tmp_path, family, **config)
    capsys.readouterr()
    assert cli.main(["export", "gguf", path, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not os.path.exists(tmp_path / "out")


def test_an_existing_directory_is_replaced_only_when_it_is_an_earlier_export(saved, tmp_path, capsys):
    capsys.readouterr()
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert cli.main(["export", "gguf", saved, "--out", str(other)]) == 2
    assert "is not an earlier GGUF export" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "keep me"
    assert cli.main(["export", "gguf", saved, "--out", os.path.join(saved, "gguf")]) == 2
    assert "outside the model directory" in capsys.readouterr().err
    out = str(tmp_path / "g")
    assert cli.main(["export", "gguf", saved, "--out", out]) == 0
    first = json.loads(capsys.readouterr().out)["uuid"]
    assert cli.main(["export", "gguf", saved, "--out", out, "--type", "f16"]) == 0
    manifest = json.load(open(os.path.join(out, "fullband-gguf.json")))
    assert manifest["type"] == "f16" and manifest["uuid"] != first
    assert read(out)[0]["general.uuid"] == manifest["uuid"]
