"""Where the fixed per-step cost of the vLLM plugin goes (not a test; run by hand in the vLLM venv).

Usage: ``OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python tests/serving_helpers/profile_serve_step.py [REPEATS]``.
The models of ``fullband bench serve`` at its default tiny size (d256 L4, vocab 4096, fp32, ``enforce_eager``),
batch 1, a 32-token prompt, 64 new tokens, the engine core in this process so the plugin's code can be timed: wall
time of each model's ``generate`` (alternating, median of REPEATS), and per step the time in the plugin's metadata
build, in its forward outside the backbone (token embedding, state gather, fusion, state write), and in the
backbone's forward (fullband and plain). Prints JSON.
"""

import json
import os
import random
import statistics
import sys
import tempfile
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(repeats: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models.llama import LlamaModel

    import fullband.serving.vllm_model as vm
    from fullband.serving.benchmark import build_models

    plain_dir, fb_dir = build_models(tempfile.mkdtemp(prefix="fullband-profile-"), 256, 4, 4096)
    acc = dict.fromkeys(("build", "fb_forward", "backbone_in_fb", "plain_backbone"), 0.0)
    in_fullband = [False]

    def timed(cls, name, key):
        f = getattr(cls, name)

        def g(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            acc[key(self_is_fb=in_fullband[0]) if callable(key) else key] += time.perf_counter() - t
            return r
        setattr(cls, name, g)

    timed(vm.FeedbackStateMetadataBuilder, "build", "build")
    timed(vm.FullBandwidthForCausalLMVLLM, "forward", "fb_forward")
    timed(LlamaModel, "forward", lambda self_is_fb: "backbone_in_fb" if self_is_fb else "plain_backbone")
    engine = dict(dtype="float32", enforce_eager=True, skip_tokenizer_init=True, seed=0, max_num_seqs=1,
                  max_model_len=32 + 64 + 8, enable_prefix_caching=False)
    llms = {"fullband": LLM(model=fb_dir, **engine), "plain": LLM(model=plain_dir, **engine)}
    rng = random.Random(0)
    prompt = [TokensPrompt(prompt_token_ids=[1] + [rng.randrange(3, 4096) for _ in range(31)])]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    times = {"fullband": [], "plain": []}
    load_before = os.getloadavg()
    for r in range(repeats + 1):  # round 0 warms up, untimed
        for name in (("fullband", "plain") if r % 2 == 0 else ("plain", "fullband")):
            in_fullband[0] = name == "fullband"
            t = time.perf_counter()
            llms[name].generate(prompt, params, use_tqdm=False)
            if r:
                times[name].append(time.perf_counter() - t)
        if r == 0:
            acc.update(dict.fromkeys(acc, 0.0))
    steps = 64 * repeats
    fb, pl = statistics.median(times["fullband"]), statistics.median(times["plain"])
    us = 1e6 / steps
    return {"load_average_before": load_before, "load_average_after": os.getloadavg(), "repeats": repeats,
            "ratio_of_medians": pl / fb, "paired_ratios": [p / f for f, p in zip(times["fullband"], times["plain"])],
            "step_us_fullband": fb / 64 * 1e6, "step_us_plain": pl / 64 * 1e6,
            "plugin_build_us": acc["build"] * us,
            "plugin_forward_outside_backbone_us": (acc["fb_forward"] - acc["backbone_in_fb"]) * us,
            "backbone_us_fullband": acc["backbone_in_fb"] * us, "backbone_us_plain": acc["plain_backbone"] * us}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 10), indent=1))
