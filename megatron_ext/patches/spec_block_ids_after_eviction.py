"""Fault S1: with speculative decoding, an eviction sends a resumed request's KV to another request's block.

With ``num_speculative_tokens`` ``n > 0`` a decode step forwards ``n + 1`` tokens per request, and a
request whose last block cannot hold them all is paused, then resumed with a new block in the same
``DynamicInferenceContext.update_requests``: its tokens before the block boundary belong in its
previous last block, those from the boundary on in the new one. ``update_requests`` clones
``request_last_kv_block_id`` into ``prev_last_block_ids`` before it resumes paused requests (step 6)
and, at its end, reads that copy by row (``prev_last_block_ids[paused_request_count:
total_request_count]``) for the pre-boundary tokens of each request that crosses a boundary. Between
the two, ``evict_overflow_paused_requests`` swaps the evicted rows with active rows
(``_swap_book_keeping_tensors``), and step 6.d swaps a chunked-prefill row; the copy is not swapped
with them, so a moved resumed request reads another row's old last block: its pre-boundary tokens'
KV is written into a block of the evicted request (released: free, or with prefix caching a
cached block another request may match) or of another live request. The writer reads its own
previous block afterwards, where that KV never landed: wrong tokens with caching off; with caching
on, a hash-registered block holds the wrong KV and a later request that matches it generates
wrong tokens. It takes a full KV pool, speculative decoding (MTP) and a resume and an eviction in
one step. Every tree has it: 0.17.0-0.19.2 and Megatron-LM main 2a75ac12c5 / d98e8a64. No upstream
report or change is known.

The fix keys the copy by request, not by row: before ``update_requests`` it records each request's
last block ID (no block is allocated before the clone is taken, so these are the values the clone
holds), and after it rewrites, for each active request whose step crosses a block boundary, the
``token_to_block_idx`` entries of its tokens before the boundary to that request's recorded block.
Requests the step did not reorder get the value the released code wrote; with
``num_speculative_tokens == 0`` nothing runs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..mcore import DYNAMIC_CONTEXT_MODULE
from ..patching import Patch, Target

UPDATE = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.update_requests")
EVICT = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.evict_overflow_paused_requests")
SWAP = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext._swap_book_keeping_tensors")


def last_block_ids(ctx: Any) -> dict[int, int]:
    """Request ID -> ``request_last_kv_block_id`` of every paused and active request."""
    end = ctx.total_request_count
    return dict(zip(ctx.request_ids[:end].tolist(), ctx.request_last_kv_block_id[:end].tolist()))


def route_pre_boundary_tokens(ctx: Any, previous: dict[int, int]) -> int:
    """After ``update_requests``: point the pre-boundary tokens of each active request that crosses
    a block boundary at its own previous last block.

    Args:
        ctx: the ``DynamicInferenceContext`` (``num_speculative_tokens > 0``).
        previous: :func:`last_block_ids` taken before ``update_requests``.

    Returns the number of ``token_to_block_idx`` entries changed.
    """
    first, end = ctx.paused_request_count, ctx.total_request_count
    per_request = ctx.num_speculative_tokens + 1
    if end <= first or ctx.active_token_count != (end - first) * per_request:
        return 0
    block = ctx.block_size_tokens
    offsets = ctx.request_last_kv_block_offset[first:end].cpu()
    before = (offsets - per_request) % block  # the offsets update_requests advanced by n + 1
    crosses = before[:, None] + 1 + torch.arange(per_request)[None, :] >= block
    changed = 0
    for row in torch.nonzero(crosses.any(dim=1)).flatten().tolist():
        prev = previous.get(int(ctx.request_ids[first + row]))
        if prev is None:
            continue
        for j in torch.nonzero(~crosses[row]).flatten().tolist():
            index = row * per_request + j
            if int(ctx.token_to_block_idx[index]) != prev:
                ctx.token_to_block_idx[index] = prev
                changed += 1
    return changed


def _update_wrapper(wrapped: Callable, ctx: Any, args: tuple, kwargs: dict) -> Any:
    """``update_requests``, then each resumed request's pre-boundary tokens to its own previous block."""
    if not getattr(ctx, "num_speculative_tokens", 0):
        return wrapped(*args, **kwargs)
    previous = last_block_ids(ctx)
    result = wrapped(*args, **kwargs)
    route_pre_boundary_tokens(ctx, previous)
    return result


class SpecBlockIdsAfterEvictionPatch(Patch):
    """Keys ``update_requests``' previous last block IDs by request, not by row (see module docstring)."""

    name = "spec-block-ids-after-eviction"
    fault = "S1"
    source_patched_targets = (UPDATE,)
    fault_evidence = ("no megatron-core release up to 0.19.2 (nor Megatron-LM main at d98e8a64) reorders "
                      "update_requests' prev_last_block_ids with the rows an eviction swaps")

    def wrappers(self) -> dict[Target, Callable]:
        return {UPDATE: _update_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        """``update_requests`` (wrapped) and the eviction and swap it relies on: the rows move there."""
        return (UPDATE, EVICT, SWAP)
