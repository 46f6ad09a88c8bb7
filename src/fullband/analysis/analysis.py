"""``fullband analyze``: what the fed-back state carries, and whether shallow residuals carry richer information.

Owns the analysis of a trained fullband model (optionally side by side with a baseline: a plain Hugging Face
causal LM, or another fullband model) on held-out text, and the report it writes (markdown + PNG plots + JSON of
every number) under ``--out`` (default ``runs/analyze/``):

1. **Load-bearing test** (:func:`load_bearing`): next-token loss with the real fed-back state versus the same
   model with the state zeroed, shuffled across positions, or taken from another document, and with feedback
   switched off. Measured under the exact token-by-token recurrence (what decoding runs) and under the K-pass
   teacher-forced forward (what training runs). "Damage" = intervened loss − real loss, in nats per token.
2. **Layer probes** (:func:`ridge_probe`): for each layer's residual stream (the backbone's
   ``output_hidden_states``: the embedding output, then each layer), a ridge regression fitted in closed form on
   one split of the positions and scored on another, recovering (a) the next token, (b) the token two ahead
   (one-hot targets, accuracy of the argmax) and (c) the previous position's top-layer state (R²).
3. **Logit lens** (:func:`logit_lens`): the backbone's final norm and LM head applied to every layer's residual
   stream; next-token loss and accuracy per layer.
4. **Gate statistics** (:func:`gate_statistics`): the distribution of the GLU token gate
   ``sigmoid(W_G norm(e_t))`` over the tokens of the text, per-token mean gates, and the ratio
   ``||u_t|| / ||e_t||`` of the fused input to the plain embedding at fused positions.

The exact recurrence with a hook on the fed-back state (:func:`recurrence`) and the K-pass forward with a
transform of the fed-back states (:func:`passes_forward`) live here, so :mod:`fullband.modeling` stays the
single reference implementation of the model itself; both reproduce it exactly when no intervention is made
(tested).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..utils.io import atomic_write_bytes

DEFAULT_OUT = os.path.join("runs", "analyze")
INTERVENTIONS = ("real", "zero", "shuffle", "other_doc", "plain")
PROBE_TARGETS = ("next_token", "two_ahead", "prev_state")
ALPHAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)

StateHook = Callable[[int, torch.Tensor], torch.Tensor]


def _log(msg: str) -> None:
    print(f"[analyze] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- models


def is_fullband(model) -> bool:
    from ..model.modeling import FullBandwidthForCausalLM

    return isinstance(model, FullBandwidthForCausalLM)


def load_any_model(path: str):
    """A saved fullband model, or a plain Hugging Face causal LM directory (for a baseline)."""
    from ..model.modeling import load_model

    return load_model(path).eval()


def backbone_of(model) -> nn.Module:
    """The Hugging Face causal LM that does the work (the model itself when it has no feedback)."""
    return model.backbone if is_fullband(model) else model


_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "norm_f", "final_layernorm", "ln_final", "final_norm")


def final_norm(backbone: nn.Module) -> nn.Module:
    """The norm a causal LM applies to its last layer's output before the LM head (``model.norm`` for
    Llama-likes, ``transformer.ln_f`` for GPT-2, ``gpt_neox.final_layer_norm``, ``model.decoder.final_layer_norm``
    for OPT, ...). Raises ``ValueError`` for a family where none can be found."""
    candidates = []
    get_decoder = getattr(backbone, "get_decoder", None)
    if callable(get_decoder):
        try:
            candidates.append(get_decoder())
        except (AttributeError, NotImplementedError, TypeError):
            pass
    for name in ("model", "transformer", "gpt_neox", "decoder"):
        sub = getattr(backbone, name, None)
        if isinstance(sub, nn.Module):
            candidates.append(sub)
            inner = getattr(sub, "decoder", None)
            if isinstance(inner, nn.Module):
                candidates.append(inner)
    for module in candidates:
        if module is None:
            continue
        for name in _NORM_NAMES:
            norm = getattr(module, name, None)
            if isinstance(norm, nn.Module):
                return norm
    raise ValueError(f"logit lens: cannot find the final norm of a {type(backbone).__name__} "
                     f"(looked for {', '.join(_NORM_NAMES)} on its decoder); this backbone family is not supported")


# ----------------------------------------------------------------------------------------------- data


@dataclass
class AnalysisData:
    """Packed held-out rows ``ids [N, T]`` and which document each token belongs to (``doc_ids [N, T]``)."""

    ids: torch.Tensor
    doc_ids: torch.Tensor
    doc_names: list[str]
    source: str
    total_rows: int

    @property
    def tokens(self) -> int:
        return self.ids.numel()


def analysis_rows(tokenizer, data: str | None = None, seq_len: int = 128, max_tokens: int = 8192,
                  val_fraction: float = 0.1, seed: int = 0) -> AnalysisData:
    """Held-out rows for the analysis.

    ``data`` None (or ``"shakespeare"``): the validation documents of the embedded corpus
    (:func:`fullband.data.split_documents` with the given ``val_fraction``/``seed``, the training defaults);
    otherwise every document of ``data`` (give held-out text). Documents are packed as ``BOS text EOS`` like in
    training and cut into rows of ``seq_len``; ``max_tokens // seq_len`` rows are taken evenly spaced over the
    stream, so that several documents are represented.
    """
    from ..data.corpus import EMBEDDED, load_documents, split_documents, tokenize_documents

    if seq_len < 4:
        raise ValueError(f"--seq-len must be >= 4 for the analysis (probes look two tokens ahead), got {seq_len}")
    if max_tokens < seq_len:
        raise ValueError(f"--max-tokens ({max_tokens}) must be at least --seq-len ({seq_len})")
    if data is None or data == EMBEDDED:
        _, docs = split_documents(load_documents(EMBEDDED), val_fraction, seed)
        source = f"{EMBEDDED} (validation split, val_fraction={val_fraction}, seed={seed})"
    else:
        docs = load_documents(data)
        source = data
    token_lists = tokenize_documents(tokenizer, docs)
    stream = torch.tensor([t for ids in token_lists for t in ids], dtype=torch.long)
    doc_stream = torch.cat([torch.full((len(ids),), i, dtype=torch.long) for i, ids in enumerate(token_lists)])
    n = stream.numel() // seq_len
    if n == 0:
        raise ValueError(f"only {stream.numel()} tokens of text: not one row of {seq_len}; use a shorter --seq-len")
    ids = stream[: n * seq_len].view(n, seq_len)
    doc_ids = doc_stream[: n * seq_len].view(n, seq_len)
    k = min(n, max_tokens // seq_len)
    pick = torch.linspace(0, n - 1, k).round().long().unique()
    return AnalysisData(ids[pick].clone(), doc_ids[pick].clone(), [d.name for d in docs], source, n)


# ----------------------------------------------------------------------------------------------- runs


@dataclass
class RunRecord:
    """One forward over ``ids [B, T]``.

    ``nll``/``correct`` ``[B, T-1]``: next-token loss and top-1 hit of position t predicting t+1;
    ``last_hidden`` ``[B, T, d]`` the final hidden states (what the LM head reads and what is fed back);
    ``hidden_states`` the ``L+1`` residual streams (embedding output, then each layer), when asked for;
    ``inputs_embeds`` what actually entered the backbone, ``token_embeds`` the plain embeddings.
    """

    nll: torch.Tensor
    correct: torch.Tensor
    last_hidden: torch.Tensor
    hidden_states: list[torch.Tensor] | None = None
    inputs_embeds: torch.Tensor | None = None
    token_embeds: torch.Tensor | None = None


def _nll_correct(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    nll = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view(targets.shape)
    return nll, logits.argmax(-1) == targets


@torch.no_grad()
def standard_forward(backbone: nn.Module, ids: torch.Tensor, output_hidden_states: bool = False) -> RunRecord:
    """The backbone's ordinary forward (no feedback anywhere)."""
    out = backbone(input_ids=ids, output_hidden_states=True, return_dict=True)
    nll, correct = _nll_correct(out.logits[:, :-1], ids[:, 1:])
    hs = [h.float() for h in out.hidden_states]
    return RunRecord(nll, correct, hs[-1], hs if output_hidden_states else None,
                     token_embeds=backbone.get_input_embeddings()(ids))


