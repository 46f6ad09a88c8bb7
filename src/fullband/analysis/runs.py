"""What the fed-back state carries: the runs behind ``fullband analyze`` and the load-bearing test.

Owns the held-out rows of an analysis (:func:`analysis_rows`), one run of a model over them as a
:class:`RunRecord` (plain forward; the exact recurrence with a hook on the fed-back state, :func:`recurrence`; the
K-pass forward with a transform of the fed-back states, :func:`passes_forward` -- both call the model's own single
implementation), the state interventions (zero / shuffle / other document / plain), the collection of residual
streams for probes and logit lens (:func:`collect`) and the load-bearing measurement (:func:`load_bearing`):
next-token loss with the real fed-back state versus the same model with the state intervened on, under the exact
recurrence (what decoding runs) and the K-pass forward (what training runs).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..data.corpus import EMBEDDED, load_documents, split_documents, tokenize_documents
from ..model.feedback import build_feedback_mask, shift_right
from ..model.modeling import FullBandwidthForCausalLM, load_model

INTERVENTIONS = ("real", "zero", "shuffle", "other_doc", "plain")
StateHook = Callable[[int, torch.Tensor], torch.Tensor]


def log(msg: str) -> None:
    print(f"[analyze] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- models


def is_fullband(model) -> bool:
    return isinstance(model, FullBandwidthForCausalLM)


def load_any_model(path: str):
    """A saved fullband model, or a plain Hugging Face causal LM directory (for a baseline)."""
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
    """The exact token-by-token recurrence (:meth:`~fullband.FullBandwidthForCausalLM.recurrent_forward`, the one
    implementation) as a :class:`RunRecord`. At step t (t ≥ 1), ``state_hook(t, h_prev)`` receives the final hidden
    state ``h_{t-1}`` ``[B, 1, d]`` that this run produced one step earlier and returns the state to fuse instead;
    no hook = the real recurrence."""
    out = model.recurrent_forward(ids, feedback_mask=feedback_mask, state_hook=state_hook,
                                  output_hidden_states=output_hidden_states)
    nll, correct = _nll_correct(out.logits[:, :-1], ids[:, 1:])
    hs = [h.float() for h in out.hidden_states] if output_hidden_states else None
    return RunRecord(nll, correct, out.last_hidden_state.float(), hs, inputs_embeds=out.inputs_embeds,
                     token_embeds=model.get_input_embeddings()(ids))


@torch.no_grad()
def passes_forward(model, ids: torch.Tensor, num_passes: int, feedback_mask: torch.Tensor | None = None,
                   transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The K-pass teacher-forced forward (the model's own, in eval mode) with an optional ``transform`` of the
    fed-back states: pass k > 1 fuses ``transform(S)`` where ``S[:, t] = h^{(k-1)}_{t-1}`` of *all* rows
    ``[N, T, d]`` (one forward over all rows, so a transform may take states from other rows). Returns the last
    pass's per-position next-token loss ``[N, T-1]``."""
    if num_passes < 1:
        raise ValueError(f"num_passes must be >= 1, got {num_passes}")
    hook = (lambda k, state: transform(state).to(state.dtype)) if transform is not None else None
    out = model(ids, num_passes=num_passes, feedback_mask=feedback_mask, state_hook=hook)
    return _nll_correct(out.logits[:, :-1], ids[:, 1:])[0]


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
            nll = passes_forward(model, ids, num_passes, fmask, intervention_transform(name, src_shuffle, src_other))
            pass_loss[name] = float(nll.mean())
        pass_loss["plain"] = result["recurrence"]["plain"]
        result["passes"] = {"num_passes": num_passes, **pass_loss}
        result["passes_damage"] = {k: v - pass_loss["real"] for k, v in pass_loss.items() if k != "real"}
    return result
