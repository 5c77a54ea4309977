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

import torch

from ..mcore import DYNAMIC_CONTEXT_MODULE
from ..patching import Patch, Target, fingerprint

ADD_REQUEST = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.add_request")
COMPUTE_PREFIX_MATCH = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext._compute_prefix_match")

#: Attribute kept on each request: the positions in its block table (0-based block indices)
#: that it got from a hash match, accumulated over the chunks of a chunked prefill.
MATCHED_POSITIONS_ATTR = "_megatron_ext_matched_block_positions"

# Recorded from the released wheels with scripts/record_fingerprints.py.
_V017 = {
    "DynamicInferenceContext.add_request": "8ac0ab32824d8700",
    "DynamicInferenceContext._compute_prefix_match": "5d401f2688102ce6",
}
_V018 = {
    "DynamicInferenceContext.add_request": "0babd74ab35ee1e0",
    "DynamicInferenceContext._compute_prefix_match": "e81b818b7e132741",
}
_V019 = {
    "DynamicInferenceContext.add_request": "534c2a2ae3b4f713",
    "DynamicInferenceContext._compute_prefix_match": "d840974b34a6f732",
}
FINGERPRINTS = {
    "0.17.0": _V017,
    "0.17.1": _V017,
    "0.18.0": _V018,
    "0.18.2": _V018,
    "0.19.0": _V019,
    "0.19.2": _V019,
}


#: ``add_request`` after the source patch of ``patches/`` (scripts/record_fingerprints.py
#: --source-patched): code that already has the fix, so the runtime patch is not needed.
SOURCE_PATCHED_FINGERPRINTS = {
    "0.17.0": "7c708c069d6a87a9",
    "0.17.1": "7c708c069d6a87a9",
    "0.18.0": "94fea459285700b8",
    "0.18.2": "94fea459285700b8",
    "0.19.0": "b38d4e85147ba316",
    "0.19.2": "b38d4e85147ba316",
}


def matched_block_positions(req: Any, finished_tokens: int) -> set[int]:
    """The request's set of hash-matched block-table positions, reset when its prefill restarts.

    Args:
        req: a ``DynamicInferenceRequest``.
        finished_tokens: ``req.finished_chunk_token_count`` before this ``add_request`` call; 0
            means a first chunk (a new request, or an evicted one added again from scratch).
    """
    positions = req.__dict__.get(MATCHED_POSITIONS_ATTR)
    if positions is None or finished_tokens == 0:
        positions = set()
        req.__dict__[MATCHED_POSITIONS_ATTR] = positions
    return positions


def redirect_matched_block_writes(
    context: Any, first_token: int, end_token: int, matched_positions: set[int]
) -> int:
    """Point the KV writes of tokens ``[first_token, end_token)`` that fall in matched blocks at the dummy block.

    Args:
        context: the ``DynamicInferenceContext`` the tokens were just added to.
        first_token, end_token: the token slots ``add_request`` filled (active-token indices).
        matched_positions: block-table positions of the request obtained from a hash match.

    Only ``token_to_block_idx[first_token:end_token]`` (int64) changes, in place, on whatever
    device the bookkeeping lives on. Returns the number of redirected tokens.
    """
    if not matched_positions or end_token <= first_token:
        return 0
    block_positions = (
        context.token_to_position_in_request[first_token:end_token] // context.block_size_tokens
    )
    matched = torch.tensor(sorted(matched_positions), device=block_positions.device)
    in_matched_block = torch.isin(block_positions, matched.to(block_positions.dtype))
    context.token_to_block_idx[first_token:end_token].masked_fill_(
        in_matched_block, context.kv_block_allocator.dummy_block_idx
    )
    return int(in_matched_block.sum())


def _add_request_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict) -> None:
    """wrapt wrapper around ``add_request(req, prefill_chunk_length=None)``."""
    if not context.enable_prefix_caching:
        return wrapped(*args, **kwargs)
    req = kwargs["req"] if "req" in kwargs else args[0]
    finished = req.finished_chunk_token_count
    first_token = context.active_token_count
    matched_before = context.prefix_cache_blocks_matched
    wrapped(*args, **kwargs)
    # add_request matched blocks at block-table positions [already_allocated, +newly_matched).
    newly_matched = context.prefix_cache_blocks_matched - matched_before
    already_allocated = -(-finished // context.block_size_tokens)
    positions = matched_block_positions(req, finished)
    positions.update(range(already_allocated, already_allocated + newly_matched))
    redirect_matched_block_writes(context, first_token, context.active_token_count, positions)


class MatchedBlockWritesPatch(Patch):
    """Wraps ``DynamicInferenceContext.add_request`` (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "matched-block-writes"
        self.title = "recomputed tokens in hash-matched KV blocks write to the dummy block"
        self.upstream = "Megatron-LM main 2026-08-26 (matched blocks are read-only); no release yet"
        self.fingerprints = FINGERPRINTS

    def wrappers(self) -> dict[Target, Callable]:
        return {ADD_REQUEST: _add_request_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        return (ADD_REQUEST, COMPUTE_PREFIX_MATCH)

    def needed(self) -> tuple[bool, str]:
        """Not needed only where ``add_request`` is megatron-ext's source-patched code."""
        found = fingerprint(ADD_REQUEST.original())
        releases = [r for r, fixed in SOURCE_PATCHED_FINGERPRINTS.items() if fixed == found]
        if releases:
            return False, (f"add_request fingerprint {found} is the source-patched code of "
                           f"patches/ for {', '.join(releases)}")
        return True, "no megatron-core release up to 0.19.2 carries the upstream fix"
