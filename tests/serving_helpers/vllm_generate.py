"""Run greedy generation through vLLM (with the fullband plugin) in a process of its own.

Usage: ``python vllm_generate.py SPEC.json OUT.json``. SPEC holds ``runs``, each with ``model`` (a directory),
``prompts`` (lists of token ids), ``max_tokens`` (one per prompt) and ``engine`` (keyword arguments of
``vllm.LLM``); the engines are started one after the other. OUT gets one result per run: ``outputs`` (the
generated token ids per prompt) or, when the engine refuses to start, ``error`` (its message). A script of its own
because vLLM spawns worker processes (the ``__main__`` guard) and keeps global state.
"""

import gc
import json
import sys


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        llm = LLM(model=spec["model"], **spec.get("engine", {}))
    except Exception as err:  # a refusal under test: report its message
        return {"error": f"{type(err).__name__}: {err}"}
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in spec["max_tokens"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = {"outputs": [list(o.outputs[0].token_ids) for o in outs]}
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:  # stop this engine's processes before the next run starts one
        core.shutdown()
    del llm
    gc.collect()
    return result


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    results = [run(r) for r in spec["runs"]]
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
