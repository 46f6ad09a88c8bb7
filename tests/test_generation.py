"""Decoding with latent feedback: every decode path against a from-scratch recomputation with the exact recurrence."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from conftest import BOS, EOS, PAD, VOCAB, random_ids, tiny_backbone, tiny_model

from fullband import cli
from fullband.model.cache import FeedbackCache, FeedbackStaticCache, cache_bytes
from fullband.model.configuration import FEEDBACK_MODES
from fullband.model.feedback import build_feedback_mask, fuse_where, gate_table, shift_right
from fullband.model.generation import generate, score

ATOL = 1e-5


# ----------------------------------------------------------------------------------------------- references


def _hidden_and_logits(model, inputs_embeds, mask, positions):
    out = model.backbone(inputs_embeds=inputs_embeds, attention_mask=mask, position_ids=positions,
                         output_hidden_states=True)
    return out.hidden_states[-1], out.logits


@torch.no_grad()
def reference_decode(model, ids, mask, mode, n, passes=1, forced=None):
    """From scratch, no cache: the whole sequence's inputs are rebuilt and re-run at every step. The prompt is
    treated as ``mode`` says; every new token is fused with the final state of the step before it."""
    B, P = ids.shape
    mask = torch.ones_like(ids) if mask is None else mask
    embed = model.get_input_embeddings()
    e = embed(ids)
    fmask = build_feedback_mask(ids, mask, BOS)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    if mode in ("standard", "soft"):
        u = e
    elif mode == "fused":
        u = e
        for _ in range(passes):
            h, _ = _hidden_and_logits(model, u, mask, pos)
            u = fuse_where(fmask, model.feedback(shift_right(h), e), e)
    else:
        h = model.recurrent_forward(ids, mask).last_hidden_state
        u = fuse_where(fmask, model.feedback(shift_right(h), e), e)
    tokens, logits = [], []
    for i in range(n):
        m = torch.cat([mask, mask.new_ones(B, i)], 1)
        p = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(i)], 1)
        h, lg = _hidden_and_logits(model, u, m, p)
        logits.append(lg[:, -1])
        tok = lg[:, -1].argmax(-1) if forced is None else forced[:, i]
        tokens.append(tok)
        et = embed(tok)[:, None]
        if mode != "standard":
            et = fuse_where((tok != BOS)[:, None], model.feedback(h[:, -1:], et), et)
        u = torch.cat([u, et], 1)
    return torch.stack(tokens, 1), torch.stack(logits, 1)


def recurrence_logits(model, seq, mask, prompt_len, mode):
    """Logits of the whole sequence through ``recurrent_forward``; the prompt is fused only in ``exact`` mode."""
    full_mask = torch.cat([mask, mask.new_ones(seq.shape[0], seq.shape[1] - mask.shape[1])], 1)
    fmask = build_feedback_mask(seq, full_mask, BOS)
    if mode == "soft":
        fmask[:, :prompt_len] = False
    return model.recurrent_forward(seq, full_mask, feedback_mask=fmask).logits


def padded_batch(lengths, seed=0):
    P = max(lengths)
    rows = [random_ids(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)]
    ids = torch.full((len(rows), P), PAD)
    mask = torch.zeros((len(rows), P), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, P - len(r):] = r
        mask[i, P - len(r):] = 1
    return ids, mask, rows


def hf_greedy(model, ids, mask, mode, n, **kw):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, feedback_mode=mode,
                         eos_token_id=None, return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


# ----------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("mode", FEEDBACK_MODES)
def test_greedy_with_cache_equals_recomputation(llama, mode):
    ids, mask, _ = padded_batch([7, 4, 6])
    n = 6
    ref_tok, ref_logits = reference_decode(llama, ids, mask, mode, n, passes=2)
    if mode != "fused":  # the same through the exact recurrence over the whole sequence
        rec = recurrence_logits(llama, torch.cat([ids, ref_tok], 1), mask, ids.shape[1], mode)
        torch.testing.assert_close(rec[:, ids.shape[1] - 1:-1], ref_logits, atol=ATOL, rtol=0)
    tok, logits = hf_greedy(llama, ids, mask, mode, n, prefill_passes=2)
    assert torch.equal(tok, ref_tok)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    for cache in ("static", "dynamic"):
        res = generate(llama, ids, mask, mode=mode, max_new_tokens=n, prefill_passes=2, ignore_eos=True,
                       output_logits=True, cache_implementation=cache)
        assert torch.equal(res.new_tokens, ref_tok)
        torch.testing.assert_close(res.logits, ref_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "mistral"])
def test_other_families_match_recomputation(family):
    model = tiny_model(family)
    ids, mask, _ = padded_batch([5, 3])
    for mode in ("soft", "exact"):
        ref_tok, ref_logits = reference_decode(model, ids, mask, mode, 4)
        tok, logits = hf_greedy(model, ids, mask, mode, 4)
        res = generate(model, ids, mask, mode=mode, max_new_tokens=4, ignore_eos=True, output_logits=True)
        assert torch.equal(tok, ref_tok) and torch.equal(res.new_tokens, ref_tok)
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(res.logits, ref_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("fusion", ["concat", "add"])
def test_ablation_fusions_decode_exactly(fusion):
    model = tiny_model("llama", fusion=fusion)
    ids = random_ids(2, 5)
    ref_tok, ref_logits = reference_decode(model, ids, None, "exact", 4)
    res = generate(model, ids, mode="exact", max_new_tokens=4, ignore_eos=True, output_logits=True)
    assert torch.equal(res.new_tokens, ref_tok)
    torch.testing.assert_close(res.logits, ref_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", FEEDBACK_MODES)
def test_batch_equals_each_row_alone(llama, mode):
    ids, mask, rows = padded_batch([8, 3, 5], seed=3)
    n = 5
    tok, logits = hf_greedy(llama, ids, mask, mode, n)
    lean = generate(llama, ids, mask, mode=mode, max_new_tokens=n, ignore_eos=True, output_logits=True)
    assert torch.equal(lean.new_tokens, tok)
    for i, row in enumerate(rows):
        alone = generate(llama, row[None], mode=mode, max_new_tokens=n, ignore_eos=True, output_logits=True)
        assert torch.equal(alone.new_tokens[0], tok[i])
        torch.testing.assert_close(alone.logits[0], logits[i], atol=ATOL, rtol=0)
        torch.testing.assert_close(lean.logits[i], logits[i], atol=ATOL, rtol=0)


def test_bos_in_the_middle_is_not_fused(llama):
    ids = random_ids(1, 7)
    ids[0, 4] = BOS  # a second document starts inside the prompt
    for mode in ("exact", "fused"):
        ref_tok, ref_logits = reference_decode(llama, ids, None, mode, 3)
        res = generate(llama, ids, mode=mode, max_new_tokens=3, ignore_eos=True, output_logits=True)
        assert torch.equal(res.new_tokens, ref_tok)
        torch.testing.assert_close(res.logits, ref_logits, atol=ATOL, rtol=0)


def test_score_is_the_teacher_forced_recurrence(llama):
    ids, mask, _ = padded_batch([6, 4], seed=5)
    cont = random_ids(2, 5, seed=9, bos=False)
    for mode in ("soft", "exact", "fused"):
        _, ref_logits = reference_decode(llama, ids, mask, mode, 5, forced=cont)
        ref = ref_logits.log_softmax(-1).gather(-1, cont[..., None])[..., 0]
        torch.testing.assert_close(score(llama, ids, cont, mask, mode=mode), ref, atol=ATOL, rtol=0)


def test_standard_on_feedback_model_equals_backbone_generate(llama):
    ids, mask, _ = padded_batch([6, 4])
    plain = llama.backbone.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                    eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    plain_logits = torch.stack(plain.logits, 1)
    tok, logits = hf_greedy(llama, ids, mask, "standard", 6)
    assert torch.equal(tok, plain.sequences[:, ids.shape[1]:])
    torch.testing.assert_close(logits, plain_logits, atol=ATOL, rtol=0)
    for model in (llama, llama.backbone):  # the lean loop runs a plain HF model too
        res = generate(model, ids, mask, mode="standard", max_new_tokens=6, ignore_eos=True, output_logits=True)
        assert torch.equal(res.new_tokens, tok)
        torch.testing.assert_close(res.logits, plain_logits, atol=ATOL, rtol=0)


def test_default_mode_comes_from_config(llama):
    ids = random_ids(1, 5)
    default = llama.config.default_feedback_mode
    a = generate(llama, ids, max_new_tokens=4, ignore_eos=True)
    b = generate(llama, ids, mode=default, max_new_tokens=4, ignore_eos=True)
    assert a.mode == default and torch.equal(a.sequences, b.sequences)
    assert torch.equal(llama.generate(ids, max_new_tokens=4, eos_token_id=None),
                       llama.generate(ids, max_new_tokens=4, eos_token_id=None, feedback_mode=default))


# ----------------------------------------------------------------------------------------------- HF strategies


def test_sampling_is_reproducible_and_consistent(llama):
    ids, mask, _ = padded_batch([5, 3], seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
              num_return_sequences=3, feedback_mode="soft", eos_token_id=None, return_dict_in_generate=True,
              output_logits=True)
    torch.manual_seed(11)
    a = llama.generate(ids, **kw)
    torch.manual_seed(11)
    b = llama.generate(ids, **kw)
    assert a.sequences.shape == (6, ids.shape[1] + 5) and torch.equal(a.sequences, b.sequences)
    # the state followed the num_return_sequences expansion: each row's logits are its own recurrence's
    rec = recurrence_logits(llama, a.sequences, mask.repeat_interleave(3, 0), ids.shape[1], "soft")
    torch.testing.assert_close(torch.stack(a.logits, 1), rec[:, ids.shape[1] - 1:-1], atol=ATOL, rtol=0)
    lean = [generate(llama, ids, mask, mode="soft", max_new_tokens=5, do_sample=True, temperature=0.8, top_k=20,
                     top_p=0.9, generator=torch.Generator().manual_seed(5), ignore_eos=True).sequences
            for _ in range(2)]
    assert torch.equal(lean[0], lean[1])


def test_lean_sampling_filters(llama):
    ids = random_ids(2, 5)
    greedy = generate(llama, ids, mode="soft", max_new_tokens=5, ignore_eos=True).sequences
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-4)):
        sampled = generate(llama, ids, mode="soft", max_new_tokens=5, ignore_eos=True, do_sample=True,
                           generator=torch.Generator().manual_seed(0), **kw).sequences
        assert torch.equal(sampled, greedy), kw
    with pytest.raises(ValueError, match="temperature"):
        generate(llama, ids, mode="soft", max_new_tokens=2, do_sample=True, temperature=0.0)


@pytest.mark.parametrize("mode", ["soft", "exact"])
def test_beam_search_state_follows_reordering(llama, mode):
    ids, mask, _ = padded_batch([6, 4], seed=2)
    kw = dict(attention_mask=mask, max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False,
              length_penalty=0.0, feedback_mode=mode, eos_token_id=None, return_dict_in_generate=True,
              output_scores=True)
    a = llama.generate(ids, **kw)
    b = llama.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    P = ids.shape[1]
    rec = recurrence_logits(llama, a.sequences, mask.repeat_interleave(2, 0), P, mode)
    logp = rec[:, P - 1:-1].log_softmax(-1).gather(-1, a.sequences[:, P:, None])[..., 0].sum(-1)
    torch.testing.assert_close(a.sequences_scores, logp, atol=1e-4, rtol=0)


def test_feedback_cache_moves_state_with_kv():
    cache = FeedbackCache()
    k = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 2, 4).contiguous()
    cache.update(k, k.clone(), 0)
    cache.set_state(torch.arange(3.0)[:, None].expand(3, 5).contiguous())
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert cache.feedback_state[:, 0].tolist() == [2, 2, 0] and cache.layers[0].keys[:, 0, 0, 0].tolist() == [2, 2, 0]
    cache.batch_repeat_interleave(2)
    assert cache.feedback_state[:, 0].tolist() == [2, 2, 2, 2, 0, 0]
    cache.batch_select_indices(torch.tensor([0, 5]))
    assert cache.feedback_state[:, 0].tolist() == [2, 0] and cache.layers[0].keys[:, 0, 0, 0].tolist() == [2, 0]
    old = cache.feedback_state
    cache.update(k[:2, :, :1], k[:2, :, :1], 0)
    cache.set_state(torch.zeros(2, 5))
    cache.crop(-1)  # one step back: the previous state comes back
    assert cache.get_seq_length() == 2 and torch.equal(cache.feedback_state, old)
    cache.crop(-1)
    assert cache.feedback_state is None


def test_eos_streamer_and_stop_strings(llama, tmp_path):
    from transformers import StopStringCriteria, TextIteratorStreamer

    tok = _tiny_tokenizer()
    ids = random_ids(1, 5)
    free = generate(llama, ids, mode="soft", max_new_tokens=8, ignore_eos=True).new_tokens[0]
    stop_tok = int(free[2])
    # EOS: the lean loop stops at it and equals the free run up to there; HF generate too
    res = generate(llama, ids, mode="soft", max_new_tokens=8, eos_token_id=stop_tok)
    assert res.new_tokens[0].tolist() == free[:3].tolist()
    hf = llama.generate(ids, max_new_tokens=8, feedback_mode="soft", eos_token_id=stop_tok, pad_token_id=PAD)
    assert hf[0, 5:].tolist() == free[:3].tolist()
    # stop strings, through HF generate and through the lean loop's `stopping`
    free_exact = generate(llama, ids, mode="exact", max_new_tokens=8, ignore_eos=True).new_tokens[0].tolist()
    stop_exact = tok.convert_ids_to_tokens(free_exact[2])
    hf = llama.generate(ids, max_new_tokens=8, feedback_mode="exact", eos_token_id=None, stop_strings=[stop_exact],
                        tokenizer=tok)
    assert hf[0, 5:].tolist() == free_exact[:free_exact.index(free_exact[2]) + 1]
    stop = tok.convert_ids_to_tokens(stop_tok)
    lean = generate(llama, ids, mode="soft", max_new_tokens=8, ignore_eos=True,
                    stopping=StopStringCriteria(tok, [stop]))
    assert lean.new_tokens[0].tolist() == free[:3].tolist()
    # a TextIteratorStreamer fed by HF generate in a thread, and by the lean loop
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    thread = threading.Thread(target=llama.generate, args=(ids,),
                              kwargs=dict(max_new_tokens=6, feedback_mode="soft", eos_token_id=None,
                                          streamer=streamer))
    thread.start()
    text = "".join(streamer)
    thread.join()
    expected = tok.decode(free[:6])
    assert text == expected
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    generate(llama, ids, mode="soft", max_new_tokens=6, ignore_eos=True, streamer=streamer)
    assert "".join(streamer) == expected


# ----------------------------------------------------------------------------------------------- gate table


def test_gate_table_is_the_gate_from_raw_weights(llama):
    """Each row of the table is sigmoid(W_G e / rms(e)) of its vocabulary entry, computed here from the raw weights,
    whatever the chunking (7 does not divide the vocabulary). That the table is never stale -- after real training
    steps, p.data.copy_, load_state_dict, .to(), resizing -- is tests/test_gate_fresh.py's."""
    embed = llama.get_input_embeddings().weight
    w_g, eps = llama.feedback.gate_proj.weight, llama.feedback.embed_norm.eps
    expected = torch.sigmoid(embed / torch.sqrt(embed.pow(2).mean(-1, keepdim=True) + eps) @ w_g.T).detach()
    for chunk in (7, 4096):
        torch.testing.assert_close(gate_table(llama.feedback, llama.get_input_embeddings(), chunk=chunk), expected,
                                   atol=1e-6, rtol=0)


