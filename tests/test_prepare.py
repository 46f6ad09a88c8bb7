"""Prepared data (``fullband data prepare``) and lazy reading: every source kind round-trips to the in-memory
path's tokens, the split rule, the token dtype, the manifest, resuming, bad input, training on it (same losses as
the in-memory path), the O(batch) data order, resume mid-epoch, and ranks reading disjoint rows.

References are written from the definitions here (the split rule, BOS text EOS packing, the old randperm order),
not taken from the package's own helpers."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import sys

import numpy as np
import pytest
import torch

from fullband import cli
from fullband.data.corpus import Corpus, batch_rows, load_documents, train_tokenizer
from fullband.data.shards import open_prepared
from fullband.training.config import TrainConfig
from fullband.training.distributed import DistEnv
from fullband.training.pretrain import PretrainRecipe, train
from fullband.utils.io import read_jsonl

WORDS = "the a of to and in that is was he for it with as his on be at by had not are but from".split()
SEQ = 32


def make_texts(n=40, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 90))) + f" E{i}." for i in range(n)]


def held_out(index: int, seed: int, fraction: float) -> bool:
    """The split rule as the manifest states it."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little")
    return h < fraction * 2.0 ** 64


def encode(tok, text):
    """A document as the in-memory path packs it: BOS, its ids, EOS."""
    return [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]


