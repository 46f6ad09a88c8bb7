"""vLLM serving plugin (fullband.serving): greedy tokens from vLLM == ``generate(feedback_mode="soft")`` (fp32).

The tests marked ``needs_vllm`` run only where vLLM is importable (the separate venv of .ci/run) and are skipped
otherwise; the command-line checks of ``fullband serve`` run everywhere. Every vLLM engine runs in a subprocess
(tests/serving_helpers/vllm_generate.py, ``fullband serve``, ``fullband bench serve``) on tiny models built from
configs here. Tolerance: exact token equality. The reference itself is checked to be precision-stable
(fp32 == fp64 ``generate`` for every prompt), so an exact match is a fair demand and a near-tie cannot make the test
flaky; the references also differ from the plain backbone's tokens, so a plugin that ignored the state would fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

import fullband

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed here (.ci/run tests it in a venv of its own)")

HELPER = Path(__file__).parent / "serving_helpers" / "vllm_generate.py"
VOCAB, BOS, EOS, PAD = 384, 1, 2, 0
TIMEOUT = 420  # seconds for one vLLM subprocess (startup ~20-40 s on a quiet machine)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


# ----------------------------------------------------------------------------------------------- models


def _backbone(family: str, seed: int):
    common = dict(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    # head_dim 32: the smallest head size vLLM's CPU attention supports
    if family == "llama":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, max_position_embeddings=256, **common)
    elif family == "qwen2":
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False, **common)
    else:
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=256, **common)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "to be or not to be, that is the question",
            "hello world, a tiny model serves tokens"] * 20
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 4, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    assert fast.convert_tokens_to_ids(["<pad>", "<s>", "</s>"]) == [PAD, BOS, EOS] and len(fast) <= VOCAB
    return fast


def _save(path: Path, family: str, fusion: str, seed: int, bos_logit_scale: float = 1.0) -> Path:
    backbone = _backbone(family, seed)
    if bos_logit_scale != 1.0:  # make the model generate the document-start token now and then
        with torch.no_grad():
            backbone.get_output_embeddings().weight[BOS] *= bos_logit_scale
    torch.manual_seed(seed + 1)
    model = fullband.FullBandwidthForCausalLM.from_backbone(backbone, fusion=fusion).eval()
    if fusion == "residual":  # its gain starts at 0 (== the plain backbone): give the feedback term some weight
        with torch.no_grad():
            model.feedback.out_norm.weight.fill_(model.config.embed_rms)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    return {"llama": _save(root / "llama_glu", "llama", "glu", 0),
            "qwen2": _save(root / "qwen2_residual", "qwen2", "residual", 3, bos_logit_scale=3.0),
            "gpt2": _save(root / "gpt2_glu", "gpt2", "glu", 5),
            "root": root}


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, VOCAB, (n,), generator=g)
        ids[0] = BOS
        out.append(ids.tolist())
    return out


def reference(path, prompts, max_tokens, mode="soft", prefill_passes=1):
    """Greedy ``generate()`` tokens per prompt (fp32), after checking fp64 gives the same ones."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    model64 = AutoModelForCausalLM.from_pretrained(path).double().eval()
    outs = []
    for ids, n in zip(prompts, max_tokens):
        x = torch.tensor([ids])
        kw = dict(feedback_mode=mode, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=PAD,
                  prefill_passes=prefill_passes)
        a = model.generate(x, **kw)[0, len(ids):].tolist()
        assert a == model64.generate(x, **kw)[0, len(ids):].tolist(), "reference not precision-stable"
        outs.append(a)
    return outs


def _env(tmp: Path, **extra) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_CACHE_ROOT"] = str(tmp / "vllm-cache")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_vllm(tmp: Path, runs: list[dict], name: str) -> tuple[list[dict], str]:
    """Start one engine per run (model, prompts, max_tokens, engine kwargs) in one subprocess, one after the
    other; returns each run's result (``outputs`` or ``error``, plus the ``stats`` the plugin wrote) and the log."""
    base = {"dtype": "float32", "enforce_eager": True, "skip_tokenizer_init": True, "seed": 0}
    spec = {"runs": [{"model": str(r["model"]), "prompts": r.get("prompts", [[BOS, 5]]),
                      "max_tokens": r.get("max_tokens", [2]), "engine": {**base, **r.get("engine", {})}}
                     for r in runs]}
    spec_path, out_path, stats = tmp / f"{name}.spec.json", tmp / f"{name}.out.json", tmp / f"{name}.stats.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(HELPER), str(spec_path), str(out_path)], capture_output=True,
                          text=True, timeout=TIMEOUT * len(runs), env=_env(tmp, FULLBAND_VLLM_STATS=stats))
    assert proc.returncode == 0 and out_path.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(out_path.read_text())
    if len(results) == 1 and stats.exists():
        results[0]["stats"] = json.loads(stats.read_text())
    return results, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------- exactness

