"""``FullBandwidthForCausalLM``: latent feedback wrapped around any Hugging Face decoder-only causal LM.

Owns the model class (a ``PreTrainedModel`` with ``GenerationMixin``), retrofitting an existing backbone
(:meth:`FullBandwidthForCausalLM.from_backbone`), the K-pass teacher-forced forward and the exact
token-by-token recurrence (:meth:`FullBandwidthForCausalLM.recurrent_forward`) that every fast path is tested
against. The backbone is used as it is: architecture, KV cache and LM head are untouched; the only new module is
``model.feedback`` (see :mod:`fullband.feedback`).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import fields
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.cache_utils import Cache

from .configuration import FullBandwidthConfig
from .feedback import (
    GLUFusion,
    build_feedback_mask,
    build_fusion,
    fuse_where,
    gate_table,
    gate_table_pays,
    jitter,
    max_positions,
    position_ids_from_mask,
    shift_right,
)
from .full_backprop import full_backprop_forward
from .generation import FeedbackGenerationMixin
from .lm_loss import check_chunkable, chunked_lm_loss, z_loss_from_logits
from .objective import combine_pass_losses
from .outputs import FullBandwidthOutput
from .recurrence import run_recurrence
from .sharding import embedding_rms, gathered_once, without_dropout

StateHook = Callable[[int, torch.Tensor], torch.Tensor]


def _zero_unscored(terms: list) -> list:
    """A pass's objective terms with the passes not scored (``None``: run without gradient, no loss computed) as
    zeros: the objective's part that has gradient, whose backward is the whole objective's."""
    ref = next(t for t in terms if t is not None)
    return [ref.new_zeros(()) if t is None else t for t in terms]


class FullBandwidthPreTrainedModel(PreTrainedModel):
    config: FullBandwidthConfig
    config_class = FullBandwidthConfig
    base_model_prefix = "fullband"
    supports_gradient_checkpointing = True
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True


class FullBandwidthForCausalLM(FullBandwidthPreTrainedModel, FeedbackGenerationMixin):
    """A decoder-only causal LM whose input at step t fuses the previous position's final hidden state.

    ``generate(..., feedback_mode="standard"|"soft"|"fused"|"exact", prefill_passes=1)`` decodes with latent
    feedback through Hugging Face's ``GenerationMixin`` (see :mod:`fullband.generation`).

    ``model.backbone`` is the wrapped ``AutoModelForCausalLM``; ``model.feedback(prev_hidden, token_embeds)``
    returns the fused ``inputs_embeds``.
    """

    def __init__(self, config: FullBandwidthConfig, backbone: PreTrainedModel | None = None):
        super().__init__(config)
        if backbone is None:
            backbone = AutoModelForCausalLM.from_config(config.text_config)
        self.backbone = backbone
        embeddings = backbone.get_input_embeddings()
        head = backbone.get_output_embeddings()
        embed_dim = embeddings.embedding_dim
        hidden_size = head.in_features if head is not None else embed_dim
        if config.embed_rms is None:
            config.embed_rms = embedding_rms(embeddings)
        eps = float(getattr(config.text_config, "rms_norm_eps", None) or getattr(config.text_config, "layer_norm_epsilon", None) or 1e-6)
        self._fusion_shape = (hidden_size, embed_dim, eps)
        self.feedback = build_fusion(config.fusion, hidden_size, embed_dim, eps)
        self.feedback.reset_parameters(config.embed_rms)
        self.feedback.to(dtype=embeddings.weight.dtype, device=embeddings.weight.device)
        self.post_init()

    # ------------------------------------------------------------------ construction

    token_step: str = "auto"
    """How the token-by-token recurrence runs (:mod:`fullband.model.recurrence`): ``lean`` (the backbone's decoder
    layers called directly), ``compiled`` (that step through ``torch.compile``), ``off`` (the backbone's full
    forward at every token) or ``auto`` (lean on CPU, compiled on CUDA). The states are the same either way."""

    @torch.no_grad()
    def reset_feedback(self, generator: torch.Generator | None = None) -> None:
        """Re-initialise the fusion at the embeddings' current scale (``config.embed_rms`` re-measured).

        Training calls this when feedback switches on in a run whose fusion was built at step 0 and never trained:
        by then the embeddings have moved away from their initial RMS, and the fused input should enter at their
        current scale."""
        self.config.embed_rms = embedding_rms(self.get_input_embeddings())
        params = dict(self.feedback.named_parameters())
        if not any(isinstance(p, DTensor) for p in params.values()):
            self.feedback.reset_parameters(self.config.embed_rms, generator)
            return
        # FSDP2 shards the fusion: an in-place init would fill every rank's shard from the same draws. Draw the
        # full initialisation once on an unsharded fusion (the same on every rank: same generator) and keep each
        # rank's own shard of it (no communication: src_data_rank=None).
        full = build_fusion(self.config.fusion, *self._fusion_shape)
        full.reset_parameters(self.config.embed_rms, generator)
        for name, value in full.named_parameters():
            p = params[name]
            if isinstance(p, DTensor):
                shard = distribute_tensor(value.detach().to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(shard.to_local())
            else:
                p.copy_(value)

    def _init_weights(self, module):
        # The backbone initialises itself (it is a PreTrainedModel of its own); the fusion is initialised in
        # __init__ (FusionModule.reset_parameters), and a checkpoint's weights are loaded over it.
        pass

    @classmethod
    def from_backbone(cls, backbone_or_path, fusion: str = "residual", **feedback_kwargs) -> "FullBandwidthForCausalLM":
        """Retrofit latent feedback onto an existing causal LM (an object, or a local directory).

        The backbone's weights are kept as they are; only the fusion module is new. ``feedback_kwargs`` are
        :class:`FullBandwidthConfig` fields (``feedback_weight``, ``jitter``, ``detach_state``, ...).
        """
        known = {f.name for f in fields(FullBandwidthConfig)} - {"text_config", "fusion"}
        unknown = sorted(set(feedback_kwargs) - known)
        if unknown:
            raise ValueError(f"unknown feedback setting(s) {unknown}; known: {sorted(known - set(dir(PreTrainedModel)))}")
        if isinstance(backbone_or_path, (str, os.PathLike)):
            path = os.fspath(backbone_or_path)
            if not os.path.isdir(path):
                raise ValueError(f"backbone directory {path!r} does not exist (give a local HF checkpoint directory)")
            backbone = AutoModelForCausalLM.from_pretrained(path)
        else:
            backbone = backbone_or_path
        if isinstance(backbone, FullBandwidthForCausalLM):
            raise ValueError("that model already has latent feedback; load it with FullBandwidthForCausalLM.from_pretrained")
        if not isinstance(backbone, PreTrainedModel) or backbone.get_input_embeddings() is None:
            raise ValueError(f"expected a Hugging Face causal LM (PreTrainedModel with input embeddings), got {type(backbone).__name__}")
        # a config's attention choice is set recursively on its sub-configs: keep the backbone's own
        config = FullBandwidthConfig(text_config=backbone.config, fusion=fusion,
                                     attn_implementation=backbone.config._attn_implementation, **feedback_kwargs)
        return cls(config, backbone=backbone)

    def get_input_embeddings(self):
        return self.backbone.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.backbone.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.backbone.get_output_embeddings()

    def set_output_embeddings(self, value):
        self.backbone.set_output_embeddings(value)

    @property
    def doc_start_token_id(self) -> int | None:
        return self.config.doc_start_token_id

    # ------------------------------------------------------------------ checks

    def check_inputs(self, input_ids, attention_mask=None, labels=None, feedback_mask=None,
                     num_passes: int = 1, past_length: int = 0) -> None:
        """Raise ``ValueError`` saying what to fix for malformed inputs."""
        if not isinstance(num_passes, int) or isinstance(num_passes, bool) or num_passes < 1:
            raise ValueError(f"num_passes must be an integer >= 1, got {num_passes!r}")
        if input_ids is None:
            raise ValueError("input_ids is required")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.long, torch.int, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        vocab = self.get_input_embeddings().num_embeddings
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            bad = int(input_ids.max()) if int(input_ids.max()) >= vocab else int(input_ids.min())
            raise ValueError(f"input_ids contain id {bad}, outside the backbone's vocabulary of {vocab} entries "
                             "(was the text tokenized with this model's tokenizer?)")
        B, T = input_ids.shape
        if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[0] != B
                                           or attention_mask.shape[1] != past_length + T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but must be "
                             f"({B}, {past_length + T}) for input_ids of shape {(B, T)} after {past_length} cached tokens")
        for name, t in (("labels", labels), ("feedback_mask", feedback_mask)):
            if t is not None and tuple(t.shape) != (B, T):
                raise ValueError(f"{name} has shape {tuple(t.shape)} but input_ids has {(B, T)}; they must match")
        limit = max_positions(self.config.text_config)
        if limit is not None and past_length + T > limit:
            raise ValueError(f"sequence of {past_length + T} tokens exceeds the backbone's {limit} positions; "
                             "truncate the input")

    # ------------------------------------------------------------------ forward

    def fuse(self, state: torch.Tensor, input_ids: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """``fusion(state, e)`` for tokens ``input_ids`` with embeddings ``token_embeds`` (any leading shape).

        The GLU-family gate ``sigmoid(W_G norm(e))`` is computed from the live weights, so it is right whatever
        changed them (any optimizer, fused or not, ``p.data.copy_``, ``load_state_dict``, ``.to()``, resizing);
        only inside :meth:`frozen_gate_table` (eval mode, no gradient) is it looked up in that scope's table."""
        table = self._scoped_gate_table
        if table is not None and not self.training and not torch.is_grad_enabled():
            return self.feedback.fuse_gated(state.to(token_embeds.dtype), table[input_ids], token_embeds)
        return self.feedback(state, token_embeds)

    _scoped_gate_table: torch.Tensor | None = None  # set only inside frozen_gate_table()

    @contextlib.contextmanager
    def frozen_gate_table(self):
        """Within this scope the gate is looked up in a per-vocabulary table (:func:`fullband.model.feedback.gate_table`)
        built on entry from the weights as they are and dropped on exit; open it only around code that does not
        change ``W_G`` or the embeddings (one ``generate()`` call, one evaluation). It pays when the scope fuses at
        least ``vocab`` tokens (:func:`fullband.model.feedback.gate_table_pays`; :meth:`gate_table_scope` decides
        that). Nested scopes reuse the outer table. A no-op for fusions without a token-only gate."""
        if self._scoped_gate_table is not None or not isinstance(self.feedback, GLUFusion):
            yield
            return
        self._scoped_gate_table = gate_table(self.feedback, self.get_input_embeddings())
        try:
            yield
        finally:
            self._scoped_gate_table = None

    def gate_table_scope(self, fused_tokens: int):
        """:meth:`frozen_gate_table` when one call that fuses ``fused_tokens`` tokens makes a table pay, else a
        scope that changes nothing (the gate computed per token)."""
        vocab = self.get_input_embeddings().num_embeddings
        return self.frozen_gate_table() if gate_table_pays(vocab, fused_tokens) else contextlib.nullcontext()

    def _backbone_pass(self, inputs_embeds, attention_mask, position_ids, cache=None, use_cache=False,
                       logits_to_keep=0, output_hidden_states=False, **kwargs):
        out = self.backbone(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                            cache=cache, use_cache=use_cache, output_hidden_states=True,
                            logits_to_keep=logits_to_keep, return_dict=True, **kwargs)
        return out.logits, out.hidden_states[-1], out.cache, (out.hidden_states if output_hidden_states else None)

    def _pass_loss(self, logits, hidden, labels, loss_chunk: int = 0, z_loss: float = 0.0, **kwargs):
        """``(cross-entropy, z-loss or None)`` of one pass: from ``logits`` through the backbone's own loss function
        or, with ``loss_chunk`` (no logits were computed), chunk by chunk from the final hidden states through the
        LM head (:func:`fullband.model.lm_loss.chunked_lm_loss`)."""
        if loss_chunk:
            return chunked_lm_loss(self.get_output_embeddings(), hidden, labels, loss_chunk, z_loss=z_loss, **kwargs)
        ce = self.backbone.loss_function(logits=logits, labels=labels,
                                         vocab_size=self.get_output_embeddings().out_features, **kwargs)
        return ce, (z_loss_from_logits(logits, labels, z_loss, **kwargs) if z_loss else None)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, num_passes: int = 1,
                feedback_mask: torch.Tensor | None = None, position_ids: torch.LongTensor | None = None,
                prev_hidden: torch.Tensor | None = None, cache: Cache | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0,
                num_items_in_batch: torch.Tensor | None = None, feedback_weight: float | None = None,
                state_hook: StateHook | None = None, grad_passes: int | None = None,
                pass_tol: float | None = None, loss_chunk: int | None = None, z_loss: float | None = None,
                score_all_passes: bool = False, exact_states: bool = False, full_backprop: bool = False,
                backprop_chunk: int = 8, **kwargs) -> FullBandwidthOutput:
        """K-pass teacher-forced forward: the one place the K passes are written.

        Pass 1 is the backbone's ordinary forward (fused only at position 0 when ``prev_hidden``, the state of
        the position just before ``input_ids``, is given); pass k > 1 feeds pass k-1's final hidden states
        shifted right by one wherever ``feedback_mask`` is True (default: :func:`fullband.model.feedback.build_feedback_mask`).
        In training mode the fed-back state gets the jitter of ``config.jitter`` and, with
        ``config.detach_state``, no gradient. A ``cache`` is filled by the last pass only and must then be empty
        when ``num_passes > 1``. ``feedback_weight`` overrides ``config.feedback_weight`` (λ) for this call (the
        training loop ramps it at the feedback switch-on). ``state_hook(k, state)`` (analysis interventions) may
        replace the shifted state ``[B, T, d]`` fed to pass ``k + 1`` (k = 1..K-1) before it is fused.

        Packed rows (several samples in one row, as TRL's padding-free packing gives them: ``position_ids`` that
        restart at 0 per sample and no ``attention_mask``): the default feedback mask starts a document wherever
        the given ``position_ids`` restart (:func:`fullband.model.feedback.position_restarts`), so no state crosses
        from one packed sample into the next, as the backbone's attention does not.

        Long recurrences (K up to the row length; K = T is the exact recurrence on T positions, pass k being exact
        at positions < k): ``grad_passes`` = N runs passes 1..K-N without gradient and only the last N with
        gradient, the first of them fed a state that carries none (truncated backpropagation through the passes;
        ``None``: all K). The passes without gradient compute no logits and no loss (their states are all the
        next pass needs; at a large vocabulary the LM head and cross-entropy are a fifth of a pass and a
        ``[B, T, V]`` fp32 tensor): their ``pass_losses`` entries are NaN (not scored), and ``loss`` is the
        objective's part that has gradient, ``L_1 + λ·mean(L_2..L_K)`` with the unscored passes' terms (constants
        without gradient) as 0. ``score_all_passes=True`` scores them too (as before: their losses detached, in
        ``loss``'s value but not in its backward) for a log of every pass. ``pass_tol`` stops the passes early once the fed-back states stop changing: after pass k >= 2,
        when ``max|h_k - h_{k-1}| / max|h_{k-1}| < pass_tol`` (over the whole batch: under ``torch.distributed``
        the two maxima are all-reduced over the default group, so every rank makes this call and stops alike), the
        no-gradient passes still to come are skipped (the last N gradient passes always run, from the converged
        state) or, when every pass has gradient, the passes end there. Each skipped pass is reported with the loss
        of the pass the passes stopped at (the fixed point's; NaN when that pass was not scored), so
        ``pass_losses`` always has K entries;
        ``passes_run`` and ``pass_changes`` (the relative change after each pass from the second) say what ran.

        Memory at large vocabularies: ``loss_chunk`` = N (with ``labels``) computes no logits at all (``logits`` is
        then ``None``): each pass's loss is taken from its final hidden states N positions at a time, each chunk's
        logits recomputed in the backward (:mod:`fullband.model.lm_loss`). ``z_loss`` = c adds the PaLM z-loss
        ``c · mean(logsumexp^2)`` over the supervised tokens to every pass's loss (combined over the passes as the
        losses are); ``pass_losses`` stay the cross-entropies and ``z_loss`` reports the added term.

        The exact recurrence at linear cost: ``exact_states=True`` first runs the token-by-token recurrence
        (:meth:`recurrent_forward`, through the backbone's KV cache, without gradient and without logits), which
        gives the exact final hidden state of every position, then ``num_passes`` = N teacher-forced passes with
        gradient, the first fed the exact states shifted right by one (so its output is the exact recurrence's, to
        rounding), each next one fed the one before (the gradient flows through these N passes and their chain of
        states, not through the token-by-token pass). It equals ``num_passes = T + 1 + N, grad_passes = N`` (the
        passes without gradient reach the exact states at pass T + 1) at the cost of one forward without the LM head
        (the token-by-token pass: T sequential one-token calls) plus N gradient passes, whatever T. Every pass's
        loss is the exact recurrence's; ``loss`` is their mean (no plain pass, so ``feedback_weight`` does not apply:
        ``fullband train`` refuses a λ or its ramp here) and ``pass_losses`` has N entries. It takes no
        ``prev_hidden``, ``cache``, ``grad_passes`` or ``pass_tol``.

        Full backpropagation through the recurrence: ``full_backprop=True`` (with ``num_passes=1``) runs the
        token-by-token recurrence itself with gradient, through the fed-back states and the KV cache, in blocks of
        ``backprop_chunk`` tokens recomputed in the backward (:mod:`fullband.model.full_backprop`: memory linear in
        T). Its loss is the recurrence's, its gradient that of the last of ``num_passes = T + 1`` passes;
        ``pass_losses`` has one entry. It takes no ``prev_hidden``, ``cache``, ``grad_passes``, ``pass_tol``,
        ``exact_states``, ``state_hook`` or ``score_all_passes``, and no packed rows.
        """
        kwargs.pop("return_dict", None)
        kwargs.pop("output_hidden_states", None)
        kwargs.pop("inputs_embeds", None)
        if exact_states and (prev_hidden is not None or cache is not None or use_cache or grad_passes is not None
                             or pass_tol is not None):
            raise ValueError("exact_states runs the whole recurrence itself, then num_passes gradient passes: it "
                             "takes no prev_hidden, cache, use_cache, grad_passes or pass_tol")
        if full_backprop and (num_passes != 1 or prev_hidden is not None or cache is not None or use_cache
                              or grad_passes is not None or pass_tol is not None or exact_states
                              or state_hook is not None or score_all_passes):
            raise ValueError("full_backprop runs the whole recurrence as one pass with gradient: it takes "
                             "num_passes=1 and no prev_hidden, cache, use_cache, grad_passes, pass_tol, "
                             "exact_states, state_hook or score_all_passes")
        past_length = cache.get_seq_length() if cache is not None else 0
        self.check_inputs(input_ids, attention_mask, labels, feedback_mask, num_passes, past_length)
        if num_passes > 1 and past_length:
            raise ValueError("num_passes > 1 needs an empty cache: every pass re-reads the whole sequence")
        if feedback_mask is None:  # the position ids as given: packed samples' starts (none derived from padding)
            feedback_mask = build_feedback_mask(input_ids, attention_mask, self.doc_start_token_id,
                                                has_prev_state=prev_hidden is not None, position_ids=position_ids)
        feedback_mask = feedback_mask.bool()
        T = input_ids.shape[1]
        if position_ids is None and attention_mask is not None:
            position_ids = position_ids_from_mask(attention_mask, T)
        if labels is not None and attention_mask is not None:
            labels = labels.masked_fill(~attention_mask[:, -T:].bool(), -100)

        if grad_passes is not None and (not isinstance(grad_passes, int) or isinstance(grad_passes, bool)
                                        or grad_passes < 1):
            raise ValueError(f"grad_passes must be an integer >= 1 (or None: all passes), got {grad_passes!r}")
        if pass_tol is not None and not pass_tol >= 0:
            raise ValueError(f"pass_tol must be >= 0 (or None: no early stop), got {pass_tol!r}")
        if pass_tol is not None and num_passes > 1 and (cache is not None or use_cache):
            raise ValueError("pass_tol (early stop) cannot fill a cache: the last pass is not known in advance")
        if loss_chunk is not None and (not isinstance(loss_chunk, int) or isinstance(loss_chunk, bool)
                                       or loss_chunk < 0):
            raise ValueError(f"loss_chunk must be an integer >= 0 positions (0 or None: off), got {loss_chunk!r}")
        if z_loss is not None and not z_loss >= 0:
            raise ValueError(f"z_loss must be >= 0 (0 or None: off), got {z_loss!r}")
        chunked = bool(loss_chunk) and labels is not None
        if chunked:
            check_chunkable(self.config.text_config)
        loss_kwargs = {"loss_chunk": loss_chunk if chunked else 0, "z_loss": z_loss or 0.0}
        if num_items_in_batch is not None:
            loss_kwargs["num_items_in_batch"] = num_items_in_batch
        if full_backprop:
            return full_backprop_forward(self, input_ids, attention_mask, labels, feedback_mask, position_ids,
                                         backprop_chunk, loss_kwargs, **kwargs)
        # passes 0..first_grad-1 run without gradient (0-based), scored only with score_all_passes; the last n_grad
        # with it
        exact = None
        if exact_states:  # pass 0: the exact recurrence's states (no gradient, no logits), then N gradient passes
            with torch.no_grad(), gathered_once(self):
                exact = self.recurrent_forward(input_ids, attention_mask, feedback_mask, position_ids,
                                               need_logits=False).last_hidden_state
            num_passes += 1
        n_grad = num_passes if grad_passes is None else min(grad_passes, num_passes)
        first_grad = 1 if exact_states else num_passes - n_grad
        first_scored = 0 if score_all_passes else first_grad
        grad_on = torch.is_grad_enabled()
        no_logits = torch.empty(0, dtype=torch.long, device=input_ids.device)  # HF's logits_to_keep: no position

        token_embeds = self.get_input_embeddings()(input_ids)
        # per pass: the objective's term (with its graph on gradient passes), the cross-entropy and the z-loss
        terms, pass_losses, z_terms = [], [], []
        hidden, logits, out_cache, changes, ran_grad = None, None, None, [], 0
        k = 0
        while k < num_passes:
            last = k == num_passes - 1
            if k == 0 and exact is not None:  # the exact states stand in for pass 0's output
                hidden, k = exact, 1
                continue
            if k == 0:
                state = None
                if prev_hidden is not None:
                    state = torch.zeros_like(token_embeds, dtype=prev_hidden.dtype)
                    state[:, 0] = prev_hidden
                    pass_mask = feedback_mask.clone()
                    pass_mask[:, 1:] = False
            else:
                state = shift_right(hidden)
                if prev_hidden is not None:
                    state[:, 0] = prev_hidden
                if state_hook is not None:
                    state = state_hook(k, state)
                pass_mask = feedback_mask
            with torch.set_grad_enabled(grad_on and k >= first_grad):
                if state is None:
                    inputs = token_embeds
                else:
                    if self.training:
                        state = jitter(state, self.config.jitter)
                    if self.config.detach_state:
                        state = state.detach()
                    inputs = fuse_where(pass_mask, self.fuse(state, input_ids, token_embeds), token_embeds)
                scored = labels is not None and k >= first_scored
                keep = logits_to_keep if (last or scored or (pass_tol is not None and k >= first_grad)) else 1
                if chunked or k < first_scored:  # the LM head on no position: no logits
                    keep = no_logits
                previous = hidden
                logits, hidden, step_cache, _ = self._backbone_pass(inputs, attention_mask, position_ids,
                                                                    cache=cache if last else None,
                                                                    use_cache=bool(use_cache) and last,
                                                                    logits_to_keep=keep, **kwargs)
                if scored:
                    ce, z = self._pass_loss(logits, hidden, labels, **loss_kwargs)
                    term = ce if z is None else ce + z
                    terms.append(term if k >= first_grad else term.detach())
                    pass_losses.append(ce.detach().float())
                    if z is not None:
                        z_terms.append(z.detach())
                elif labels is not None:  # not scored: no term (0 in the loss), NaN reported
                    terms.append(None)
                    pass_losses.append(hidden.new_full((), float("nan"), dtype=torch.float32))
                    if loss_kwargs["z_loss"]:
                        z_terms.append(None)
            if last:
                out_cache = step_cache
            ran_grad += k >= first_grad
            nxt = k + 1
            if pass_tol is not None and previous is not None:
                extremes = torch.stack([(hidden.detach() - previous.detach()).abs().max(),
                                        previous.detach().abs().max()])
                if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                    # the whole global batch: every rank stops at the same pass (DDP / FSDP ranks run the same
                    # passes, hence the same collectives), as one process holding every rank's rows would
                    wide = extremes.float()
                    dist.all_reduce(wide, op=dist.ReduceOp.MAX)
                    extremes = wide.to(extremes.dtype)
                change = float(extremes[0] / extremes[1].clamp_min(1e-12))
                changes.append(change)
                if change < pass_tol and k < first_grad:
                    nxt = first_grad  # skip the rest of the passes without gradient
                elif change < pass_tol and first_grad == 0:
                    nxt = num_passes  # every pass has gradient: the passes end here
            if labels is not None:  # skipped passes: the loss of the (converged) pass the passes stopped at
                skipped = min(nxt, num_passes) - k - 1
                for store in (terms, pass_losses, z_terms) if z_terms else (terms, pass_losses):
                    store += [store[-1]] * skipped
            k = nxt
        weight = self.config.feedback_weight if feedback_weight is None else feedback_weight
        if exact_states:  # every pass is the exact recurrence's: their mean, no plain pass to weigh against
            loss = torch.stack(terms).mean() if terms else None
            z_total = torch.stack(z_terms).mean() if z_terms else None
        else:
            loss = combine_pass_losses(_zero_unscored(terms), weight) if terms else None
            z_total = combine_pass_losses(_zero_unscored(z_terms), weight) if z_terms else None
        passes_run = num_passes - (exact is not None) if pass_tol is None else len(changes) + 1
        return FullBandwidthOutput(
            loss=loss, logits=None if chunked else logits, last_hidden_state=hidden, cache=out_cache,
            pass_losses=torch.stack(pass_losses) if pass_losses else None,
            z_loss=z_total,
            passes_run=passes_run, grad_passes_run=ran_grad if grad_on else 0,
            pass_changes=changes if pass_tol is not None else None,
        )

    # ------------------------------------------------------------------ exact reference

    @torch.no_grad()
    def recurrent_forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                          feedback_mask: torch.Tensor | None = None, position_ids: torch.LongTensor | None = None,
                          *, cache: Cache | None = None, state_hook: StateHook | None = None,
                          output_hidden_states: bool = False, need_logits: bool = True) -> FullBandwidthOutput:
        """The true token-by-token recurrence with the backbone's KV cache -- the one place it is written: position
        t takes ``fusion(h_{t-1}, e_t)`` wherever the feedback mask allows (the plain embedding elsewhere), where
        ``h_{t-1}`` is the final hidden state this very recurrence produced one step earlier.

        ``cache`` (empty) is filled and returned (decoding's ``exact`` prefill continues from it); ``state_hook(t,
        h_prev)`` may replace the state fused at step t (analysis interventions); ``output_hidden_states`` also
        returns every layer's residual stream. Returns logits ``[B, T, V]``, ``last_hidden_state`` ``[B, T, d]``
        and ``inputs_embeds`` (what entered the backbone). No jitter, no gradient, no dropout: in training mode it
        runs as in evaluation (:func:`without_dropout`), so its states are the recurrence's (the exact states of
        ``exact_states=True``), not those of T dropout masks; the gradient passes after it keep the backbone's
        dropout, as training does. ``need_logits=False`` projects no position through the LM head (``logits`` is
        then ``None``): the states are all that is wanted.

        Packed rows (``position_ids`` that restart, no ``attention_mask``: see :meth:`forward`): each packed sample
        runs as a sequence of its own (its own cache: the backbone's attention over the whole row keeps the samples
        apart just so), its state reset at its start; such rows fill no ``cache`` and take no ``state_hook``."""
        with without_dropout(self):
            return run_recurrence(self, input_ids, attention_mask, feedback_mask, position_ids, cache, state_hook,
                                  output_hidden_states, need_logits)


def load_model(path: str, **kwargs):
    """Load a saved model from a local directory, with a one-line error when it is not one: a fullband model
    (``FullBandwidthForCausalLM``), or a plain Hugging Face causal LM (returned as it is: no latent feedback, so
    only the ``standard`` mode applies to it). A truncated or corrupt weights file is reported as such."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path!r} has no config.json: not a saved model (save_pretrained output)")
    try:
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"{os.path.join(path, 'config.json')!r} is not a readable config: {err}") from None
    cls = FullBandwidthForCausalLM if model_type == FullBandwidthConfig.model_type else AutoModelForCausalLM
    try:
        return cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        weights = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        where = os.path.join(path, weights[0]) if len(weights) == 1 else path
        raise ValueError(f"could not load the model from {where!r} (truncated or corrupt?): {msg}") from None