def tree_hashes(root):
    """sha256 of each token / document-boundary file (done markers also record timings)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".done.json"):
                continue
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "bpe"
    train_tokenizer(make_texts(60, seed=9), vocab_size=300).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def corpus_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_texts()))
    return str(path)


def prep(src, out, *extra):
    return cli.main(["data", "prepare", str(src), "--out", str(out), "--no-progress", *extra])


# ----------------------------------------------------------------------------------------------- sources


def write_source(kind, folder, texts):
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "text-folder":
        for i, t in enumerate(texts):
            (folder / f"{i:03d}.txt").write_text(t)
        return folder
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    if kind == "jsonl":
        (folder / "a.jsonl").write_text(lines)
        return folder / "a.jsonl"
    if kind == "jsonl.gz":
        with gzip.open(folder / "a.jsonl.gz", "wt", encoding="utf-8") as f:
            f.write(lines)
        return folder / "a.jsonl.gz"
    if kind == "jsonl.zst":
        zstandard = pytest.importorskip("zstandard")
        (folder / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
        return folder / "a.jsonl.zst"
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), str(folder / "a.parquet"), row_group_size=7)
        return folder / "a.parquet"
    if kind == "datasets":
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(folder / "ds"))
        return folder / "ds"
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["text-folder", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "datasets"])
def test_every_source_kind_round_trips(kind, tok_dir, tmp_path):
    """Each document lands whole in the split the hash rule says, encoded as the in-memory path encodes it; the
    rows are the in-memory packing of those documents; a blank document is dropped (indices count kept ones)."""
    texts = make_texts(30)
    texts.insert(5, "   ")
    src = write_source(kind, tmp_path / "src", texts)
    out = tmp_path / "prep"
    assert prep(src, out, "--tokenizer", tok_dir, "--val-fraction", "0.3", "--shard-mb", "0.0005") == 0
    pc = open_prepared(str(out), SEQ)
    kept = [t for t in texts if t.strip()]
    tok = pc.tokenizer
    want = {s: [encode(tok, t) for i, t in enumerate(kept) if held_out(i, 0, 0.3) == (s == "val")]
            for s in ("train", "val")}
    assert 3 <= len(want["val"]) <= 20  # the rule holds out some documents, not all
    for split in ("train", "val"):
        got = [d.tolist() for d in pc.documents(split)]
        assert got == want[split]
        stream = [t for d in want[split] for t in d]
        n = len(stream) // SEQ
        rows = pc.train_rows if split == "train" else pc.val_rows
        assert rows.shape == (n, SEQ)
        assert rows[:].tolist() == [stream[r * SEQ:(r + 1) * SEQ] for r in range(n)]
    assert len(pc.manifest["splits"]["train"]["shards"]) > 3  # rows cross shard boundaries


def test_zstd_without_zstandard_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if not installed: importing it raises ImportError
    (tmp_path / "a.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    assert prep(tmp_path / "a.jsonl.zst", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a.jsonl.zst" in err and "pip install zstandard" in err


# ----------------------------------------------------------------------------------------------- split, dtype, manifest


def test_split_is_deterministic_and_seeded(corpus_jsonl, tok_dir, tmp_path):
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        assert prep(corpus_jsonl, tmp_path / name, "--tokenizer", tok_dir, "--seed", seed) == 0
    a, b, c = (json.loads((tmp_path / n / "manifest.json").read_text()) for n in "abc")
    assert a["splits"] == b["splits"] and a["sha256"] == b["sha256"]
    val = {s: [i for i in range(40) if held_out(i, s, 0.1)] for s in (0, 1)}
    assert val[0] != val[1]
    assert a["splits"]["val"]["documents"] == len(val[0]) and c["splits"]["val"]["documents"] == len(val[1])
    assert a["sha256"] != c["sha256"]


def test_token_dtype_follows_the_vocabulary(tmp_path, tok_dir, corpus_jsonl):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|pad|>": 0, "<|bos|>": 1, "<|eos|>": 2, "[UNK]": 3}
    vocab.update({f"w{i}": i for i in range(4, 70_000)})
    wl = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big = PreTrainedTokenizerFast(tokenizer_object=wl, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    big.save_pretrained(str(tmp_path / "big"))
    (tmp_path / "w.jsonl").write_text(json.dumps({"text": "w5 w65535 w65536 w69999"}) + "\n" +
                                      json.dumps({"text": "w4 w70"}) + "\n")
    assert prep(tmp_path / "w.jsonl", tmp_path / "big-prep", "--tokenizer", str(tmp_path / "big"),
                "--val-fraction", "0") == 0
    manifest = json.loads((tmp_path / "big-prep" / "manifest.json").read_text())
    assert manifest["dtype"] == "uint32"
    raw = np.fromfile(tmp_path / "big-prep" / manifest["splits"]["train"]["shards"][0]["file"], dtype="<u4")
    assert raw.tolist() == [1, 5, 65535, 65536, 69999, 2, 1, 4, 70, 2]
    assert prep(corpus_jsonl, tmp_path / "small", "--tokenizer", tok_dir) == 0
    small = json.loads((tmp_path / "small" / "manifest.json").read_text())
    assert small["dtype"] == "uint16"
    shard = small["splits"]["train"]["shards"][0]
    assert os.path.getsize(tmp_path / "small" / shard["file"]) == 2 * shard["tokens"]


def test_a_tokenizer_saved_with_truncation_and_padding_still_encodes_whole_documents(tmp_path, tok_dir):
    """The workers encode with the backend directly (``encode_batch_fast``); a tokenizer.json that carries
    truncation / padding settings must give the ids of a plain ``tok(text, add_special_tokens=False)`` call."""
    from fullband.data.corpus import load_tokenizer

    tok = load_tokenizer(tok_dir)
    tok.backend_tokenizer.enable_truncation(max_length=5)
    tok.backend_tokenizer.enable_padding(length=64, pad_id=0, pad_token="<|pad|>")
    tok.save_pretrained(str(tmp_path / "trunc"))
    assert json.loads((tmp_path / "trunc" / "tokenizer.json").read_text())["truncation"]["max_length"] == 5
    texts = make_texts(12)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "prep"
    assert prep(tmp_path / "t.jsonl", out, "--tokenizer", str(tmp_path / "trunc"), "--val-fraction", "0",
                "--workers", "2", "--shard-mb", "0.0005") == 0
    plain = load_tokenizer(tok_dir)
    got = [d.tolist() for d in open_prepared(str(out), SEQ).documents("train")]
    assert got == [encode(plain, t) for t in texts]
    assert max(len(d) for d in got) > 64


def test_manifest_fields_and_a_changed_tokenizer(corpus_jsonl, tok_dir, tmp_path, capsys):
    out = tmp_path / "p"
    assert prep(corpus_jsonl, out, "--vocab-size", "300", "--val-fraction", "0.2") == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("fullband data prepare: 40 documents") and len(line.splitlines()) == 1
    m = json.loads((out / "manifest.json").read_text())
    texts = make_texts()
    train_texts = [t for i, t in enumerate(texts) if not held_out(i, 0, 0.2)]
    # the BPE was trained on the whole (small) training split: the in-memory path's tokenizer of those documents
    assert open_prepared(str(out), SEQ).tokenizer.get_vocab() == train_tokenizer(train_texts, 300).get_vocab()
    tok = open_prepared(str(out), SEQ).tokenizer
    tokens = {s: sum(len(encode(tok, t)) for i, t in enumerate(texts) if held_out(i, 0, 0.2) == (s == "val"))
              for s in ("train", "val")}
    assert m["format_version"] == 1 and m["dtype"] == "uint16" and m["documents"] == 40
    assert {s: m["splits"][s]["tokens"] for s in tokens} == tokens and m["tokens"] == sum(tokens.values())
    assert m["splits"]["val"]["documents"] == sum(held_out(i, 0, 0.2) for i in range(40))
    assert m["tokenizer"]["vocab_size"] == 300 and (m["tokenizer"]["bos_id"], m["tokenizer"]["eos_id"]) == (1, 2)
    assert "trained on the first 64.0 MB" in m["tokenizer"]["source"]
    assert m["sources"] == [{"path": os.path.abspath(corpus_jsonl), "kind": "jsonl",
                             "bytes": os.path.getsize(corpus_jsonl)}]
    cfg = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 7
    (out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="differs from the tokenizer the shards were encoded with"):
        open_prepared(str(out), SEQ)


# ----------------------------------------------------------------------------------------------- resume, bad input


def test_resumed_prepare_is_byte_identical(corpus_jsonl, tok_dir, tmp_path, capsys):
    fresh, resumed = tmp_path / "fresh", tmp_path / "resumed"
    common = ["--vocab-size", "300", "--shard-mb", "0.001"]
    assert prep(corpus_jsonl, fresh, *common) == 0
    assert prep(corpus_jsonl, resumed, *common, "--workers", "2", "--stop-after-shards", "2") == 0
    assert "stopped after 2 new shards" in capsys.readouterr().out
    assert not (resumed / "manifest.json").exists()
    with pytest.raises(ValueError, match="unfinished"):
        open_prepared(str(resumed), SEQ)
    # what a SIGKILL leaves: a temporary file, a shard's tokens without its done marker
    (resumed / "shards" / "000003.train.bin.tmp").write_bytes(b"torn")
    (resumed / "shards" / "000002.train.bin").write_bytes(b"\x01\x00")
    os.unlink(resumed / "shards" / "000002.done.json") if (resumed / "shards" / "000002.done.json").exists() else None
    assert prep(corpus_jsonl, resumed, *common, "--workers", "2") == 0
    assert tree_hashes(fresh / "shards") == tree_hashes(resumed / "shards")
    mf, mr = (json.loads((d / "manifest.json").read_text()) for d in (fresh, resumed))
    assert mf["splits"] == mr["splits"] and mf["sha256"] == mr["sha256"]
    # other settings in the same directory: refused (the data is kept), unless --overwrite
    assert prep(corpus_jsonl, resumed, "--vocab-size", "301", "--shard-mb", "0.001") == 2
    assert "other settings (tokenizer)" in capsys.readouterr().err
    assert tree_hashes(fresh / "shards") == tree_hashes(resumed / "shards")


def test_malformed_jsonl_line_is_one_line_error_and_nothing_half_written(tok_dir, tmp_path, capsys):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in make_texts(10)))
    (folder / "b.jsonl").write_text(json.dumps({"text": "fine"}) + "\n\n" + '{"text": "cut here\n')
    out = tmp_path / "out"
    assert prep(folder, out, "--tokenizer", tok_dir, "--shard-mb", "0.0005", "--workers", "2") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{folder / 'b.jsonl'}:3: not valid JSON" in err
    assert not (out / "manifest.json").exists()
    names = os.listdir(out / "shards")
    assert not [n for n in names if n.endswith(".tmp")]
    for n in names:  # every shard on disk is complete: it has its done marker
        assert n.split(".")[0] + ".done.json" in names


# ----------------------------------------------------------------------------------------------- training


def cfg(data, out, **kw):
    base = dict(out=str(out), preset="micro", steps=6, seed=0, data=data, vocab_size=300, seq_len=SEQ, batch_size=4,
                progress=False, tensorboard=False, plot=False, eval_every=3, eval_rows=4)
    base.update(kw)
    return TrainConfig(**base)


def losses(out):
    return [(r["step"], r["loss"], r["pass_losses"], r["num_passes"])
            for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("split") == "train"]


def val_losses(out):
    return [r["val_loss"] for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("split") == "val"]


@pytest.fixture(scope="module")
def prepared(corpus_jsonl, tok_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "p"
    assert prep(corpus_jsonl, out, "--tokenizer", tok_dir, "--val-fraction", "0.2", "--shard-mb", "0.002") == 0
    return str(out)


FEEDBACK = dict(feedback_start=0.5, num_passes=2, prefix_mix=0.5)


def test_training_on_prepared_data_equals_the_in_memory_path(prepared, corpus_jsonl, tmp_path):
    """Same documents, tokenizer, packing and order (the prepared data's Feistel order, given to the in-memory
    corpus): the same losses, bitwise, with feedback and prefix mixing on."""
    from fullband.data.corpus import load_tokenizer, pack, tokenize_documents

    a = train(cfg(prepared, tmp_path / "a", **FEEDBACK))
    docs = load_documents(corpus_jsonl)
    tok = load_tokenizer(os.path.join(prepared, "tokenizer"))
    tr = [d for i, d in enumerate(docs) if not held_out(i, 0, 0.2)]
    va = [d for i, d in enumerate(docs) if held_out(i, 0, 0.2)]
    mem = Corpus(tok, pack(tokenize_documents(tok, tr), SEQ), pack(tokenize_documents(tok, va), SEQ),
                 [d.name for d in tr], [d.name for d in va], order="feistel")
    b = train(cfg(corpus_jsonl, tmp_path / "b", **FEEDBACK), corpus=mem)
    assert a["status"] == b["status"] == "done"
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert [x[3] for x in la] == [1, 1, 1, 2, 2, 2] and la == lb
    assert val_losses(tmp_path / "a") == val_losses(tmp_path / "b") and len(val_losses(tmp_path / "a")) == 2


def test_resume_mid_epoch_equals_uninterrupted(prepared, tmp_path):
    rows = open_prepared(prepared, 128).train_rows.shape[0]
    assert 4 * 3 % rows != 0 and rows < 4 * 6  # step 3 ends mid-epoch; the run crosses an epoch boundary
    full = train(cfg(prepared, tmp_path / "full", seq_len=128, **FEEDBACK))
    first = train(cfg(prepared, tmp_path / "part", seq_len=128, stop_after=3, **FEEDBACK))
    assert full["status"] == "done" and first["status"] == "paused"
    train(cfg(prepared, tmp_path / "part", seq_len=128, **FEEDBACK), resume=True)
    assert losses(tmp_path / "part") == losses(tmp_path / "full")


def test_ranks_read_disjoint_rows_and_build_the_single_process_batch(prepared, tmp_path):
    recipe = PretrainRecipe(cfg(prepared, tmp_path / "r", batch_size=8, grad_accum=2))
    recipe.setup(None)
    read = []
    rows = recipe.train_rows

    class Recording:
        shape = rows.shape

        def __getitem__(self, index):
            read.append(index.tolist())
            return rows[index]

    recipe.train_rows = Recording()
    for step in (0, 5):
        single = recipe.batch(step, 2, torch.Generator().manual_seed(step), DistEnv())
        read.clear()
        parts = [recipe.batch(step, 2, torch.Generator().manual_seed(step), DistEnv(rank=r, world_size=2))
                 for r in (0, 1)]
        assert len(read) == 2 and not set(read[0]) & set(read[1]) and len(read[0]) == 4
        for key in ("input_ids", "feedback_mask"):
            whole = torch.cat([m[key] for m in single.micro])
            split = torch.cat([m[key] for p in parts for m in p.micro])
            assert torch.equal(whole, split)
        assert not torch.cat([m["feedback_mask"] for m in single.micro]).all()


def test_training_refuses_another_tokenizer(prepared, tmp_path):
    other = tmp_path / "tok"
    train_tokenizer(make_texts(50, seed=3), vocab_size=310).save_pretrained(str(other))
    with pytest.raises(ValueError, match="prepared with another tokenizer"):
        train(cfg(prepared, tmp_path / "x", tokenizer=str(other)))


# ----------------------------------------------------------------------------------------------- data order


def old_batch_rows(step, batch_size, num_rows, seed=0):
    """The data order every in-memory run was trained with (before prepared data): a randperm per epoch."""
    rows = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(pos, num_rows)
        perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        rows.append(int(perm[i]))
    return rows


def test_in_memory_order_is_unchanged_and_built_once_per_epoch(monkeypatch):
    for n, b, seed in ((10, 4, 0), (7, 3, 2), (3, 8, 1)):
        for step in range(7):
            assert batch_rows(step, b, n, seed).tolist() == old_batch_rows(step, b, n, seed)
    calls = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(a) or real(*a, **k))
    for step in range(25):  # 100 positions of 997 rows: one epoch, one permutation
        batch_rows(step, 4, 997, seed=5)
    assert len(calls) == 1


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_feistel_order_is_a_permutation_per_epoch(n, monkeypatch):
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: (_ for _ in ()).throw(AssertionError("randperm")))
    b = 7
    seq = [r for step in range(-(-3 * n // b)) for r in batch_rows(step, b, n, 0, "feistel").tolist()]
    epochs = [seq[e * n:(e + 1) * n] for e in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(n))  # every row exactly once per epoch
    if n >= 5:
        assert epochs[0] != epochs[1]  # a new order each epoch
        assert batch_rows(0, n, n, 1, "feistel").tolist() != epochs[0]  # and for another seed
        assert epochs[0] != list(range(n))


def test_feistel_order_costs_o_batch():
    """10^15 rows: no array of the row count can exist; a batch still comes back, in range and distinct."""
    rows = batch_rows(123456789, 64, 10**15, seed=3, order="feistel")
    assert rows.shape == (64,) and int(rows.min()) >= 0 and int(rows.max()) < 10**15
    assert len(set(rows.tolist())) == 64


def test_data_bench_runs_and_its_markdown_reads_its_own_numbers(tmp_path, capsys):
    """``fullband data bench`` at a tiny size (prepare only): one JSON object on stdout with the seed, the load and
    the prepare's figures, whose Markdown (the generated page) shows those figures and the memory bar's verdict;
    the training start-up comparison says NOT met when the prepared directory is more than 10% slower, and the
    generated files are deleted."""
    from fullband.commands.data_bench import BARS, format_result

    work = tmp_path / "bench"
    assert cli.main(["data", "bench", "--gb", "0.002", "--workers", "1", "--tokenizer-sample-mb", "0.5",
                     "--skip-train", "--workdir", str(work)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert not work.exists()  # deleted without --keep
    p = res["prepare"]
    assert res["seed"] == 0 and len(res["load_average"]) == 2 and p["rc"] == 0 and p["tokens"] > 0
    assert p["tokens"] == p["run"]["tokens"] and res["corpus"]["bytes"] >= 0.002e9
    text = format_result(res)
    assert f"{p['tokens']:,} `{p['dtype']}` tokens" in text and f"{p['peak_pss_mb_tree']:,} MB**" in text
    assert f"({'met' if p['peak_pss_mb_tree'] < BARS['prepare_peak_mb'] else 'NOT met'})" in text
    assert "train --preset micro" not in text  # --skip-train: no start-up rows
    res["train_embedded"] = {"wall_s": 10.0, "cpu_s_tree": 9.0, "peak_rss_mb_main": 900.0}
    res["train_prepared"] = {"wall_s": 11.5, "cpu_s_tree": 10.0, "peak_rss_mb_main": 800.0}
    res["train_prepared_vs_embedded"] = {"wall_ratio": 1.15, "rss_mb_delta": -100.0}
    last = format_result(res).splitlines()[-1]
    assert "wall ratio 1.15, RSS -100.0 MB" in last and last.endswith("(NOT met) |")
    res["train_prepared_vs_embedded"]["wall_ratio"] = 0.9
    assert format_result(res).splitlines()[-1].endswith("(met) |")