@torch.no_grad()
def recurrence(model, ids: torch.Tensor, feedback_mask: torch.Tensor | None = None, state_hook: StateHook | None = None,
               output_hidden_states: bool = False) -> RunRecord:
    """The exact token-by-token recurrence of a fullband model (as
    :meth:`~fullband.FullBandwidthForCausalLM.recurrent_forward`), with a hook on the fed-back state.

    At step t (t ≥ 1), ``state_hook(t, h_prev)`` receives the final hidden state ``h_{t-1}`` ``[B, 1, d]`` that
    this run produced one step earlier and returns the state to fuse instead; the fused input is used where
    ``feedback_mask[:, t]`` is True, the plain embedding elsewhere (as in decoding). No hook = the real recurrence.
    """
    from transformers import DynamicCache

    from ..model.feedback import build_feedback_mask, fuse_where

    model.check_inputs(ids, None, None, feedback_mask)
    B, T = ids.shape
    if feedback_mask is None:
        feedback_mask = build_feedback_mask(ids, None, model.doc_start_token_id)
    feedback_mask = feedback_mask.bool().to(ids.device)
    backbone = model.backbone
    positions = torch.arange(T, device=ids.device).expand(B, T)
    token_embeds = model.get_input_embeddings()(ids)
    cache = DynamicCache(config=backbone.config)
    logits_steps, inputs, prev = [], [], None
    layers: list[list[torch.Tensor]] | None = None
    for t in range(T):
        inp = token_embeds[:, t:t + 1]
        if prev is not None:
            state = state_hook(t, prev) if state_hook is not None else prev
            inp = fuse_where(feedback_mask[:, t:t + 1], model.feedback(state.to(prev.dtype), inp), inp)
        inputs.append(inp)
        out = backbone(inputs_embeds=inp, position_ids=positions[:, t:t + 1], cache=cache, use_cache=True,
                       output_hidden_states=True, return_dict=True)
        cache = out.cache
        prev = out.hidden_states[-1]
        logits_steps.append(out.logits[:, -1:].float())
        if output_hidden_states:
            if layers is None:
                layers = [[] for _ in out.hidden_states]
            for store, h in zip(layers, out.hidden_states):
                store.append(h.float())
        else:
            if layers is None:
                layers = [[]]
            layers[0].append(prev.float())
    logits = torch.cat(logits_steps, 1)
    nll, correct = _nll_correct(logits[:, :-1], ids[:, 1:])
    hs = [torch.cat(store, 1) for store in layers]
    return RunRecord(nll, correct, hs[-1], hs if output_hidden_states else None,
                     inputs_embeds=torch.cat(inputs, 1), token_embeds=token_embeds)


@torch.no_grad()
def passes_forward(model, ids: torch.Tensor, num_passes: int, feedback_mask: torch.Tensor | None = None,
                   transform: Callable[[torch.Tensor], torch.Tensor] | None = None, batch_size: int = 32) -> torch.Tensor:
    """The K-pass teacher-forced forward (as ``model(ids, num_passes=K)`` in eval mode), pass-major over batches
    of rows, with an optional ``transform`` of the fed-back states.

    Pass 1 is plain; pass k > 1 fuses ``transform(S)`` where ``S[:, t] = h^{(k-1)}_{t-1}`` (pass k-1's final
    hidden states shifted right by one) of *all* rows ``[N, T, d]`` (so a transform may take states from other
    rows). Returns the last pass's per-position next-token loss ``[N, T-1]``.
    """
    from ..model.feedback import build_feedback_mask, fuse_where, shift_right

    if num_passes < 1:
        raise ValueError(f"num_passes must be >= 1, got {num_passes}")
    N, T = ids.shape
    if feedback_mask is None:
        feedback_mask = build_feedback_mask(ids, None, model.doc_start_token_id)
    feedback_mask = feedback_mask.bool()
    backbone = model.backbone
    embed = model.get_input_embeddings()
    hidden, nll = None, None
    for k in range(num_passes):
        state = None
        if k > 0:
            state = shift_right(hidden)
            if transform is not None:
                state = transform(state)
        new_hidden, new_nll = [], []
        for i in range(0, N, batch_size):
            rows = ids[i:i + batch_size]
            tok = embed(rows)
            inp = tok
            if state is not None:
                inp = fuse_where(feedback_mask[i:i + batch_size], model.feedback(state[i:i + batch_size].to(tok.dtype), tok), tok)
            out = backbone(inputs_embeds=inp, output_hidden_states=True, return_dict=True)
            new_hidden.append(out.hidden_states[-1])
            if k == num_passes - 1:
                new_nll.append(_nll_correct(out.logits[:, :-1], rows[:, 1:])[0])
        hidden = torch.cat(new_hidden, 0)
        if new_nll:
            nll = torch.cat(new_nll, 0)
    return nll


# ----------------------------------------------------------------------------------------------- interventions


def shuffle_index(feedback_mask: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``src_t [N, T]``: for each row, a random derangement of that row's fused positions (position t takes the
    fed state of fused position ``src_t[b, t] != t`` of the same row); the identity at unfused positions and in
    rows with fewer than two fused positions."""
    N, T = feedback_mask.shape
    src = torch.arange(T).expand(N, T).clone()
    for b in range(N):
        pos = feedback_mask[b].nonzero().flatten().cpu()
        if pos.numel() < 2:
            continue
        order = pos[torch.randperm(pos.numel(), generator=generator)]
        src[b, order] = order.roll(-1)
    return src


def other_doc_index(doc_ids: torch.Tensor, feedback_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src_b, covered)`` ``[N, T]``: at fused position (b, t) the row ``src_b[b, t]`` — the nearest following
    row (cyclically) whose token at t belongs to a different document and is itself fused there, so its fed state
    ``h_{t-1}`` exists and comes from that other document. ``covered`` is False where no such row exists (then
    ``src_b`` is b itself)."""
    N, T = doc_ids.shape
    rows = torch.arange(N).unsqueeze(1).expand(N, T)
    src = rows.clone()
    covered = torch.zeros(N, T, dtype=torch.bool)
    fm = feedback_mask.bool().cpu()
    docs = doc_ids.cpu()
    for k in range(1, N):
        cand = (rows + k) % N
        ok = fm & ~covered & (docs[cand, torch.arange(T)] != docs) & fm[cand, torch.arange(T)]
        src[ok] = cand[ok]
        covered |= ok
    return src, covered


