"""Fault H8 (issue 22): a hybrid request's later prefill chunk skips KV-matched tokens its Mamba
layers never see.

``DynamicInferenceContext._compute_prefix_match`` (0.17.0 to 0.19.2, and Megatron-LM main as of
2026-08-22) sets a chunk's skip from its KV match (``min(matched blocks * block, chunk - 1)`` when
the chunk starts on a block boundary) and, for a hybrid model, replaces it by the Mamba match only
on the first chunk (``finished == 0``): "continuation chunks already had Mamba state restored
during the first chunk". But a continuation chunk can match KV blocks too (another request's
cached blocks beyond where the first chunk ended), and ``add_request`` restores Mamba state only on
the first chunk. The skip is kept: attention reads the matched KV, while the Mamba layers continue
from the state at the end of the previous chunk straight to the first computed token, as if the
skipped tokens were not in the prompt. The request's output differs from caching off (no error).
Reached with chunked prefill when a request's first chunk ends before its KV match does (its token
budget is shared with other requests of the step).

No upstream fix to mirror. The fix: a hybrid request's continuation chunk skips nothing (there is no
Mamba state to restore there); the chunk's effective length grows by the dropped skip. The engine
sizes continuation chunks without a skip (its token budget already covers the whole chunk), and
the recomputed tokens' KV writes inside matched blocks go to the dummy block (fix 2,
``matched-block-writes``).
"""

from __future__ import annotations

from typing import Any, Callable

from ..mcore import DYNAMIC_CONTEXT_MODULE
from ..guards import Guarded
from ..patching import Patch, Target

COMPUTE_PREFIX_MATCH = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext._compute_prefix_match")
# Relied on: add_request restores Mamba state only when finished_chunk_token_count == 0.
ADD_REQUEST = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.add_request")


def _compute_prefix_match_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict):
    """``_compute_prefix_match(req, prefill_chunk_length, ...)`` of a hybrid context (guarded:
    ``is_hybrid_model``); returns the released 6-tuple, with
    ``prefix_skip_tokens`` 0 and ``effective_prefill_chunk_length`` the whole chunk for a hybrid
    request's continuation chunk (``req.finished_chunk_token_count > 0``)."""
    result = wrapped(*args, **kwargs)
    matched, from_pool, allocated, required, skip, effective = result
    if skip == 0:
        return result
    req = kwargs["req"] if "req" in kwargs else args[0]
    if req.finished_chunk_token_count == 0:  # the first chunk's skip comes with a Mamba restore
        return result
    return matched, from_pool, allocated, required, 0, effective + skip


class MambaContinuationSkipPatch(Patch):
    """A hybrid request's later prefill chunks skip nothing (see module docstring)."""

    name = "mamba-continuation-skip"
    fault = "H8"
    source_patched_targets = (COMPUTE_PREFIX_MATCH,)
    fault_evidence = ("_compute_prefix_match keeps the KV skip of a hybrid request's continuation chunk, "
                      "and add_request restores Mamba state on the first chunk only")
    # without fix 2 the tokens this fix recomputes inside matched blocks write KV into shared blocks
    requires = ("matched-block-writes",)

    def wrappers(self) -> dict[Target, Guarded]:
        return {COMPUTE_PREFIX_MATCH: Guarded(_compute_prefix_match_wrapper, "is_hybrid_model")}

    def checked_functions(self) -> tuple[Target, ...]:
        return (COMPUTE_PREFIX_MATCH, ADD_REQUEST)
