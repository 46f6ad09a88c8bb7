"""``fullband data bench``: prepared data at scale, measured (a benchmark, not a test).

Owns the benchmark: it writes a synthetic jsonl corpus of ``--gb`` GB (Zipf-distributed pseudo-words, documents
of 100..4000 words, seeded; with ``--txt``, the same lines as one ``.txt`` file: a single document of ``--gb`` GB)
under ``--workdir``, runs ``fullband data prepare`` on it with ``--workers`` processes, then ``fullband train
--steps 1`` on the prepared directory and on the embedded corpus; each command is a subprocess whose process tree
is polled with psutil every 0.25 s for its peak memory (the main process's RSS, and the tree's PSS summed over its
processes, workers included) and whose CPU-seconds are counted (the whole tree's, so the prepare's rate per
CPU-second end to end includes reading, the split, the BPE and the main process). It prints one JSON object (load
average and CPU count included) and deletes the generated files unless ``--keep``. :func:`format_result` renders
that object as Markdown against the bars of :data:`BARS` (the generated results page reads it).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time

import numpy as np

from ..utils.io import atomic_write_text
from ..utils.argtypes import POSITIVE_FLOAT, POSITIVE_INT

SEED = 0  # the synthetic corpus
# the prepare's peak memory (the tree's PSS) below 1.5 GB at any corpus size; training start-up on the prepared
# directory within 10% of the embedded corpus's wall time and at most 200 MB more resident memory
BARS = {"prepare_peak_mb": 1500.0, "train_wall_ratio": 1.10, "train_rss_mb_delta": 200.0}


def add_bench_parser(group) -> None:
    b = group.add_parser("bench", help="benchmark: prepare a synthetic corpus, then training start-up on it (JSON)",
                         description=__doc__.split("\n\n")[1])
    b.add_argument("--gb", type=POSITIVE_FLOAT, default=2.0, help="size of the synthetic jsonl corpus in GB (default: 2)")
    b.add_argument("--workers", type=POSITIVE_INT, default=2, help="prepare workers (default: 2)")
    b.add_argument("--workdir", default="/tmp/fullband-data-bench", help="where the corpus and outputs go")
    b.add_argument("--txt", action="store_true",
                   help="write the corpus as one .txt file: a single document of --gb GB (one line per jsonl document)")
    b.add_argument("--tokenizer-sample-mb", type=POSITIVE_FLOAT, default=64.0, help="BPE training sample (default: 64)")
    b.add_argument("--shard-mb", type=POSITIVE_FLOAT, default=32.0, help="prepare --shard-mb (default: 32)")
    b.add_argument("--piece-mb", type=POSITIVE_FLOAT, default=1.0, help="prepare --piece-mb (default: 1)")
    b.add_argument("--skip-train", action="store_true", help="measure the prepare only")
    b.add_argument("--keep", action="store_true", help="keep the generated files")
    b.add_argument("--out-json", default=None, metavar="FILE", help="also write the result here")
    b.set_defaults(func=run_bench)


def write_corpus(path: str, gb: float, seed: int = 0, txt: bool = False) -> dict:
    """A jsonl file of at least ``gb`` GB of synthetic text (``txt``: the same texts as the lines of a text file, one
    document); returns its size and document count.

    A pool of 2048 documents of Zipf-distributed pseudo-words (20,000 of them, 1..9 letters) is drawn once; each
    line of the file joins the tail of one pool document to the head of another at random cut points (fast to
    write: the text needs no JSON escaping). Lines are written in blocks of up to 4096 (about 55 MB); the last one
    stops at the first line that reaches ``gb``."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = np.array(["".join(rng.choice(letters, size=rng.integers(1, 10))) for _ in range(20000)])
    p = 1.0 / np.arange(1, words.size + 1) ** 1.1
    p /= p.sum()
    pool = [" ".join(words[rng.choice(words.size, size=int(rng.integers(100, 4000)), p=p)]) for _ in range(2048)]
    target, size, docs = int(gb * 1e9), 0, 0
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii") as f:
        while size < target:
            picks = rng.integers(0, len(pool), size=(4096, 2))
            cuts = rng.random((4096, 2))
            lines = []
            for (i, j), (a, b) in zip(picks.tolist(), cuts.tolist()):
                x, y = pool[i], pool[j]
                text = x[int(a * len(x)):] + " " + y[:int(b * len(y)) + 1]
                lines.append(text + "\n" if txt else '{"text": "' + text + '"}\n')
            if size + sum(map(len, lines)) > target:  # the last block: up to the line that reaches the target
                n, total = 0, size
                while total < target:
                    total += len(lines[n])
                    n += 1
                lines = lines[:n]
            chunk = "".join(lines)
            f.write(chunk)
            size += len(chunk)
            docs += len(lines)
    os.replace(tmp, path)
    return {"path": path, "bytes": os.path.getsize(path), "documents": 1 if txt else docs}


