"""Fault 6: under LRU, paused requests cannot resume into blocks that eviction could free.

Every step, ``update_requests`` pauses each request that needs a new KV block and then calls
``DynamicInferenceContext.resume_paused_requests``, which resumes at most ``total_avail`` (the
free pool) requests and asserts the new blocks fit the free pool. Under LRU the pool is normally
full of cached ref-0 blocks that an allocation would evict, but they are not counted: with no
free block a request that crosses a block boundary stays paused (with the default paused
budget of 0 it is evicted and recomputed from scratch), and once no request is active the step
fails ``active_request_count == 0 with no hidden chunked prefill``. Present in 0.17 to 0.19.

The fix mirrors Megatron-LM main #5995 (2026-07-31, in no release): paused requests resume while
the new blocks they take (not their number) fit the free pool plus the evictable cached blocks,
and exactly the missing blocks are evicted (leaf first, by ``evict_lru_blocks``) before they are
allocated; a resumed request that needs no new block costs no cache hit. Only where the released
bound can bind (LRU, a free pool smaller than the paused request count) does the patch replace
``resume_paused_requests``; everywhere else the released function runs unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..mcore import DYNAMIC_CONTEXT_MODULE, KV_BLOCK_ALLOCATOR_MODULE, uses_lru_prefix_caching
from ..patching import Patch, Target

RESUME = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.resume_paused_requests")
EVICTABLE = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.get_evictable_block_count")


def resume_plan(context: Any, active_request_count: int, block_budget: int) -> tuple[int, int]:
    """How many paused requests resume, and how many new blocks they take.

    The released bounds stay: requests resume from the right-most paused one (LIFO) while their
    blocks, plus one for each that needs a new block, fit the active buffer
    (``get_active_avail``), and within what ``max_requests`` / ``max_tokens`` leave room for. The
    bound by the free pool becomes #5995's: the new blocks they take fit ``block_budget``.

    Args:
        context: a ``DynamicInferenceContext`` with paused requests.
        active_request_count: as passed to ``resume_paused_requests``.
        block_budget: blocks the resumed requests may take (free pool plus evictable blocks).

    Returns:
        ``(requests, new blocks)``, both ints >= 0.
    """
    paused = context.paused_request_count
    speculative = getattr(context, "num_speculative_tokens", 0)
    offsets = context.request_last_kv_block_offset[:paused]
    # flipped: requests resume from the right-most paused one
    needs_new_block = (offsets >= context.block_size_tokens - 1 - speculative).to(torch.int64).flip(dims=[0])
    blocks_when_resumed = context.request_kv_block_counts[:paused].flip(dims=[0]) + needs_new_block
    fit_active_buffer = int(torch.count_nonzero(
        blocks_when_resumed.cumsum(dim=0) <= context.kv_block_allocator.get_active_avail()))
    max_active = min(context.max_requests, context.max_tokens // (speculative + 1))
    candidates = min(fit_active_buffer, max(0, max_active - active_request_count))
    new_blocks = needs_new_block[:candidates].cumsum(dim=0)
    requests = int(torch.count_nonzero(new_blocks <= block_budget))
    return requests, int(new_blocks[requests - 1]) if requests else 0


def resume_into_evictable(context: Any, active_request_count: int,
                          newly_paused_request_ids: Optional[torch.Tensor]) -> tuple[int, Optional[torch.Tensor]]:
    """``resume_paused_requests`` as #5995 bounds it (see :func:`resume_plan`), for LRU contexts.

    Args:
        context: a ``DynamicInferenceContext`` under LRU prefix caching.
        active_request_count: the active request count before resuming.
        newly_paused_request_ids: int64 request IDs paused by this step (1-D), or ``None``.

    Returns:
        ``(active request count, newly paused IDs)`` after resuming: the resumed requests' IDs
        are dropped from the end of ``newly_paused_request_ids`` (requests resume LIFO).
    """
    allocator = context.kv_block_allocator
    budget = allocator.total_avail + int(allocator.get_evictable_block_count())
    requests, new_blocks = resume_plan(context, active_request_count, budget)
    shortfall = new_blocks - allocator.total_avail
    if requests == 0 or (shortfall > 0 and not allocator.evict_lru_blocks(shortfall)):
        return active_request_count, newly_paused_request_ids
    context.paused_request_count -= requests
    first = context.paused_request_count
    if new_blocks:
        offsets = context.request_last_kv_block_offset[first:first + requests]
        speculative = getattr(context, "num_speculative_tokens", 0)
        rows = first + torch.nonzero(offsets >= context.block_size_tokens - 1 - speculative).squeeze(1)
        block_ids = allocator.allocate_memory_blocks(new_blocks)
        context.request_to_kv_block_ids[rows, context.request_kv_block_counts[rows]] = block_ids
        context.request_kv_block_counts[rows] += 1
        context.request_last_kv_block_id[rows] = block_ids
    if newly_paused_request_ids is not None:
        newly_paused_request_ids = newly_paused_request_ids[:-requests]
    return active_request_count + requests, newly_paused_request_ids


def _resume_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict):
    allocator = context.kv_block_allocator
    # the released bound (resumed requests <= free pool) binds only when the pool is short
    if allocator.total_avail >= context.paused_request_count or not uses_lru_prefix_caching(allocator):
        return wrapped(*args, **kwargs)
    return resume_into_evictable(context, *args, **kwargs)


class LruResumeEvictablePatch(Patch):
    """Lets paused requests resume into evictable cached blocks (see module docstring)."""

    name = "lru-resume-evictable"
    fault = "6"
    source_patched_targets = (RESUME,)
    fault_evidence = "no megatron-core release up to 0.19.2 counts evictable blocks when resuming"

    def wrappers(self) -> dict[Target, Callable]:
        return {RESUME: _resume_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        return (RESUME, EVICTABLE)