LENGTHS = [1, 40, 15, 9, 33, 5, 21, 17]
NEW = [24, 10, 30, 16, 8, 28, 12, 20]


@needs_vllm
def test_llama_glu_equals_generate_soft_mixed_batches_chunked_prefill(ckpt):
    """8 prompts (1-40 tokens) through 3 sequence slots, 16-token steps: prompts are split into chunks, steps mix
    prefill chunks with decodes, requests start and finish at different times and state slots are reused."""
    prompts = _prompts(LENGTHS, seed=11)
    want = reference(ckpt["llama"], prompts, NEW)
    plain = reference(ckpt["llama"], prompts, NEW, mode="standard")
    assert sum(w != p for w, p in zip(want, plain)) >= len(prompts) - 1  # feedback changes the tokens
    (got,), _ = run_vllm(ckpt["root"], [dict(model=ckpt["llama"], prompts=prompts, max_tokens=NEW, engine=dict(
        max_num_seqs=3, max_num_batched_tokens=16, max_model_len=128, num_gpu_blocks_override=40))], "llama")
    for i, (g, w) in enumerate(zip(got["outputs"], want)):
        assert g == w, f"prompt {i} (length {LENGTHS[i]}): vLLM {g} != generate(soft) {w}"
    s = got["stats"]
    assert s["mixed_steps"] > 0, s  # steps with prefill chunks and decodes together
    assert s["prefill_chunks"] > len(prompts), s  # some prompt went in more than one chunk
    assert s["one_token_prefill_chunks"] > 0, s  # a last chunk of one token is still prompt, not a decode
    assert s["max_requests_in_step"] == 3 and len(s["slots_seen"]) < len(prompts), s  # slots were reused
    assert s["fused_tokens"] == sum(NEW) - len(prompts), s  # every generated token but the last was fed in


@needs_vllm
def test_qwen2_residual_equals_generate_soft_prefix_caching_requested(ckpt):
    """Qwen2 backbone, the residual fusion; prefix caching is asked for (and switched off by the plugin) while
    prompts share long prefixes; the model generates the document-start token (BOS) now and then, which must enter
    plainly (no feedback across a document start)."""
    base = _prompts([20], seed=5)[0]
    prompts = [base, base + [7, 8, 9], base[:12], base + [7], _prompts([6], seed=6)[0]]
    new = [16, 12, 20, 8, 14]
    want = reference(ckpt["qwen2"], prompts, new)
    assert sum(w[:-1].count(BOS) for w in want) >= 3  # generated BOS tokens that are fed back in
    assert sum(w != p for w, p in zip(want, reference(ckpt["qwen2"], prompts, new, mode="standard"))) >= 3
    (got,), log = run_vllm(ckpt["root"], [dict(model=ckpt["qwen2"], prompts=prompts, max_tokens=new, engine=dict(
        max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64, enable_prefix_caching=True))], "qwen2")
    assert got["outputs"] == want
    assert "prefix caching switched off" in log


@needs_vllm
def test_fused_mode_equals_generate_fused(ckpt):
    """Mode fused, 2 Jacobi passes over each prompt (whole prompts per step, chunked prefill off), prompts arriving
    while others decode: equal to generate(feedback_mode="fused", prefill_passes=2), and different from soft."""
    prompts, new = _prompts([30, 7, 1, 18, 12], seed=21), [12, 20, 10, 16, 14]
    want = reference(ckpt["llama"], prompts, new, mode="fused", prefill_passes=2)
    soft = reference(ckpt["llama"], prompts, new)
    assert sum(w != s for w, s in zip(want, soft)) >= 3
    overrides = {"serving_feedback_mode": "fused", "serving_prefill_passes": 2}
    (got,), _ = run_vllm(ckpt["root"], [dict(model=ckpt["llama"], prompts=prompts, max_tokens=new, engine=dict(
        max_num_seqs=2, max_model_len=128, enable_chunked_prefill=False, max_num_batched_tokens=128,
        hf_overrides=overrides))], "fused")
    assert got["outputs"] == want
    assert got["stats"]["mixed_steps"] > 0, got["stats"]


# ----------------------------------------------------------------------------------------------- refusals


