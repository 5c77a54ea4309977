"""Fault R2: a request whose KV blocks are handed out again in the step it finishes loses its routing.

megatron-core 0.18 and 0.19 store MoE routing per KV block (``KVBlockAllocator.block_routing``,
with ``moe_enable_routing_replay``) and rebuild a finished request's ``routing_indices`` from
its blocks. The controller saves the finished requests' block IDs before
``DynamicInferenceContext.update_requests``; ``update_requests`` releases those blocks and, in
the same call, allocates blocks for the requests that go on (a decode crossing a block boundary,
the next prefill chunk, a resumed request); ``allocate_memory_blocks`` drops the routing of every
block it hands out. The engine then rebuilds the finished request's routing from its saved block
IDs, finds a block without routing and sets ``routing_indices = None``: the trainer gets no
routing for that rollout. It takes a block released by a finishing request being allocated in the
same step, so it depends on the batch: with prefix caching off (blocks go straight back to the
free pool) as much as on. No release fixes it; open Megatron-LM PR #7310 (2026-09-14) reworks
where routing is kept for the asynchronous path.

The fix keeps, for the step, a reference to the routing arrays of the finishing requests' blocks
(taken right before ``update_requests``; the allocator drops its dict entries, not the arrays),
and lets ``reconstruct_routing_from_blocks`` see those entries again for the blocks it no longer
has. Every other block, and every call without routing replay, is left to the released code.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from ..mcore import DYNAMIC_CONTEXT_MODULE, KV_BLOCK_ALLOCATOR_MODULE
from ..patching import Patch, Target

UPDATE = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.update_requests")
RECONSTRUCT = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.reconstruct_routing_from_blocks")
ALLOCATE = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.allocate_memory_blocks")

#: allocator -> block ID -> routing array (``[block_size_tokens, layers, topk]``) of the blocks of
#: the requests that finished in the allocator's last ``update_requests``.
_FINISHED_ROUTING: "weakref.WeakKeyDictionary[Any, dict[int, Any]]" = weakref.WeakKeyDictionary()


def finishing_routing(context: Any, active_requests_mask: Any) -> dict[int, Any]:
    """The stored routing of every block held by a request ``update_requests`` will finish.

    Args:
        context: the ``DynamicInferenceContext``.
        active_requests_mask: ``[active requests]`` (0: the request finishes), as
            ``update_requests`` gets it.

    Returns block ID -> the allocator's routing array of that block (blocks without one left out).
    """
    stored = context.kv_block_allocator.block_routing
    rows = (active_requests_mask == 0).nonzero().squeeze(1) + context.paused_request_count
    blocks = context.request_to_kv_block_ids[rows]
    return {b: stored[b] for b in blocks[blocks >= 0].tolist() if b in stored}


def _update_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict) -> Any:
    """Before ``update_requests``: remember the finishing requests' block routing (routing replay only)."""
    allocator = context.kv_block_allocator
    if allocator.block_routing:
        mask = kwargs["active_requests_mask"] if "active_requests_mask" in kwargs else args[0]
        _FINISHED_ROUTING[allocator] = finishing_routing(context, mask)
    else:
        _FINISHED_ROUTING.pop(allocator, None)
    return wrapped(*args, **kwargs)


def _reconstruct_wrapper(wrapped: Callable, allocator: Any, args: tuple, kwargs: dict) -> Any:
    """``reconstruct_routing_from_blocks`` with the finished requests' dropped entries seen again."""
    kept = _FINISHED_ROUTING.get(allocator)
    if not kept:
        return wrapped(*args, **kwargs)
    stored = allocator.block_routing
    missing = {b: routing for b, routing in kept.items() if b not in stored}
    if not missing:
        return wrapped(*args, **kwargs)
    allocator.block_routing = {**stored, **missing}  # what get_block_routing reads; restored below
    try:
        return wrapped(*args, **kwargs)
    finally:
        allocator.block_routing = stored


class RoutingFinishedBlocksPatch(Patch):
    """Rebuilds a finished request's routing from its blocks as they were (see module docstring)."""

    name = "routing-finished-blocks"
    fault = "R2"
    source_patched_targets = (UPDATE, RECONSTRUCT)
    fault_evidence = ("no megatron-core release up to 0.19.2 keeps a finished request's block routing "
                      "past update_requests")

    def wrappers(self) -> dict[Target, Callable]:
        return {UPDATE: _update_wrapper, RECONSTRUCT: _reconstruct_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        return (UPDATE, RECONSTRUCT, ALLOCATE)

    def needed(self) -> tuple[bool, str]:
        allocator = RECONSTRUCT.owner()
        if not hasattr(allocator, "reconstruct_routing_from_blocks"):
            return False, "no per-block routing (0.17): routing_indices are built step by step"
        return super().needed()
