"""The llama.cpp engine (:mod:`fullband.serving.llamacpp`) on ``fullband export gguf`` output: the backbone against the
Hugging Face model it came from, the decode modes against :func:`fullband.model.generation.generate` (per-step logit
error, greedy agreement, near-ties), batches against each sequence alone, the fusion against the package's module,
llama.cpp's tokenizer against the saved one, the CLI. Needs llama-cpp-python (the ``llamacpp`` extra; .ci/run builds
it in its own step and skips these tests with one line where the build fails)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import BOS, TEXTS, save_model_dir, tiny_backbone_config
from fullband import cli
from fullband.model.feedback import FUSIONS, build_fusion
from fullband.model.generation import generate
from fullband.model.modeling import load_model

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (fullband[llamacpp]) is not installed")
from fullband.serving.gguf_export import export_gguf  # noqa: E402
from fullband.serving.llamacpp import LlamaCppEngine, StepFusion  # noqa: E402
from fullband.serving.llamacpp_bench import agreement  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny fullband Llama (GLU fusion, feedback active at init) with a BPE tokenizer, and its f32 export."""
    root = tmp_path_factory.mktemp("llama")
    path = save_model_dir(root / "model", fusion="glu")
    export_gguf(path, str(root / "gguf"), "f32")
    return path, str(root / "gguf")


@pytest.fixture(scope="module")
def engine(llama):
    with LlamaCppEngine(llama[1], n_seq=4, threads=1) as eng:
        yield eng


def prompts(vocab, n=8, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[BOS] + torch.randint(3, vocab, (length - 1 - i % 3,), generator=g).tolist() for i in range(n)]


def rel_err(got, want):
    return float(np.abs(np.asarray(got) - np.asarray(want)).max() / np.abs(np.asarray(want)).max())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_plain_backbone_in_llama_cpp_matches_hugging_face(tmp_path, family):
    """Every position's logits and final normed hidden state (llama.cpp's embedding output) against the Hugging Face
    forward of the same backbone: the tensor names, Llama's rotary row order and Qwen2's biases all enter here."""
    torch.manual_seed(0)
    backbone = AutoModelForCausalLM.from_config(tiny_backbone_config(family)).eval()
    backbone.save_pretrained(tmp_path / "m")
    export_gguf(str(tmp_path / "m"), str(tmp_path / "g"))
    ids = prompts(97, n=1, length=16)[0]
    with torch.no_grad():
        out = backbone(torch.tensor([ids]), output_hidden_states=True)
    with LlamaCppEngine(str(tmp_path / "g"), threads=1) as eng:
        logits, states = eng._decode([0] * len(ids), list(range(len(ids))), tokens=ids)
    assert rel_err(logits, out.logits[0]) < 2e-3  # float32 in another summation order: measured about 1e-4
    assert rel_err(states, out.hidden_states[-1][0]) < 2e-3


@pytest.mark.parametrize("mode", ["standard", "soft", "fused", "exact"])
def test_each_step_s_logits_follow_generate_in_every_mode(llama, engine, mode):
    """Teacher-forced with generate()'s tokens, the engine's logits at every step equal generate()'s to float32
    reordering error, with a document start inside one prompt (the state reset there)."""
    model = load_model(llama[0]).eval()
    ps = prompts(model.get_input_embeddings().num_embeddings, n=2)
    ps[1][5] = BOS
    for p in ps:
        ref = generate(model, torch.tensor([p]), mode=mode, max_new_tokens=12, prefill_passes=2, output_logits=True)
        got = engine.generate([p], mode=mode, max_new_tokens=12, prefill_passes=2,
                              forced=ref.new_tokens.tolist(), output_logits=True)
        assert rel_err(got.logits[0], ref.logits[0]) < 2e-3


def test_greedy_continuations_agree_with_generate_or_part_at_a_near_tie(llama, engine):
    """The issue's criterion: 8 prompts x 32 new tokens x soft / fused / exact, an f32 GGUF: >= 90% of the
    (prompt, mode) pairs give generate()'s tokens exactly, and every pair that differs first differs where
    generate()'s top-2 gap is within twice the measured logit error (a near-tie)."""
    model = load_model(llama[0]).eval()
    res = agreement(model, engine, prompts(model.get_input_embeddings().num_embeddings), new_tokens=32)
    assert res["pairs"] == 24
    assert res["identical_fraction"] >= 0.9, res["rows"]
    assert res["differing_all_near_ties"], [r for r in res["rows"] if not r["identical"]]


def test_sequences_decoded_together_equal_each_alone(engine):
    ps = prompts(engine.n_vocab, n=3, seed=3)
    for mode in ("soft", "fused", "exact"):
        together = engine.generate(ps, mode=mode, max_new_tokens=10, output_logits=True)
        for s, p in enumerate(ps):
            alone = engine.generate([p], mode=mode, max_new_tokens=10, output_logits=True)
            assert together.new_tokens[s] == alone.new_tokens[0]
            # llama.cpp's kernels for a batch of rows sum in another order than for one row: ~1e-4 relative
            assert rel_err(together.logits[s], alone.logits[0]) < 2e-3


