"""Fault H5 (issue 22): with chunked prefill, 0.17/0.18 count Mamba matches over the whole prompt.

For a hybrid (Mamba + attention) model with prefix caching, the engine's scheduler sets
``req._mamba_num_matched_blocks = DynamicInferenceEngine._find_mamba_match_count(req)`` before it
admits a request: the farthest block of the *whole prompt* whose hash has a cached Mamba state.
``DynamicInferenceContext._compute_prefix_match`` matches KV blocks only *within the chunk* it is
given (``_find_kv_match_count(req, already_allocated_blocks, overall_required_blocks)``) and
asserts ``num_mamba_matched <= num_matched``. When chunked prefill gives a request's first chunk
fewer blocks than its cached Mamba prefix (a long shared prefix, a small token budget), that
assertion fails inside ``add_request``: ``AssertionError: Mamba match (3) > KV match (2)`` and the
engine step dies.

The fix mirrors Megatron-LM #4758 (2026-06-22, released in 0.19.0): the Mamba match is counted by
the context in the same block range as the KV match, the farthest block among the chunk's
KV-matched blocks whose hash has a cached Mamba state. Here the released ``_compute_prefix_match``
is given that count through the attribute it reads (``_mamba_num_matched_blocks``, which #4758
also keeps, recording the chunk-local count on the request); the engine's whole-prompt count is
overwritten on the request's first chunk, the only one that reads it.
"""

from __future__ import annotations

from typing import Any, Callable

from ..mcore import DYNAMIC_CONTEXT_MODULE
from ..guards import Guarded
from ..patching import Patch, Target

COMPUTE_PREFIX_MATCH = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext._compute_prefix_match")
# Relied on: the KV match the released _compute_prefix_match computes, same arguments.
FIND_KV_MATCH = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext._find_kv_match_count")

#: The attribute ``_compute_prefix_match`` reads the Mamba match count from (0.17, 0.18, and 0.19's
#: ``record_mamba_match``).
MAMBA_MATCH_ATTR = "_mamba_num_matched_blocks"


def mamba_match_in_chunk(context: Any, req: Any, prefill_chunk_length: int) -> int:
    """The Mamba match count of a request's first chunk, in the chunk's KV-matched blocks.

    Args:
        context: a hybrid ``DynamicInferenceContext`` with a Mamba prefix cache
            (``mamba_slot_allocator`` not None).
        req: a ``DynamicInferenceRequest`` that has not begun its prefill
            (``finished_chunk_token_count == 0``).
        prefill_chunk_length: tokens of the chunk being matched (the prompt's first ones).

    Returns ``i + 1`` for the farthest block ``i`` among the chunk's KV-matched blocks
    (``_find_kv_match_count(req, 0, ceil(chunk / block))``, the released function's own call) whose
    hash is in ``mamba_slot_allocator.hash_to_block_id``; 0 when there is none. Never more than
    the KV match, so the released assertion holds.
    """
    blocks = -(-prefill_chunk_length // context.block_size_tokens)
    matched, _ = context._find_kv_match_count(req, 0, blocks)
    mamba_map = context.mamba_slot_allocator.hash_to_block_id
    hashes = req.precomputed_block_hashes
    for i in range(len(matched) - 1, -1, -1):
        if hashes[i] in mamba_map:
            return i + 1
    return 0


def _compute_prefix_match_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict):
    """``_compute_prefix_match(req, prefill_chunk_length)`` of a hybrid context (guarded:
    ``is_hybrid_model``) with the chunk's own Mamba match."""
    req = kwargs["req"] if "req" in kwargs else args[0]
    if (
        context.enable_prefix_caching
        and getattr(context, "mamba_slot_allocator", None) is not None
        and req.finished_chunk_token_count == 0  # the only chunk that reads the Mamba match
    ):
        chunk = kwargs["prefill_chunk_length"] if "prefill_chunk_length" in kwargs else args[1]
        setattr(req, MAMBA_MATCH_ATTR, mamba_match_in_chunk(context, req, chunk))
    return wrapped(*args, **kwargs)


class MambaMatchInChunkPatch(Patch):
    """Counts a hybrid request's Mamba match within its first chunk, 0.17/0.18 (module docstring)."""

    name = "mamba-match-in-chunk"
    fault = "H5"

    def wrappers(self) -> dict[Target, Guarded]:
        return {COMPUTE_PREFIX_MATCH: Guarded(_compute_prefix_match_wrapper, "is_hybrid_model")}

    def checked_functions(self) -> tuple[Target, ...]:
        return (COMPUTE_PREFIX_MATCH, FIND_KV_MATCH)

    def needed(self) -> tuple[bool, str]:
        """#4758 moved the Mamba match into the context (0.19.0, and the source patches here)."""
        context_class = COMPUTE_PREFIX_MATCH.owner()
        if "_find_mamba_match_count" in vars(context_class):
            return False, ("DynamicInferenceContext has _find_mamba_match_count: the Mamba match is "
                           "counted within the chunk's KV match (#4758)")
        return True, ("the Mamba match count is the engine's whole-prompt one "
                      "(DynamicInferenceEngine._find_mamba_match_count): chunked prefill fails "
                      "'Mamba match > KV match'")
