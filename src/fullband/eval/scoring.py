"""Held-out language-model loss of a model in any mode: the one map from a mode to the model call.

Owns :func:`mode_logits` (whole rows: ``standard`` = one ordinary pass; ``passes`` = the K-pass teacher-forced
forward of training; ``exact`` = the token-by-token recurrence decoding runs -- K-pass figures need not carry over to
it, so report both) and :func:`token_nll` (per-token loss in any scoring mode, ``soft`` / ``fused`` scoring a
continuation after a prompt as decoding sees it), which evaluation, the quickstart, the experiments, SFT evaluation
and the lm-eval adapter all call; around them :func:`row_losses` / :func:`evaluate_loss` (per row / mean over packed
rows), :func:`evaluation_rows` (the held-out text, split exactly as training splits it, with
:func:`split_settings` reading a run's own split), :func:`evaluate_model` (every mode of one model into one
report), :func:`report_markdown`, :func:`load_any_model` (a fullband or plain Hugging Face directory, with its
tokenizer) and :func:`write_report` (JSON + markdown, each written atomically).
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..data.corpus import load_documents, load_tokenizer, pack, split_documents, tokenize_documents
from ..model.configuration import SCORING_MODES, has_feedback
from ..model.generation import score
from ..model.modeling import load_model
from ..utils.io import atomic_write_text

MODES = ("standard", "passes", "exact")  # the whole-row modes a report covers (soft / fused need a prompt)


@torch.no_grad()
def mode_logits(model, ids: torch.Tensor, mode: str = "standard", num_passes: int = 2,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[B, T, V]`` of whole rows in a whole-row mode: ``standard`` (one plain pass), ``passes`` (the K-pass
    teacher-forced forward) or ``exact`` (the token-by-token recurrence). A plain model allows ``standard`` only."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not a whole-row mode: choose one of {', '.join(MODES)}")
    if mode != "standard" and not has_feedback(model):
        raise ValueError(f"mode {mode!r} needs a fullband model (one with latent feedback); this one has none")
    if mode == "exact":
        return model.recurrent_forward(ids, attention_mask).logits
    if has_feedback(model):
        return model(ids, attention_mask=attention_mask, num_passes=num_passes if mode == "passes" else 1).logits
    return (model(input_ids=ids) if attention_mask is None else model(input_ids=ids, attention_mask=attention_mask)).logits


@torch.no_grad()
def token_nll(model, ids: torch.Tensor, mode: str = "standard", num_passes: int = 2, prompt_length: int = 0,
              prefill_passes: int = 1) -> torch.Tensor:
    """Next-token NLL ``[B, T - max(1, prompt_length)]`` of the tokens ``ids[:, max(1, prompt_length):]``, in ``mode``:

    * ``standard`` one plain pass; ``passes`` the K-pass teacher-forced forward (``num_passes``); ``exact`` the
      token-by-token recurrence over the whole row -- each needs only the row;
    * ``soft`` / ``fused``: the first ``prompt_length`` tokens are the prompt (plain, or with ``prefill_passes``
      Jacobi passes), the rest is scored as a decode would see it (each token fused with the state before it).

    A plain model (no latent feedback) allows ``standard`` only. This is the one place that maps a mode to the
    model call; every evaluation in the package scores through it.
    """
    if mode not in SCORING_MODES:
        raise ValueError(f"unknown scoring mode {mode!r}: choose one of {', '.join(SCORING_MODES)}")
    if mode != "standard" and not has_feedback(model):
        raise ValueError(f"mode {mode!r} needs a fullband model (one with latent feedback); this one has none")
    start = max(1, prompt_length)
    if start >= ids.shape[1]:
        raise ValueError(f"prompt_length {prompt_length} leaves nothing to score in rows of {ids.shape[1]} tokens")
    if mode in ("soft", "fused"):
        if prompt_length < 1:
            raise ValueError(f"mode {mode!r} scores a continuation: give prompt_length >= 1")
        logp = score(model, ids[:, :start], ids[:, start:], mode=mode, prefill_passes=prefill_passes)
        return -logp.float()
    logits = mode_logits(model, ids, mode, num_passes)
    logits = logits[:, start - 1:-1].float()
    return F.cross_entropy(logits.flatten(0, 1), ids[:, start:].flatten(), reduction="none").view(ids.shape[0], -1)


@torch.no_grad()
def row_losses(model, rows: torch.Tensor, mode: str = "standard", num_passes: int = 2, prompt_length: int = 0,
               batch_size: int = 16, progress: bool = False) -> torch.Tensor:
    """Mean NLL of each row ``[N]`` (float64) in ``mode`` (see :func:`token_nll`); rows have equal length, so
    the mean of these is the per-token mean."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    starts = range(0, rows.shape[0], batch_size)
    if progress:
        starts = tqdm(starts, desc=f"eval {mode}", unit="batch", leave=False)
    out = []
    try:
        for i in starts:
            nll = token_nll(model, rows[i:i + batch_size].to(device), mode, num_passes, prompt_length)
            out.append(nll.double().mean(1).cpu())
    finally:
        model.train(was_training)
    return torch.cat(out)


