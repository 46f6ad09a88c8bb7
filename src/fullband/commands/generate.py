"""``fullband generate``: stream a continuation of a prompt from a saved model in any decode mode, through PyTorch
(:func:`fullband.model.generation.generate`) or through llama.cpp (``--engine llama.cpp``: a ``fullband export gguf``
directory decoded by :class:`fullband.serving.llamacpp.LlamaCppEngine`)."""

from __future__ import annotations

import argparse
import os
import sys

import torch
from transformers import AutoTokenizer, StopStringCriteria, TextStreamer
from transformers.utils import logging as hf_logging

from ..model.configuration import has_feedback
from ..model.generation import MODES, generate
from ..model.lean import TOKEN_STEPS
from ..model.modeling import load_model
from ..utils.errors import UsageError
from ..serving.llamacpp import LlamaCppEngine
from ..utils.argtypes import NONNEG_FLOAT, NONNEG_INT, POSITIVE_FRACTION, POSITIVE_INT


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    if not os.path.isdir(args.model):
        raise FileNotFoundError(f"model directory {args.model!r} does not exist")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
    if not any(os.path.isfile(os.path.join(args.model, name)) for name in tokenizer_files):
        raise FileNotFoundError(f"no tokenizer saved with the model in {args.model!r} (save one there with "
                                "tokenizer.save_pretrained)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError, TypeError, KeyError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise FileNotFoundError(f"cannot load the tokenizer saved in {args.model!r}: {first}") from None
    hf_logging.disable_progress_bar()
    if args.engine == "llama.cpp":
        return _run_llama_cpp(args, tokenizer)
    model = load_model(args.model)
    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = model.to(device=device, dtype=dtype).eval()
    model.token_step = args.token_step  # the decode steps of a plain HF model follow it too
    if args.threads:
        torch.set_num_threads(args.threads)
    enc = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=not args.no_special_tokens)
    input_ids = enc["input_ids"].to(device)
    if input_ids.shape[1] == 0:
        bos = model.config.doc_start_token_id if has_feedback(model) else model.config.bos_token_id
        if bos is None:
            raise UsageError("the prompt is empty and the model has no BOS token")
        input_ids = torch.tensor([[bos]], device=device)
    streamer = None if args.no_stream else TextStreamer(tokenizer, skip_prompt=False, skip_special_tokens=True)
    stopping = StopStringCriteria(tokenizer, args.stop) if args.stop else None
    generator = torch.Generator(device=device).manual_seed(args.seed) if args.seed is not None else None
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else None
    res = generate(model, input_ids, mode=args.mode, max_new_tokens=args.max_new_tokens,
                   prefill_passes=args.prefill_passes, do_sample=args.temperature > 0,
                   temperature=args.temperature if args.temperature > 0 else 1.0, top_k=args.top_k,
                   top_p=args.top_p, generator=generator, eos_token_id=eos, ignore_eos=args.ignore_eos,
                   stopping=stopping, streamer=streamer)
    if streamer is None:
        print(tokenizer.decode(res.sequences[0], skip_special_tokens=True))
    n = res.num_new_tokens
    rate = n / res.decode_seconds if res.decode_seconds > 0 else float("inf")
    print(f"[{res.mode}: {n} new tokens, prefill {res.prefill_seconds * 1e3:.1f} ms, {rate:.1f} tokens/s]",
          file=sys.stderr)
    return 0


def _run_llama_cpp(args, tokenizer) -> int:
    """``--engine llama.cpp``: the export directory decoded by llama.cpp (one sequence, streamed)."""
    for flag, value, default in (("--device", args.device, "cpu"), ("--dtype", args.dtype, "float32"),
                                 ("--token-step", args.token_step, "auto"), ("--stop", args.stop, None)):
        if value != default:
            raise UsageError(f"{flag} is not an option of --engine llama.cpp (the GGUF's type sets the precision)")
    engine = LlamaCppEngine(args.model, threads=args.threads or None)
    ids = tokenizer(args.prompt, add_special_tokens=not args.no_special_tokens)["input_ids"]
    if not ids:
        if engine.doc_start is None:
            raise UsageError("the prompt is empty and the model has no BOS token")
        ids = [engine.doc_start]
    streamer = None if args.no_stream else TextStreamer(tokenizer, skip_prompt=False, skip_special_tokens=True)
    if streamer is not None:
        streamer.put(torch.tensor(ids))
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    eos = None if args.ignore_eos else tokenizer.eos_token_id
    res = engine.generate([ids], mode=args.mode, max_new_tokens=args.max_new_tokens,
                          prefill_passes=args.prefill_passes, do_sample=args.temperature > 0,
                          temperature=args.temperature if args.temperature > 0 else 1.0, top_k=args.top_k,
                          top_p=args.top_p, generator=generator, eos_token_id=eos,
                          on_token=None if streamer is None else lambda _, tok: streamer.put(torch.tensor([tok])))
    if streamer is None:
        print(tokenizer.decode(ids + res.new_tokens[0], skip_special_tokens=True))
    else:
        streamer.end()
    n = len(res.new_tokens[0])
    rate = n / res.decode_seconds if res.decode_seconds > 0 else float("inf")
    print(f"[llama.cpp {res.mode}: {n} new tokens, prefill {res.prefill_seconds * 1e3:.1f} ms, {rate:.1f} tokens/s]",
          file=sys.stderr)
    engine.close()
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a saved fullband model (streams tokens)",
                       description="Generate a continuation of --prompt with a saved fullband model, streaming "
                                   "tokens as they come. Decode modes: " + ", ".join(MODES) + ".",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (save_pretrained output, with its tokenizer); "
                                                  "with --engine llama.cpp, a `fullband export gguf` directory")
    p.add_argument("--engine", choices=("torch", "llama.cpp"), default="torch",
                   help="torch: the PyTorch decode loop; llama.cpp: the GGUF export decoded by llama.cpp "
                        "(pip install \"fullband[llamacpp]\")")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="decode mode (default: the model's config.default_feedback_mode)")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=64)
    p.add_argument("--prefill-passes", type=POSITIVE_INT, default=1, help="Jacobi passes over the prompt in 'fused' mode")
    p.add_argument("--temperature", type=NONNEG_FLOAT, default=0.0, help="0 = greedy; > 0 samples")
    p.add_argument("--top-k", type=NONNEG_INT, default=0, help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=POSITIVE_FRACTION, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=NONNEG_INT, default=None, help="seed for sampling")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when this text has been generated (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    p.add_argument("--no-special-tokens", action="store_true", help="do not add BOS etc. to the prompt")
    p.add_argument("--no-stream", action="store_true", help="print the whole text at the end")
    p.add_argument("--device", default="cpu")
    p.add_argument("--token-step", choices=TOKEN_STEPS, default="auto",
                   help="how token-by-token steps run (the exact prefill, the decode steps): lean (the backbone's "
                        "decoder layers called directly), compiled (that step through torch.compile), off (the "
                        "backbone's full forward), auto (lean on CPU, compiled on CUDA)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--threads", type=NONNEG_INT, default=0, help="CPU threads (0 = torch default)")
    p.set_defaults(func=run)
