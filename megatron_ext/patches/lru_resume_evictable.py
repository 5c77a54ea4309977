"""Fault 6: under LRU, paused requests cannot resume into blocks that eviction could free.

Every step, ``update_requests`` pauses each request that needs a new KV block and then calls
``DynamicInferenceContext.resume_paused_requests``, which resumes at most ``total_avail`` (the
free pool) requests and asserts the new blocks fit the free pool. Under LRU the pool is normally
full of cached ref-0 blocks that an allocation would evict, but they are not counted: with no
free block a request that crosses a block boundary stays paused (with the default paused
budget of 0 it is evicted and recomputed from scratch), and once no request is active the step
fails ``active_request_count == 0 with no hidden chunked prefill``. Present in 0.17 to 0.19.

The fix counts evictable blocks as available, as Megatron-LM main #5995 (2026-07-31, in no
release) does, and nothing more: before the released ``resume_paused_requests`` runs, cached
blocks are evicted (leaf first, by ``evict_lru_blocks``) into the free pool until it covers the
requests the released bounds would resume if the free pool counted evictable blocks too. The
released code then resumes exactly those requests and its assertion holds.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..mcore import DYNAMIC_CONTEXT_MODULE, KV_BLOCK_ALLOCATOR_MODULE, uses_lru_prefix_caching
from ..patching import Patch, Target

RESUME = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.resume_paused_requests")
EVICTABLE = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.get_evictable_block_count")

# Recorded from the released wheels with scripts/record_fingerprints.py.
_RESUME = {"DynamicInferenceContext.resume_paused_requests": "3d81b934d0821f73",
           "KVBlockAllocator.get_evictable_block_count": "8c415c01e64765fe"}
FINGERPRINTS = {release: _RESUME for release in
                ("0.17.0", "0.17.1", "0.18.0", "0.18.2", "0.19.0", "0.19.2")}

#: ``resume_paused_requests`` after the source patches of ``patches/`` (already fixed code);
#: recorded with ``scripts/record_fingerprints.py --source-patched``.
SOURCE_PATCHED_FINGERPRINTS: dict[str, dict[str, str]] = {
    release: {"DynamicInferenceContext.resume_paused_requests": "2adedff833ff161a"} for release in FINGERPRINTS}


def resumable_request_count(context: Any, active_request_count: int, block_budget: int) -> int:
    """How many paused requests the released ``resume_paused_requests`` resumes, given a free pool
    of ``block_budget`` blocks.

    The released bounds: requests resume from the right-most paused one while their blocks, plus
    one for each that needs a new block, fit the active buffer (``get_active_avail``); at most
    ``block_budget``; at most what ``max_requests`` / ``max_tokens`` leave room for.
    """
    paused = context.paused_request_count
    block = context.block_size_tokens
    speculative = getattr(context, "num_speculative_tokens", 0)
    offsets = context.request_last_kv_block_offset[:paused]
    needs_new_block = (offsets >= block - 1 - speculative).to(context.request_kv_block_counts.dtype)
    blocks_when_resumed = (context.request_kv_block_counts[:paused] + needs_new_block).flip(dims=[0])
    fit_active_buffer = int(torch.count_nonzero(
        blocks_when_resumed.cumsum(dim=0) <= context.kv_block_allocator.get_active_avail()))
    max_active = min(context.max_requests, context.max_tokens // (speculative + 1))
    return min(fit_active_buffer, block_budget, max(0, max_active - active_request_count))


def evict_for_paused_requests(context: Any, active_request_count: int) -> int:
    """Evict cached blocks so the free pool covers what the paused requests can resume into.

    Args:
        context: a ``DynamicInferenceContext`` with LRU prefix caching.
        active_request_count: as passed to ``resume_paused_requests``.

    Returns the number of cached blocks evicted (0 when the free pool already suffices).
    """
    allocator = context.kv_block_allocator
    free = allocator.total_avail
    if free >= context.paused_request_count:  # the released bound by the free pool cannot bind
        return 0
    evictable = int(allocator.get_evictable_block_count())
    if evictable == 0:
        return 0
    shortfall = resumable_request_count(context, active_request_count, free + evictable) - free
    if shortfall <= 0 or not allocator.evict_lru_blocks(shortfall):
        return 0
    return shortfall


def _resume_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict):
    if context.paused_request_count > 0 and uses_lru_prefix_caching(context.kv_block_allocator):
        active = kwargs["active_request_count"] if "active_request_count" in kwargs else args[0]
        evict_for_paused_requests(context, active)
    return wrapped(*args, **kwargs)


class ResumeEvictablePatch(Patch):
    """Lets paused requests resume into evictable cached blocks (see module docstring)."""

    name = "lru-resume-evictable"
    fingerprints = FINGERPRINTS
    source_patched_targets = (RESUME,)
    source_patched_fingerprints = SOURCE_PATCHED_FINGERPRINTS
    fault_evidence = "no megatron-core release up to 0.19.2 counts evictable blocks when resuming"

    def wrappers(self) -> dict[Target, Callable]:
        return {RESUME: _resume_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        return (RESUME, EVICTABLE)
