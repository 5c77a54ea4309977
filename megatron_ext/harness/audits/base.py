"""What every audit shares: the violation record, the fix each kind of violation points at, and
the log of one context (step counter, unique violations, the rows and owners of live blocks)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...patches import (LruLeafFirstEvictionPatch, LruPinBeforeAllocatePatch, LruRegisterOncePatch,
                        MambaClampRestorePatch, MatchedBlockWritesPatch, ReleaseRefcountPatch,
                        RoutingFinishedBlocksPatch, SpecBlockIdsAfterEvictionPatch, WeightUpdateInvalidationPatch)
from ...patching import fault_label


@dataclass(frozen=True)
class Violation:
    """One broken invariant.

    Attributes:
        kind: ``kv_write`` (into a block the writer matched), ``kv_write_foreign`` (into a block
            not in the writer's block table), ``ref_count``, ``free_pool``, ``drain``, ``block_table``,
            ``prefix_chain``, ``child_count``, ``stale_hit``, ``mamba_restore``, ``routing_missing`` (a
            finished MoE request got no routing, fault R2; see :data:`FAULT_OF_KIND`) or ``routing_replay``
            (replayed expert IDs stale, wrong or of other tokens; no patch, so not in :data:`FAULT_OF_KIND`).
        step: engine step (0-based) at which it was seen.
        block: the KV block ID concerned (-1: none, a ``mamba_restore`` skip with no restore attempt).
        request_id: the request concerned (``kv_write``, ``kv_write_foreign``, ``block_table``, ``stale_hit`` and
            ``mamba_restore``), else -1.
        detail: one human sentence.
    """

    kind: str
    step: int
    block: int
    request_id: int
    detail: str


#: Violation kind -> the patch whose fault it shows.
PATCH_OF_KIND = {
    "kv_write": MatchedBlockWritesPatch,
    "kv_write_foreign": SpecBlockIdsAfterEvictionPatch,
    "ref_count": ReleaseRefcountPatch, "free_pool": ReleaseRefcountPatch, "drain": ReleaseRefcountPatch,
    "block_table": LruPinBeforeAllocatePatch,
    "prefix_chain": LruLeafFirstEvictionPatch,
    "child_count": LruRegisterOncePatch,
    "stale_hit": WeightUpdateInvalidationPatch,
    "mamba_restore": MambaClampRestorePatch,
    "routing_missing": RoutingFinishedBlocksPatch,
}
#: Violation kind -> the fault it shows, as failure messages name it (``fault 2 (matched-block-writes)``).
FAULT_OF_KIND = {kind: fault_label(patch) for kind, patch in PATCH_OF_KIND.items()}


@dataclass
class AuditLog:
    """One context under audit: the current engine step and the unique violations seen so far.

    Attributes:
        context: the megatron-core ``DynamicInferenceContext``.
        step: engine step (0-based) the audits are at.
        violations: unique violations, in the order seen (a KV write violation is counted once
            per step, request and block, not once per layer or token).
    """

    context: Any
    step: int = 0
    violations: list[Violation] = field(default_factory=list)
    _seen: set[tuple] = field(default_factory=set)

    def add(self, violation: Violation) -> None:
        """Record ``violation`` unless the same kind, step, block and request was recorded already."""
        key = (violation.kind, violation.step, violation.block, violation.request_id)
        if key not in self._seen:
            self._seen.add(key)
            self.violations.append(violation)

    def count(self, *kinds: str) -> int:
        """Violations of any of ``kinds``."""
        return sum(1 for v in self.violations if v.kind in kinds)

    def live_rows(self) -> range:
        """Rows holding blocks: paused + active, plus a chunked-prefill request between chunks."""
        ctx = self.context
        end = ctx.total_request_count
        if getattr(ctx, "chunked_prefill_request_id", -1) != -1 and end < ctx.max_requests:
            if int(ctx.request_ids[end]) == ctx.chunked_prefill_request_id:
                end += 1  # update_requests leaves the chunked request's row just past the end
        return range(0, end)

    def block_table(self, row: int) -> list[int]:
        """The block IDs in ``row``'s block table (its used entries, padding included)."""
        ctx = self.context
        return ctx.request_to_kv_block_ids[row][: int(ctx.request_kv_block_counts[row])].tolist()

    def owner_counts(self) -> Counter:
        """Block ID -> number of live block tables that hold it (an owner per table entry)."""
        owners: Counter = Counter()
        for row in self.live_rows():
            owners.update(b for b in self.block_table(row) if b >= 0)
        return owners


def pool_blocks(allocator: Any) -> int:
    """Blocks in the allocator's pool, the dummy block included.

    0.17-0.19 call it ``total_count``; Megatron-LM main (since 2a75ac12c5) ``pool_size``.
    """
    return int(allocator.pool_size if hasattr(allocator, "pool_size") else allocator.total_count)


def free_blocks(allocator: Any) -> int:
    """Blocks in the allocator's free pool (``block_bag[:n]``): ``total_avail`` on 0.17-0.19,
    ``pool_avail`` on Megatron-LM main."""
    return int(allocator.pool_avail if hasattr(allocator, "pool_avail") else allocator.total_avail)