def substitute_states(states: torch.Tensor, src_b: torch.Tensor | None = None, src_t: torch.Tensor | None = None) -> torch.Tensor:
    """``out[b, t] = states[src_b[b, t], src_t[b, t]]`` (identity for a map that is None)."""
    N, T = states.shape[:2]
    if src_b is None:
        src_b = torch.arange(N).unsqueeze(1).expand(N, T)
    if src_t is None:
        src_t = torch.arange(T).expand(N, T)
    return states[src_b.to(states.device), src_t.to(states.device)]


def intervention_transform(name: str, src_shuffle: torch.Tensor, src_other: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The map from the fed-state tensor ``S [N, T, d]`` (``S[:, t] = h_{t-1}``) to the intervened one."""
    if name == "real":
        return lambda s: s
    if name == "zero":
        return torch.zeros_like
    if name == "shuffle":
        return lambda s: substitute_states(s, src_t=src_shuffle)
    if name == "other_doc":
        return lambda s: substitute_states(s, src_b=src_other)
    raise ValueError(f"unknown intervention {name!r}")


# ----------------------------------------------------------------------------------------------- collection


@dataclass
class Collected:
    """Everything one model's real run over the analysis rows yields."""

    nll: torch.Tensor  # [N, T-1]
    correct: torch.Tensor
    last_hidden: torch.Tensor  # [N, T, d]
    lens_nll: list[float]  # per layer, mean
    lens_acc: list[float]
    probe_features: list[torch.Tensor]  # per layer, [n_sel, d]
    probe_rows: torch.Tensor  # [n_sel] row index of each selected position
    probe_pos: torch.Tensor  # [n_sel] its position in the row
    probe_next: torch.Tensor
    probe_two: torch.Tensor
    probe_prev_state: torch.Tensor  # [n_sel, d]
    norm_ratio: torch.Tensor | None = None  # ||u_t|| / ||e_t|| at fused positions
    feedback_mask: torch.Tensor | None = None


def probe_selection(ids: torch.Tensor, doc_ids: torch.Tensor, max_samples: int, seed: int = 0) -> torch.Tensor:
    """Bool ``[N, T]``: positions usable by every probe target — ``1 <= t <= T-3`` with t-1, t, t+1 and t+2 in
    one document — subsampled (seeded) to at most ``max_samples``."""
    N, T = ids.shape
    ok = torch.zeros(N, T, dtype=torch.bool)
    if T >= 4:
        d = doc_ids
        ok[:, 1:T - 2] = (d[:, 0:T - 3] == d[:, 1:T - 2]) & (d[:, 2:T - 1] == d[:, 1:T - 2]) & (d[:, 3:T] == d[:, 1:T - 2])
    where = ok.flatten().nonzero().flatten()
    if where.numel() > max_samples:
        keep = where[torch.randperm(where.numel(), generator=torch.Generator().manual_seed(seed))[:max_samples]]
        ok = torch.zeros(N * T, dtype=torch.bool)
        ok[keep] = True
        ok = ok.view(N, T)
    return ok


@torch.no_grad()
def logit_lens_logits(backbone: nn.Module, hidden_states: list[torch.Tensor], norm: nn.Module | None = None) -> list[torch.Tensor]:
    """Logits read from every residual stream: ``head(final_norm(h_l))`` for l < L; the last entry of a Hugging
    Face ``hidden_states`` tuple already has the final norm applied, so it gets the head alone (its lens equals
    the model's own logits)."""
    norm = norm if norm is not None else final_norm(backbone)
    head = backbone.get_output_embeddings()
    dtype = head.weight.dtype
    out = []
    for i, h in enumerate(hidden_states):
        h = h.to(dtype)
        out.append(head(h if i == len(hidden_states) - 1 else norm(h)).float())
    return out


@torch.no_grad()
def collect(model, ids: torch.Tensor, doc_ids: torch.Tensor, selection: torch.Tensor, batch_size: int = 32,
            lens: bool = True) -> Collected:
    """Run ``model`` over the rows (a fullband model: the exact recurrence; a plain LM: its ordinary forward) and
    gather the loss, the logit lens, the probe features/targets at ``selection`` and the fused/plain norm ratio."""
    from ..model.feedback import build_feedback_mask, shift_right

    fb = is_fullband(model)
    backbone = backbone_of(model)
    norm = final_norm(backbone) if lens else None
    nlls, corrects, lasts, feats, prevs, ratios = [], [], [], None, [], []
    lens_nll, lens_hit, count = None, None, 0
    fmask = build_feedback_mask(ids, None, model.doc_start_token_id) if fb else None
    for i in range(0, ids.shape[0], batch_size):
        rows = ids[i:i + batch_size]
        if fb:
            rec = recurrence(model, rows, fmask[i:i + batch_size], output_hidden_states=True)
        else:
            rec = standard_forward(backbone, rows, output_hidden_states=True)
        nlls.append(rec.nll)
        corrects.append(rec.correct)
        lasts.append(rec.last_hidden)
        if lens:
            layer_logits = logit_lens_logits(backbone, rec.hidden_states, norm)
            sums = [_nll_correct(lg[:, :-1], rows[:, 1:]) for lg in layer_logits]
            if lens_nll is None:
                lens_nll, lens_hit = [0.0] * len(sums), [0] * len(sums)
            for j, (n, c) in enumerate(sums):
                lens_nll[j] += float(n.sum())
                lens_hit[j] += int(c.sum())
            count += rows[:, 1:].numel()
            del layer_logits
        sel = selection[i:i + batch_size]
        if feats is None:
            feats = [[] for _ in rec.hidden_states]
        for store, h in zip(feats, rec.hidden_states):
            store.append(h[sel].float())
        prevs.append(shift_right(rec.last_hidden)[sel].float())
        if fb:
            m = fmask[i:i + batch_size]
            u = rec.inputs_embeds[m].float().norm(dim=-1)
            e = rec.token_embeds[m].float().norm(dim=-1)
            ratios.append(u / e.clamp_min(1e-12))
    rows_index = torch.arange(ids.shape[0]).unsqueeze(1).expand_as(selection)[selection]
    T = ids.shape[1]
    t_index = torch.arange(T).expand_as(selection)[selection]
    next_tok = ids[rows_index, (t_index + 1).clamp(max=T - 1)]
    two_tok = ids[rows_index, (t_index + 2).clamp(max=T - 1)]
    return Collected(
        nll=torch.cat(nlls), correct=torch.cat(corrects), last_hidden=torch.cat(lasts),
        lens_nll=[s / max(count, 1) for s in lens_nll] if lens else [],
        lens_acc=[h / max(count, 1) for h in lens_hit] if lens else [],
        probe_features=[torch.cat(s) for s in feats], probe_rows=rows_index, probe_pos=t_index, probe_next=next_tok, probe_two=two_tok,
        probe_prev_state=torch.cat(prevs), norm_ratio=torch.cat(ratios) if ratios else None, feedback_mask=fmask,
    )


# ----------------------------------------------------------------------------------------------- 1. load-bearing


@torch.no_grad()
def load_bearing(model, ids: torch.Tensor, doc_ids: torch.Tensor, real: RunRecord | Collected | None = None,
                 num_passes: int = 2, batch_size: int = 32, seed: int = 0) -> dict:
    """Next-token loss (nats per predicted token, every position of every row) of a fullband model with its real
    fed-back state and under interventions on it:

    * ``real`` — the exact recurrence: position t fuses ``h_{t-1}``, the final hidden state this very run produced
      at t-1 (what decoding does);
    * ``zero`` — at every fused position the state is replaced by zeros, inside the recurrence (so every later
      state is that of the zeroed run);
    * ``shuffle`` — at every fused position (b, t) the state is the real run's ``h_{s-1}`` of another fused
      position s of the same row (a seeded random derangement of the row's fused positions, :func:`shuffle_index`);
    * ``other_doc`` — at every fused position (b, t) the state is the real run's ``h_{t-1}`` of the same position
      in another row whose token there belongs to a different document (:func:`other_doc_index`);
    * ``plain`` — no feedback at all: the backbone's ordinary forward on plain embeddings.

    ``shuffle`` and ``other_doc`` are two-phase: the substituted states come from the *real* recurrence (phase 1),
    while the run being measured (phase 2) is the intervened recurrence, whose own states go nowhere. Positions
    without a fused input (row starts, document starts) take the plain embedding in every condition.

    With ``num_passes`` K ≥ 2 the same interventions are also measured on the K-pass teacher-forced forward, where
    they transform the fed-state tensor of every pass k > 1 (the states there are pass k-1's of the same
    intervened forward). ``damage`` = intervened loss − real loss.
    """
    from ..model.feedback import build_feedback_mask, shift_right

    if not is_fullband(model):
        raise ValueError("the load-bearing test needs a fullband model (one with latent feedback)")
    N = ids.shape[0]
    fmask = build_feedback_mask(ids, None, model.doc_start_token_id)
    gen = torch.Generator().manual_seed(seed)
    src_shuffle = shuffle_index(fmask, gen)
    src_other, covered = other_doc_index(doc_ids, fmask)
    n_fused = int(fmask.sum())

    def batches(fn):
        return torch.cat([fn(i, ids[i:i + batch_size], fmask[i:i + batch_size]) for i in range(0, N, batch_size)])

    if real is None:
        runs = [recurrence(model, ids[i:i + batch_size], fmask[i:i + batch_size]) for i in range(0, N, batch_size)]
        real_nll = torch.cat([r.nll for r in runs])
        real_hidden = torch.cat([r.last_hidden for r in runs])
        del runs
    else:
        real_nll, real_hidden = real.nll, real.last_hidden
    real_states = shift_right(real_hidden)  # S[:, t] = h_{t-1} of the real recurrence

    def substituted(sub: torch.Tensor):
        return lambda i, r, m: recurrence(
            model, r, m, state_hook=lambda t, prev: sub[i:i + r.shape[0], t:t + 1].to(prev.dtype)).nll

    rec_loss = {
        "real": real_nll,
        "zero": batches(lambda i, r, m: recurrence(model, r, m, state_hook=lambda t, prev: torch.zeros_like(prev)).nll),
        "shuffle": batches(substituted(substitute_states(real_states, src_t=src_shuffle))),
        "plain": batches(lambda i, r, m: standard_forward(model.backbone, r).nll),
    }
    if bool(covered.any()):
        rec_loss["other_doc"] = batches(substituted(substitute_states(real_states, src_b=src_other)))
    result = {
        "tokens": int(real_nll.numel()),
        "fused_positions": n_fused,
        "fused_fraction": n_fused / max(ids.numel(), 1),
        "other_doc_coverage": float(covered.sum()) / max(n_fused, 1),
        "recurrence": {k: float(v.mean()) for k, v in rec_loss.items()},
    }
    result["recurrence_damage"] = {k: result["recurrence"][k] - result["recurrence"]["real"]
                                   for k in result["recurrence"] if k != "real"}
    # per-position damage curve (mean over rows) for the plot
    result["recurrence_damage_by_position"] = {k: (v - real_nll).mean(0).tolist() for k, v in rec_loss.items() if k != "real"}
    if num_passes >= 2:
        pass_loss = {}
        for name in ("real", "zero", "shuffle", "other_doc"):
            if name == "other_doc" and not bool(covered.any()):
                continue
            nll = passes_forward(model, ids, num_passes, fmask, intervention_transform(name, src_shuffle, src_other),
                                 batch_size)
            pass_loss[name] = float(nll.mean())
        pass_loss["plain"] = result["recurrence"]["plain"]
        result["passes"] = {"num_passes": num_passes, **pass_loss}
        result["passes_damage"] = {k: v - pass_loss["real"] for k, v in pass_loss.items() if k != "real"}
    return result


# ----------------------------------------------------------------------------------------------- 2. probes


def _split_fit_test(rows: torch.Tensor, n_rows: int, t_index: torch.Tensor, T: int):
    """Fit on even rows, test on odd rows (a single row: first half of the positions vs second half)."""
    if n_rows >= 2:
        fit = rows % 2 == 0
    else:
        fit = t_index < (T // 2)
    return fit, ~fit


@torch.no_grad()
def ridge_probe(x_fit: torch.Tensor, y_fit: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                kind: str = "class", alphas=ALPHAS, holdout: float = 0.2, seed: int = 0) -> dict:
    """A linear probe fitted by ridge regression in closed form (float64, with intercept).

    ``kind="class"``: ``y`` are integer labels, regressed as one-hot vectors; the score is the accuracy of the
    argmax on the test split, next to ``chance`` = accuracy of always predicting the fit split's most frequent
    label. ``kind="regression"``: ``y`` ``[n, k]``; the score is R² on the test split,
    ``1 - sum (y - ŷ)² / sum (y - mean_test(y))²`` over all k outputs. The penalty is ``alpha · tr(XᵀX)/d``
    (scale-free); ``alpha`` is chosen from ``alphas`` on a seeded ``holdout`` fraction of the fit split, then the
    probe is refitted on the whole fit split.
    """
    if kind not in ("class", "regression"):
        raise ValueError(f"unknown probe kind {kind!r}")
    if x_fit.shape[0] < 2 or x_test.shape[0] < 1:
        raise ValueError(f"too few positions to fit a probe ({x_fit.shape[0]} fit, {x_test.shape[0]} test); "
                         "raise --max-tokens")
    x_fit, x_test = x_fit.double(), x_test.double()

    def fit(x, y):
        mu = x.mean(0)
        xc = x - mu
        g = xc.T @ xc
        evals, q = torch.linalg.eigh(g)
        scale = float(g.diagonal().sum()) / g.shape[0]
        scale = scale if scale > 0 else 1.0
        if kind == "class":
            classes, idx = torch.unique(y, return_inverse=True)
            b = torch.zeros(x.shape[1], classes.numel(), dtype=x.dtype).index_add_(1, idx, xc.T)
            offset = torch.bincount(idx, minlength=classes.numel()).double() / idx.numel()
        else:
            y = y.double()
            offset = y.mean(0)
            b = xc.T @ (y - offset)
            classes = None
        qb = q.T @ b

        def predictor(alpha):
            w = q @ (qb / (evals.clamp_min(0) + alpha * scale).unsqueeze(1))
            return lambda xt: (xt - mu) @ w + offset
        return predictor, classes

    def score(pred, classes, x, y):
        if kind == "class":
            hits = 0
            for j in range(0, x.shape[0], 1024):
                hits += int((classes[pred(x[j:j + 1024]).argmax(1)] == y[j:j + 1024]).sum())
            return hits / x.shape[0]
        y = y.double()
        sst = float(((y - y.mean(0)) ** 2).sum())
        sse = float(((y - pred(x)) ** 2).sum())
        return 1.0 - sse / sst if sst > 0 else float("nan")

    n = x_fit.shape[0]
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    n_hold = max(1, int(round(holdout * n))) if n >= 5 else 0
    best_alpha = alphas[len(alphas) // 2]
    if n_hold and len(alphas) > 1:
        hold, inner = perm[:n_hold], perm[n_hold:]
        predictor, classes = fit(x_fit[inner], y_fit[inner])
        scores = [score(predictor(a), classes, x_fit[hold], y_fit[hold]) for a in alphas]
        scores = [s if s == s else -math.inf for s in scores]
        best_alpha = alphas[max(range(len(alphas)), key=lambda i: (scores[i], alphas[i]))]
    predictor, classes = fit(x_fit, y_fit)
    result = {"score": score(predictor(best_alpha), classes, x_test, y_test), "alpha": best_alpha,
              "n_fit": int(n), "n_test": int(x_test.shape[0])}
    if kind == "class":
        values, counts = torch.unique(y_fit, return_counts=True)
        result["chance"] = float((y_test == values[counts.argmax()]).double().mean())
    else:
        result["chance"] = 0.0
    return result


def layer_probes(c: Collected, n_rows: int, T: int, seed: int = 0) -> dict:
    """Per layer, the three probes of :func:`ridge_probe` on a model's collected residual streams."""
    fit, test = _split_fit_test(c.probe_rows, n_rows, c.probe_pos, T)
    out = {"layers": list(range(len(c.probe_features))), "n_fit": int(fit.sum()), "n_test": int(test.sum())}
    targets = {"next_token": ("class", c.probe_next), "two_ahead": ("class", c.probe_two),
               "prev_state": ("regression", c.probe_prev_state)}
    for name, (kind, y) in targets.items():
        scores, alphas, chance = [], [], None
        for x in c.probe_features:
            r = ridge_probe(x[fit], y[fit], x[test], y[test], kind=kind, seed=seed)
            scores.append(r["score"])
            alphas.append(r["alpha"])
            chance = r["chance"]
        out[name] = scores
        out[f"{name}_alpha"] = alphas
        out[f"{name}_chance"] = chance
    return out


# ----------------------------------------------------------------------------------------------- 3. logit lens


def logit_lens(c: Collected) -> dict:
    """Per-layer next-token loss and accuracy of ``head(final_norm(h_l))`` (the last layer: the model itself)."""
    return {"layers": list(range(len(c.lens_nll))), "loss": list(c.lens_nll), "accuracy": list(c.lens_acc)}


# ----------------------------------------------------------------------------------------------- 4. gates


@torch.no_grad()
def gate_statistics(model, ids: torch.Tensor, norm_ratio: torch.Tensor | None = None, tokenizer=None,
                    bins: int = 50, top: int = 12) -> dict:
    """Distribution of the GLU token gate ``sigmoid(W_G norm(e_t))`` over the tokens of ``ids`` (every
    occurrence counts, all ``d`` gate channels pooled), per-token mean gates (mean over channels) with the most
    and least open frequent tokens, and the fused/plain norm ratio ``||u_t|| / ||e_t||`` at fused positions of the
    real recurrence (``norm_ratio``). Gate entries are ``None`` for a non-GLU fusion."""
    import numpy as np

    from ..model.feedback import GLUFusion

    out: dict = {"fusion": model.config.fusion}
    tokens, counts = torch.unique(ids.flatten(), return_counts=True)
    edges = np.linspace(0.0, 1.0, bins + 1)
    if isinstance(model.feedback, GLUFusion):
        gates = model.feedback.gate(model.get_input_embeddings()(tokens)).float()  # [U, d]
        w = counts.double()
        total = float(w.sum()) * gates.shape[1]
        mean = float((gates.double().sum(1) * w).sum()) / total
        var = float((((gates.double() - mean) ** 2).sum(1) * w).sum()) / total
        values = gates.flatten().numpy()
        weights = np.repeat(counts.numpy().astype(np.float64), gates.shape[1])
        hist, _ = np.histogram(values, bins=edges, weights=weights)
        per_token = gates.mean(1)
        tok_hist, _ = np.histogram(per_token.numpy(), bins=edges, weights=counts.numpy().astype(np.float64))
        frequent = counts >= max(2, int(counts.float().quantile(0.5)))
        if int(frequent.sum()) < 2 * top:
            frequent = torch.ones_like(counts, dtype=torch.bool)
        idx = frequent.nonzero().flatten()
        order = idx[per_token[idx].argsort()]

        def describe(i):
            tid = int(tokens[i])
            text = tokenizer.decode([tid]) if tokenizer is not None else str(tid)
            return {"id": tid, "token": text, "mean_gate": float(per_token[i]), "count": int(counts[i])}

        out.update({
            "gate_mean": mean, "gate_std": math.sqrt(max(var, 0.0)),
            "gate_frac_below_0.1": float(weights[values < 0.1].sum() / weights.sum()),
            "gate_frac_above_0.9": float(weights[values > 0.9].sum() / weights.sum()),
            "gate_histogram": {"edges": edges.tolist(), "weights": (hist / hist.sum()).tolist()},
            "token_mean_gate_histogram": {"edges": edges.tolist(), "weights": (tok_hist / tok_hist.sum()).tolist()},
            "token_mean_gate_spread": float(per_token.max() - per_token.min()),
            "most_open_tokens": [describe(i) for i in order.flip(0)[:top].tolist()],
            "most_closed_tokens": [describe(i) for i in order[:top].tolist()],
            "distinct_tokens": int(tokens.numel()),
        })
    else:
        out.update({"gate_mean": None, "gate_histogram": None, "note": f"fusion {model.config.fusion!r} has no token gate"})
    if norm_ratio is not None and norm_ratio.numel():
        r = norm_ratio.double()
        q = torch.quantile(r, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
        hi = float(r.max())
        ratio_edges = np.linspace(0.0, max(hi * 1.05, 1e-6), bins + 1)
        rh, _ = np.histogram(r.numpy(), bins=ratio_edges)
        out["norm_ratio"] = {"mean": float(r.mean()), "p05": q[0], "median": q[1], "p95": q[2], "n": int(r.numel()),
                             "histogram": {"edges": ratio_edges.tolist(), "weights": (rh / rh.sum()).tolist()}}
    else:
        out["norm_ratio"] = None
    return out


# ----------------------------------------------------------------------------------------------- orchestration


@dataclass
class AnalyzeOptions:
    model: str
    baseline: str | None = None
    data: str | None = None
    tokenizer: str | None = None
    seq_len: int = 128
    max_tokens: int = 8192
    batch_size: int = 32
    num_passes: int = 2
    probe_samples: int = 4000
    seed: int = 0
    out: str = DEFAULT_OUT
    extra: dict = field(default_factory=dict)


def _tokenizer_for(model_dir: str, given: str | None = None):
    """``given`` (a tokenizer directory) or else the one saved in ``model_dir``."""
    from ..data.corpus import load_tokenizer

    if given:
        return load_tokenizer(given), given
    if not _has_tokenizer(model_dir):
        raise FileNotFoundError(f"no tokenizer in {model_dir!r}; pass --tokenizer DIR")
    return load_tokenizer(model_dir), model_dir


def _check_fits(model, data: AnalysisData, which: str) -> None:
    from ..model.modeling import max_positions

    cfg = backbone_of(model).config
    limit = max_positions(cfg)
    if limit is not None and data.ids.shape[1] > limit:
        raise ValueError(f"--seq-len {data.ids.shape[1]} exceeds the {which}'s {limit} positions")
    vocab = backbone_of(model).get_input_embeddings().num_embeddings
    if int(data.ids.max()) >= vocab:
        raise ValueError(f"the text holds token id {int(data.ids.max())}, outside the {which}'s vocabulary of {vocab}; "
                         "use that model's own tokenizer")


def analyze_models(model, data: AnalysisData, baseline=None, baseline_data: AnalysisData | None = None,
                   tokenizer=None, num_passes: int = 2, probe_samples: int = 4000, batch_size: int = 32,
                   seed: int = 0) -> dict:
    """All four measures for a fullband ``model`` (and the probes / logit lens of ``baseline``) as a dict."""
    if not is_fullband(model):
        raise ValueError("--model must be a fullband model (one with latent feedback); give a plain LM as --baseline")
    model.eval()
    ids, doc_ids = data.ids, data.doc_ids
    N, T = ids.shape
    selection = probe_selection(ids, doc_ids, probe_samples, seed)
    _log(f"real recurrence over {N} rows x {T} tokens (hidden states, logit lens)")
    c = collect(model, ids, doc_ids, selection, batch_size)
    _log("load-bearing interventions")
    lb = load_bearing(model, ids, doc_ids, real=c, num_passes=num_passes, batch_size=batch_size, seed=seed)
    _log("layer probes")
    results = {
        "load_bearing": lb,
        "probes": {"fbt": layer_probes(c, N, T, seed)},
        "logit_lens": {"fbt": logit_lens(c)},
        "gates": gate_statistics(model, ids, c.norm_ratio, tokenizer),
    }
    if baseline is not None:
        baseline.eval()
        bdata = baseline_data or data
        same = bdata.ids.shape == ids.shape and torch.equal(bdata.ids, ids)
        bsel = selection if same else probe_selection(bdata.ids, bdata.doc_ids, probe_samples, seed)
        _log("baseline run (hidden states, logit lens, probes)")
        bc = collect(baseline, bdata.ids, bdata.doc_ids, bsel, batch_size)
        results["probes"]["baseline"] = layer_probes(bc, bdata.ids.shape[0], bdata.ids.shape[1], seed)
        results["logit_lens"]["baseline"] = logit_lens(bc)
        results["baseline_loss"] = float(bc.nll.mean())
        results["baseline_same_tokens"] = bool(same)
    return results


def run_analysis(opts: AnalyzeOptions) -> dict:
    """Load, analyze, and write the report; returns the results (also written as ``analysis.json``)."""
    if opts.num_passes < 0:
        raise ValueError(f"--num-passes must be >= 0 (0 or 1 skips the K-pass measurements), got {opts.num_passes}")
    if opts.probe_samples < 10:
        raise ValueError(f"--probe-samples must be >= 10, got {opts.probe_samples}")
    if opts.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {opts.batch_size}")
    torch.manual_seed(opts.seed)
    model = load_any_model(opts.model)
    if not is_fullband(model):
        raise ValueError(f"--model {opts.model!r} has no latent feedback (not a fullband model); "
                         "give a plain LM as --baseline")
    tokenizer, _ = _tokenizer_for(opts.model, opts.tokenizer)
    data = analysis_rows(tokenizer, opts.data, opts.seq_len, opts.max_tokens)
    _check_fits(model, data, "model")
    baseline = bdata = None
    if opts.baseline:
        # a baseline is the plain LM it is: a fullband checkpoint given as the baseline (e.g. one written before
        # baselines were saved plainly, with a fusion it never trained) is scored through its backbone alone
        baseline = backbone_of(load_any_model(opts.baseline))
        # the baseline reads the text with its own tokenizer when it has one (the same rows when they agree)
        btok = _tokenizer_for(opts.baseline)[0] if _has_tokenizer(opts.baseline) else tokenizer
        bdata = analysis_rows(btok, opts.data, opts.seq_len, opts.max_tokens)
        _check_fits(baseline, bdata, "baseline")
    results = analyze_models(model, data, baseline, bdata, tokenizer, opts.num_passes, opts.probe_samples,
                             opts.batch_size, opts.seed)
    results = {
        "version": 1,
        "model": os.path.abspath(opts.model),
        "baseline": os.path.abspath(opts.baseline) if opts.baseline else None,
        "baseline_kind": (None if baseline is None else ("fullband" if is_fullband(baseline) else "plain")),
        "data": {"source": data.source, "documents": len(data.doc_names), "rows": int(data.ids.shape[0]),
                 "rows_available": data.total_rows, "seq_len": int(data.ids.shape[1]), "tokens": data.tokens,
                 "documents_in_rows": int(data.doc_ids.unique().numel())},
        "settings": {"num_passes": opts.num_passes, "probe_samples": opts.probe_samples, "seed": opts.seed,
                     "batch_size": opts.batch_size},
        **results,
    }
    write_report(results, opts.out)
    return results


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


# ----------------------------------------------------------------------------------------------- report


def _save_figure(fig, path: str) -> None:
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())


def make_plots(results: dict, out_dir: str) -> list[str]:
    """The four PNGs; returns their file names."""
    from matplotlib.figure import Figure

    names = []
    lb = results["load_bearing"]
    fig = Figure(figsize=(11, 4))
    ax1, ax2 = fig.subplots(1, 2)
    groups = [("recurrence", "exact recurrence")]
    if "passes" in lb:
        groups.append(("passes", f"{lb['passes']['num_passes']}-pass forward"))
    width = 0.8 / len(groups)
    conds = [c for c in INTERVENTIONS if c in lb["recurrence"]]
    for gi, (key, label) in enumerate(groups):
        vals = [lb[key].get(c, float("nan")) for c in conds]
        ax1.bar([i + gi * width for i in range(len(conds))], vals, width, label=label)
    ax1.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(conds))], conds)
    ax1.set_ylabel("next-token loss (nats)")
    ax1.set_title("Load-bearing test")
    lo = min(v for key, _ in groups for c, v in lb[key].items() if c in conds)
    ax1.set_ylim(bottom=max(0.0, lo - 0.5))
    ax1.legend()
    for c, curve in lb.get("recurrence_damage_by_position", {}).items():
        half = max(0, min(4, len(curve) // 16))
        smooth = [sum(curve[max(0, i - half):i + half + 1]) / len(curve[max(0, i - half):i + half + 1])
                  for i in range(len(curve))]
        ax2.plot(range(1, len(curve) + 1), smooth, label=c, lw=1)
    ax2.axhline(0, color="k", lw=0.5)
    ax2.set_xlabel("position in row (predicted token; centred mean over ±4)")
    ax2.set_ylabel("damage (nats)")
    ax2.set_title("Damage by position (exact recurrence)")
    ax2.legend()
    _save_figure(fig, os.path.join(out_dir, "load_bearing.png"))
    names.append("load_bearing.png")

    probes = results["probes"]
    fig = Figure(figsize=(14, 4))
    axes = fig.subplots(1, 3)
    titles = {"next_token": "(a) next token — accuracy", "two_ahead": "(b) token two ahead — accuracy",
              "prev_state": "(c) previous top-layer state — R²"}
    for ax, target in zip(axes, PROBE_TARGETS):
        for who, style in (("fbt", "-o"), ("baseline", "--s")):
            if who in probes:
                p = probes[who]
                ax.plot(p["layers"], p[target], style, label="FBT" if who == "fbt" else "baseline", ms=4)
                if target != "prev_state":
                    ax.axhline(p[f"{target}_chance"], color="C0" if who == "fbt" else "C1", lw=0.7, ls=":")
        ax.set_title(titles[target])
        ax.set_xlabel("layer (0 = embedding output)")
        ax.legend()
    _save_figure(fig, os.path.join(out_dir, "probes.png"))
    names.append("probes.png")

    lens = results["logit_lens"]
    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    for who, style in (("fbt", "-o"), ("baseline", "--s")):
        if who in lens:
            label = "FBT" if who == "fbt" else "baseline"
            ax1.plot(lens[who]["layers"], lens[who]["loss"], style, label=label, ms=4)
            ax2.plot(lens[who]["layers"], lens[who]["accuracy"], style, label=label, ms=4)
    ax1.set_title("Logit lens: next-token loss")
    ax1.set_ylabel("nats")
    ax2.set_title("Logit lens: top-1 accuracy")
    for ax in (ax1, ax2):
        ax.set_xlabel("layer (0 = embedding output)")
        ax.legend()
    _save_figure(fig, os.path.join(out_dir, "logit_lens.png"))
    names.append("logit_lens.png")

    gates = results["gates"]
    panels = [p for p in ("gate_histogram", "token_mean_gate_histogram") if gates.get(p)]
    if gates.get("norm_ratio"):
        panels.append("norm_ratio")
    if panels:
        fig = Figure(figsize=(4.5 * len(panels), 3.8))
        axes = fig.subplots(1, len(panels))
        axes = [axes] if len(panels) == 1 else list(axes)
        titles = {"gate_histogram": "gate values σ(W_G norm(e_t))", "token_mean_gate_histogram": "per-token mean gate",
                  "norm_ratio": "||u_t|| / ||e_t|| at fused positions"}
        for ax, p in zip(axes, panels):
            h = gates[p]["histogram"] if p == "norm_ratio" else gates[p]
            e = h["edges"]
            ax.bar(e[:-1], h["weights"], width=[b - a for a, b in zip(e[:-1], e[1:])], align="edge")
            ax.set_title(titles[p])
            ax.set_ylabel("fraction")
        _save_figure(fig, os.path.join(out_dir, "gates.png"))
        names.append("gates.png")
    return names


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if x != x:
            return "nan"
        return f"{x:.{digits}f}"
    return str(x)


def render_markdown(results: dict, images: list[str]) -> str:
    lb = results["load_bearing"]
    d = results["data"]
    lines = [
        "# fullband analysis: what the fed-back state carries", "",
        f"- model: `{results['model']}`",
        f"- baseline: `{results['baseline']}` ({results['baseline_kind']})" if results.get("baseline") else "- baseline: none",
        f"- data: {d['source']} — {d['rows']} rows × {d['seq_len']} tokens = {d['tokens']} tokens "
        f"(of {d['rows_available']} rows; {d['documents_in_rows']} documents in the rows)",
        "", "## 1. Load-bearing test", "",
        "Next-token loss (nats per predicted token, every position) with the real fed-back state and with it "
        "zeroed, shuffled across positions of the same row, or taken from the same position of a row of another "
        "document; `plain` = feedback off (ordinary forward on plain embeddings). Under the exact recurrence the "
        "substituted states (shuffle, other_doc) are the real run's; the zeroed run feeds zeros at every fused "
        "position. Damage = loss − real loss.", "",
    ]
    header = "| condition | exact recurrence | damage |"
    sep = "|---|---|---|"
    if "passes" in lb:
        header += f" {lb['passes']['num_passes']}-pass forward | damage |"
        sep += "---|---|"
    lines += [header, sep]
    for c in INTERVENTIONS:
        if c not in lb["recurrence"]:
            lines.append(f"| {c} | n/a (one document only) | |" + (" | |" if "passes" in lb else ""))
            continue
        row = f"| {c} | {_fmt(lb['recurrence'][c])} | {_fmt(lb['recurrence_damage'].get(c, 0.0), 4) if c != 'real' else ''} |"
        if "passes" in lb:
            row += f" {_fmt(lb['passes'].get(c))} | {_fmt(lb['passes_damage'].get(c), 4) if c != 'real' else ''} |"
        lines.append(row)
    lines += ["", f"Fused positions: {lb['fused_positions']} ({100 * lb['fused_fraction']:.1f}% of tokens); "
              f"other-document coverage {100 * lb['other_doc_coverage']:.1f}%.", ""]
    if "load_bearing.png" in images:
        lines += ["![load-bearing](load_bearing.png)", ""]

    probes = results["probes"]
    lines += ["## 2. Layer probes", "",
              "Ridge probes (closed form, penalty chosen on a holdout of the fit split) on each layer's residual "
              "stream (layer 0 = embedding output; for the FBT that is the fused input u_t), fitted on the even "
              "rows and scored on the odd rows. (a)/(b): accuracy of the argmax of a one-hot regression for the "
              "next token / the token two ahead; (c): R² for the previous position's top-layer state (for the FBT "
              "the fed-back state h_{t-1}; for the baseline its own previous final hidden state). FBT residual "
              "streams come from the exact recurrence.", ""]
    whos = [w for w in ("fbt", "baseline") if w in probes]
    head = "| layer |" + "".join(f" {('FBT' if w == 'fbt' else 'baseline')} {t} |" for t in ("(a)", "(b)", "(c) R²") for w in whos)
    lines += [head, "|---|" + "---|" * (3 * len(whos))]
    depth = max(len(probes[w]["layers"]) for w in whos)
    for layer in range(depth):
        row = f"| {layer} |"
        for t in PROBE_TARGETS:
            for w in whos:
                vals = probes[w][t]
                row += f" {_fmt(vals[layer]) if layer < len(vals) else ''} |"
        lines.append(row)
    chance = "; ".join(f"{'FBT' if w == 'fbt' else 'baseline'}: (a) {_fmt(probes[w]['next_token_chance'])}, "
                       f"(b) {_fmt(probes[w]['two_ahead_chance'])}" for w in whos)
    lines += ["", f"Majority-class accuracy (chance): {chance}. Positions: "
              + "; ".join(f"{w} {probes[w]['n_fit']} fit / {probes[w]['n_test']} test" for w in whos) + ".", ""]
    for w in whos:
        p = probes[w]
        best = {t: max(range(len(p[t])), key=lambda i: p[t][i] if p[t][i] == p[t][i] else -math.inf) for t in PROBE_TARGETS}
        lines.append(f"- {'FBT' if w == 'fbt' else 'baseline'}: best layer for (a) {best['next_token']}, "
                     f"(b) {best['two_ahead']}, (c) {best['prev_state']}; shallowest-half mean R² (c) "
                     f"{_fmt(sum(p['prev_state'][: max(1, len(p['prev_state']) // 2)]) / max(1, len(p['prev_state']) // 2))}.")
    lines.append("")
    if "probes.png" in images:
        lines += ["![probes](probes.png)", ""]

    lens = results["logit_lens"]
    lines += ["## 3. Logit lens", "",
              "The backbone's final norm and LM head applied to each layer's residual stream (the last layer is "
              "the model's own output). Next-token loss (nats) / top-1 accuracy.", ""]
    whos = [w for w in ("fbt", "baseline") if w in lens]
    lines += ["| layer |" + "".join(f" {('FBT' if w == 'fbt' else 'baseline')} loss | acc |" for w in whos),
              "|---|" + "---|---|" * len(whos)]
    depth = max(len(lens[w]["layers"]) for w in whos)
    for layer in range(depth):
        row = f"| {layer} |"
        for w in whos:
            if layer < len(lens[w]["loss"]):
                row += f" {_fmt(lens[w]['loss'][layer])} | {_fmt(lens[w]['accuracy'][layer])} |"
            else:
                row += " | |"
        lines.append(row)
    if "baseline_loss" in results:
        lines += ["", f"Baseline loss on its rows: {_fmt(results['baseline_loss'])} nats "
                  f"({'same tokens as the model' if results['baseline_same_tokens'] else 'its own tokenization'})."]
    lines.append("")
    if "logit_lens.png" in images:
        lines += ["![logit lens](logit_lens.png)", ""]

    g = results["gates"]
    lines += ["## 4. Gate statistics", ""]
    if g.get("gate_histogram"):
        lines += [f"Token gate σ(W_G norm(e_t)) over every token occurrence (all channels pooled): mean "
                  f"{_fmt(g['gate_mean'])}, std {_fmt(g['gate_std'])}, {100 * g['gate_frac_below_0.1']:.1f}% below 0.1, "
                  f"{100 * g['gate_frac_above_0.9']:.1f}% above 0.9. Per-token mean gate spread (max − min over "
                  f"{g['distinct_tokens']} distinct tokens): {_fmt(g['token_mean_gate_spread'])}.", "",
                  "| most open (mean gate) | most closed (mean gate) |", "|---|---|"]
        for a, b in zip(g["most_open_tokens"], g["most_closed_tokens"]):
            lines.append(f"| `{a['token']!r}` {_fmt(a['mean_gate'])} (×{a['count']}) | "
                         f"`{b['token']!r}` {_fmt(b['mean_gate'])} (×{b['count']}) |")
        lines.append("")
    else:
        lines += [g.get("note", "no gate"), ""]
    if g.get("norm_ratio"):
        r = g["norm_ratio"]
        lines += [f"Fused / plain input norm ratio ||u_t|| / ||e_t|| at {r['n']} fused positions: mean {_fmt(r['mean'])}, "
                  f"median {_fmt(r['median'])}, 5–95% {_fmt(r['p05'])}–{_fmt(r['p95'])}.", ""]
    if "gates.png" in images:
        lines += ["![gates](gates.png)", ""]
    lines += ["All numbers: `analysis.json`.", ""]
    return "\n".join(lines)


def write_report(results: dict, out_dir: str) -> list[str]:
    """``report.md``, ``analysis.json`` and the PNGs under ``out_dir`` (each written atomically)."""
    os.makedirs(out_dir, exist_ok=True)
    images = make_plots(results, out_dir)
    atomic_write_bytes(os.path.join(out_dir, "analysis.json"), json.dumps(results, indent=2).encode())
    atomic_write_bytes(os.path.join(out_dir, "report.md"), render_markdown(results, images).encode())
    return ["report.md", "analysis.json", *images]


# ----------------------------------------------------------------------------------------------- CLI


def _run(args) -> int:
    opts = AnalyzeOptions(model=args.model, baseline=args.baseline, data=args.data, tokenizer=args.tokenizer,
                          seq_len=args.seq_len, max_tokens=args.max_tokens, batch_size=args.batch_size,
                          num_passes=args.num_passes, probe_samples=args.probe_samples, seed=args.seed, out=args.out)
    results = run_analysis(opts)
    lb = results["load_bearing"]["recurrence_damage"]
    print(f"wrote {os.path.join(opts.out, 'report.md')} — damage (nats, exact recurrence): "
          + ", ".join(f"{k} {v:+.4f}" for k, v in lb.items()))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "analyze", help="what the fed-back state carries: load-bearing test, layer probes, logit lens, gates",
        description="Analyze a fullband model on held-out text (optionally next to a baseline) and write a markdown "
                    "report with PNG plots and a JSON of all numbers.")
    p.add_argument("--model", required=True, help="fullband model directory (save_pretrained output + tokenizer)")
    p.add_argument("--baseline", help="baseline model directory: a plain Hugging Face causal LM or a fullband model")
    p.add_argument("--data", help="held-out text: file, folder, .jsonl or datasets directory, all of whose documents "
                                  "are used (default: the embedded corpus's validation documents)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model directory's)")
    p.add_argument("--seq-len", type=int, default=128, help="row length in tokens (default 128)")
    p.add_argument("--max-tokens", type=int, default=8192, help="tokens analyzed, in rows spread over the text (default 8192)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per forward (default 32)")
    p.add_argument("--num-passes", type=int, default=2,
                   help="K of the K-pass load-bearing measurements (default 2; 0 or 1 skips them)")
    p.add_argument("--probe-samples", type=int, default=4000, help="positions used by the probes (default 4000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffles and samples (default 0)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"report directory (default {DEFAULT_OUT})")
    p.set_defaults(func=_run)