@pytest.mark.parametrize("fusion", FUSIONS)
def test_the_engine_s_step_fusion_is_the_package_s_fusion(fusion):
    torch.manual_seed(0)
    module = build_fusion(fusion, 32, 32, 1e-5)
    module.reset_parameters(0.5)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))  # no zero gain (residual) or identity (concat) left
    embeds = torch.randn(50, 32)
    step = StepFusion(module.eval(), embeds)
    states = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    ids = np.array([3, 7, 3, 49])
    with torch.no_grad():
        want = module(torch.from_numpy(states), embeds[torch.from_numpy(ids)]).numpy()
    assert rel_err(step(states, ids), want) < 1e-5
    assert rel_err(step(states, ids), want) < 1e-5  # the kept gates of a second call


def test_llama_cpp_tokenizes_text_as_the_saved_tokenizer(llama, engine):
    tok = AutoTokenizer.from_pretrained(llama[0])
    vocab = llama_cpp.llama_model_get_vocab(engine._model)
    for text in TEXTS:
        raw = text.encode()
        buf = (llama_cpp.llama_token * (4 * len(raw) + 8))()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, False)
        assert list(buf[:n]) == tok(text, add_special_tokens=False)["input_ids"]


def test_a_fusion_file_of_another_export_is_refused(llama, tmp_path):
    other = str(tmp_path / "other")
    export_gguf(llama[0], other, "f32")
    os.replace(os.path.join(other, "fusion.safetensors"), os.path.join(llama[1], "fusion.safetensors.new"))
    try:
        os.replace(os.path.join(llama[1], "fusion.safetensors"), os.path.join(tmp_path, "kept"))
        os.replace(os.path.join(llama[1], "fusion.safetensors.new"), os.path.join(llama[1], "fusion.safetensors"))
        with pytest.raises(ValueError, match="belongs to another GGUF"):
            LlamaCppEngine(llama[1])
    finally:
        os.replace(os.path.join(tmp_path, "kept"), os.path.join(llama[1], "fusion.safetensors"))


def test_plain_gguf_refuses_feedback_modes_and_bad_requests(tmp_path, engine):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_backbone_config("llama")).save_pretrained(tmp_path / "m")
    export_gguf(str(tmp_path / "m"), str(tmp_path / "g"))
    with LlamaCppEngine(str(tmp_path / "g"), threads=1) as plain:
        with pytest.raises(ValueError, match="needs latent feedback"):
            plain.generate([[1, 5]], mode="soft")
        assert len(plain.generate([[1, 5]], mode="standard", max_new_tokens=3).new_tokens[0]) == 3
    with pytest.raises(ValueError, match="made for 4 sequences"):
        engine.generate([[1]] * 5, mode="soft")
    with pytest.raises(ValueError, match="exceed the context"):
        engine.generate([[1, 5]], mode="soft", max_new_tokens=10_000)
    with pytest.raises(FileNotFoundError, match="not a GGUF export"):
        LlamaCppEngine(str(tmp_path / "m"))


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_f16_and_q8_0_exports_decode_close_to_generate(llama, tmp_path, kind):
    """Reported, not asserted, by the benchmark: token agreement. Asserted: the per-step error stays at the weight
    type's precision (f16 2^-11, q8_0 about 1/127 per block, relative to the logits' scale)."""
    export_gguf(llama[0], str(tmp_path / kind), kind)
    model = load_model(llama[0]).eval()
    p = prompts(model.get_input_embeddings().num_embeddings, n=1)[0]
    ref = generate(model, torch.tensor([p]), mode="fused", max_new_tokens=8, output_logits=True)
    with LlamaCppEngine(str(tmp_path / kind), threads=1) as eng:
        got = eng.generate([p], mode="fused", max_new_tokens=8, forced=ref.new_tokens.tolist(), output_logits=True)
    assert rel_err(got.logits[0], ref.logits[0]) < {"f16": 2e-2, "q8_0": 1e-1}[kind]


def test_generate_cli_with_llama_cpp_prints_what_the_torch_engine_prints(llama, capsys):
    common = ["generate", "--prompt", "To be, or not", "--max-new-tokens", "12", "--mode", "fused", "--no-stream"]
    assert cli.main(common + ["--model", llama[0]]) == 0
    torch_text = capsys.readouterr().out
    assert cli.main(common + ["--model", llama[1], "--engine", "llama.cpp", "--threads", "1"]) == 0
    out = capsys.readouterr()
    assert out.out == torch_text and "[llama.cpp fused: 12 new tokens" in out.err
    assert cli.main(common + ["--model", llama[1], "--engine", "llama.cpp", "--dtype", "bfloat16"]) == 2
    assert "--dtype is not an option of --engine llama.cpp" in capsys.readouterr().err
