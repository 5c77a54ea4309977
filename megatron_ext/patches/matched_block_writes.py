"""Fix 2: a request never writes KV into a block it obtained from a prefix-cache hash match.

``DynamicInferenceContext.add_request`` puts hash-matched blocks into the request's block table
and skips computing their tokens, but some of those tokens are recomputed anyway (the skip is
capped at ``prefill_chunk_length - 1``; from 0.18 a chunk is kept at >= 2 tokens by rounding the
skip down to a block boundary; Mamba back-off; a chunked prefill spreading one matched block over
two chunks). For those tokens the released code points ``token_to_block_idx`` at the shared
block, so the KV append rewrites a block other live requests read, with low bits that depend on
the batch: caching on vs off stops being bit-identical.

The fix redirects the KV writes of such tokens to the dummy block
(``kv_block_allocator.dummy_block_idx``, where padding tokens already write). Reads are unchanged:
the block table still points at the matched blocks. Because the CPU bookkeeping is corrected
before ``transfer_bookkeeping_to_gpu`` (0.18+) or in place on the GPU tensors (0.17), the plain
torch append, the Triton append kernel and CUDA-graph replay all see the corrected indices.

Mirrors the upstream change on Megatron-LM main of 2026-08-26 (matched blocks are read-only for
the request that matched them); no megatron-core release up to 0.19.2 carries it.
"""

from __future__ import annotations

from typing import Any, Callable

from ..mcore import DYNAMIC_CONTEXT_MODULE
from ..guards import Guarded
from ..patching import Patch, Target
from .request_state import RequestSideTable
from .views import cpu_view

ADD_REQUEST = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.add_request")
COMPUTE_PREFIX_MATCH = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext._compute_prefix_match")

#: Per request (beside it: ``serialize()`` copies its ``__dict__``): the token-position ranges
#: ``(start, stop)`` of the blocks it got from a hash match, one range per ``add_request`` call
#: that matched, accumulated over the chunks of a chunked prefill.
MATCHED_RANGES: RequestSideTable[list[tuple[int, int]]] = RequestSideTable()


def redirect_matched_block_writes(
    context: Any, offset: int, first_position: int, end_position: int,
    matched_ranges: list[tuple[int, int]],
) -> None:
    """Point the KV writes of just-added tokens that fall in matched blocks at the dummy block.

    Args:
        context: the ``DynamicInferenceContext`` the tokens were just added to.
        offset: active-token slot minus token position: ``add_request`` lays the added tokens out
            contiguously (an ``arange`` of positions in every release 0.17 to 0.19).
        first_position, end_position: the token positions within the request that were added,
            ``[first_position, end_position)``.
        matched_ranges: token-position ranges ``(start, stop)`` of the request's hash-matched blocks.

    Only ``token_to_block_idx`` (integer, shape ``[max_tokens]``) changes, in place, on whatever
    device the bookkeeping lives on, and only where a range overlaps the added tokens.
    """
    target = None
    for start, stop in matched_ranges:  # no max()/min() calls: this runs on every cache hit
        if start < first_position:
            start = first_position
        if stop > end_position:
            stop = end_position
        if start < stop:
            if target is None:
                target = cpu_view(context, "token_to_block_idx")
            target[start + offset : stop + offset] = context.kv_block_allocator.dummy_block_idx


def _add_request_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict) -> None:
    """Wrapper around ``add_request(req, prefill_chunk_length=None)``.

    The request's matched ranges (``MATCHED_RANGES``, beside the request: ``(start, stop)`` token
    positions, block aligned, stop exclusive) are kept across the chunks of its prefill; they are dropped
    when its prefill starts over (``finished_chunk_token_count == 0``: a new request, or an
    evicted one added again). Nothing is recorded when ``add_request`` raises (it then admitted
    nothing). It runs on every admission with prefix caching on (guarded:
    ``enable_prefix_caching``), so the common cases (nothing matched, nothing to redirect) do as
    little as possible.
    """
    req = kwargs["req"] if "req" in kwargs else args[0]
    finished = req.finished_chunk_token_count
    ranges = MATCHED_RANGES.get(req)
    if not finished and ranges is not None:  # a prefill starting over: those ranges are void
        MATCHED_RANGES.pop(req)
        ranges = None
    first_slot = context.active_token_count
    matched_before = context.prefix_cache_blocks_matched
    wrapped(*args, **kwargs)  # reads the request, changes none of what is read here
    # add_request put the newly matched blocks at block-table positions
    # [ceil(finished / block), + newly_matched) and added the chunk's last tokens, positions
    # [finished + chunk - added, finished + chunk): the matched prefix it skipped comes first.
    newly_matched = context.prefix_cache_blocks_matched - matched_before
    if newly_matched:
        block = context.block_size_tokens
        start = -(-finished // block) * block
        if ranges is None:
            ranges = MATCHED_RANGES.set(req, [])
        ranges.append((start, start + newly_matched * block))
    if ranges:
        chunk = args[1] if len(args) > 1 else kwargs.get("prefill_chunk_length")
        end_position = finished + (req.remaining_prompt_length if chunk is None else chunk)
        offset = context.active_token_count - end_position  # token position -> active-token slot
        redirect_matched_block_writes(context, offset, first_slot - offset, end_position, ranges)


class MatchedBlockWritesPatch(Patch):
    """Wraps ``DynamicInferenceContext.add_request`` (see module docstring)."""

    name = "matched-block-writes"
    fault = "2"
    source_patched_targets = (ADD_REQUEST,)
    fault_evidence = ("no megatron-core release up to 0.19.2 carries the upstream fix (#6895, on "
                      "Megatron-LM main since 2026-08-26, after d98e8a64)")

    def wrappers(self) -> dict[Target, Guarded]:
        return {ADD_REQUEST: Guarded(_add_request_wrapper, "enable_prefix_caching")}

    def checked_functions(self) -> tuple[Target, ...]:
        return (ADD_REQUEST, COMPUTE_PREFIX_MATCH)
