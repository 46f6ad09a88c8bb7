"""``fullband export gguf``: a saved model as a GGUF that llama.cpp loads, plus the fusion beside it.

Owns the export: the backbone's weights, hyper-parameters and tokenizer written with the ``gguf`` package (llama.cpp's
own Python library: its writer, its tensor-name map, its vocabulary readers and its quantizers; no GGUF bytes are
written here), and the latent-feedback fusion in a sidecar file, ``fusion.safetensors``, that names the GGUF it belongs
to. The fusion is not put inside the GGUF: llama.cpp refuses a file with tensors its architecture does not create.

Layout of ``--out`` (written whole into a temporary directory, then renamed into place; an existing directory is
replaced only when it is an earlier export, never a directory of anything else):

* ``model.gguf``: architecture ``llama`` or ``qwen2``; ``general.uuid`` a fresh id; ``fullband.feedback`` (bool),
  ``fullband.fusion`` (the fusion's name, absent without feedback), ``fullband.doc_start_token_id``;
* ``fusion.safetensors`` (feedback models only): the fusion's weights in float32 and, in its metadata, the GGUF's
  ``general.uuid``, the fusion's name and shape, the RMSNorm eps, the document-start token and the default mode;
* the tokenizer files saved with the model, so that ``fullband generate --engine llama.cpp`` tokenizes as the model
  was trained;
* ``fullband-gguf.json``: what was exported, from where, at which type.

What llama.cpp needs that a Hugging Face checkpoint does not say the same way: Llama's query and key rows are
reordered for llama.cpp's rotary convention (interleaved pairs; Qwen2 uses the same half-split convention as
Hugging Face and is written as it is), as llama.cpp's converter does. Vocabulary: a byte-level BPE tokenizer (the one
``fullband`` trains) is written as llama.cpp's ``gpt2`` model with the GPT-2 pre-tokenizer, so llama.cpp's own
tools tokenize text; any other tokenizer as ``none`` with the vocabulary size (llama.cpp then takes token ids only,
which is what the fullband engine feeds it). Types: ``f32``; ``f16`` and ``q8_0`` for matrices (norms and biases
stay float32, and a matrix whose rows are not a multiple of 32 stays f16 under ``q8_0``, as in llama.cpp's converter).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import uuid

import numpy as np
import torch
from safetensors.torch import save_file

from ..model.configuration import has_feedback
from ..model.modeling import load_model
from ..utils.io import atomic_directory

log = logging.getLogger(__name__)

TYPES = ("f32", "f16", "q8_0")
GGUF_NAME, FUSION_NAME, MANIFEST_NAME = "model.gguf", "fusion.safetensors", "fullband-gguf.json"
FUSION_FORMAT = "fullband-fusion/1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
INSTALL_HINT = ('pip install "fullband[llamacpp]" (llama-cpp-python builds from source: about 10-30 minutes on 2 '
                'cores; CMAKE_ARGS="-DLLAVA_BUILD=OFF" skips its multimodal library)')


def require_gguf():
    """The ``gguf`` package (the ``llamacpp`` extra), imported on first use so that the CLI starts without it; a
    one-line error saying how to install it when it is missing."""
    try:
        return importlib.import_module("gguf")
    except ImportError:
        raise ValueError(f"the gguf package is not installed: {INSTALL_HINT}") from None


def _architecture(config) -> str:
    """llama.cpp's architecture for a backbone config, or a one-line ``ValueError`` saying why it cannot take it."""
    family = config.model_type
    if family not in ("llama", "qwen2"):
        raise ValueError(f"llama.cpp export supports Llama and Qwen2 backbones; this one is {family!r}")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {rope.get('rope_type')!r} is not exported (plain RoPE only)")
    if getattr(config, "mlp_bias", False):
        raise ValueError("a Llama backbone with MLP biases has no llama.cpp counterpart")
    if family == "qwen2" and getattr(config, "use_sliding_window", False):
        raise ValueError("a Qwen2 backbone with sliding-window attention is not exported (full attention only)")
    return family


def _head_dim(config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's half-split rotary rows of each head reordered to llama.cpp's interleaved pairs (Llama only)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tensor_type(name: str, array: np.ndarray, out_type: str):
    gguf = require_gguf()
    q = gguf.GGMLQuantizationType
    if out_type == "f32" or array.ndim == 1:
        return q.F32
    if out_type == "q8_0" and array.shape[-1] % 32 == 0:
        return q.Q8_0
    return q.F16


def _tensors(backbone, family: str):
    gguf = require_gguf()
    config = backbone.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.upper()], config.num_hidden_layers)
    state = backbone.state_dict()
    tied = getattr(config, "tie_word_embeddings", False)
    for hf_name, tensor in state.items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reads the token embedding as the output matrix when there is none
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"llama.cpp has no tensor for {hf_name!r} of this {family} backbone")
        tensor = tensor.detach().float()
        if family == "llama" and hf_name.endswith("q_proj.weight"):
            tensor = _rope_rows(tensor, config.num_attention_heads)
        elif family == "llama" and hf_name.endswith("k_proj.weight"):
            tensor = _rope_rows(tensor, config.num_key_value_heads)
        yield name, tensor.numpy()


def _tokenizer_files(model_dir: str) -> list[str]:
    return [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, n))]


