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
import re
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from serving_helpers.openai_client import Server, complete, free_port
from serving_helpers.references import forced_logprobs, reference_bf16
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

import fullband
from fullband.serving.benchmark import summarize_pairs  # its statistics: tests/test_bench_stats.py

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
    """Start one engine per run (model, prompts, max_tokens, engine kwargs, optionally ``abort_after``) in one
    subprocess, one after the other; returns each run's result (``outputs`` or ``error``, plus the ``stats`` the
    plugin wrote) and the log."""
    base = {"dtype": "float32", "enforce_eager": True, "skip_tokenizer_init": True, "seed": 0}
    spec = {"runs": [{"model": str(r["model"]), "prompts": r.get("prompts", [[BOS, 5]]),
                      "max_tokens": r.get("max_tokens", [2]), "engine": {**base, **r.get("engine", {})}}
                     for r in runs]}
    for s, r in zip(spec["runs"], runs):
        if r.get("abort_after"):
            s["abort_after"] = r["abort_after"]
    spec_path, out_path, stats = tmp / f"{name}.spec.json", tmp / f"{name}.out.json", tmp / f"{name}.stats"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(HELPER), str(spec_path), str(out_path), str(stats)],
                          capture_output=True, text=True, timeout=TIMEOUT * len(runs), env=_env(tmp))
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)  # the whole log, for a failure's first error
    assert proc.returncode == 0 and out_path.exists(), (f"whole log: {tmp / f'{name}.log'}\n"
                                                        + proc.stdout[-3000:] + proc.stderr[-6000:])
    results = json.loads(out_path.read_text())
    for i, result in enumerate(results):
        path = Path(f"{stats}.{i}.json")
        if path.exists():
            result["stats"] = json.loads(path.read_text())
        sched = Path(f"{stats}.{i}.json.scheduler.json")  # preemptions, vLLM's prefix-cache queries / hits
        if sched.exists():
            result["scheduler"] = json.loads(sched.read_text())
    return results, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------- exactness

LENGTHS = [1, 40, 15, 9, 33, 5, 21, 17]
NEW = [24, 10, 30, 16, 8, 28, 12, 20]
HANG_UP_CHECKED = 20  # tokens of a hung-up stream compared with generate()
ABORT_POOL_BLOCKS = 6  # a KV pool that holds one request of max_model_len 64 (see the abort test)
PREEMPT_POOL_BLOCKS = 2 * (2 + 1) + 1  # two requests of max_model_len 64 (see the preemption test)
PREEMPT_NEW = [56, 20, 44, 50, 28, 54, 40, 44]  # answers that take the LENGTHS prompts to 57-61 tokens (2 blocks)
BF16_LENGTHS = [1, 40, 15, 9, 33, 5, 21, 17, 26, 12, 3, 30]
BF16_MIN_IDENTICAL, BF16_MAX_GAP = 4, 0.016  # bf16 tolerance, see test_bf16_serving_close_to_generate_bf16


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
def test_qwen2_residual_equals_generate_soft_prefix_caching(ckpt):
    """Qwen2 backbone, the residual fusion, prefix caching on (vLLM's default) while prompts share prefixes; the
    model generates the document-start token (BOS) now and then, which must enter plainly (no feedback across a
    document start). Hits and the decode-block case: test_prefix_caching_hits_exact_and_decode_blocks_never_shared."""
    base = _prompts([20], seed=5)[0]
    prompts = [base, base + [7, 8, 9], base[:12], base + [7], _prompts([6], seed=6)[0]]
    new = [16, 12, 20, 8, 14]
    want = reference(ckpt["qwen2"], prompts, new)
    assert sum(w[:-1].count(BOS) for w in want) >= 3  # generated BOS tokens that are fed back in
    assert sum(w != p for w, p in zip(want, reference(ckpt["qwen2"], prompts, new, mode="standard"))) >= 3
    (got,), _ = run_vllm(ckpt["root"], [dict(model=ckpt["qwen2"], prompts=prompts, max_tokens=new, engine=dict(
        max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64, enable_prefix_caching=True))], "qwen2")
    assert got["outputs"] == want


