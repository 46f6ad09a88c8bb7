"""``fullband data prepare`` on long documents: a document is read and tokenized in pieces cut between words (the
same token ids as one call on the whole text, exactly one BOS and one EOS), its shards run on across shard
boundaries, a run that cannot be cut is a one-line error with nothing half-written, and the peak memory of a
single huge ``.txt`` document does not grow with its size.

References are the one-call encodings ``tok(text, add_special_tokens=False)`` of whole texts and the BOS text EOS
packing written out here, not the package's own helpers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fullband import cli
from fullband.data.corpus import embedded_corpus, load_tokenizer, train_tokenizer
from fullband.data.shards import open_prepared
from fullband.data.sources import split_text

WORDS = "the a of to and in that is was he for it with as his on be at by had not are but from".split()


def held_out(index: int, seed: int, fraction: float) -> bool:
    import hashlib

    h = int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little")
    return h < fraction * 2.0 ** 64


def long_text(n_words: int, seed: int) -> str:
    """Words, punctuation, digits, runs of spaces / tabs / blank lines, a contraction: cut points of every kind."""
    rng = random.Random(seed)
    seps = [" "] * 12 + ["\n"] * 3 + ["  ", "\n\n", " \n", "\t", ".\n", ", ", "\n  ", "'s "]
    out = []
    for _ in range(n_words):
        out.append(rng.choice(WORDS) if rng.random() < 0.9 else str(rng.randint(0, 99999)))
        out.append(rng.choice(seps))
    return "".join(out).strip() + " end."


@pytest.fixture(scope="module")
def embedded_tok():
    """The package's byte-level BPE trained on the embedded corpus."""
    return train_tokenizer([d.text for d in embedded_corpus()[:6]], vocab_size=1000)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("piece", [60, 997, 20_000])
def test_pieces_cut_between_words_tokenize_as_the_whole_text(embedded_tok, piece):
    """Embedded works and a text with every kind of whitespace, cut at spaces and newlines: the concatenated ids of
    the pieces are the ids of the whole text; and a cut right after a space would change them (the test can fail)."""
    texts = [d.text for d in embedded_corpus()[6:9]] + [long_text(3000, 1)]
    starts = set()
    for text in texts:
        pieces = split_text(text, piece)
        assert "".join(pieces) == text and max(map(len, pieces)) <= piece and len(pieces) > len(text) // piece
        starts.update(p[0] for p in pieces[1:])
        got = [t for p in pieces for t in ids(embedded_tok, p)]
        assert got == ids(embedded_tok, text)
    assert starts == {" ", "\n"}  # cuts at both
    text = texts[-1]
    bad = text.index("the a") + 4  # after the space: the whole text has "the", " a", the pieces "the", " ", "a"
    assert ids(embedded_tok, text[:bad]) + ids(embedded_tok, text[bad:]) != ids(embedded_tok, text)


def prep(src, out, *extra):
    return cli.main(["data", "prepare", str(src), "--out", str(out), "--no-progress", *extra])


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "bpe"
    train_tokenizer([long_text(2000, 9)], vocab_size=300).save_pretrained(str(path))
    return str(path)


def test_a_document_in_many_pieces_and_shards_gives_the_one_call_ids(tok_dir, tmp_path, capsys):
    """Four long .txt documents (a few small ones between), 100-character pieces, 1000-character shards: each
    document comes back as BOS + the one-call ids of its whole text + EOS (one BOS, one EOS), in the split of the
    hash rule, its shards marked as continuing; the token files equal those of the one-piece run concatenated; the
    manifest counts each document once; a resumed run is byte-identical."""
    src = tmp_path / "src"
    src.mkdir()
    texts = [long_text(700, s) if s % 2 == 0 else f"short {s}" for s in range(7)]
    for i, t in enumerate(texts):
        (src / f"{i}.txt").write_text(t)
    small, tiny = tmp_path / "one-piece", tmp_path / "pieces"
    common = ["--tokenizer", tok_dir, "--val-fraction", "0.4", "--seed", "3"]
    assert prep(src, small, *common, "--shard-mb", "1") == 0
    assert prep(src, tiny, *common, "--shard-mb", "0.001", "--piece-mb", "0.0001") == 0
    tok = load_tokenizer(tok_dir)
    val = [held_out(i, 3, 0.4) for i in range(len(texts))]
    assert any(v for v, t in zip(val, texts) if len(t) > 1000) and not all(val)  # a long document in each split
    m = json.loads((tiny / "manifest.json").read_text())
    pc = open_prepared(str(tiny), 16)
    for split in ("train", "val"):
        want = [[1, *ids(tok, t), 2] for t, v in zip(texts, val) if v == (split == "val")]
        got = [d.tolist() for d in pc.documents(split)]
        assert got == want
        stream = np.concatenate([np.fromfile(tiny / s["file"], dtype="<u2") for s in m["splits"][split]["shards"]])
        one = json.loads((small / "manifest.json").read_text())["splits"][split]["shards"]
        assert len(one) == 1 and stream.tobytes() == (small / one[0]["file"]).read_bytes()
        assert (stream == 1).sum() == len(want) and (stream == 2).sum() == len(want)
        assert m["splits"][split]["documents"] == len(want)
        assert sum(bool(s.get("continues")) for s in m["splits"][split]["shards"]) >= 2
    assert len(m["splits"]["train"]["shards"]) > 10
    # resumed after a stop inside a long document: the same bytes
    resumed = tmp_path / "resumed"
    args = [*common, "--shard-mb", "0.001", "--piece-mb", "0.0001"]
    assert prep(src, resumed, *args, "--stop-after-shards", "3") == 0
    assert prep(src, resumed, *args) == 0
    for s in m["splits"]["train"]["shards"] + m["splits"]["val"]["shards"]:
        assert (resumed / s["file"]).read_bytes() == (tiny / s["file"]).read_bytes()
        assert (resumed / s["docs"]).read_bytes() == (tiny / s["docs"]).read_bytes()


