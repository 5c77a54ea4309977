"""Leaf-first's block-table links (scalar writes through NumPy views) under
chunked prefill: chunks ending inside blocks, so a chunk's registration starts at the previous
chunk's partial block, and a second request matching part of the first one's blocks in its second
chunk. Expected books: each registered block's parent is the entry before it in its table."""

from __future__ import annotations

import pytest

from .allocator_factory import block_count
from .context_factory import BLOCK, finish_chunk, make_request
from .test_lru_faults import forest, lru_context, predecessor_books, table

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run


def chunked(ctx, req, sizes):
    for k, size in enumerate(sizes):
        ctx.add_request(req, size)
        if k + 1 < len(sizes):
            finish_chunk(ctx, req, size)


def test_chunked_registrations_link_to_table_predecessors(runtime_patches_either_order):
    p1 = list(range(10_000, 10_000 + 5 * BLOCK))
    p2 = p1[: 3 * BLOCK] + list(range(20_000, 20_000 + 3 * BLOCK))
    with lru_context(usable_blocks=63, max_tokens=2048) as ctx:
        ctx.prefix_cache_lru_clock += 1
        r1, r2 = make_request(1, p1), make_request(2, p2)
        chunked(ctx, r1, [24, 24, 24, 8])
        finish_chunk(ctx, r1, 8)  # r1 done with prefill, row 0 kept
        ctx.total_request_count += 1
        chunked(ctx, r2, [20, 40, 36])
        first, second = table(ctx, 5), table(ctx, 6, row=1)
        assert second[:3] == first[:3] and not set(second[3:]) & set(first)
        assert forest(ctx) == predecessor_books(block_count(ctx.kv_block_allocator), [first, second])
