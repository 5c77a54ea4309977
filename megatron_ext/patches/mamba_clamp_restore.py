"""Fault H1 (issue 22): the >= 2-token clamp skips a hybrid prefix whose Mamba state is not cached.

``DynamicInferenceContext._compute_prefix_match`` (0.18, 0.19, and Megatron-LM main as of
2026-08-22) first picks a hybrid request's skip from its Mamba match: the farthest matched block
with a cached Mamba state, or a back-off to an earlier one. Then it keeps the prefill chunk at
>= 2 tokens (``prefill_chunk_length - prefix_skip_tokens < 2``) by rounding ``prefill_chunk_length
- 2`` down to a block boundary, and that boundary need not have a Mamba state. ``add_request``
then queues a restore from the block just before the skip (``matched_block_ids[skip // block -
1]``); ``MambaSlotAllocator.restore_to_live`` finds no slot for it and returns False, the request's
Mamba state is zeroed, and the skip is kept: the tokens after the skip run from a zero Mamba state
instead of the prefix's, and the request's output differs from caching off (no error). Block 16,
Mamba snapshots at tokens 32 and 48 of a 48-token prompt: a request with its first 33 tokens
matches 2 blocks, skips 32, is clamped to 16, and block 0 has no state.

No upstream fix to mirror. The fix keeps the skip consistent with what ``add_request`` restores:
after the released function, a hybrid request's first chunk whose skip ends at a matched block
without a Mamba state (``MambaSlotAllocator.has_state``, the test ``restore_to_live`` makes) backs
off to the farthest earlier matched block with one, or skips nothing; the chunk's effective
length grows by what is no longer skipped. The clamp only ever lowers the skip, so it stays
satisfied. Tokens recomputed inside matched blocks write their KV to the dummy block (fix 2,
``matched-block-writes``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from .. import mcore
from ..mcore import DYNAMIC_CONTEXT_MODULE
from ..guards import Guarded
from ..patching import Patch, Target

COMPUTE_PREFIX_MATCH = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext._compute_prefix_match")
# Relied on: add_request restores from matched_block_ids[skip // block - 1] on the first chunk,
# and restore_to_live succeeds exactly when has_state says so.
ADD_REQUEST = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.add_request")
_SLOTS = "megatron.core.inference.contexts.mamba_slot_allocator"
HAS_STATE = Target(_SLOTS, "MambaSlotAllocator.has_state")
RESTORE = Target(_SLOTS, "MambaSlotAllocator.restore_to_live")

#: The released clamp, as it reads in ``_compute_prefix_match`` (0.18.0 to 0.19.2, main).
CLAMP = "prefill_chunk_length - prefix_skip_tokens < 2"


def restorable_skip(context: Any, matched_block_ids: list[int], prefix_skip_tokens: int) -> int:
    """The longest skip, at most ``prefix_skip_tokens``, whose Mamba state can be restored.

    Args:
        context: a hybrid ``DynamicInferenceContext`` with a Mamba prefix cache.
        matched_block_ids: the KV block IDs the first chunk matched, in prompt order.
        prefix_skip_tokens: the released skip (tokens, a multiple of the block size, covered by
            ``matched_block_ids``).

    Returns ``k * block_size_tokens`` for the largest ``k <= prefix_skip_tokens // block`` whose
    block ``matched_block_ids[k - 1]`` has a Mamba state, or 0.
    """
    block = context.block_size_tokens
    slots = context.mamba_slot_allocator
    for count in range(prefix_skip_tokens // block, 0, -1):
        if slots.has_state(matched_block_ids[count - 1]):
            return count * block
    return 0


def _compute_prefix_match_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict):
    """``_compute_prefix_match(req, prefill_chunk_length)`` of a hybrid context (guarded:
    ``is_hybrid_model``); returns the released 6-tuple with ``prefix_skip_tokens`` and
    ``effective_prefill_chunk_length`` made restorable."""
    result = wrapped(*args, **kwargs)
    matched, from_pool, allocated, required, skip, effective = result
    req = kwargs["req"] if "req" in kwargs else args[0]
    if (
        skip == 0
        or getattr(context, "mamba_slot_allocator", None) is None
        or req.finished_chunk_token_count != 0  # later chunks restore nothing
    ):
        return result
    restorable = restorable_skip(context, matched, skip)
    if restorable == skip:
        return result
    return matched, from_pool, allocated, required, restorable, effective + skip - restorable


def has_clamp(compute_prefix_match: Callable) -> bool:
    """Whether ``_compute_prefix_match`` carries the >= 2-token clamp (0.18+; 0.17 has none)."""
    return CLAMP in inspect.getsource(compute_prefix_match)


class MambaClampRestorePatch(Patch):
    """Keeps a hybrid request's skip on a block with a Mamba state (see module docstring)."""

    name = "mamba-clamp-restore"
    fault = "H1"
    # 0.17's series has no H1 patch (no clamp to fix): its source-patched fingerprint is the code
    # after its series (H5, H8), so a source-patched 0.17 tree says "not needed" too
    source_patched_targets = (COMPUTE_PREFIX_MATCH,)
    fault_evidence = ("_compute_prefix_match rounds a hybrid skip down to a block boundary (the "
                      ">= 2-token clamp) without checking that the block has a Mamba state")
    # without fix 2 the tokens this fix recomputes inside matched blocks write KV into shared blocks
    requires = ("matched-block-writes",)

    def wrappers(self) -> dict[Target, Guarded]:
        return {COMPUTE_PREFIX_MATCH: Guarded(_compute_prefix_match_wrapper, "is_hybrid_model")}

    def checked_functions(self) -> tuple[Target, ...]:
        return (COMPUTE_PREFIX_MATCH, ADD_REQUEST, HAS_STATE, RESTORE)

    def needed(self) -> tuple[bool, str]:
        """Not needed on source-patched code, nor on 0.17 (its ``_compute_prefix_match`` has no
        clamp, :func:`has_clamp`); elsewhere a changed function is refused by its fingerprint."""
        needed, evidence = super().needed()
        if needed and mcore.release_series(mcore.installed_version()) == "0.17":
            return False, "0.17's _compute_prefix_match has no >= 2-token clamp: the skip is the Mamba match's"
        return needed, evidence