def test_a_bpe_trained_on_pieces_is_the_bpe_of_the_whole_documents(tmp_path):
    """The tokenizer sample is read in pieces; the cuts keep the pre-tokens, so the trained vocabulary is the one
    trained on the whole texts."""
    text = long_text(3000, 5)
    (tmp_path / "a.txt").write_text(text)
    assert prep(tmp_path / "a.txt", tmp_path / "p", "--vocab-size", "300", "--val-fraction", "0",
                "--piece-mb", "0.0002") == 0
    got = open_prepared(str(tmp_path / "p"), 16).tokenizer.get_vocab()
    assert got == train_tokenizer([text], 300).get_vocab()


@pytest.mark.parametrize("given_tokenizer", [True, False])
def test_a_run_that_cannot_be_cut_is_a_one_line_error(tok_dir, tmp_path, capsys, given_tokenizer):
    """A line of 3000 characters without a space, pieces of 1000: exit 2, one line naming the file, no token file,
    no temporary file, no manifest (whether the error comes while sampling the BPE or while sharding)."""
    path = tmp_path / "blob.txt"
    path.write_text("one two three\n" + "x" * 3000 + "\nfour five\n")
    out = tmp_path / "out"
    extra = ["--tokenizer", tok_dir] if given_tokenizer else ["--vocab-size", "300"]
    assert prep(path, out, *extra, "--piece-mb", "0.001", "--val-fraction", "0") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and "--piece-mb" in err, err
    assert not (out / "manifest.json").exists()
    assert [n for n in os.listdir(out / "shards")] == []
    # the same file with pieces long enough: fine
    assert prep(path, tmp_path / "out2", *extra, "--piece-mb", "0.004", "--val-fraction", "0") == 0


def test_a_huge_record_of_jsonl_is_cut_too(tok_dir, tmp_path):
    """A jsonl record longer than a piece: cut the same way, the one-call ids, one BOS and one EOS."""
    texts = [long_text(800, 2), "small one"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert prep(tmp_path / "a.jsonl", tmp_path / "p", "--tokenizer", tok_dir, "--val-fraction", "0",
                "--piece-mb", "0.0001", "--shard-mb", "0.001") == 0
    tok = load_tokenizer(tok_dir)
    got = [d.tolist() for d in open_prepared(str(tmp_path / "p"), 16).documents("train")]
    assert got == [[1, *ids(tok, t), 2] for t in texts]


# ----------------------------------------------------------------------------------------------- memory

_MEASURE = textwrap.dedent("""
    import resource, sys
    from fullband import cli
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rc = cli.main(sys.argv[1:])
    print(rc, base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
""")


def prepare_rss_growth_mb(args: list[str]) -> float:
    """Peak RSS of ``fullband data prepare ARGS`` in a fresh process, less its RSS once the package is imported (MB):
    what preparing costs, without the fixed cost of torch / transformers."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, "-c", _MEASURE, "data", "prepare", *args], env=env, capture_output=True,
                         text=True, check=True)
    rc, base, peak = out.stdout.split()[-3:]
    assert rc == "0", out.stderr
    return (int(peak) - int(base)) / 1024


def test_peak_memory_of_one_huge_txt_document_is_bounded(tmp_path):
    """One 20 MB .txt document (lines of 6..40 words) prepared with the default 1 MB pieces and 2 MB shards: the
    prepare adds under 400 MB to the process's RSS (the old code, reading and encoding the document whole, adds
    about 1.8 GB: about 90 bytes per character). A word-level tokenizer keeps it fast;
    ``fullband data bench --txt-mb`` shows the peak flat in the document's size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|pad|>": 0, "<|bos|>": 1, "<|eos|>": 2, "[UNK]": 3}
    vocab.update({w: i + 4 for i, w in enumerate(WORDS)})
    wl = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=wl, bos_token="<|bos|>", eos_token="<|eos|>",
                            pad_token="<|pad|>").save_pretrained(str(tmp_path / "wl"))
    rng = random.Random(0)
    block = "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40))) + "\n" for _ in range(5000))
    with open(tmp_path / "big.txt", "w") as f:
        for _ in range(20_000_000 // len(block) + 1):
            f.write(block)
    growth = prepare_rss_growth_mb([str(tmp_path / "big.txt"), "--out", str(tmp_path / "out"), "--tokenizer",
                                    str(tmp_path / "wl"), "--workers", "1", "--shard-mb", "2", "--val-fraction", "0",
                                    "--no-progress"])
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["documents"] == 1 and len(m["splits"]["train"]["shards"]) >= 6
    assert growth < 400, growth