@needs_vllm
def test_refusals_at_startup(ckpt, tmp_path):
    """One line each, before serving anything: a backbone the plugin cannot serve, mode fused with chunked
    prefill, and a KV cache small enough that vLLM could preempt (and wrongly recompute) a request."""
    (gpt2, fused, small_kv), log = run_vllm(tmp_path, [
        dict(model=ckpt["gpt2"]),
        dict(model=ckpt["llama"], engine=dict(max_model_len=128, hf_overrides={"serving_feedback_mode": "fused"})),
        dict(model=ckpt["llama"], engine=dict(max_num_seqs=8, max_model_len=128, num_gpu_blocks_override=6)),
    ], "refusals")
    assert "GPT2LMHeadModel" in gpt2["error"] and "LlamaForCausalLM" in gpt2["error"], gpt2
    assert "no-enable-chunked-prefill" in fused["error"], fused
    assert "error" in small_kv and "preempt" in log and "max_num_seqs=8" in log, log[-3000:]


def _serve(capsys, *args) -> tuple[int, str, str]:
    from fullband.cli import main

    capsys.readouterr()
    code = main(["serve", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_serve_refuses_what_it_cannot_serve_in_one_line(ckpt, tmp_path, capsys):
    plain = tmp_path / "plain"
    _backbone("llama", 0).save_pretrained(plain)
    no_tok = tmp_path / "no_tokenizer"
    fullband.FullBandwidthForCausalLM.from_backbone(_backbone("llama", 0)).save_pretrained(no_tok)
    for model, words in ((ckpt["gpt2"], "GPT2LMHeadModel"), (plain, "not a fullband"), (no_tok, "no tokenizer"),
                         (tmp_path / "missing", "does not exist")):
        code, _, err = _serve(capsys, "--model", model)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and words in lines[0], err


def test_serve_command_line(ckpt, capsys):
    soft = shlex.split(_serve(capsys, "--model", ckpt["llama"], "--print-command", "--", "--enforce-eager")[1])
    assert soft[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and soft[-1] == "--enforce-eager"
    assert soft[soft.index("--host") + 1] == "127.0.0.1" and "--no-enable-prefix-caching" in soft
    fused = shlex.split(_serve(capsys, "--model", ckpt["llama"], "--mode", "fused", "--prefill-passes", 2,
                               "--max-model-len", 96, "--print-command")[1])
    assert json.loads(fused[fused.index("--hf-overrides") + 1]) == {"serving_feedback_mode": "fused",
                                                                     "serving_prefill_passes": 2}
    assert "--no-enable-chunked-prefill" in fused and fused[fused.index("--max-num-batched-tokens") + 1] == "96"


# ----------------------------------------------------------------------------------------------- server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@needs_vllm
def test_openai_server_round_trip(ckpt, tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "fullband.cli", "serve", "--model", str(ckpt["llama"]),
                             "--port", str(port), "--dtype", "float32", "--max-model-len", "128",
                             "--max-num-seqs", "4", "--", "--enforce-eager"],
                            stdout=log, stderr=subprocess.STDOUT, env=_env(tmp_path), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, "server did not become healthy in time"
            time.sleep(1)
        tok = _tokenizer()
        model = str(ckpt["llama"])
        text = "the quick brown fox"
        comp = _post(base + "/v1/completions", {"model": model, "prompt": text, "max_tokens": 12, "temperature": 0,
                                                "ignore_eos": True, "return_token_ids": True})
        choice = comp["choices"][0]
        prompt_ids = choice["prompt_token_ids"] or comp.get("prompt_token_ids")
        assert prompt_ids == tok(text).input_ids
        assert choice["token_ids"] == reference(ckpt["llama"], [prompt_ids], [12])[0]
        assert choice["text"] == tok.decode(choice["token_ids"])

        messages = [{"role": "user", "content": "hello world"}]
        chat = _post(base + "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 10,
                                                     "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        chat_ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"])
        assert chat["prompt_token_ids"] == chat_ids
        assert chat["choices"][0]["token_ids"] == reference(ckpt["llama"], [chat_ids], [10])[0]
    finally:
        _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its own, from start_new_session: the group id is its PID), then
    SIGKILL after a bounded wait."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------------------------- benchmark


@needs_vllm
def test_bench_serve_runs_once_at_tiny_size(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fullband.cli", "bench", "serve", "--json", "--size", "d64l2",
                           "--vocab-size", "512", "--batch-sizes", "1,4", "--prompt-len", "8", "--new-tokens", "8",
                           "--repeats", "1", "--out", str(tmp_path / "bench")],
                          capture_output=True, text=True, timeout=2 * TIMEOUT, env=_env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    for b in ("1", "4"):
        row = report["batch"][b]
        assert row["fullband_tokens_per_s"] > 0 and row["plain_tokens_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["fullband_tokens_per_s"] / row["plain_tokens_per_s"], rel=1e-6)