@needs_vllm
def test_prefix_caching_hits_exact_and_decode_blocks_never_shared(ckpt):
    """Prefix caching on (32-token blocks, the smallest vLLM's CPU attention takes), 2 sequences at a time: prompts
    sharing a 64-token prefix hit its 2 cached blocks, answers equal generate(soft); and a prompt that is an earlier
    prompt + its answer (the decode-block case, 100 tokens) hits only that prompt's 2 prompt blocks -- the full block
    holding prompt tokens 64-67 and answer tokens 68-95 (KV written by fused decode steps) is never entered in the
    cache, so the new prompt is prefilled plainly, as generate(soft) on it does. Hits asserted from vLLM's own
    prefix-cache statistics (tokens)."""
    shared = _prompts([64], seed=81)[0]
    tails = _prompts([5, 9, 4], seed=82)
    prompts = [shared + tails[0][1:], shared + tails[1][1:], shared[:40] + tails[2][1:]]  # 68, 72, 43 tokens
    new = [32, 40, 40]  # prompt 3 starts when prompt 1 ends, after prompt 0 ended: all its blocks were full then
    want = reference(ckpt["llama"], prompts, new)
    prompts.append(prompts[0] + want[0])  # prompt 0 + its answer
    new.append(12)
    want.append(reference(ckpt["llama"], prompts[-1:], new[-1:])[0])
    (got,), _ = run_vllm(ckpt["root"], [dict(model=ckpt["llama"], prompts=prompts, max_tokens=new, engine=dict(
        max_num_seqs=2, max_model_len=128, enable_prefix_caching=True, block_size=32, disable_log_stats=False))],
        "prefix")
    for i, (g, w) in enumerate(zip(got["outputs"], want)):
        assert g == w, f"prompt {i}: vLLM {g} != generate(soft) {w}"
    # prompt 1: the 2 shared blocks (cached in the same step); prompt 2: the first one; prompt 3: prompt 0's 2
    # prompt-only blocks, not its 3rd (cached, every block of a request entered, it would hit 96 and answer wrong)
    assert got["scheduler"]["prefix_cache_hits"] == 64 + 32 + 64, got["scheduler"]


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


@needs_vllm
def test_preemption_exact_soft_and_fused(ckpt):
    """A KV pool of 2 requests' blocks (max_model_len 64: 2 blocks of 32 + 1 state page each, + vLLM's null block)
    and 8 requests of 1-40 prompt tokens at once, each growing to 57-61 tokens: vLLM admits what fits and preempts
    running requests as their answers grow; a preempted request resumes by re-prefilling its prompt and re-running
    its generated part one token per step through the recurrence. Every answer equals generate() in its mode -- soft
    (chunked prefill, prefix caching on) and fused (2 Jacobi passes, whole prompts) -- and the scheduler counted
    preemptions, re-prefilled prompt tokens and recomputed generated tokens."""
    prompts = _prompts(LENGTHS, seed=11)
    engine = dict(max_num_seqs=8, max_model_len=64, num_gpu_blocks_override=PREEMPT_POOL_BLOCKS, block_size=32,
                  disable_log_stats=False)
    fused = dict(engine, enable_chunked_prefill=False, max_num_batched_tokens=64,
                 hf_overrides={"serving_feedback_mode": "fused", "serving_prefill_passes": 2})
    want = {"soft": reference(ckpt["llama"], prompts, PREEMPT_NEW),
            "fused": reference(ckpt["llama"], prompts, PREEMPT_NEW, mode="fused", prefill_passes=2)}
    (soft, fus), _ = run_vllm(ckpt["root"], [
        dict(model=ckpt["llama"], prompts=prompts, max_tokens=PREEMPT_NEW,
             engine=dict(engine, max_num_batched_tokens=16)),
        dict(model=ckpt["llama"], prompts=prompts, max_tokens=PREEMPT_NEW, engine=fused)], "preempt")
    for mode, got in (("soft", soft), ("fused", fus)):
        for i, (g, w) in enumerate(zip(got["outputs"], want[mode])):
            assert g == w, f"{mode}, prompt {i} (length {LENGTHS[i]}): vLLM {g} != generate({mode}) {w}"
        s = got["scheduler"]
        assert s["preemptions"] >= 2 and s["reprefilled_prompt_tokens"] > 0, (mode, s)
        assert s["recomputed_generated_tokens"] > 0, (mode, s)  # resumed answers re-run through the recurrence


