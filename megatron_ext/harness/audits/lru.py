"""Block-table and prefix-forest audit (faults 3-5, LRU under memory pressure).

Checked after every step, and after a step megatron-core cut short: no live block table holds
one block ID twice (fault 4: a matched block evicted and handed back as a new one); every
registered block's parent hash is registered too, else the next lookup of that prefix raises
``KeyError`` (fault 3: a parent evicted before its child); where the allocator keeps a prefix
forest (``block_child_count``, 0.19 or fix 3), each block's child count equals the registered
blocks naming it parent (fault 5: a block registered twice).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...mcore import uses_lru_prefix_caching
from .base import AuditLog, Violation


@dataclass
class LRUAudit:
    """Checks block tables, prefix chains and child counts (faults 3-5).

    Attributes:
        log: the context's :class:`AuditLog`.
    """

    log: AuditLog
    _parent_hash: dict[int, int] = field(default_factory=dict)  # block hash -> parent hash (0: root)

    def learn_parent_hashes(self, req: Any) -> None:
        """Record each block hash's parent hash from the request's chained block hashes."""
        hashes = list(getattr(req, "precomputed_block_hashes", None) or [])
        self._parent_hash.update(zip(hashes, [0] + hashes[:-1]))

    def check(self) -> None:
        """Block tables without a repeated ID, whole prefix chains, child counts that add up."""
        self._check_block_tables()
        self._check_prefix_chains()

    def _check_block_tables(self) -> None:
        ctx = self.log.context
        for row in self.log.live_rows():
            table = [b for b in self.log.block_table(row) if b >= 0]
            for block, times in Counter(table).items():
                if times > 1:
                    request_id = int(ctx.request_ids[row])
                    self.log.add(Violation("block_table", self.log.step, block, request_id,
                                           f"request {request_id}'s block table holds block {block} "
                                           f"{times} times"))

    def _check_prefix_chains(self) -> None:
        allocator = self.log.context.kv_block_allocator
        hash_map = allocator.kv_hash_to_block_id
        for block_hash, block in hash_map.items():
            parent = self._parent_hash.get(block_hash, 0)
            if parent != 0 and parent not in hash_map:
                self.log.add(Violation("prefix_chain", self.log.step, block, -1,
                                       f"cached block {block} outlived its parent block: a lookup of "
                                       "its prefix raises KeyError"))
        if not hasattr(allocator, "block_child_count") or not uses_lru_prefix_caching(allocator):
            return
        registered = [b for b, h in enumerate(allocator.block_hashes.tolist()) if h != -1]
        parent_ids = allocator.block_parent_id.tolist()
        named = Counter(parent_ids[b] for b in registered if parent_ids[b] >= 0)
        for block, counted in enumerate(allocator.block_child_count.tolist()):
            if counted != named.get(block, 0):
                self.log.add(Violation("child_count", self.log.step, block, -1,
                                       f"block {block} counts {counted} cached children but "
                                       f"{named.get(block, 0)} registered blocks name it parent: it can "
                                       "never be evicted, yet counts as evictable"))
