"""Stale-hit audit (fault 8): no request matches a KV block cached under older weights.

The harness tells the audit when it updated the weights (:meth:`StaleHitAudit.weights_updated`:
the weight version goes up by one). The audit records, per request, the weight version at which
it was admitted from scratch (an ``add_request`` with ``finished_chunk_token_count == 0``: a new
request, or one re-added after an eviction or a RECOMPUTE resume, whose KV is all recomputed), and
per block the version of the request that registered its hash (``register_kv_block_hashes``
inside that request's ``add_request``). At every ``add_request``, each block the request obtained
by a hash match whose registration version is older than the current version is a stale hit: the
request reads KV that older weights computed, so its output differs from caching off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from .base import AuditLog, Violation


@dataclass
class StaleHitAudit:
    """Counts hash matches of blocks registered under an older weight version (fault 8).

    Attributes:
        log: the context's :class:`AuditLog`.
        version: the current weight version (0 until the first update).
        request_version: request ID -> weight version of its latest admission from scratch.
        block_version: block ID -> weight version of the request that last registered its hash.
    """

    log: AuditLog
    version: int = 0
    request_version: dict[int, int] = field(default_factory=dict)
    block_version: dict[int, int] = field(default_factory=dict)
    _adding: Optional[int] = None
    _before_call: dict[int, Optional[int]] = field(default_factory=dict)

    def weights_updated(self) -> None:
        """The harness changed the weights: blocks registered from now on carry the next version."""
        self.version += 1

    def allocator_replaced(self) -> None:
        """megatron-core built a new, empty allocator (RECOMPUTE resume): no block is registered."""
        self.block_version.clear()

    def begin_add_request(self, request_id: int, finished_tokens: int) -> None:
        """An ``add_request`` of ``request_id`` starts (``finished_tokens``: its prompt tokens
        already prefilled; 0 means it is admitted from scratch at the current version)."""
        if finished_tokens == 0:
            self.request_version[request_id] = self.version
        self._adding = request_id
        self._before_call.clear()

    def registered(self, block_ids: Iterable[int]) -> None:
        """``register_kv_block_hashes`` registered ``block_ids``: they carry the version of the
        request being added (the current version if none is, or if it was never seen admitted)."""
        version = self.request_version.get(self._adding, self.version) if self._adding is not None else self.version
        for block in block_ids:
            self._before_call.setdefault(block, self.block_version.get(block))
            self.block_version[block] = version

    def end_add_request(self, request_id: int, matched_blocks: Iterable[int]) -> int:
        """The ``add_request`` returned with ``matched_blocks`` newly obtained by a hash match;
        record each one registered under an older version as a stale hit. Returns how many."""
        self._adding = None
        hits = 0
        for block in sorted(matched_blocks):
            registered = self._before_call.get(block, self.block_version.get(block))
            if registered is None or registered >= self.version:
                continue
            hits += 1
            admitted = self.request_version.get(request_id, self.version)
            self.log.add(Violation(
                "stale_hit", self.log.step, block, request_id,
                f"request {request_id} (admitted at weight version {admitted}) matched block {block}, "
                f"cached at weight version {registered}; the weights are at version {self.version}"))
        self._before_call.clear()
        return hits
