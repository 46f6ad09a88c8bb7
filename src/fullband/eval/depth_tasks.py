"""Tasks that need sequential steps, answered at one position: the depth experiment's data.

Owns the generators, their fixed word-level vocabulary and their row format (``fullband experiment depth``):

* ``pointer`` -- k-hop pointer chasing: a random permutation ``pi`` of ``n`` symbols given as ``n`` single
  edge tokens ``"a>b"`` (meaning ``pi(a) = b``) in random order, then ``Q``, a start symbol ``s`` and the hop
  token ``k<k>``; the answer is ``pi^k(s)``. Each hop is one attention look-up that depends on the previous one.
  Optionally ``pi`` is a single n-cycle, so the start symbol is never the answer for k < n.
* ``compose`` -- iterated composition of a running state: ``k`` permutations of ``m`` elements (``m = 3``: the
  symmetric group S3, 6 tokens ``g0..g5``) after ``C``; the answer is the running product ``g_1 g_2 ... g_k``
  (apply ``g_1`` first) as a ``g`` token. ``modsum`` is the same with residues mod ``p`` (tokens ``r0..``).

Every question may be followed by ``think`` filler positions (the token ``.``, identical everywhere, so it carries
no information: only the fed-back state can carry work across it), then ``=``; the answer token follows ``=`` and
is the only position a model is scored or trained on. A row is ``<bos> question .* = answer <eos>`` right-padded
with ``<pad>`` to a fixed length. The tokenizer (:func:`depth_tokenizer`) is a ``tokenizers`` WordLevel model over
the fixed vocabulary (nothing learned, nothing downloaded), split on whitespace.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ..data.corpus import SPECIAL_TOKENS

THINK, EQUALS = ".", "="
TASKS = ("pointer", "compose", "modsum")
IGNORE = -100


@dataclasses.dataclass(frozen=True)
class DepthProblem:
    """One question: ``words`` (without BOS/EOS, ending in ``=``), ``answer`` (one word) and what an independent
    solver needs (``facts``: the permutation for ``pointer``, the elements for ``compose`` / ``modsum``)."""

    task: str
    k: int
    think: int
    words: tuple[str, ...]
    answer: str
    facts: tuple

    @property
    def text(self) -> str:
        return " ".join(self.words + (self.answer,))


# ----------------------------------------------------------------------------------------------- groups


def permutations_of(m: int) -> list[tuple[int, ...]]:
    """The elements of S_m in a fixed order (index = the ``g`` token's number)."""
    return list(itertools.permutations(range(m)))


def compose_two(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """``a`` then ``b``: the permutation ``x -> b[a[x]]``."""
    return tuple(b[a[x]] for x in range(len(a)))


# ----------------------------------------------------------------------------------------------- generators


def _tail(words: list[str], think: int) -> tuple[str, ...]:
    return tuple(words + [THINK] * think + [EQUALS])


def pointer_problem(rng: random.Random, k: int, think: int = 0, n: int = 6, single_cycle: bool = False) -> DepthProblem:
    """``single_cycle``: the permutation is one n-cycle, so ``pi^k(s) != s`` for 1 <= k < n (no copy shortcut:
    on a random permutation the start symbol is the answer whenever its cycle length divides k)."""
    if single_cycle:
        order = list(range(n))
        rng.shuffle(order)
        perm = [0] * n
        for i, a in enumerate(order):
            perm[a] = order[(i + 1) % n]
    else:
        perm = list(range(n))
        rng.shuffle(perm)
    edges = [f"{a}>{perm[a]}" for a in range(n)]
    rng.shuffle(edges)
    start = rng.randrange(n)
    x = start
    for _ in range(k):
        x = perm[x]
    return DepthProblem("pointer", k, think, _tail(edges + ["Q", f"s{start}", f"k{k}"], think), f"s{x}",
                        (tuple(perm), start))


def compose_problem(rng: random.Random, k: int, think: int = 0, m: int = 3) -> DepthProblem:
    group = permutations_of(m)
    idx = [rng.randrange(len(group)) for _ in range(k)]
    acc = tuple(range(m))
    for i in idx:
        acc = compose_two(acc, group[i])
    return DepthProblem("compose", k, think, _tail(["C"] + [f"g{i}" for i in idx], think), f"g{group.index(acc)}",
                        tuple(idx))


def modsum_problem(rng: random.Random, k: int, think: int = 0, p: int = 7) -> DepthProblem:
    xs = [rng.randrange(p) for _ in range(k)]
    return DepthProblem("modsum", k, think, _tail(["M"] + [f"r{x}" for x in xs], think), f"r{sum(xs) % p}",
                        tuple(xs))


GENERATORS = {"pointer": pointer_problem, "compose": compose_problem, "modsum": modsum_problem}


def make_depth_problems(tasks, n: int, seed: int, max_k: int, max_think: int = 0, *, ks=None, thinks=None,
                        n_symbols: int = 6, group_m: int = 3, modulus: int = 7,
                        single_cycle: bool = False) -> list[DepthProblem]:
    """``n`` problems cycling over ``tasks``, with ``k`` drawn from ``ks`` (default ``1..max_k``) and the think
    count from ``thinks`` (default ``0..max_think``), seeded. Test sets pass ``ks`` / ``thinks`` to fix cells."""
    tasks = list(tasks)
    bad = [t for t in tasks if t not in GENERATORS]
    if bad or not tasks:
        raise ValueError(f"unknown depth task(s) {bad}: choose from {', '.join(TASKS)}")
    if max_k < 1 or max_think < 0:
        raise ValueError(f"max_k must be >= 1 and max_think >= 0, got {max_k}, {max_think}")
    ks = list(ks) if ks is not None else list(range(1, max_k + 1))
    thinks = list(thinks) if thinks is not None else list(range(max_think + 1))
    extra = {"pointer": {"n": n_symbols, "single_cycle": single_cycle}, "compose": {"m": group_m},
             "modsum": {"p": modulus}}
    if max(ks) > 9 and "pointer" in tasks:
        raise ValueError("pointer chasing has hop tokens k1..k9")
    rng = random.Random(seed)
    return [GENERATORS[t](rng, rng.choice(ks), rng.choice(thinks), **extra[t])
            for t in (tasks[i % len(tasks)] for i in range(n))]


# ----------------------------------------------------------------------------------------------- vocabulary


def depth_vocabulary(n_symbols: int = 6, group_m: int = 3, modulus: int = 7, max_k: int = 9) -> list[str]:
    """Every word any generator writes (specials first), in a fixed order."""
    words = list(SPECIAL_TOKENS.values()) + [THINK, EQUALS, "Q", "C", "M"]
    words += [f"{a}>{b}" for a in range(n_symbols) for b in range(n_symbols)]
    words += [f"s{a}" for a in range(n_symbols)] + [f"k{k}" for k in range(1, max_k + 1)]
    words += [f"g{i}" for i in range(len(permutations_of(group_m)))] + [f"r{i}" for i in range(modulus)]
    return list(dict.fromkeys(words))


def depth_tokenizer(**vocab_options) -> PreTrainedTokenizerFast:
    """A word-level ``PreTrainedTokenizerFast`` over :func:`depth_vocabulary` (whitespace-split; no BOS added)."""
    vocab = {w: i for i, w in enumerate(depth_vocabulary(**vocab_options))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["pad_token"]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 30, **SPECIAL_TOKENS)


def row_length(max_k: int, max_think: int, tasks, n_symbols: int = 6) -> int:
    """Tokens of the longest row: ``<bos>`` + question + thinks + ``=`` + answer + ``<eos>``."""
    q = {"pointer": n_symbols + 3, "compose": 1 + max_k, "modsum": 1 + max_k}
    return 1 + max(q[t] for t in tasks) + max_think + 1 + 2


def encode_rows(tokenizer, problems: list[DepthProblem], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [N, seq_len], answer_pos [N])``: ``<bos> words answer <eos>`` right-padded; ``answer_pos`` is the
    index of the answer token (the logits at ``answer_pos - 1``, the ``=`` position, predict it)."""
    vocab = tokenizer.get_vocab()
    bos, eos, pad = (vocab[SPECIAL_TOKENS[k]] for k in ("bos_token", "eos_token", "pad_token"))
    rows = torch.full((len(problems), seq_len), pad, dtype=torch.long)
    pos = torch.empty(len(problems), dtype=torch.long)
    for i, p in enumerate(problems):
        try:
            ids = [bos] + [vocab[w] for w in p.words + (p.answer,)] + [eos]
        except KeyError as err:
            raise ValueError(f"word {err} is not in the depth vocabulary") from None
        if len(ids) > seq_len:
            raise ValueError(f"a {p.task} problem needs {len(ids)} tokens, more than seq_len {seq_len}")
        rows[i, :len(ids)] = torch.tensor(ids)
        pos[i] = len(ids) - 2
    return rows, pos


def answer_labels(rows: torch.Tensor, equals_id: int) -> torch.Tensor:
    """Labels for training on the answer only: the token after ``=`` keeps its id, everything else is ``-100``."""
    after_eq = torch.zeros_like(rows, dtype=torch.bool)
    after_eq[:, 1:] = rows[:, :-1] == equals_id
    return torch.where(after_eq, rows, torch.full_like(rows, IGNORE))
