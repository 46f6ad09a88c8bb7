"""What vLLM's engine core does differently for a fullband model: the state's KV-cache spec and manager, and the
scheduler (prefix caching and preemption kept exact).

Owns
* :class:`FeedbackStateSpec` / :class:`FeedbackStateManager`: the per-request state (one page: the fed-back final
  hidden state) as a Mamba-style spec that opts out of prefix caching (``prefix_cacheable`` False: its pages are
  per-request scratch, never looked up, never shared) and whose block size is the attention block size, so it
  neither coarsens the prefix-cache granularity (vLLM hashes at the LCM of the groups' block sizes) nor caps a hit
  (a Mamba group otherwise limits hits to where a state was cached); the manager gives every request exactly one
  page whatever its length, and frees nothing early; :func:`register_state_spec` registers the pair with vLLM;
* :class:`FeedbackScheduler` (and :class:`FeedbackAsyncScheduler`), set as ``scheduler_cls`` at startup
  (:func:`fullband.serving.config.check_engine_config`):

  - **prefix caching**: only blocks that hold prompt tokens alone, and not the prompt's last token, are entered in
    the cache (:meth:`FeedbackScheduler._cache_prompt_blocks`). A prompt token's KV is a plain prefill's in mode
    ``soft``, a function of the tokens before it alone, so such a block is what any later prompt with the same
    tokens would write -- a hit serves exactly ``generate(soft)``'s KV. A block holding a generated token (its KV
    was written by a fused decode step, the feedback KV) is never cached, so a later prompt that equals an earlier
    prompt + answer is prefilled plainly, as ``generate(soft)`` on it does. A hit never covers a prompt's last
    token, whose final hidden state is the first fed-back state: vLLM looks a hit up to the request's tokens but
    one, which stops a new request before that token; a resumed request's tokens include its answer, so its lookup
    is capped at its prompt (:class:`PromptOnly`) -- without that, a preempted request whose prompt ends on a block
    boundary would hit blocks another request with a longer prompt cached, its first fed-back state would never be
    recomputed, and its next token would be fused with a state page nobody wrote;
  - **preemption**: vLLM preempts a request by freeing its blocks and later recomputes prompt + generated tokens
    as a prefill. :meth:`FeedbackScheduler._reserve_prefill_lookahead` (the per-request chunk-size hook of both
    scheduling loops) ends every chunk at the prompt's end and schedules positions past it one per step: the
    resumed request re-runs its generated part through the recurrence, each token fused with the state its
    predecessor's step wrote, exactly as its decode steps did (the sampled tokens of these steps are discarded by
    vLLM, as for any partial prefill; the answer continues at the end). A preemption costs one prefill of the
    prompt (less any prefix-cache hit) plus one step per generated token so far;
  - statistics for the tests (with ``FULLBAND_VLLM_STATS``): preemptions and vLLM's prefix-cache queries / hits.

vLLM internals (the KV-cache spec registry, ``MambaManager``, ``Scheduler``), pinned with the ``vllm`` extra.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import MambaManager
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

STATS_ENV = "FULLBAND_VLLM_STATS"  # tests: the scheduler writes STATS_ENV + ".scheduler.json"


@dataclass(frozen=True)
class FeedbackStateSpec(MambaSpec):
    """One state page per request; no part in prefix caching (see the module docstring)."""

    @property
    def prefix_cacheable(self) -> bool:
        return False


class FeedbackStateManager(MambaManager):
    """Exactly one page per running request, kept until the request is freed (``mamba_cache_mode`` 'none'
    allocation, independent of the request's length and of the spec's block size)."""

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:
        return super().get_num_blocks_to_allocate(request_id, 1, new_computed_blocks, total_computed_tokens,
                                                  num_local_computed_tokens, 1, apply_admission_cap, prefill_end)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        return super().allocate_new_blocks(request_id, 1, 1)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0


def register_state_spec() -> None:
    """Register :class:`FeedbackStateSpec` with its manager (idempotent; vLLM's built-in specs first, since the
    registry fills itself only while it is empty)."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(FeedbackStateSpec, FeedbackStateManager, uniform_type_base_spec=MambaSpec)


register_state_spec()


class PromptOnly:
    """A request as the prefix-cache lookup sees it: its prompt alone (``num_tokens`` at most the prompt's), every
    other attribute the request's. vLLM's lookup hits at most ``num_tokens - 1`` tokens."""

    __slots__ = ("request",)

    def __init__(self, request):
        self.request = request

    def __getattr__(self, name):
        return getattr(self.request, name)

    @property
    def num_tokens(self) -> int:
        return min(self.request.num_tokens, self.request.num_prompt_tokens)


class _FeedbackScheduling:
    """The fullband rules, mixed into vLLM's scheduler classes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        coordinator = self.kv_cache_manager.coordinator
        self._cache_all_blocks = coordinator.cache_blocks
        coordinator.cache_blocks = self._cache_prompt_blocks  # the one place vLLM enters a request's blocks
        path = os.environ.get(STATS_ENV)
        self._stats_path = path + ".scheduler.json" if path else None
        self._stats = {"steps": 0, "preemptions": 0, "reprefilled_prompt_tokens": 0,
                       "recomputed_generated_tokens": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                       "prefix_cache_requests": 0}

    def _cache_prompt_blocks(self, request, num_computed_tokens: int) -> None:
        self._cache_all_blocks(request, min(num_computed_tokens, request.num_prompt_tokens - 1))

    def _get_local_prefix_cache_hit(self, request):
        return super()._get_local_prefix_cache_hit(PromptOnly(request))  # never past the prompt's last token

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        prompt = request.num_prompt_tokens
        if num_computed_tokens < prompt:
            return min(n, prompt - num_computed_tokens)  # a chunk ends at the prompt's end at the latest
        return min(n, 1)  # generated positions: one per step, through the recurrence

    def _update_after_schedule(self, scheduler_output) -> None:
        if self._stats_path:  # what resumed requests recompute (counted before vLLM advances the requests)
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                request = self.requests[req_id]
                start, prompt = request.num_computed_tokens, request.num_prompt_tokens
                if request.num_preemptions and start < prompt:
                    self._stats["reprefilled_prompt_tokens"] += n
                elif start >= prompt and start + n < request.num_tokens:
                    self._stats["recomputed_generated_tokens"] += n
            self._stats["steps"] += 1
        super()._update_after_schedule(scheduler_output)

    def _preempt_request(self, request, timestamp, drop_stale_output=False) -> None:
        super()._preempt_request(request, timestamp, drop_stale_output)
        self._stats["preemptions"] += 1

    def make_stats(self, *args, **kwargs):
        stats = super().make_stats(*args, **kwargs)
        if self._stats_path:
            pc = stats.prefix_cache_stats if stats is not None else None
            if pc is not None:
                self._stats["prefix_cache_queries"] += pc.queries
                self._stats["prefix_cache_hits"] += pc.hits
                self._stats["prefix_cache_requests"] += pc.requests
            tmp = self._stats_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self._stats, f)
            os.replace(tmp, self._stats_path)
        return stats


class FeedbackScheduler(_FeedbackScheduling, Scheduler):
    """vLLM's scheduler with the fullband rules."""


class FeedbackAsyncScheduler(_FeedbackScheduling, AsyncScheduler):
    """vLLM's async scheduler with the fullband rules."""