def measure(cmd: list[str], env: dict) -> dict:
    """Run ``cmd``; wall time, exit code, CPU-seconds of its whole tree (``getrusage`` of the waited-for children:
    the command and, through it, its workers), and peak RSS (MB) of its main process and of its whole tree."""
    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {"main": 0, "tree": 0}
    stop = threading.Event()

    def poll():
        try:
            root = psutil.Process(proc.pid)
        except psutil.Error:
            return
        while not stop.is_set():
            try:  # the tree as PSS: pages a forked worker shares with its parent are counted once
                main = root.memory_info().rss
                procs = [root, *root.children(recursive=True)]
                tree = sum(p.memory_full_info().pss for p in procs)
            except psutil.Error:
                tree = main = 0
            peak["main"], peak["tree"] = max(peak["main"], main), max(peak["tree"], tree)
            stop.wait(0.25)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    out, err = proc.communicate()
    stop.set()
    thread.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"cmd": " ".join(cmd[2:]) if cmd[:2] == [sys.executable, "-m"] else " ".join(cmd),
            "rc": proc.returncode, "wall_s": round(time.perf_counter() - start, 2), "cpu_s_tree": round(cpu, 2),
            "peak_rss_mb_main": round(peak["main"] / 2**20, 1), "peak_pss_mb_tree": round(peak["tree"] / 2**20, 1),
            "stdout": out, "stderr_tail": err[-1000:]}


def run_bench(args) -> int:
    work = args.workdir
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    fb = [sys.executable, "-m", "fullband.cli"]
    result = {"load_avg_start": list(os.getloadavg()), "cpus": os.cpu_count(), "gb": args.gb,
              "format": "one .txt document" if args.txt else "jsonl", "seed": SEED, "threads": 1,
              "workers": args.workers, "tokenizer_sample_mb": args.tokenizer_sample_mb}
    corpus = os.path.join(work, "corpus.txt" if args.txt else "corpus.jsonl")
    prep = os.path.join(work, "prepared")
    try:
        t = time.perf_counter()
        result["corpus"] = dict(write_corpus(corpus, args.gb, seed=SEED, txt=args.txt), write_s=round(time.perf_counter() - t, 1))
        shutil.rmtree(prep, ignore_errors=True)
        p = measure(fb + ["data", "prepare", corpus, "--out", prep, "--workers", str(args.workers), "--json",
                          "--no-progress", "--tokenizer-sample-mb", str(args.tokenizer_sample_mb), "--shard-mb",
                          str(args.shard_mb), "--piece-mb", str(args.piece_mb)], env)
        if p["rc"] != 0:
            raise ValueError(f"prepare failed: {p['stderr_tail'].strip().splitlines()[-1:]}")
        manifest = json.loads(p.pop("stdout"))
        p["run"] = manifest["run"]
        p["mb_per_cpu_s_tree"] = round(manifest["run"]["text_mb"] / max(p["cpu_s_tree"], 1e-9), 3)  # end to end
        p["tokens"], p["documents"], p["dtype"] = manifest["tokens"], manifest["documents"], manifest["dtype"]
        result["prepare"] = p
        result["load_avg_after_prepare"] = list(os.getloadavg())
        if not args.skip_train:
            common = ["--preset", "micro", "--steps", "1", "--no-progress", "--no-tensorboard", "--no-plot"]
            for name, data in (("embedded", "shakespeare"), ("prepared", prep)):
                out = os.path.join(work, f"train-{name}")
                r = measure(fb + ["train", "--data", data, "--out", out, "--overwrite", *common], env)
                r.pop("stdout")
                if r["rc"] != 0:
                    raise ValueError(f"train on {name} failed: {r['stderr_tail'].strip().splitlines()[-1:]}")
                result[f"train_{name}"] = r
            e, q = result["train_embedded"], result["train_prepared"]
            delta = round(q["peak_rss_mb_main"] - e["peak_rss_mb_main"], 1)
            result["train_prepared_vs_embedded"] = {"wall_ratio": round(q["wall_s"] / e["wall_s"], 3),
                                                    "rss_mb_delta": delta}
        result["load_avg_end"] = list(os.getloadavg())
        result["load_average"] = [round(result["load_avg_start"][0], 2), round(result["load_avg_end"][0], 2)]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out_json:
        atomic_write_text(args.out_json, text + "\n")
    return 0


