"""Ref-count audit (fault 1): ref counts equal live owners, the free pool is clean, drain is complete.

After every engine step each block's ref count equals the number of live owners (block tables of
active, paused and mid-chunked-prefill requests), free IDs are unique and hold neither owners nor
hashes; at drain every block is free or cached with ref count 0.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .base import AuditLog, Violation, free_blocks


@dataclass
class RefCountAudit:
    """Checks ref counts against live owners and the free pool after each step, and the drain (fault 1).

    Attributes:
        log: the context's :class:`AuditLog`.
    """

    log: AuditLog

    def check(self, owners: Counter) -> None:
        """After a step: each block's ref count against ``owners`` (:meth:`AuditLog.owner_counts`), then the free pool."""
        allocator = self.log.context.kv_block_allocator
        ref_counts = allocator.block_ref_counts.tolist()
        for block in range(allocator.dummy_block_idx):
            if ref_counts[block] != owners.get(block, 0):
                self.log.add(Violation("ref_count", self.log.step, block, -1,
                                       f"block {block} has ref count {ref_counts[block]} but "
                                       f"{owners.get(block, 0)} live owners"))
        self._check_free_pool(owners)

    def _check_free_pool(self, owners: Counter) -> None:
        allocator = self.log.context.kv_block_allocator
        free = allocator.block_bag[: free_blocks(allocator)].tolist()
        hashes = allocator.block_hashes.tolist()
        for block, times in Counter(free).items():
            if times > 1:
                self.log.add(Violation("free_pool", self.log.step, block, -1,
                                       f"block {block} is in the free pool {times} times"))
            if owners.get(block) or hashes[block] != -1:
                self.log.add(Violation("free_pool", self.log.step, block, -1,
                                       f"free block {block} has {owners.get(block, 0)} owners and "
                                       f"hash {hashes[block]}"))

    def drain(self) -> None:
        """At drain: every block is free or cached (hashed) with ref count 0, each exactly once."""
        allocator = self.log.context.kv_block_allocator
        free = set(allocator.block_bag[: free_blocks(allocator)].tolist())
        hashes = allocator.block_hashes.tolist()
        ref_counts = allocator.block_ref_counts.tolist()
        for block in range(allocator.dummy_block_idx):
            cached = hashes[block] != -1
            if ref_counts[block] != 0 or (block in free) == cached:
                state = "free" if block in free else ("cached" if cached else "neither free nor cached")
                self.log.add(Violation("drain", self.log.step, block, -1,
                                       f"at drain block {block} is {state} with ref count "
                                       f"{ref_counts[block]}"))