@needs_vllm
def test_a_resumed_request_never_hits_its_own_last_prompt_token(ckpt):
    """Prefix caching and preemption together, the case the 20-client load test met once by chance: request A's prompt
    is exactly 2 blocks (64 tokens), and B's prompt (first, 80 tokens) holds A's whole prompt as its prefix, so B's
    two full prompt blocks are cached. A new A hits only its first block (vLLM stops a hit before a prompt's last
    token), but A preempted after its first answer token counts 65 tokens: without the plugin's cap its lookup would
    hit B's 2 blocks, covering A's last prompt token, whose final hidden state -- A's first fed-back state -- would
    then never be recomputed, and A's second token would be fused with a state page nobody wrote. The pool (B's 3
    blocks and state page, A's new block and state page, vLLM's null block) has no block for A's answer: vLLM
    preempts A right after its prefill, B finishes, A resumes. Every answer equals generate(soft)."""
    shared = _prompts([64], seed=91)[0]
    prompts = [shared + _prompts([17], seed=92)[0][1:], shared]  # B (80 tokens), A (64 tokens)
    new = [8, 12]
    want = reference(ckpt["llama"], prompts, new)
    (got,), _ = run_vllm(ckpt["root"], [dict(model=ckpt["llama"], prompts=prompts, max_tokens=new, engine=dict(
        max_num_seqs=2, max_model_len=96, num_gpu_blocks_override=7, block_size=32, enable_prefix_caching=True,
        disable_log_stats=False))], "resume-hit")
    s = got["scheduler"]
    for i, (g, w) in enumerate(zip(got["outputs"], want)):
        assert g == w, f"prompt {'BA'[i]}: vLLM {g} != generate(soft) {w} (scheduler {s})"
    # A was preempted, and resumed by re-prefilling its last prompt block (tokens 32-63; the first block a hit)
    assert s["preemptions"] >= 1 and s["reprefilled_prompt_tokens"] >= 32, s


@needs_vllm
def test_aborted_request_its_slot_reused_without_leak(ckpt):
    """Request A (40-token prompt) is aborted after 6 engine steps, mid-decode; then 6 more requests run, one at a
    time (max_num_seqs 1), in a KV pool that holds one request, so every later request starts in pages an earlier
    one wrote -- the first one after A in A's pages (measured: the state page alternates between the same two pages,
    A's other page becoming the next request's state page and back). A's tokens are a prefix of generate(soft)'s
    and every later request equals generate(soft) exactly: nothing of A's (or any earlier) state reaches them."""
    lengths, new = [40, 20, 1, 9, 33, 5, 14], [24, 16, 20, 12, 10, 18, 8]
    prompts = _prompts(lengths, seed=71)
    want = reference(ckpt["llama"], prompts, new)
    (got,), _ = run_vllm(ckpt["root"], [dict(model=ckpt["llama"], prompts=prompts, max_tokens=new, abort_after=6,
                                             engine=dict(max_num_seqs=1, max_model_len=64,
                                                         num_gpu_blocks_override=ABORT_POOL_BLOCKS))], "abort")
    partial, rest = got["outputs"][0], got["outputs"][1:]
    assert 3 <= len(partial) < new[0] and partial == want[0][:len(partial)], (partial, want[0])
    assert rest == want[1:]
    slots = got["stats"]["request_slots"]  # each request's state page, in start order
    assert len(slots) == len(prompts) and len(set(slots)) <= 2, slots  # pages written before, over and over


