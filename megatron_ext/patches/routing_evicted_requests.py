"""Fault R3: a request the engine evicted and re-added finishes without routing.

megatron-core 0.18 and 0.19 store MoE routing per KV block (``KVBlockAllocator.block_routing``,
with ``moe_enable_routing_replay``) and rebuild a finished request's ``routing_indices`` from its
blocks in ``DynamicInferenceEngine.post_process_requests``, but only when the request's
``DynamicInferenceRequestRecord`` holds one request. A request evicted because the KV pool is full
(``DynamicInferenceContext.evict_overflow_paused_requests``) is re-added later as a new entry of
its record (prompt: the original prompt and the tokens generated so far), so its record holds two
or more requests and none of them gets routing: ``DynamicInferenceRequestRecord.merge`` finds no
``routing_indices`` and the trainer gets ``None`` for that rollout. It takes a full pool, with
prefix caching on or off. No release fixes it (0.19.2 is the newest); no upstream report or change
is known.

The re-added request's blocks hold the whole sequence (it is prefilled again, or matched from the
prefix cache, over the original prompt and what was generated before the eviction), and ``merge``
concatenates the records' non-``None`` ``routing_indices`` (the earlier entries never finished, so
they have none). The fix rebuilds, after ``post_process_requests``, the routing of the last request
of every finished record with more than one request from that request's saved block IDs (the
``finished_routing_block_ids`` argument) over ``prompt + generated - 1`` tokens, as the released
code does for a record of one request. It calls the allocator's current
``reconstruct_routing_from_blocks``, so fault R2's patch (which keeps the finished blocks' routing
for the step) covers these requests too. A record of one request, a request with routing already,
and every call without routing replay are left to the released code.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from ..mcore import DYNAMIC_ENGINE_MODULE, KV_BLOCK_ALLOCATOR_MODULE
from ..patching import Patch, Target

POST_PROCESS = Target(DYNAMIC_ENGINE_MODULE, "DynamicInferenceEngine.post_process_requests")
RECONSTRUCT = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.reconstruct_routing_from_blocks")


def rebuild_evicted_routing(engine: Any, finished_records: list, block_ids: dict[int, list[int]]) -> int:
    """Give the last request of each multi-request finished record its routing from its blocks.

    Args:
        engine: the ``DynamicInferenceEngine``.
        finished_records: the ``DynamicInferenceRequestRecord`` objects ``post_process_requests``
            returned; their last request's ``routing_indices`` is set in place
            (``np.ndarray [prompt + generated - 1, layers, topk]``, or ``None`` where a block has
            no routing).
        block_ids: request ID -> the KV block IDs it held before ``update_requests`` released them.

    Returns the number of requests given routing.
    """
    rebuilt = 0
    for record in finished_records:
        request = record.requests[-1]
        if len(record.requests) < 2 or request.routing_indices is not None:
            continue
        if request.request_id not in block_ids:
            continue
        total_tokens = len(request.prompt_tokens) + len(request.generated_tokens)
        request.routing_indices = engine.context.kv_block_allocator.reconstruct_routing_from_blocks(
            block_ids[request.request_id], total_tokens - 1)
        rebuilt += request.routing_indices is not None
    return rebuilt


def _post_process_wrapper(wrapped: Callable, engine: Any, args: tuple, kwargs: dict) -> Any:
    """``post_process_requests``, then the evicted requests' routing (routing replay only)."""
    result = wrapped(*args, **kwargs)
    block_ids = kwargs.get("finished_routing_block_ids")
    if block_ids is None and args:  # the engine passes it by name; by position it is the last one
        bound = inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments
        block_ids = bound.get("finished_routing_block_ids")
    if block_ids:
        rebuild_evicted_routing(engine, result[1], block_ids)
    return result


class RoutingEvictedRequestsPatch(Patch):
    """Rebuilds an evicted and re-added request's routing from its blocks (see module docstring)."""

    name = "routing-evicted-requests"
    fault = "R3"
    source_patched_targets = (POST_PROCESS,)
    waits_for_import = (POST_PROCESS,)  # the engine module imports the context half-way through
    fault_evidence = ("no megatron-core release up to 0.19.2 rebuilds the routing of a request "
                      "whose record holds more than one request")

    def wrappers(self) -> dict[Target, Callable]:
        return {POST_PROCESS: _post_process_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        return (POST_PROCESS, RECONSTRUCT)

    def needed(self) -> tuple[bool, str]:
        allocator = RECONSTRUCT.owner()
        if not hasattr(allocator, "reconstruct_routing_from_blocks"):
            return False, "no per-block routing (0.17): routing_indices are built step by step"
        return super().needed()
