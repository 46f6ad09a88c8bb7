"""Peak extra resident memory of rank 0 while the final model of a 2-process FSDP2 run (gloo, CPU) is written.

``sharded``: :func:`fullband.training.sharded.save_pretrained_sharded` (what ``fullband train --parallel fsdp``
does now); ``gathered``: the old path (the full state dict gathered to rank 0 with ``get_model_state_dict(
full_state_dict=True, cpu_offload=True)``, then ``save_pretrained``). Prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/export_memory.py {sharded|gathered} HIDDEN LAYERS VOCAB [FILE_BYTES]
"""

import gc
import json
import os
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, LlamaConfig

import fullband
from fullband.training import distributed as D
from fullband.training import sharded as S


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(cfg: LlamaConfig):
    torch.manual_seed(0)
    return fullband.FullBandwidthForCausalLM.from_backbone(AutoModelForCausalLM.from_config(cfg), fusion="glu")


def worker(rank: int, root: str, mode: str, hidden: int, layers: int, vocab: int, file_bytes: int | None) -> None:
    torch.set_num_threads(1)
    if file_bytes:
        S.FILE_BYTES = file_bytes
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=2)
    env = D.DistEnv(rank=rank, world_size=2, backend="gloo")
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.6875), num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=vocab, tie_word_embeddings=False)
    model = build(cfg)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    model = D.wrap_model(model, env, "fsdp")
    gc.collect()
    time.sleep(0.2)
    base, peak, stop = rss(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0005)

    thread = threading.Thread(target=sample)
    thread.start()
    out = f"{root}/out"
    if mode == "sharded":
        S.save_pretrained_sharded(model, out, env)
    else:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            fresh = build(cfg)
            fresh.load_state_dict(state)
            del state
            fresh.save_pretrained(out)
        dist.barrier()
    stop.set()
    thread.join()
    if rank == 0:
        print(json.dumps({"mode": mode, "model_MB": round(model_bytes / 1e6, 1),
                          "largest_tensor_MB": round(largest / 1e6, 1), "file_bytes": S.FILE_BYTES,
                          "rank0_peak_extra_rss_MB": round((peak[0] - base) / 1e6, 1)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) not in (5, 6) or sys.argv[1] not in ("sharded", "gathered"):
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    mode = sys.argv[1]
    hidden, layers, vocab = (int(x) for x in sys.argv[2:5])
    file_bytes = int(float(sys.argv[5])) if len(sys.argv) > 5 else None
    mp.spawn(worker, args=(tempfile.mkdtemp(), mode, hidden, layers, vocab, file_bytes), nprocs=2)
