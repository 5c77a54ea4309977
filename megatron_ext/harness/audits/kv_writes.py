"""KV write audit (faults 2 and S1): no KV write lands in a block the writing request did not allocate.

Every KV append is checked, token by token, against the writing request's own blocks. A
request's own blocks are those in its block table that it did not get from a hash match; the
audit learns which ones were matched by watching each ``add_request`` call and the allocator
calls made inside it (new block-table entries that were not freshly allocated are matched). A
write is legal if it lands in an own block or in the dummy block. A write into a block the writer
obtained by a hash match is a ``kv_write`` violation (fault 2); one into a block not in its block
table at all (another request's, or a free or cached one) is a ``kv_write_foreign`` violation: with
speculative decoding, fault S1 (an eviction reorders the rows ``update_requests`` reads a resumed
request's previous block from).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import AuditLog, Violation


@dataclass
class KVWriteAudit:
    """Checks every KV append against the writing request's own blocks (fault 2).

    Attributes:
        log: the context's :class:`AuditLog`.
        matched_blocks: request ID -> block IDs it obtained by a hash match.
        kv_writes_checked: number of (token, layer) KV writes inspected.
        kv_writes_redirected: of those, the writes that went to the dummy block (fix 2 sends
            there the KV of tokens recomputed inside blocks obtained by a hash match).
    """

    log: AuditLog
    matched_blocks: dict[int, set[int]] = field(default_factory=dict)
    kv_writes_checked: int = 0
    kv_writes_redirected: int = 0
    #: the blocks the last ``add_request`` obtained by a hash match (new block-table entries)
    last_matched: list[int] = field(default_factory=list)
    _allocated_in_call: list[int] = field(default_factory=list)

    def begin_add_request(self) -> None:
        """An ``add_request`` call starts: forget the blocks allocated by the previous one."""
        self._allocated_in_call.clear()

    def allocated(self, blocks: list[int]) -> None:
        """The allocator handed out ``blocks`` (inside the current ``add_request``)."""
        self._allocated_in_call.extend(blocks)

    def end_add_request(self, request_id: int, row: int, finished_tokens: int) -> int:
        """Remember which new block-table entries came from a hash match; return how many."""
        ctx = self.log.context
        first_new = -(-finished_tokens // ctx.block_size_tokens)  # blocks held before this chunk
        count = int(ctx.request_kv_block_counts[row])
        new_entries = ctx.request_to_kv_block_ids[row][first_new:count].tolist()
        matched = set(new_entries) - set(self._allocated_in_call)
        self.last_matched = sorted(b for b in matched if b >= 0)
        if finished_tokens == 0:  # a first chunk: a new request or one re-added after eviction
            self.matched_blocks[request_id] = set()
        self.matched_blocks.setdefault(request_id, set()).update(matched)
        return len(matched)

    def check_append(self) -> None:
        """Before a KV append: every token's target block is the writer's own or the dummy block."""
        ctx = self.log.context
        tokens = ctx.active_token_count
        view = getattr(ctx, "gpu_view", None) or ctx  # what the KV append kernel reads
        written = view.token_to_block_idx[:tokens].tolist()
        rows = ctx.token_to_request_idx[:tokens].tolist()
        dummy = ctx.kv_block_allocator.dummy_block_idx
        own_blocks: dict[int, set[int]] = {}
        for row, block in zip(rows, written):
            self.kv_writes_checked += 1
            if block == dummy:
                self.kv_writes_redirected += 1
                continue
            if row not in own_blocks:
                own_blocks[row] = self._own_blocks(row)
            if block not in own_blocks[row]:
                request_id = int(ctx.request_ids[row])
                matched = block in self.matched_blocks.get(request_id, ())
                why = "obtained by hash match" if matched else "not in its block table"
                self.log.add(Violation("kv_write" if matched else "kv_write_foreign", self.log.step, block,
                                       request_id, f"request {request_id} wrote KV into block {block}, {why}"))

    def _own_blocks(self, row: int) -> set[int]:
        request_id = int(self.log.context.request_ids[row])
        return set(self.log.block_table(row)) - self.matched_blocks.get(request_id, set())