@needs_vllm
def test_bf16_serving_close_to_generate_bf16(ckpt):
    """bf16 (the gate table built at load, in bf16, and the fusion in bf16, as generate() runs it) against
    ``generate(soft)`` with the model loaded in bf16. Not bit-equal: vLLM's bf16 kernels (fused residual + RMSNorm,
    attention) round differently from HF's, and a greedy decode follows the first near-tie either way. Tolerance
    (stated in the README): at least BF16_MIN_IDENTICAL of the 12 prompts give identical tokens (24 each), and every
    first divergence is at a near-tie of the bf16 reference, a top-2 logit gap < BF16_MAX_GAP (8 bf16 steps at this
    model's logit size). The tiny model's logits are close, so this can fail: a quarter of all reference steps have a
    gap < 0.01, so a decoder that diverged for another reason (a wrong or stale state) would show a larger gap at
    some of its divergences. The plain backbone served in bf16 against HF's bf16 ``generate()`` must meet the same
    bar (measured: fullband 6/12 identical, largest gap at a divergence 0.0098; plain 9/12, 0.002)."""
    prompts, new = _prompts(BF16_LENGTHS, seed=61), [24] * len(BF16_LENGTHS)
    plain = ckpt["root"] / "plain_llama"
    if not plain.exists():
        _backbone("llama", 0).save_pretrained(plain)  # the backbone of ckpt["llama"]
    engine = dict(dtype="bfloat16", max_num_seqs=4, max_model_len=128)
    (fb, pl), _ = run_vllm(ckpt["root"], [dict(model=ckpt["llama"], prompts=prompts, max_tokens=new, engine=engine),
                                          dict(model=plain, prompts=prompts, max_tokens=new, engine=engine)], "bf16")
    assert fb["stats"]["gate_table_at_load"][1] == "torch.bfloat16", fb["stats"]
    for got, path, mode in ((fb, ckpt["llama"], "soft"), (pl, plain, None)):
        want, gaps = reference_bf16(path, prompts, new, mode, PAD)
        diverged = [(i, d, gaps[i][d]) for i, (g, w) in enumerate(zip(got["outputs"], want))
                    for d in [next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), None)] if d is not None]
        assert len(prompts) - len(diverged) >= BF16_MIN_IDENTICAL, (mode, diverged)
        assert all(gap < BF16_MAX_GAP for _, _, gap in diverged), (mode, diverged)


# ----------------------------------------------------------------------------------------------- refusals


