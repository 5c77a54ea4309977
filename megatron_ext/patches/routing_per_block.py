"""Fault R1: with prefix caching, an MoE request's ``routing_indices`` leave out its matched prefix (0.17).

With ``moe_enable_routing_replay`` the engine returns, per request, the expert IDs every token was
routed to (``routing_indices``, ``[prompt + generated - 1, moe layers, topk]``), which an RL
trainer replays in its own forward pass (rollout routing replay). megatron-core 0.17 builds them
step by step from ``TextGenerationController._router_record_bookkeeping``: each step's routing of
the tokens the step forwarded, appended by ``post_process_requests``. A prefix-cached request never
forwards the tokens of its matched blocks, so its ``routing_indices`` start at the first token it
computed: shorter than the request, and every entry shifted. A trainer replays the wrong experts
for the whole prompt, and ``DynamicInferenceRequest.serialize`` (the coordinator's and
``engine.generate``'s path) fails its assertion ``routing_indices.shape[0] == total_tokens - 1``.

Mirrors Megatron-LM PR #4301 (merged 2026-04-14, released in megatron-core 0.18.0): routing is
stored per KV block as tokens are forwarded, so a matched block carries the routing of the
request that computed it. The released 0.17 bookkeeping is kept; this patch only adds the store
and, for a request's first forward that starts after a skipped prefix, puts the prefix's stored
routing in front of what the step recorded:

- after every ``_router_record_bookkeeping`` (the context still describes the step's tokens), the
  routing of each forwarded token whose KV went to a real block (not the dummy block) is written
  at its block and offset (``block_routing``, per allocator, CPU int tensors ``[block_size_tokens,
  layers, topk]``, one per block ID: bounded by the pool);
- a request seen for the first time whose first forwarded position ``p`` is past 0 gets positions
  ``0..p-1`` from the blocks of its block table prepended. Only hash-matched blocks hold those
  positions, and a block is hash-registered only once every token in it was forwarded in its
  current allocation, so what is read was written by the request that computed the block.

Requests seen are remembered per context while they are in it (paused included). A request
evicted by the engine and added again is a new entry of its record, with routing from position 0
again (recomputed, or a matched prefix's put in front); merging the entries' routing is fault R3's
patch (``routing-evicted-requests``).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from ..mcore import KV_BLOCK_ALLOCATOR_MODULE, TEXT_GENERATION_CONTROLLER_MODULE, import_module
from ..patching import Patch, Target

RECORD = Target(TEXT_GENERATION_CONTROLLER_MODULE, "TextGenerationController._router_record_bookkeeping")

#: allocator -> block ID -> ``[block_size_tokens, layers, topk]`` routing (CPU, the recorded dtype).
_BLOCK_ROUTING: "weakref.WeakKeyDictionary[Any, dict[int, torch.Tensor]]" = weakref.WeakKeyDictionary()
#: context -> IDs of the requests in it whose routing has started.
_STARTED: "weakref.WeakKeyDictionary[Any, set[int]]" = weakref.WeakKeyDictionary()


def block_routing(allocator: Any) -> dict[int, torch.Tensor]:
    """The routing this patch stored for ``allocator``'s blocks: block ID -> ``[block_size_tokens,
    layers, topk]`` expert IDs (CPU; rows never written are 0). Empty when nothing was stored."""
    return _BLOCK_ROUTING.setdefault(allocator, {})


def store_step_routing(context: Any, routing: dict[int, torch.Tensor]) -> None:
    """Write the step's routing at each forwarded token's KV block and offset.

    Args:
        context: the ``DynamicInferenceContext`` before ``update_requests`` (its ``token_to_*``
            arrays describe the step's ``active_token_count`` tokens, in active-request order).
        routing: request ID -> ``[tokens the request forwarded this step, layers, topk]`` int
            tensor, as ``_router_record_bookkeeping`` returns it.
    """
    active = slice(context.paused_request_count, context.total_request_count)
    flat = torch.cat([routing[int(r)] for r in context.request_ids[active].tolist()]).cpu()
    count = flat.shape[0]
    blocks = context.token_to_block_idx[:count].cpu()
    offsets = context.token_to_local_position_within_kv_block[:count].cpu()
    store = block_routing(context.kv_block_allocator)
    real = blocks != context.kv_block_allocator.dummy_block_idx
    for block in torch.unique(blocks[real]).tolist():
        rows = (blocks == block).nonzero().squeeze(1)
        if block not in store:
            store[block] = flat.new_zeros((context.block_size_tokens, *flat.shape[1:]))
        store[block][offsets[rows]] = flat[rows]


def matched_prefix_routing(context: Any, row: int, length: int) -> torch.Tensor | None:
    """Stored routing of positions ``0..length-1`` of the request in context row ``row``, from the
    blocks of its block table: ``[length, layers, topk]`` (CPU); None if a block has none stored."""
    size = context.block_size_tokens
    table = context.request_to_kv_block_ids[row][: (length + size - 1) // size].tolist()
    store = block_routing(context.kv_block_allocator)
    if any(block not in store for block in table):
        return None
    return torch.cat([store[block] for block in table])[:length]


def complete_first_routing(context: Any, routing: dict[int, torch.Tensor]) -> None:
    """Prepend its matched prefix's stored routing to the routing of each request forwarded for
    the first time from a position past 0 (in place, on each entry's device and dtype)."""
    started = _STARTED.setdefault(context, set())
    active = range(context.paused_request_count, context.total_request_count)
    for row in active:
        request_id = int(context.request_ids[row])
        if request_id in started or request_id not in routing:
            continue
        started.add(request_id)
        first = int(context.request_kv_length_offsets[row])  # KV already in place: the skipped prefix
        if first == 0:
            continue
        prefix = matched_prefix_routing(context, row, first)
        if prefix is not None:
            step = routing[request_id]
            routing[request_id] = torch.cat([prefix.to(device=step.device, dtype=step.dtype), step])
    started.intersection_update(context.request_ids[: context.total_request_count].tolist())


def _record_wrapper(wrapped: Callable, controller: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper around ``_router_record_bookkeeping``; nothing to do without prefix caching."""
    routing = wrapped(*args, **kwargs)
    context = controller.inference_wrapped_model.inference_context
    if routing and context.enable_prefix_caching:
        store_step_routing(context, routing)
        complete_first_routing(context, routing)
    return routing


class RoutingPerBlockPatch(Patch):
    """Stores MoE routing per KV block and replays a matched prefix's (see module docstring)."""

    name = "routing-per-block"
    fault = "R1"
    source_patched_targets = (RECORD,)
    waits_for_import = (RECORD,)

    def wrappers(self) -> dict[Target, Callable]:
        return {RECORD: _record_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        return (RECORD,)

    def needed(self) -> tuple[bool, str]:
        allocator = import_module(KV_BLOCK_ALLOCATOR_MODULE).KVBlockAllocator
        if hasattr(allocator, "store_routing_per_block"):
            return False, "KVBlockAllocator.store_routing_per_block exists: routing is stored per KV block (0.18+)"
        return super().needed()