@torch.no_grad()
def evaluate_loss(model, rows: torch.Tensor, mode: str = "standard", num_passes: int = 2, batch_size: int = 16,
                  max_rows: int | None = None, progress: bool = False) -> dict:
    """``{"loss", "perplexity", "tokens", "mode", "num_passes"}`` over ``rows`` ``[N, T]`` (all positions predicted)."""
    if mode not in MODES:
        raise ValueError(f"unknown evaluation mode {mode!r}: choose one of {', '.join(MODES)}")
    if rows.dim() != 2 or rows.shape[1] < 2 or rows.shape[0] == 0:
        raise ValueError(f"need at least one evaluation row of >= 2 tokens, got shape {tuple(rows.shape)}")
    if max_rows is not None:
        rows = rows[:max_rows]
    per_row = row_losses(model, rows, mode, num_passes, batch_size=batch_size, progress=progress)
    count = rows[:, 1:].numel()
    total = float(per_row.sum()) * (rows.shape[1] - 1)
    loss = total / count
    return {"mode": mode, "num_passes": num_passes if mode == "passes" else (1 if mode == "standard" else None),
            "loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}


# ----------------------------------------------------------------------------------------------- model + data


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_any_model(path: str, device: str | None = None, dtype: str | None = None):
    """``(model, tokenizer)`` from a local directory: a fullband model, or a plain HF causal LM (no feedback).

    ``dtype`` is ``None`` (as saved), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    """
    kwargs = {}
    if dtype is not None:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {dtype!r}: choose float32, bfloat16 or float16")
        kwargs["dtype"] = getattr(torch, dtype)
    model = load_model(path, **kwargs)
    tokenizer = load_tokenizer(path)
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer in {path!r} has {len(tokenizer)} entries but the model's vocabulary only "
                         f"{vocab}: they do not belong together")
    model.to(device or default_device()).eval()
    return model, tokenizer