@needs_vllm
def test_refusals_at_startup(ckpt, tmp_path):
    """One line each, before serving anything: a backbone the plugin cannot serve, mode fused with chunked
    prefill, Mamba cache mode 'align' (per-block state snapshots the plugin does not keep), a KV-transfer connector
    (disaggregated prefill: a request would start decoding without its own state), KV offloading, prompt embeddings
    (no token ids to fuse) and a dummy weight load (no gate table)."""
    llama = dict(model=ckpt["llama"], engine=dict(max_model_len=128))
    runs = [dict(model=ckpt["gpt2"]),
            dict(model=ckpt["llama"], engine=dict(max_model_len=128, hf_overrides={"serving_feedback_mode": "fused"}))]
    runs += [{**llama, "engine": {**llama["engine"], **extra}} for extra in (
        {"mamba_cache_mode": "align"},
        {"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}},
        {"kv_offloading_size": 1.0}, {"enable_prompt_embeds": True}, {"load_format": "dummy"})]
    (gpt2, fused, align, kv_transfer, offload, embeds, dummy), log = run_vllm(tmp_path, runs, "refusals")
    assert "GPT2LMHeadModel" in gpt2["error"] and "LlamaForCausalLM" in gpt2["error"], gpt2
    assert "no-enable-chunked-prefill" in fused["error"], fused
    for result, words in ((align, "--mamba-cache-mode align"), (kv_transfer, "--kv-transfer-config"),
                          (offload, "--kv-offloading-size"), (embeds, "--enable-prompt-embeds"),
                          (dummy, "load format 'dummy'")):
        assert "fullband: " in result.get("error", ""), result
        assert words in result["error"].split("fullband: ", 1)[1].splitlines()[0], result  # said in one line


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
    for flag in ("--enable-prompt-embeds", '--kv-transfer-config={"kv_connector":"X","kv_role":"kv_both"}',
                 "--kv-offloading-size", "--speculative-config"):  # refused before vLLM starts, not in a traceback
        code, out, err = _serve(capsys, "--model", ckpt["llama"], "--print-command", "--", "--enforce-eager", flag,
                                "1")
        lines = err.strip().splitlines()
        assert code == 2 and not out and len(lines) == 1 and flag.split("=")[0] in lines[0], (flag, err)


def test_serve_command_line(ckpt, capsys):
    soft = shlex.split(_serve(capsys, "--model", ckpt["llama"], "--print-command", "--", "--enforce-eager")[1])
    assert soft[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and soft[-1] == "--enforce-eager"
    assert soft[soft.index("--host") + 1] == "127.0.0.1" and "prefix-caching" not in " ".join(soft)
    fused = shlex.split(_serve(capsys, "--model", ckpt["llama"], "--mode", "fused", "--prefill-passes", 2,
                               "--max-model-len", 96, "--print-command")[1])
    assert json.loads(fused[fused.index("--hf-overrides") + 1]) == {"serving_feedback_mode": "fused",
                                                                     "serving_prefill_passes": 2}
    assert "--no-enable-chunked-prefill" in fused and fused[fused.index("--max-num-batched-tokens") + 1] == "96"


# ----------------------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server(ckpt):
    """One ``fullband serve`` (llama + glu, fp32, 4 sequences decoded together, 256-token context) shared by the
    server tests; it logs every request (so an abort is logged)."""
    port = free_port()
    cmd = [sys.executable, "-m", "fullband.cli", "serve", "--model", str(ckpt["llama"]), "--port", str(port),
           "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--",
           "--enforce-eager", "--enable-log-requests"]
    srv = Server(cmd, port, ckpt["root"] / "server.log", _env(ckpt["root"]), TIMEOUT)
    try:
        yield srv
    finally:
        srv.stop()


def _aborted(log: str) -> set[str]:
    """Requests the server aborted because the client went away (vLLM logs ``Request ID aborted.``)."""
    return set(re.findall(r"Request (\S+) aborted\.", log))


def _completion(model, prompt, n_tokens, **extra) -> dict:
    return {"model": str(model), "prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


@needs_vllm
def test_openai_server_round_trip(ckpt, server):
    tok = _tokenizer()
    model = str(ckpt["llama"])
    text = "the quick brown fox"
    comp = server.post("/v1/completions", _completion(model, text, 12))
    choice = comp["choices"][0]
    prompt_ids = choice["prompt_token_ids"] or comp.get("prompt_token_ids")
    assert prompt_ids == tok(text).input_ids
    assert choice["token_ids"] == reference(ckpt["llama"], [prompt_ids], [12])[0]
    assert choice["text"] == tok.decode(choice["token_ids"])

    messages = [{"role": "user", "content": "hello world"}]
    chat = server.post("/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 10,
                                                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    chat_ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"])
    assert chat["prompt_token_ids"] == chat_ids
    assert chat["choices"][0]["token_ids"] == reference(ckpt["llama"], [chat_ids], [10])[0]


@needs_vllm
def test_n_greater_than_one_each_sample_has_its_own_state(ckpt, server):
    """n = 3 samples of one prompt (temperature 1, seeded) run as 3 requests with 3 state slots: the log-probability
    vLLM reports for every sampled token (raw, before temperature) must be the one ``generate(soft)`` gives that
    token after that sample's own history -- a sample fused with a sibling's (or a stale) state gets other
    log-probabilities. (vLLM refuses n > 1 with greedy sampling.)"""
    prompt = _prompts([11], seed=31)[0]
    comp = server.post("/v1/completions", _completion(ckpt["llama"], prompt, 10, n=3, temperature=1.0, seed=7,
                                                      logprobs=0))
    samples = [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in comp["choices"]]
    assert len(samples) == 3 and len({tuple(t) for t, _ in samples}) == 3, samples  # 3 different samples
    greedy = reference(ckpt["llama"], [prompt], [10])[0]
    assert all(t != greedy for t, _ in samples)
    for tokens, served in samples:
        assert served == pytest.approx(forced_logprobs(ckpt["llama"], prompt, tokens, PAD), abs=2e-4), tokens


@needs_vllm
def test_client_disconnect_mid_stream(ckpt, server):
    """A streaming client hangs up after 3 chunks of a 240-token answer (long, so that the engine cannot finish it
    before the API server notices the hang-up on a loaded machine): the server aborts that request (its log says
    so), the tokens it did stream are generate(soft)'s, and the next request on the same server is exact."""
    prompt, nxt = _prompts([14, 6], seed=41)
    before = _aborted(server.log())
    got = complete(server.port, _completion(ckpt["llama"], prompt, 240, stream=True), hang_up_after=3)
    assert got["status"] == 200 and not got["done"] and 3 <= len(got["token_ids"]) < 240, got
    assert got["token_ids"] == reference(ckpt["llama"], [prompt], [len(got["token_ids"])])[0]
    after = complete(server.port, _completion(ckpt["llama"], nxt, 16))
    assert after["token_ids"] == reference(ckpt["llama"], [nxt], [16])[0]
    deadline = time.monotonic() + 60
    while len(_aborted(server.log()) - before) < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(_aborted(server.log()) - before) == 1, server.log()[-3000:]


def _load(ckpt, server, prompts, hang_up_tokens: int = 200) -> None:
    """20 clients at once: 8 answers whole, 6 streamed, 6 streams hung up after 2 chunks (of 200 tokens). Every
    completed answer equals generate(soft) for its prompt, every hung-up stream's tokens are a prefix of it, hung-up
    requests are aborted (at least one; see below), and the server stays up and exact afterwards."""
    kinds = ["whole", "stream", "hang_up", "whole", "hang_up", "stream", "whole", "stream", "hang_up", "whole"] * 2
    new = [hang_up_tokens if k == "hang_up" else 6 + (3 * i) % 17 for i, k in enumerate(kinds)]
    want = reference(ckpt["llama"], prompts, [n if k != "hang_up" else HANG_UP_CHECKED for n, k in zip(new, kinds)])
    before = _aborted(server.log())
    barrier = threading.Barrier(len(prompts))

    def client(i):
        body = _completion(ckpt["llama"], prompts[i], new[i], stream=kinds[i] != "whole")
        barrier.wait(timeout=60)
        return complete(server.port, body, hang_up_after=2 if kinds[i] == "hang_up" else None)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(client, range(len(prompts))))
    for i, (r, k, w) in enumerate(zip(results, kinds, want)):
        assert r["status"] == 200, (i, r)
        if k == "hang_up":  # the server may have merged tokens into a chunk: check the first HANG_UP_CHECKED
            assert not r["done"] and 2 <= len(r["token_ids"]) < hang_up_tokens, (i, r)
            assert r["token_ids"][:HANG_UP_CHECKED] == w[:len(r["token_ids"])], (i, r, w)
        else:
            assert r["token_ids"] == w, (i, k, r, w)
            assert k == "whole" or (r["done"] and r["finish_reason"] == "length"), (i, r)
    # the API server notices a hang-up when its event loop gets to it, so a hung-up request can also run to its end
    # first (seen once in 3 runs: 5 of 6 aborted); at least one abort must have reached the engine mid-load
    deadline = time.monotonic() + 30
    while len(_aborted(server.log()) - before) < kinds.count("hang_up") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert 1 <= len(_aborted(server.log()) - before) <= kinds.count("hang_up"), server.log()[-3000:]
    assert server.proc.poll() is None and server.healthy()
    again = complete(server.port, _completion(ckpt["llama"], prompts[1], 12))
    assert again["token_ids"] == reference(ckpt["llama"], [prompts[1]], [12])[0]


LOAD_LENGTHS = [1, 60, 7, 33, 12, 3, 48, 20, 9, 27, 2, 55, 16, 5, 40, 11, 24, 8, 36, 14]


@needs_vllm
def test_load_concurrent_clients_stream_hang_up(ckpt, server):
    """20 clients at once against 4 decode slots, prompts of 1-60 tokens (:func:`_load`)."""
    _load(ckpt, server, _prompts(LOAD_LENGTHS, seed=51))


TIGHT_POOL_BLOCKS = (8 + 1) + 1 + 2  # one request of max_model_len 256 (8 blocks of 32 + 1 state page), null, 2 more


@pytest.fixture(scope="module")
def tight_server(ckpt):
    """``fullband serve`` as production runs vLLM: prefix caching on, and a KV pool of two requests' blocks for 4
    decode slots (one request at full length and two blocks more: vLLM preempts as answers grow); its scheduler
    writes its statistics."""
    port = free_port()
    stats = ckpt["root"] / "tight.stats"
    cmd = [sys.executable, "-m", "fullband.cli", "serve", "--model", str(ckpt["llama"]), "--port", str(port),
           "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--",
           "--enforce-eager", "--enable-log-requests", "--enable-prefix-caching", "--block-size", "32",
           "--num-gpu-blocks-override", str(TIGHT_POOL_BLOCKS)]
    srv = Server(cmd, port, ckpt["root"] / "tight-server.log",
                 _env(ckpt["root"], FULLBAND_VLLM_STATS=stats), TIMEOUT)
    srv.stats = Path(f"{stats}.scheduler.json")
    try:
        yield srv
    finally:
        srv.stop()


@needs_vllm
def test_load_with_preemption_and_prefix_caching(ckpt, tight_server):
    """The 20-client load (:func:`_load`; hung-up streams of 120 tokens, to fit the 256-token context) against a
    server with prefix caching on and a KV pool of one full-length request's blocks and two more: half the prompts
    (the hung-up ones among them) share a 64-token prefix (2 blocks), the others are drawn on their own; every answer
    exact, vLLM preempted requests (the scheduler's count) and served the shared prefix from its cache (hits)."""
    shared = _prompts([64], seed=52)[0]
    tails = _prompts(LOAD_LENGTHS, seed=53)
    prompts = [shared + t[1:] if i % 2 == 0 else t for i, t in enumerate(tails)]
    _load(ckpt, tight_server, prompts, hang_up_tokens=120)
    # whether the load above preempts depends on how soon the hung-up streams are aborted (CI once saw none): then
    # 3 clients at once, each to run whole to 230 tokens (8 blocks) -- any two of them outgrow the 11-block pool, so
    # vLLM must preempt one and recompute its tokens, and every answer must still be generate(soft)'s
    long_prompts = _prompts([30, 24, 18], seed=54)
    new = [200, 206, 212]
    want = reference(ckpt["llama"], long_prompts, new)
    barrier = threading.Barrier(len(long_prompts))

    def client(i):
        body = _completion(ckpt["llama"], long_prompts[i], new[i])
        barrier.wait(timeout=60)
        return complete(tight_server.port, body, timeout=600)

    with ThreadPoolExecutor(len(long_prompts)) as pool:
        got = list(pool.map(client, range(len(long_prompts))))
    assert [r["token_ids"] for r in got] == want
    s = json.loads(tight_server.stats.read_text())
    assert s["preemptions"] >= 1 and s["recomputed_generated_tokens"] >= 1 and s["prefix_cache_hits"] >= 64, s


# ----------------------------------------------------------------------------------------------- benchmark


@needs_vllm
def test_bench_serve_runs_once_at_tiny_size(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fullband.cli", "bench", "serve", "--json", "--size", "d64l2",
                           "--vocab-size", "512", "--batch-sizes", "1,4", "--prompt-len", "8", "--new-tokens", "8",
                           "--repeats", "6", "--out", str(tmp_path / "bench"), "--profile", str(tmp_path / "prof")],
                          capture_output=True, text=True, timeout=2 * TIMEOUT, env=_env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)  # stdout is the report alone, though the engines' profilers print their tables
    # --profile: vLLM's op table of each engine, read back; the state write (index_copy_) is the fullband model's
    # alone, the backbone's attention both engines'
    prof = report["profile"]["engines"]
    ops = {name: {op for op, _, _ in prof[name]["ops"]} for name in ("fullband", "plain")}
    assert "aten::index_copy_" in ops["fullband"] and "aten::index_copy_" not in ops["plain"]
    assert "_C::cpu_attention_with_kv_cache" in ops["fullband"] & ops["plain"]
    for name in prof:
        assert sum(us for _, us, _ in prof[name]["ops"]) <= prof[name]["self_cpu_total_us"] * 1.001
        assert any(f.endswith(".profiler_out.txt") for f in os.listdir(tmp_path / "prof" / name))
    for b in ("1", "4"):
        row = report["batch"][b]
        fb, pl = row["fullband_runs"], row["plain_runs"]
        assert len(fb) == len(pl) == 6
        # the report's statistics are those of its own paired runs (6 pairs: the 95% CI is [min, max])
        assert row["paired_ratios"] == pytest.approx([f / p for f, p in zip(fb, pl)], rel=1e-12)
        assert {k: row[k] for k in ("ratio", "ci_low", "ci_high", "min", "max", "verdict")} == pytest.approx(
            {k: v for k, v in summarize_pairs(fb, pl).items() if k in ("ratio", "ci_low", "ci_high", "min", "max",
                                                                         "verdict")})
        assert (row["ci_low"], row["ci_high"]) == (min(row["paired_ratios"]), max(row["paired_ratios"]))


@needs_vllm
def test_bench_serve_shared_prefix_counts_the_prefix_hits(tmp_path):
    """--shared-prefix 256 with vLLM's 128-token CPU blocks: 2 requests of 256 + 4 tokens, 2 timed pairs: after the
    warm-up every request's 2 whole prefix blocks come from the cache (vLLM's own counters, cached engine only:
    hit tokens = 2 runs x 2 requests x 256 of 2 x 2 x 259 queried)."""
    proc = subprocess.run([sys.executable, "-m", "fullband.cli", "bench", "serve", "--json", "--size", "d64l2",
                           "--vocab-size", "512", "--batch-sizes", "2", "--prompt-len", "4", "--new-tokens", "2",
                           "--repeats", "2", "--shared-prefix", "256", "--out", str(tmp_path / "bench")],
                          capture_output=True, text=True, timeout=2 * TIMEOUT, env=_env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    row = report["batch"]["2"]
    assert report["block_size"] == 128 and report["shared_prefix"] == 256
    assert row["prefix_cache_hit_tokens"] == 2 * 2 * 256 and row["prefix_block_hit_rate"] == 1.0, row
    assert row["prefix_cache_queried_tokens"] == 2 * 2 * 259, row  # vLLM looks up all but a prompt's last token