def _byte_level_bpe(model_dir: str) -> bool:
    """Whether the saved tokenizer is a GPT-2-style byte-level BPE (llama.cpp's ``gpt2`` model, ``gpt-2`` splits)."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        tok = json.load(f)
    pre, model, normalizer = tok.get("pre_tokenizer") or {}, tok.get("model") or {}, tok.get("normalizer")
    return (model.get("type") == "BPE" and not model.get("byte_fallback") and normalizer is None
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"))


def _write_vocab(writer, model_dir: str, n_vocab: int) -> str:
    gguf = require_gguf()
    if not _byte_level_bpe(model_dir):
        log.info("the tokenizer is not a byte-level BPE llama.cpp knows: the GGUF's vocabulary is 'none' (token ids "
                 "only; fullband's engine tokenizes with the saved tokenizer)")
        writer.add_tokenizer_model("none")
        writer.add_vocab_size(n_vocab)
        return "none"
    vocab = gguf.vocab.BpeVocab(gguf.vocab.Path(model_dir))
    tokens, types = [], []
    for text, _score, kind in vocab.all_tokens():
        tokens.append(text)
        types.append(kind)
    if len(tokens) > n_vocab:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens, the model's embedding only {n_vocab}")
    for i in range(len(tokens), n_vocab):  # an embedding padded past the tokenizer, as llama.cpp's converter pads it
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.vocab.SpecialVocab(model_dir, load_merges=True, n_vocab=n_vocab).add_to_gguf(writer, quiet=True)
    return "gpt2"


def _write_gguf(path: str, backbone, family: str, out_type: str, model_dir: str, extra: dict, model_id: str) -> str:
    gguf = require_gguf()
    config = backbone.config
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    writer = gguf.GGUFWriter(path, family)
    writer.add_name(os.path.basename(os.path.abspath(model_dir)))
    writer.add_uuid(model_id)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    writer.add_rope_dimension_count(_head_dim(config))
    writer.add_rope_freq_base(float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_file_type(file_types[out_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in extra.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_int32(key, value)
        else:
            writer.add_string(key, str(value))
    vocab = _write_vocab(writer, model_dir, backbone.get_input_embeddings().num_embeddings)
    for name, array in _tensors(backbone, family):
        kind = _tensor_type(name, array, out_type)
        data = array.astype(np.float16) if kind == gguf.GGMLQuantizationType.F16 else (
            gguf.quants.quantize(array, kind) if kind == gguf.GGMLQuantizationType.Q8_0 else array)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return vocab


def _is_export(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def export_gguf(model_dir: str, out_dir: str, out_type: str = "f32") -> dict:
    """Export the saved model in ``model_dir`` to ``out_dir`` (layout in the module's text); returns the manifest."""
    require_gguf()
    if out_type not in TYPES:
        raise ValueError(f"unknown type {out_type!r}: choose one of {', '.join(TYPES)}")
    model_dir, out_dir = os.path.abspath(model_dir), os.path.abspath(out_dir)
    if os.path.lexists(out_dir) and not (os.path.isdir(out_dir) and _is_export(out_dir)):
        raise ValueError(f"{out_dir!r} exists and is not an earlier GGUF export: choose another --out")
    if os.path.commonpath([model_dir, out_dir]) in (model_dir, out_dir):
        raise ValueError("--out must be outside the model directory (and not contain it)")
    model = load_model(model_dir).float().eval()
    feedback = has_feedback(model)
    backbone = model.backbone if feedback else model
    family = _architecture(backbone.config)
    model_id = str(uuid.uuid4())
    extra = {"fullband.feedback": feedback}
    if feedback:
        extra["fullband.fusion"] = model.config.fusion
        if model.doc_start_token_id is not None:
            extra["fullband.doc_start_token_id"] = int(model.doc_start_token_id)
    manifest = {"format": "fullband-gguf/1", "source": model_dir, "backbone": family, "type": out_type,
                "gguf": GGUF_NAME, "uuid": model_id, "feedback": feedback,
                "fusion": FUSION_NAME if feedback else None, "tokenizer_files": _tokenizer_files(model_dir)}
    with atomic_directory(out_dir) as tmp:
        manifest["vocabulary"] = _write_gguf(os.path.join(tmp, GGUF_NAME), backbone, family, out_type, model_dir,
                                             extra, model_id)
        if feedback:
            hidden, embed_dim, eps = model._fusion_shape
            meta = {"format": FUSION_FORMAT, "gguf_uuid": model_id, "fusion": model.config.fusion,
                    "hidden_size": str(hidden), "embed_dim": str(embed_dim), "eps": repr(eps),
                    "doc_start_token_id": json.dumps(model.doc_start_token_id),
                    "default_feedback_mode": str(model.config.default_feedback_mode)}
            weights = {k: v.detach().float().contiguous() for k, v in model.feedback.state_dict().items()}
            save_file(weights, os.path.join(tmp, FUSION_NAME), metadata=meta)
        for name in manifest["tokenizer_files"]:
            shutil.copyfile(os.path.join(model_dir, name), os.path.join(tmp, name))
        with open(os.path.join(tmp, MANIFEST_NAME), "w") as f:
            json.dump(manifest, f, indent=2)
    return manifest
