"""Fault 4: under LRU, ``add_request`` allocates (and may evict) before it pins its matched blocks.

``DynamicInferenceContext.add_request`` (0.17, 0.18) first allocates the blocks the request needs
from the pool, then raises the ref counts of the blocks it matched by hash. When the free pool
is short, the allocation evicts cached ref-0 blocks, and the matched blocks are such blocks
until pinned: one can be evicted and handed straight back to the same request as a "new" block.
The block table then holds one ID twice, the request's new KV overwrites its own matched prefix
(wrong output, no error), and the hash chain is broken. ``check_availability`` counts the same
soon-to-be-pinned blocks as evictable, so it admits requests that only fit by that mistake.

The fix mirrors megatron-core 0.19.0 (Megatron-LM #5822, 2026-07-23):

- ``add_request``: when the free pool is short of the blocks the call takes from it (only then
  does allocation evict), the matched blocks get one extra ref count for the duration of the
  released call (so allocation can never evict them); the call's own pin then raises them as
  released, and the extra count is dropped when it returns or raises (0.19 rolls its pin back when
  the allocation fails; here the released code has not pinned yet at that point);
- ``check_availability``: matched blocks now at ref count 0 no longer count as evictable.

Only LRU changes (REF_ZERO never evicts on allocation).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ..mcore import DYNAMIC_CONTEXT_MODULE, KV_BLOCK_ALLOCATOR_MODULE
from ..guards import Guarded, lru_only
from ..patching import Patch, ShadowedMethod, Target

ADD_REQUEST = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.add_request")
CHECK_AVAILABILITY = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.check_availability")
COMPUTE_PREFIX_MATCH = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext._compute_prefix_match")
IS_MEMORY_AVAILABLE = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.is_memory_available")


def _add_request_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict) -> None:
    """Pin the request's matched blocks for the released call, which matches once, not twice.

    Where the free pool holds every block the chunk could take, allocation cannot evict and the
    released call runs as it is. Otherwise the prefix match (``_compute_prefix_match``, which only
    reads the hash map and the request in 0.17/0.18) is computed here, before anything is
    allocated, and the released ``add_request`` is handed the same result: for the duration of the
    call the context's own ``_compute_prefix_match`` attribute answers the call with these
    arguments from it (any other call goes through). Guarded (:func:`~megatron_ext.guards.lru_only`).
    """
    allocator = context.kv_block_allocator
    if not allocator.enable_prefix_caching:
        return wrapped(*args, **kwargs)
    req = kwargs["req"] if "req" in kwargs else args[0]
    chunk = args[1] if len(args) > 1 else kwargs.get("prefill_chunk_length")
    if chunk is None:
        chunk = req.remaining_prompt_length
    # The call takes at most the chunk's blocks beyond those the request holds from the pool:
    # when the free pool has them, allocation cannot evict, so nothing needs pinning (the common case).
    block, finished = context.block_size_tokens, req.finished_chunk_token_count
    if allocator.total_avail >= -(-(finished + chunk) // block) - -(-finished // block):
        return wrapped(*args, **kwargs)
    compute = context._compute_prefix_match
    match = compute(req, chunk)

    def computed_match(other_req: Any, other_chunk: int, *more: Any, **options: Any):
        if other_req is req and other_chunk == chunk and not more and not options:
            return match
        return compute(other_req, other_chunk, *more, **options)

    # Allocation evicts only when the free pool is short of the blocks it takes from the pool
    # (match[1], after the matches); otherwise no matched block can be evicted either.
    pinned = None
    if match[0] and allocator.total_avail < match[1]:
        ref_counts = allocator.block_ref_counts
        pinned = torch.tensor(match[0], dtype=torch.int64, device=ref_counts.device)
        ref_counts.index_add_(0, pinned, torch.ones_like(pinned, dtype=ref_counts.dtype))
    try:
        with ShadowedMethod(context, COMPUTE_PREFIX_MATCH.attribute, computed_match):
            return wrapped(*args, **kwargs)
    finally:
        if pinned is not None:
            ref_counts.index_add_(0, pinned, torch.full_like(pinned, -1, dtype=ref_counts.dtype))


def blocks_after_match_fit(context: Any, req: Any) -> bool:
    """Whether the pool can supply what ``add_request(req)`` allocates once its matches are pinned.

    Free blocks plus evictable cached blocks, less the matched blocks now at ref count 0 (0.19's
    ``is_memory_available(n, potential_matched_count)``).
    """
    allocator = context.kv_block_allocator
    matched, from_pool = context._compute_prefix_match(req, req.remaining_prompt_length)[:2]
    if allocator.total_avail >= from_pool:
        return True
    ref_counts = allocator.block_ref_counts
    ids = torch.tensor(matched, dtype=torch.int64, device=ref_counts.device)
    unpinned_matches = int((ref_counts[ids] == 0).sum()) if matched else 0
    evictable = int(allocator.get_evictable_block_count()) - unpinned_matches
    return allocator.total_avail + evictable >= from_pool


def _check_availability_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict):
    request_fits, tokens_fit, kv_available = wrapped(*args, **kwargs)
    allocator = context.kv_block_allocator
    if not kv_available or not allocator.enable_prefix_caching:  # guarded: lru_only
        return request_fits, tokens_fit, kv_available
    req = kwargs["req"] if "req" in kwargs else args[0]
    block = context.block_size_tokens
    finished = req.finished_chunk_token_count
    most_needed = -(-(finished + req.remaining_prompt_length) // block) - -(-finished // block)
    if allocator.total_avail >= most_needed:  # the free pool covers it, matches or not
        return request_fits, tokens_fit, kv_available
    return request_fits, tokens_fit, blocks_after_match_fit(context, req)


class LruPinBeforeAllocatePatch(Patch):
    """Pins matched blocks before ``add_request`` allocates, 0.17/0.18 (see module docstring)."""

    name = "lru-pin-before-allocate"
    fault = "4"

    def wrappers(self) -> dict[Target, Guarded]:
        return {ADD_REQUEST: lru_only(_add_request_wrapper),
                CHECK_AVAILABILITY: lru_only(_check_availability_wrapper)}

    def checked_functions(self) -> tuple[Target, ...]:
        return (ADD_REQUEST, CHECK_AVAILABILITY, COMPUTE_PREFIX_MATCH, IS_MEMORY_AVAILABLE)

    def needed(self) -> tuple[bool, str]:
        """0.19's fix came with ``is_memory_available(num_blocks, potential_matched_count)``."""
        parameters = inspect.signature(IS_MEMORY_AVAILABLE.original()).parameters
        if "potential_matched_count" in parameters:
            return False, ("is_memory_available takes potential_matched_count: add_request pins "
                           "matched blocks before allocating (#5822)")
        return True, "is_memory_available has no potential_matched_count: add_request allocates first"
