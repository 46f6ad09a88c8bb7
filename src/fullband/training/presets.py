"""Model size presets for training from scratch: Llama-style backbones (RMSNorm, RoPE, SwiGLU).

The vocabulary comes from the tokenizer, so a preset fixes everything but the vocabulary size; the parameter
counts quoted below are for the default 4,096-entry BPE (``gpt2-small`` is ≈125M with GPT-2's 50,257 entries):

======================  ======  ======  =====  ==========  ============  =========
preset                  d       layers  heads  kv heads    MLP width     params
======================  ======  ======  =====  ==========  ============  =========
``micro``               64      2       4      4           128           ≈0.6M (tests, smoke runs)
``tiny``                192     4       6      6           512           ≈3.3M
``small``               512     6       8      8           1376          ≈23M
``gpt2-small``          768     12      12     12          2048          ≈88M (≈124M at 50k vocab)
``llama-1b``            2048    16      32     8           8192          ≈0.98B (≈1.24B at 128k vocab)
======================  ======  ======  =====  ==========  ============  =========

``tiny`` and ``small`` have an untied LM head; ``gpt2-small`` ties it to the embeddings, as GPT-2 does, and so does
``llama-1b`` (Llama 3.2 1B's shape, the paper's scale: for GPU runs and ``--dry-run`` plans, not this CPU).
``fullband train --tie-embeddings`` / ``--no-tie-embeddings`` overrides a preset's choice (``tie_word_embeddings``
of :func:`backbone_config`: Hugging Face then builds one tensor for both, saves it once and ties it again on
loading); :func:`check_tying` refuses a request to change an ``--init-from`` model's tying.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from transformers import LlamaConfig


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    lr: float  # suggested peak learning rate (the default of ``fullband train --lr``)
    description: str = ""


PRESETS: dict[str, Preset] = {
    "micro": Preset(64, 2, 4, 4, 128, False, lr=3e-3, description="for tests and smoke runs"),
    "tiny": Preset(192, 4, 6, 6, 512, False, lr=3e-3, description="≈3M parameters; seconds per step on a laptop CPU"),
    "small": Preset(512, 6, 8, 8, 1376, False, lr=1.5e-3, description="≈25M parameters"),
    "gpt2-small": Preset(768, 12, 12, 12, 2048, True, lr=6e-4, description="GPT-2 small's shape, ≈125M at a 50k vocabulary"),
    "llama-1b": Preset(2048, 16, 32, 8, 8192, True, lr=3e-4, description="Llama 3.2 1B's shape, ≈1.24B at a 128k vocabulary"),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def backbone_config(name: str, vocab_size: int, *, bos_token_id: int | None = None, eos_token_id: int | None = None,
                    pad_token_id: int | None = None, max_position_embeddings: int = 2048,
                    tie_word_embeddings: bool | None = None, num_hidden_layers: int | None = None):
    """The ``LlamaConfig`` of preset ``name`` for a tokenizer of ``vocab_size`` entries (``tie_word_embeddings``,
    ``num_hidden_layers``: ``None`` = the preset's choice)."""
    p = get_preset(name)
    if num_hidden_layers is not None and num_hidden_layers < 1:
        raise ValueError(f"num_hidden_layers must be >= 1, got {num_hidden_layers}")
    tied = p.tie_word_embeddings if tie_word_embeddings is None else bool(tie_word_embeddings)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=num_hidden_layers or p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied, attention_dropout=0.0,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )


def parameter_count(name: str, vocab_size: int, tie_word_embeddings: bool | None = None) -> int:
    """Backbone parameters of preset ``name`` (embeddings and head included), without building it."""
    p = get_preset(name)
    tied = p.tie_word_embeddings if tie_word_embeddings is None else bool(tie_word_embeddings)
    d, f, L = p.hidden_size, p.intermediate_size, p.num_hidden_layers
    kv = d // p.num_attention_heads * p.num_key_value_heads
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * f + 2 * d
    return L * per_layer + (1 if tied else 2) * vocab_size * d + d


def embeddings_tied(model) -> bool:
    """Whether ``model``'s (or its backbone's) LM head is its input-embedding tensor."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def check_tying(requested: bool | None, tied: bool, source: str) -> None:
    """A one-line ``ValueError`` when ``--tie-embeddings`` / ``--no-tie-embeddings`` asks ``source`` (a model that
    is loaded, not built from a preset) for the other tying than it has."""
    if requested is not None and bool(requested) != tied:
        raise ValueError(f"{source} has {'tied' if tied else 'untied'} input/output embeddings and keeps them: "
                         f"drop --{'' if requested else 'no-'}tie-embeddings (tying is chosen when a model is built "
                         "from --preset)")


def describe() -> dict:
    return {name: asdict(p) for name, p in PRESETS.items()}
