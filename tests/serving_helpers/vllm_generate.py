"""Run generation through vLLM (with the fullband plugin) in a process of its own.

Usage: ``python vllm_generate.py SPEC.json OUT.json [STATS_PREFIX]``. SPEC holds ``runs``, each with ``model`` (a
directory), ``prompts`` (lists of token ids), ``max_tokens`` (one per prompt), ``engine`` (keyword arguments of
``vllm.LLM``) and optionally ``abort_after`` (a number of engine steps, see :func:`_abort_run`); the engines are
started one after the other. Greedy decoding, EOS ignored. OUT gets one result per run: ``outputs`` (the generated
token ids per prompt) or, when the engine refuses to start, ``error`` (its message); with STATS_PREFIX, run ``i``'s
engine writes the plugin's statistics to ``STATS_PREFIX.i.json`` (the engine process inherits the environment
variable set here before it starts). A script of its own because vLLM spawns worker processes (the ``__main__``
guard) and keeps global state.
"""

import gc
import json
import os
import sys


def _abort_run(llm, prompts, params, abort_after: int) -> list[list[int]]:
    """``prompts[0]`` runs alone for ``abort_after`` engine steps (the engine core runs in this process, so a
    ``step()`` is one scheduler step) and is aborted; then the other prompts run to the end. Returns the tokens
    ``prompts[0]`` had produced when it was aborted, then every other prompt's tokens."""
    engine = llm.llm_engine
    engine.add_request("aborted", prompts[0], params[0])
    partial: list[int] = []
    for _ in range(abort_after):
        for out in engine.step():
            partial = list(out.outputs[0].token_ids)
    engine.abort_request(["aborted"])
    for i, (p, sp) in enumerate(zip(prompts[1:], params[1:])):
        engine.add_request(f"after-{i}", p, sp)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 10_000, "engine did not finish"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert "aborted" not in done, "the aborted request was finished instead"
    return [partial] + [done[f"after-{i}"] for i in range(len(prompts) - 1)]


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if spec.get("abort_after"):  # the engine core in this process: one step() call is one engine step
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        llm = LLM(model=spec["model"], **spec.get("engine", {}))
    except Exception as err:  # a refusal under test: report its message
        return {"error": f"{type(err).__name__}: {err}"}
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in spec["max_tokens"]]
    if spec.get("abort_after"):
        result = {"outputs": _abort_run(llm, prompts, params, spec["abort_after"])}
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
        result = {"outputs": [list(o.outputs[0].token_ids) for o in outs]}
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:  # stop this engine's processes before the next run starts one
        core.shutdown()
    del llm
    gc.collect()
    return result


def main(spec_path: str, out_path: str, stats_prefix: str | None = None) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    results = []
    for i, r in enumerate(spec["runs"]):
        if stats_prefix:
            os.environ["FULLBAND_VLLM_STATS"] = f"{stats_prefix}.{i}.json"
        results.append(run(r))
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
