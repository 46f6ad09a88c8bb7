"""Data: document sources, the split by document, the tokenizer, packing and the resumable data order."""

from __future__ import annotations

import json
import random

import pytest
import torch

from fullband.data.corpus import (
    Document,
    batch_rows,
    build_corpus,
    load_documents,
    load_tokenizer,
    pack,
    special_ids,
    split_documents,
    tokenize_documents,
    train_tokenizer,
)

WORDS = "the a of to and in that is was he for it with as his on be at by had not are but from".split()


def make_docs(n=8, words=120, seed=0):
    rng = random.Random(seed)
    return [Document(f"doc{i:02d}", " ".join(rng.choice(WORDS) for _ in range(words)) + f" END{i}.") for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer((d.text for d in make_docs()), vocab_size=300)


# ----------------------------------------------------------------------------------------------- sources


def test_jsonl_file_and_folder(tmp_path):
    docs = make_docs(4)
    jl = tmp_path / "a.jsonl"
    jl.write_text("\n".join(json.dumps({"text": d.text, "name": d.name}) for d in docs[:2]) + "\n\n")
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text(docs[2].text)
    (folder / "sub" / "c.md").write_text(docs[3].text)
    (folder / "skip.bin").write_bytes(b"\x00\x01")
    (folder / "z.jsonl").write_text(json.dumps({"text": "from jsonl"}) + "\n")
    got = load_documents(str(jl))
    assert [d.text for d in got] == [d.text for d in docs[:2]] and [d.name for d in got] == ["doc00", "doc01"]
    got = load_documents(str(folder))
    assert [d.text for d in got] == [docs[2].text, "from jsonl", docs[3].text]  # sorted walk, files before subdirs
    single = load_documents(str(folder / "b.txt"))
    assert len(single) == 1 and single[0].text == docs[2].text


def test_embedded_corpus_is_one_work_per_document():
    docs = load_documents(None)
    assert len(docs) == len({d.name for d in docs}) >= 30
    assert load_documents("shakespeare") == docs


def test_hf_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["first doc", "", "second doc"]}).save_to_disk(str(tmp_path / "ds"))
    docs = load_documents(str(tmp_path / "ds"))
    assert [d.text for d in docs] == ["first doc", "second doc"]


@pytest.mark.parametrize("content, match", [
    ('{"text": "ok"}\nnot json\n', r"bad\.jsonl:2: not valid JSON"),
    ('{"txt": "no text field"}\n', r"bad\.jsonl:1: .*'text' field"),
    ('["a list"]\n', r"bad\.jsonl:1: .*'text' field"),
    ('{"text": "   "}\n', "no non-empty documents"),
])
def test_bad_jsonl(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_documents(str(path))


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_documents(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .txt/.md/.jsonl"):
        load_documents(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "no_tokenizer"))


# ----------------------------------------------------------------------------------------------- split


def test_split_is_by_document_and_deterministic():
    docs = make_docs(20)
    train, val = split_documents(docs, 0.2, seed=3)
    assert len(val) == 4 and len(train) == 16
    assert {d.name for d in train}.isdisjoint({d.name for d in val})
    assert {d.name for d in train} | {d.name for d in val} == {d.name for d in docs}
    # same seed: same split, whatever order the documents come in
    shuffled = docs[::-1]
    train2, val2 = split_documents(shuffled, 0.2, seed=3)
    assert {d.name for d in val2} == {d.name for d in val}
    assert any({d.name for d in split_documents(docs, 0.2, seed=s)[1]} != {d.name for d in val} for s in range(4, 10))
    assert split_documents(docs, 0.0) == (docs, [])
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(docs, 1.0)
    with pytest.raises(ValueError, match="at least 2 documents"):
        split_documents(docs[:1], 0.1)


# ----------------------------------------------------------------------------------------------- tokenizer, packing


def test_tokenizer_specials_and_bos_on_encode(tokenizer, tmp_path):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer("the cat")["input_ids"][0] == 1
    assert tokenizer.decode(tokenizer("the cat", add_special_tokens=False)["input_ids"]) == "the cat"
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    again = load_tokenizer(str(tmp_path / "tok"))
    text = make_docs(1, seed=5)[0].text
    assert again(text)["input_ids"] == tokenizer(text)["input_ids"]
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["x"], vocab_size=100)


def test_pack_has_bos_at_every_document_start(tokenizer):
    docs = make_docs(6, words=37)
    lists = tokenize_documents(tokenizer, docs)
    bos, eos = special_ids(tokenizer)
    assert all(ids[0] == bos and ids[-1] == eos and bos not in ids[1:] for ids in lists)
    rows = pack(lists, 16)
    stream = rows.flatten().tolist()
    starts, pos = [], 0
    for ids in lists:
        starts.append(pos)
        pos += len(ids)
    starts = [s for s in starts if s < len(stream)]
    assert [i for i, t in enumerate(stream) if t == bos] == starts
    assert rows.shape[1] == 16 and rows.shape[0] == sum(map(len, lists)) // 16
    with pytest.raises(ValueError, match="seq_len"):
        pack(lists, 1)
    with pytest.raises(ValueError, match="not one row"):
        pack([[1, 2, 3]], 16)


def test_build_corpus_splits_whole_documents(tmp_path):
    docs = make_docs(10, words=80)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"name": d.name, "text": d.text}) + "\n" for d in docs))
    a = build_corpus(str(path), seq_len=32, vocab_size=300, val_fraction=0.2, seed=1)
    b = build_corpus(str(path), seq_len=32, vocab_size=300, val_fraction=0.2, seed=1)
    assert torch.equal(a.train_rows, b.train_rows) and torch.equal(a.val_rows, b.val_rows)
    assert set(a.train_docs).isdisjoint(a.val_docs) and len(a.val_docs) == 2
    # the validation rows hold only the validation documents' end markers
    val_text = a.tokenizer.decode(a.val_rows.flatten())
    for d in docs:
        marker = d.text.split()[-1]
        if d.name in a.train_docs:
            assert marker not in val_text
    none = build_corpus(str(path), seq_len=32, vocab_size=300, val_fraction=0.0, tokenizer=a.tokenizer)
    assert none.val_rows.shape == (0, 32)


# ----------------------------------------------------------------------------------------------- data order


def test_batch_rows_resumable_epochs():
    n, bs = 10, 4
    seq = torch.cat([batch_rows(s, bs, n, seed=7) for s in range(5)]).tolist()  # 20 rows = 2 epochs
    assert sorted(seq[:10]) == list(range(10)) and sorted(seq[10:]) == list(range(10))
    assert seq[:10] != seq[10:]
    assert batch_rows(3, bs, n, seed=7).tolist() == seq[12:16]  # any step on its own: same rows
    assert batch_rows(0, bs, n, seed=8).tolist() != seq[:4]
    with pytest.raises(ValueError):
        batch_rows(0, bs, 0)
