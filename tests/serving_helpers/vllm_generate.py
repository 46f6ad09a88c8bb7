"""Run greedy generation through vLLM (with the fullband plugin) in a process of its own.

Usage: ``python vllm_generate.py SPEC.json OUT.json``. SPEC holds ``model`` (a directory), ``prompts`` (lists of
token ids), ``max_tokens`` (one per prompt) and ``engine`` (keyword arguments of ``vllm.LLM``). OUT gets
``outputs`` (the generated token ids per prompt) or, when the engine refuses to start, ``error`` (its message).
A script of its own because vLLM spawns worker processes (the ``__main__`` guard) and keeps global state.
"""

import json
import sys


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        llm = LLM(model=spec["model"], **spec.get("engine", {}))
    except Exception as err:  # the refusal under test: report its message
        with open(out_path, "w") as f:
            json.dump({"error": f"{type(err).__name__}: {err}"}, f)
        return 0
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in spec["max_tokens"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    with open(out_path, "w") as f:
        json.dump({"outputs": [list(o.outputs[0].token_ids) for o in outs]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
