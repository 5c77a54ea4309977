"""Fault H9 (issue 22): chunked prefill cuts a hybrid prompt off the Mamba chunk grid.

``DynamicInferenceEngine.schedule_chunked_prefill`` (0.17.0 to 0.19.2, and Megatron-LM main outside
batch-invariant mode) gives the queue-head request whatever is left of the step's token budget
(``context.max_tokens - context.active_token_count``): a prompt that does not fit is cut at an
arbitrary token. A Mamba layer's chunked scan starts its chunk grid (``mamba_chunk_size`` tokens)
at the first token a request computes in a step, so a prompt cut at token 23 is scanned as
``[0, 16), [16, 23) | [23, 39), ...`` instead of ``[0, 16), [16, 32), ...``: the same sums in
another order, other low bits in every later token's Mamba output, in the KV the attention layers
write from it, and in the log-probs. Where the cut falls depends on what else is in the step, so a
hybrid model's outputs depend on batch composition and arrival timing, with prefix caching off too
(identical prompts admitted in one step get different log-probs). Prefix caching moves the cuts
(skipped tokens spend no budget), so caching on and off differ. 0.19's own snap of a partial chunk
to a KV block boundary (#5952, for Mamba snapshots) runs only with the Mamba prefix cache on and
only when the budget reaches a block boundary; the ">= 2-token final chunk" guard then moves the
cut one token back.

Upstream: Megatron-LM #4871 (2026-07-31, main only, "Bs invar moe") makes non-final chunks start
and end on Mamba chunk boundaries (``_mamba_batch_invariant_prefill_chunk_length``), but only in
``batch_invariant_mode``, which refuses Mamba prefix caching. This patch mirrors that rule for every
hybrid engine with chunked prefill: a chunk that does not finish its prompt ends on a multiple of
``context.mamba_chunk_size`` (prompt position), one Mamba chunk earlier if that would leave exactly
one token (#4871's rule; the released guard would move it off the grid); a request whose budget
holds no whole Mamba chunk waits for the next step. The chunk starts are then multiples of the
Mamba chunk size too (the first at 0, a prefix-cache restore at a block boundary), so with a block
size that is a multiple of it every request is scanned on the grid of an unchunked prefill.

How: the engine reads the budget after it calls ``context.check_availability(req)`` for the queue
head (0.17/0.18 in the loop, 0.19 in ``_can_schedule_chunked_prefill``). While
``schedule_chunked_prefill`` runs, the context's ``check_availability`` is shadowed
(:class:`~megatron_ext.patching.ShadowedMethod`) by one that, for a request that will be cut,
lowers ``context.max_tokens`` by the tokens past the aligned end (restored when scheduling ends:
the loop stops after a partial chunk) or reports no KV space (the engine's own way to stop
scheduling and keep the request at the queue head).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .. import mcore
from ..mcore import DYNAMIC_CONTEXT_MODULE, DYNAMIC_ENGINE_MODULE
from ..patching import Patch, ShadowedMethod, Target

SCHEDULE = Target(DYNAMIC_ENGINE_MODULE, "DynamicInferenceEngine.schedule_chunked_prefill")
# Relied on: the engine calls check_availability for the queue head before it reads the budget,
# and add_request admits the chunk length the engine derives from that budget.
CHECK_AVAILABILITY = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.check_availability")
CAN_SCHEDULE = Target(DYNAMIC_ENGINE_MODULE, "DynamicInferenceEngine._can_schedule_chunked_prefill")
COMPUTE_PREFIX_MATCH = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext._compute_prefix_match")


def aligned_chunk_end(start: int, end: int, prompt_end: int, mamba_chunk: int) -> int:
    """The end (prompt position, tokens) of a non-final prefill chunk on the Mamba chunk grid.

    Args:
        start: the chunk's first prompt position (``req.finished_chunk_token_count``).
        end: where the released scheduler ends the chunk (exclusive), ``start < end < prompt_end``.
        prompt_end: the prompt length.
        mamba_chunk: the Mamba layers' chunk size (tokens), >= 1.

    Returns the largest multiple of ``mamba_chunk`` at most ``end`` that does not leave exactly one
    prompt token for the next chunk; it is ``<= start`` when the chunk holds no whole Mamba chunk.
    """
    aligned = end // mamba_chunk * mamba_chunk
    if prompt_end - aligned == 1:
        aligned -= mamba_chunk
    return aligned


def released_chunk_end(context: Any, req: Any, skips_outside_budget: bool) -> Optional[int]:
    """Where the released ``schedule_chunked_prefill`` ends the queue head ``req``'s chunk this
    step (prompt position, exclusive), before its ">= 2-token final chunk" guard; None when the
    rest of the prompt fits the budget (a final chunk, not cut).

    ``skips_outside_budget``: False for 0.17 / 0.18, which cut the chunk's span (skipped tokens
    included) at the budget; True for 0.19, which spends the budget on computed tokens only: a first
    chunk's prefix-cache skip (``_compute_prefix_match(req, remaining)``, at most ``remaining - 1``)
    comes on top.
    """
    remaining = len(req.remaining_prompt_tokens)
    budget = context.max_tokens - context.active_token_count
    skip = 0
    if skips_outside_budget and context.enable_prefix_caching and context.chunked_prefill_request_id < 0:
        skip = min(context._compute_prefix_match(req, remaining)[4], remaining - 1)
    if remaining - skip <= budget:
        return None
    return req.finished_chunk_token_count + skip + budget


def _skips_outside_budget() -> bool:
    """Whether this release's scheduler spends the budget on computed tokens only (0.19+)."""
    return mcore.release_series(mcore.installed_version()) not in ("0.17", "0.18")