def evaluation_rows(tokenizer, data: str | None = None, split: str = "val", seq_len: int = 256,
                    val_fraction: float = 0.1, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """Packed rows ``[N, seq_len]`` of held-out text and a description of where they came from.

    ``data`` is any :func:`fullband.data.load_documents` source (``None``: the embedded corpus). ``split`` picks
    the documents: ``"val"`` (the validation documents, split exactly as ``fullband train`` splits them with the
    same ``seed`` and ``val_fraction``), ``"train"``, or ``"all"`` (every document, e.g. a separate held-out file).
    """
    if split not in ("val", "train", "all"):
        raise ValueError(f"unknown split {split!r}: choose val, train or all")
    docs = load_documents(data)
    if split != "all":
        train, val = split_documents(docs, val_fraction, seed)
        docs = val if split == "val" else train
        if not docs:
            raise ValueError("the validation split is empty (val_fraction 0): use --split all or a val fraction > 0")
    rows = pack(tokenize_documents(tokenizer, docs), seq_len)
    info = {"source": data or "shakespeare (embedded)", "split": split, "val_fraction": val_fraction, "seed": seed,
            "seq_len": seq_len, "documents": [d.name for d in docs]}
    return rows, info


def _predicted_bytes(tokenizer, rows: torch.Tensor) -> int:
    """UTF-8 bytes of the predicted tokens (every position but the first of each row; special tokens count 0)."""
    total = 0
    for row in rows.tolist():
        total += len(tokenizer.decode(row[1:], skip_special_tokens=True).encode("utf-8"))
    return total


# ----------------------------------------------------------------------------------------------- report


def evaluate_model(model, rows: torch.Tensor, passes=(2, 3, 4), exact: bool = True, batch_size: int = 8,
                   max_rows: int | None = None, tokenizer=None, progress: bool = False) -> dict:
    """Every mode of ``model`` on the same rows: ``{"feedback", "results": [...], "notes": [...]}``.

    ``results`` lists ``standard`` (K = 1), ``passes`` for each K in ``passes`` (K = 1 is standard and skipped)
    and ``exact`` (when ``exact``); a plain HF model gets ``standard`` only, and a note saying why. With a
    ``tokenizer``, each result also has ``bits_per_byte`` (comparable across tokenizers).
    """
    if max_rows is not None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        rows = rows[:max_rows]
    feedback = has_feedback(model)
    plan = [("standard", 1)]
    notes = []
    if feedback:
        for k in passes:
            if not isinstance(k, int) or k < 1:
                raise ValueError(f"number of passes must be an integer >= 1, got {k!r}")
        plan += [("passes", k) for k in sorted(set(passes)) if k > 1]
        if exact:
            plan.append(("exact", None))
    else:
        notes.append("plain Hugging Face model without latent feedback: only the standard mode applies "
                     "(multi-pass and exact-recurrence modes were not run)")
    nbytes = _predicted_bytes(tokenizer, rows) if tokenizer is not None else None
    results = []
    for mode, k in plan:
        res = evaluate_loss(model, rows, mode=mode, num_passes=k or 1, batch_size=batch_size, progress=progress)
        res["num_passes"] = k
        if nbytes:
            res["bytes"] = nbytes
            res["bits_per_byte"] = res["loss"] * res["tokens"] / (math.log(2) * nbytes)
        results.append(res)
    return {"feedback": feedback, "rows": int(rows.shape[0]), "seq_len": int(rows.shape[1]),
            "results": results, "notes": notes}


def _mode_label(res: dict) -> str:
    if res["mode"] == "passes":
        return f"passes (K={res['num_passes']})"
    if res["mode"] == "standard":
        return "standard (K=1)"
    return "exact recurrence"


def report_markdown(report: dict) -> str:
    """The report as a markdown document (a table of loss / perplexity per mode)."""
    lines = [f"# Held-out loss: {report.get('model', 'model')}", ""]
    data = report.get("data")
    if data:
        docs = data.get("documents", [])
        shown = ", ".join(docs[:8]) + (f", … ({len(docs)} in all)" if len(docs) > 8 else "")
        lines += [f"Data: {data.get('source')} — split `{data.get('split')}` (seed {data.get('seed')}, "
                  f"val fraction {data.get('val_fraction')}): {shown}", ""]
    lines += [f"Rows: {report['rows']} × {report['seq_len']} tokens; latent feedback: "
              f"{'yes' if report['feedback'] else 'no'}", ""]
    has_bpb = any("bits_per_byte" in r for r in report["results"])
    head = "| mode | loss (nats/token) | perplexity | tokens |" + (" bits/byte |" if has_bpb else "")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in report["results"]:
        row = f"| {_mode_label(r)} | {r['loss']:.4f} | {r['perplexity']:.3f} | {r['tokens']} |"
        if has_bpb:
            row += f" {r['bits_per_byte']:.4f} |" if "bits_per_byte" in r else " |"
        lines.append(row)
    for note in report.get("notes", []):
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


def report_paths(out: str, stem: str) -> tuple[str, str]:
    """``out`` ending in ``.json``: that file and the ``.md`` beside it; otherwise a folder with ``stem``.json/.md."""
    if out.endswith(".json"):
        return out, out[: -len(".json")] + ".md"
    return os.path.join(out, f"{stem}.json"), os.path.join(out, f"{stem}.md")


def write_report(report: dict, markdown: str, out: str, stem: str) -> tuple[str, str]:
    """Write the JSON and the markdown report (each atomically); returns both paths."""
    json_path, md_path = report_paths(out, stem)
    atomic_write_text(json_path, json.dumps(report, indent=2) + "\n")
    atomic_write_text(md_path, markdown)
    return json_path, md_path


# ----------------------------------------------------------------------------------------------- evaluation text of a run


TRAIN_RUN_CONFIG = "run_config.json"  # what `fullband train` writes beside the model it saves


def split_settings(model_dir: str, data=None, seed=None, val_fraction=None, seq_len=None) -> tuple[dict, str | None]:
    """The evaluation text's settings: the ones given, else those of the training run that saved ``model_dir``
    (its ``run_config.json``: data, seed, val_fraction, seq_len), else the training defaults (embedded corpus,
    seed 0, val fraction 0.1, 256 tokens). Returns the settings and the run config used (or ``None``)."""
    saved, source = {}, None
    path = os.path.join(model_dir, TRAIN_RUN_CONFIG)
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        source = path
    given = {"data": data, "seed": seed, "val_fraction": val_fraction, "seq_len": seq_len}
    defaults = {"data": None, "seed": 0, "val_fraction": 0.1, "seq_len": 256}
    settings = {k: given[k] if given[k] is not None else saved.get(k, defaults[k]) for k in given}
    return settings, source
