"""Fault R3: the routing of a request the engine evicted and re-added is wrong (0.17) or missing (0.18+).

A request evicted because the KV pool is full (``DynamicInferenceContext.evict_overflow_paused_requests``)
is re-added later as a new entry of its ``DynamicInferenceRequestRecord`` (prompt: the original
prompt and the tokens generated so far), so its record holds two or more requests, and
``DynamicInferenceRequestRecord.merge`` builds the routing the trainer replays from all of them. It
takes a full pool, with prefix caching on or off. No release fixes it (0.19.2 is the newest); no
upstream report or change is known.

0.18 and 0.19 store MoE routing per KV block (``KVBlockAllocator.block_routing``, with
``moe_enable_routing_replay``) and rebuild a finished request's ``routing_indices`` from its blocks
in ``DynamicInferenceEngine.post_process_requests``, but only when its record holds one request:
none of an evicted request's entries gets routing, and ``merge`` returns ``None``. The re-added
request's blocks hold the whole sequence (it is prefilled again, or matched from the prefix cache,
over the original prompt and what was generated before the eviction), and ``merge`` concatenates
the entries' non-``None`` ``routing_indices`` (the earlier entries never finished, so they have
none). The fix rebuilds, after ``post_process_requests``, the routing of the last request of every
finished record with more than one request from that request's saved block IDs (the
``finished_routing_block_ids`` argument) over ``prompt + generated - 1`` tokens, as the released
code does for a record of one request. It calls the allocator's current
``reconstruct_routing_from_blocks``, so fault R2's patch (which keeps the finished blocks' routing
for the step) covers these requests too. A record of one request, a request with routing already,
and every call without routing replay are left to the released code.

0.17 builds each entry's ``routing_indices`` step by step from the tokens it forwarded, and
``merge`` concatenates every entry's: the positions an entry recomputed after its re-add appear
twice (an evicted entry's rows, then the re-added entry's rows of the same positions), so the
merged routing is longer than the request and every row after the first entry is shifted. Each
entry's rows are those of its last positions before ``prompt + generated - 1`` (a prefix-cached
entry without fault R1's patch starts past 0). The fix, after the released ``merge`` of a record of
more than one request with routing, gives each position the row of the latest entry that has it:
the last entry's rows, preceded by the rows of earlier entries for positions it lacks. With R1's
patch (which puts a matched prefix's routing in front) the last entry covers the whole sequence, so
the merged routing is exactly its ``routing_indices``. Each entry keeps its own routing (its
``serialize`` checks it against its own tokens); a record of one request and every record without
routing are left to the released code.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from .. import mcore
from ..mcore import DYNAMIC_ENGINE_MODULE, INFERENCE_REQUEST_MODULE, KV_BLOCK_ALLOCATOR_MODULE
from ..patching import Patch, Target

POST_PROCESS = Target(DYNAMIC_ENGINE_MODULE, "DynamicInferenceEngine.post_process_requests")
RECONSTRUCT = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.reconstruct_routing_from_blocks")
MERGE = Target(INFERENCE_REQUEST_MODULE, "DynamicInferenceRequestRecord.merge")  # 0.17


def routing_built_by_step() -> bool:
    """Whether the installed release builds ``routing_indices`` step by step (0.17), not from
    per-block storage when a request finishes (0.18+). Imports nothing of the engine."""
    return mcore.release_series(mcore.installed_version()) == "0.17"


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


def latest_routing(requests: list) -> torch.Tensor:
    """A record's routing with each position's row from the latest entry that forwarded it (0.17).

    Args:
        requests: a record's ``DynamicInferenceRequest`` entries, in order, each with
            ``routing_indices`` (``torch.Tensor [rows, layers, topk]``, int): the routing of its
            positions ``end - rows .. end - 1``, ``end = len(prompt_tokens) + len(generated_tokens) - 1``
            (each entry's prompt is the previous entries' sequence, so positions agree).

    Returns ``[N - first, layers, topk]`` for positions ``first .. N - 1``, ``N`` the last entry's
    ``end``: the last entry's rows, after the rows of earlier entries for the positions before it
    (``first`` is 0 unless no entry has routing from position 0).
    """
    parts, start = [], None
    for request in reversed(requests):
        rows = request.routing_indices
        end = len(request.prompt_tokens) + len(request.generated_tokens) - 1
        first = end - rows.shape[0]
        if start is None:
            parts.append(rows)
        elif first < start <= end:  # a re-added entry starts at most at the evicted one's end
            parts.append(rows[: start - first])
        else:
            continue
        start = first
        if start <= 0:
            break
    return torch.cat(parts[::-1])


def _merge_wrapper(wrapped: Callable, record: Any, args: tuple, kwargs: dict) -> Any:
    """``DynamicInferenceRequestRecord.merge``, then, for a record of several entries with routing,
    each position's routing from the latest entry that has it (0.17)."""
    merged = wrapped(*args, **kwargs)
    requests = record.requests
    if len(requests) > 1 and all(r.routing_indices is not None for r in requests):
        merged.routing_indices = latest_routing(requests)
    return merged


class RoutingEvictedRequestsPatch(Patch):
    """Gives an evicted and re-added request the routing of every token once: rebuilt from its
    blocks (0.18+), or merged from its record's latest entries (0.17; see module docstring)."""

    name = "routing-evicted-requests"
    fault = "R3"
    waits_for_import = (POST_PROCESS,)  # the engine module imports the context half-way through
    fault_evidence = ("no megatron-core release up to 0.19.2 gives a request whose record holds more "
                      "than one request the routing of each token once")

    @property
    def source_patched_targets(self) -> tuple[Target, ...]:  # the class attribute, per release
        return (MERGE,) if routing_built_by_step() else (POST_PROCESS,)

    def wrappers(self) -> dict[Target, Callable]:
        if routing_built_by_step():
            return {MERGE: _merge_wrapper}
        return {POST_PROCESS: _post_process_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        """The same three on every tree (one set of names per recorded tree): ``merge`` (wrapped on
        0.17), ``post_process_requests`` (wrapped from 0.18 on) and the per-block routing it reads
        (absent on 0.17)."""
        return (MERGE, POST_PROCESS, RECONSTRUCT)