def format_result(res: dict) -> str:
    """The benchmark's JSON object as Markdown: what was prepared, the prepare's time, throughput and peak memory,
    and training start-up on the prepared directory against the embedded corpus, each bar of :data:`BARS` met or
    not."""
    c, p = res["corpus"], res["prepare"]
    run = p["run"]
    loads = " / ".join(f"{x:.2f}" for x in res["load_avg_start"])
    after = " / ".join(f"{x:.2f}" for x in res["load_avg_after_prepare"])
    end = " / ".join(f"{x:.2f}" for x in res.get("load_avg_end", []))
    peak = p["peak_pss_mb_tree"]
    rows = [("corpus", f"{c['bytes']:,} bytes of {res['format']}, {c['documents']:,} documents (written in "
                       f"{c['write_s']} s, seed {res.get('seed', '?')})"),
            ("prepared", f"{p['tokens']:,} `{p['dtype']}` tokens of {p['documents']:,} documents in "
                         f"{run['new_shards']} shards"),
            (f"BPE trained on {res.get('tokenizer_sample_mb', '?')} MB", f"{run['tokenizer_seconds']} s"),
            ("prepare, whole command", f"{p['wall_s']:,} s wall, {p['cpu_s_tree']:,} CPU-seconds (the whole tree)"),
            (f"**peak memory of the prepare** (bar: < {BARS['prepare_peak_mb'] / 1000:g} GB)",
             f"**RSS of the main process {p['peak_rss_mb_main']:,} MB, PSS of the tree (main + workers) {peak:,} MB**"
             f" ({'met' if peak < BARS['prepare_peak_mb'] else 'NOT met'})"),
            (f"throughput, wall ({run['workers']} workers)", f"{run['mb_per_s']} MB/s, {run['tokens_per_s']:,} tokens/s"),
            ("**per worker CPU-second**", f"**{run['tokens_per_cpu_s_per_worker']:,} tokens = "
                                          f"{run['mb_per_cpu_s_per_worker']} MB of text**"),
            ("per CPU-second of the whole command (reading, split, BPE, main, start-up)", f"{p['mb_per_cpu_s_tree']} MB")]
    for name, label in (("embedded", "the embedded corpus (BPE trained at start-up)"),
                        ("prepared", "the prepared directory")):
        t = res.get(f"train_{name}")
        if t:
            rows.append((f"`train --preset micro --steps 1`, {label}",
                         f"{t['wall_s']} s ({t['cpu_s_tree']} CPU-s), peak RSS {t['peak_rss_mb_main']:,} MB"))
    cmp = res.get("train_prepared_vs_embedded")
    if cmp:
        met = cmp["wall_ratio"] <= BARS["train_wall_ratio"] and cmp["rss_mb_delta"] <= BARS["train_rss_mb_delta"]
        rows.append((f"prepared vs embedded (bar: wall within {BARS['train_wall_ratio'] - 1:.0%}, at most "
                     f"+{BARS['train_rss_mb_delta']:g} MB RSS)",
                     f"**wall ratio {cmp['wall_ratio']}, RSS {cmp['rss_mb_delta']:+,} MB** ({'met' if met else 'NOT met'})"))
    lines = [f"`uptime` load average {loads} at the start, {after} after the prepare" + (f", {end} at the end" if end else "")
             + f"; {res['cpus']} CPUs.", "", "| what | measured |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def markdown_reports(res: dict) -> str:
    """A set of ``data bench`` results (``{"reports": [{"command", "report"}, ...]}``, as
    ``docs/gen/collect_runs.py`` writes them), each under its command."""
    return "\n\n".join(f"`{e['command']}`\n\n{format_result(e['report'])}" for e in res["reports"])