class _AlignedBudget:
    """The shadowing ``check_availability`` of one ``schedule_chunked_prefill`` call."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.skips_outside_budget = _skips_outside_budget()
        self.saved_max_tokens: Optional[int] = None

    def check_availability(self, req: Any) -> tuple[bool, bool, bool]:
        """The released ``(request, tokens, KV space)`` answer; for a request the engine would
        cut off the Mamba chunk grid, ``context.max_tokens`` lowered to the aligned end, or KV
        space False when no whole Mamba chunk fits (the request waits at the queue head)."""
        context = self.context
        answer = type(context).check_availability(context, req)
        if self.saved_max_tokens is not None:  # already lowered: the loop ends with that chunk
            return answer
        end = released_chunk_end(context, req, self.skips_outside_budget)
        if end is None:
            return answer
        start = req.finished_chunk_token_count
        prompt_end = start + len(req.remaining_prompt_tokens)
        aligned = aligned_chunk_end(start, end, prompt_end, context.mamba_chunk_size)
        if aligned <= start:
            return answer[0], answer[1], False
        self.saved_max_tokens = context.max_tokens
        context.max_tokens -= end - aligned
        return answer

    def restore(self) -> None:
        if self.saved_max_tokens is not None:
            self.context.max_tokens = self.saved_max_tokens
            self.saved_max_tokens = None


def _schedule_wrapper(wrapped: Callable, engine: Any, args: tuple, kwargs: dict) -> Any:
    """``schedule_chunked_prefill()`` with a hybrid context's partial chunks on the Mamba grid
    (module docstring); unchanged for a GPT model, and when ``max_tokens`` is at most one Mamba
    chunk (no step could hold a whole Mamba chunk plus a token; upstream asserts against it)."""
    context = engine.context
    if not context.is_hybrid_model or context.max_tokens <= context.mamba_chunk_size:
        return wrapped(*args, **kwargs)
    budget = _AlignedBudget(context)
    try:
        with ShadowedMethod(context, "check_availability", budget.check_availability):
            return wrapped(*args, **kwargs)
    finally:
        budget.restore()


class MambaAlignedChunksPatch(Patch):
    """Ends a hybrid request's non-final prefill chunks on the Mamba chunk grid (module docstring)."""

    name = "mamba-aligned-chunks"
    fault = "H9"
    source_patched_targets = (SCHEDULE,)
    fault_evidence = ("schedule_chunked_prefill cuts a prompt at the step's token budget, off the Mamba "
                      "chunk grid of a hybrid model's chunked scan")
    waits_for_import = (SCHEDULE,)

    def wrappers(self) -> dict[Target, Callable]:
        return {SCHEDULE: _schedule_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        """The same four on every tree (one set of names per recorded tree; 0.17 and 0.18 have no
        ``_can_schedule_chunked_prefill``, recorded absent)."""
        return (SCHEDULE, CHECK_AVAILABILITY, CAN_SCHEDULE, COMPUTE_PREFIX_MATCH)