def test_kv_cache_bytes_identical_across_modes(llama):
    ids = random_ids(2, 6)
    sizes = {mode: cache_bytes(generate(llama, ids, mode=mode, max_new_tokens=4, ignore_eos=True,
                                        cache_implementation="dynamic").cache)
             for mode in ("standard", "soft", "fused", "exact")}
    assert len({s["kv"] for s in sizes.values()}) == 1 and sizes["standard"]["state"] == 0
    assert sizes["soft"]["state"] == 2 * 32 * 4
    static = generate(llama, ids, mode="soft", max_new_tokens=4, ignore_eos=True, cache_implementation="static")
    assert isinstance(static.cache, FeedbackStaticCache)


# ----------------------------------------------------------------------------------------------- errors


def test_errors_are_clear_value_errors(llama):
    ids = random_ids(1, 5)
    plain = tiny_backbone("llama")
    with pytest.raises(ValueError, match="needs a model with latent feedback"):
        generate(plain, ids, mode="soft", max_new_tokens=2)
    with pytest.raises(ValueError, match="unknown decode mode"):
        generate(llama, ids, mode="turbo", max_new_tokens=2)
    with pytest.raises(ValueError, match="unknown decode mode"):
        llama.generate(ids, max_new_tokens=2, feedback_mode="turbo")
    with pytest.raises(ValueError, match="128 positions"):
        generate(llama, random_ids(1, 120), mode="soft", max_new_tokens=10)
    with pytest.raises(ValueError, match="128 positions"):
        llama.generate(random_ids(1, 120), max_new_tokens=10, feedback_mode="exact")
    with pytest.raises(ValueError, match="128 positions"):
        llama.generate(random_ids(1, 130), max_new_tokens=1, feedback_mode="standard")
    with pytest.raises(ValueError, match="prefill_passes"):
        llama.generate(ids, max_new_tokens=2, feedback_mode="fused", prefill_passes=0)
    with pytest.raises(ValueError, match="use_cache"):
        llama.generate(ids, max_new_tokens=2, feedback_mode="soft", use_cache=False)
    with pytest.raises(ValueError, match="static cache"):
        llama.generate(ids, max_new_tokens=2, feedback_mode="soft", cache_implementation="static")


# ----------------------------------------------------------------------------------------------- CLI


def _tiny_tokenizer(path=None):
    """Character-level: id i <-> chr(30 + i) for the 94 printable ASCII characters; 0/1/2 are pad/BOS/EOS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **{chr(30 + i): i for i in range(3, VOCAB)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def test_cli_generate_streams(llama, tmp_path, capsys):
    model_dir = tmp_path / "model"
    llama.save_pretrained(model_dir)
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", "ab"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer" in err and len(err.strip().splitlines()) == 1
    tok = _tiny_tokenizer()
    tok.save_pretrained(model_dir)
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", "ab", "--mode", "exact",
                     "--max-new-tokens", "4", "--ignore-eos", "--no-special-tokens"]) == 0
    out = capsys.readouterr()
    prompt = torch.tensor([tok("ab", add_special_tokens=False)["input_ids"]])
    expected = generate(llama, prompt, mode="exact", max_new_tokens=4, ignore_eos=True).sequences[0]
    assert out.out.strip() == tok.decode(expected, skip_special_tokens=True).strip()
    assert "exact: 4 new tokens" in out.err
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", "ab", "--temperature", "0.7",
                     "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "3", "--no-stream"]) == 0


def test_cli_bench_decode_json(capsys):
    assert cli.main(["bench", "decode", "--json", "--sizes", "d32l1", "--batch-sizes", "1", "--new-tokens", "3",
                     "--prompt-len", "4", "--repeats", "1", "--vocab", "97"]) == 0
    report = json.loads(capsys.readouterr().out)
    (size,) = report["sizes"]
    runs = {(r["mode"], r["loop"]) for r in size["runs"]}
    assert {("standard", "lean"), ("soft", "lean"), ("fused", "hf"), ("exact", "lean"), ("standard", "hf")} <= runs
    assert len({m["kv_bytes"] for m in size["cache"].values()}) == 1
    # MACs counted by hand for GPT-2 d32 L1, vocab 97, 4-token prompt, 3 new tokens (mean context 5.5): per layer
    # qkv 32*96 + proj 32*32 + mlp 2*32*128 = 12288, LM head 97*32 = 3104, attention 2*5.5*32 = 352; feedback per
    # token: W_U 32*32 + W_G 32*32 (the gate is computed per token: 3 tokens < 97) + 2*3*32 = 2240
    assert size["macs_per_token"] == 12288 + 3104 + 352 and size["extra_macs_per_token"] == 2240
    assert size["flop_overhead"]["soft"] == pytest.approx(2240 / 15744)
    assert size["flop_overhead_table_lookup"] == pytest.approx((1024 + 96) / 15744)
    assert size["gate_table_macs"] == 97 * 32 * 32
    assert size["paired_decode_ratios"]["soft/standard lean b1"] > 0
    assert all(r["same_tokens_as_lean"] for r in size["runs"] if r["loop"] == "hf")
