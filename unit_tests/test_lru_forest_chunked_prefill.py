"""Leaf-first's block-table links (scalar writes through NumPy views) under
chunked prefill: chunks ending inside blocks, so a chunk's registration starts at the previous
chunk's partial block, and a second request matching part of the first one's blocks in its second
chunk. Expected books: each registered block's parent is the entry before it in its table."""

from __future__ import annotations

from megatron_ext.cpu_backend import cuda_on_cpu
from megatron_ext.harness.factories import small_prefix_caching_context

from .context_factory import BLOCK, finish_chunk, make_request
from .test_lru_faults import KV_BYTES_PER_BLOCK, forest, table


def chunked(ctx, req, sizes):
    for k, size in enumerate(sizes):
        ctx.add_request(req, size)
        if k + 1 < len(sizes):
            finish_chunk(ctx, req, size)


def test_chunked_registrations_link_to_table_predecessors(runtime_patches_either_order):
    if not runtime_patches_either_order:
        return  # unpatched: no forest
    p1 = list(range(10_000, 10_000 + 5 * BLOCK))
    p2 = p1[: 3 * BLOCK] + list(range(20_000, 20_000 + 3 * BLOCK))
    with cuda_on_cpu():
        ctx = small_prefix_caching_context(
            "LRU", block_size_tokens=BLOCK, buffer_size_gb=64 * KV_BYTES_PER_BLOCK / 2**30,
            max_requests=8, max_tokens=2048, max_sequence_length=2048,
        )
        if not hasattr(ctx.kv_block_allocator, "block_parent_id"):
            return
        ctx.prefix_cache_lru_clock += 1
        r1, r2 = make_request(1, p1), make_request(2, p2)
        chunked(ctx, r1, [24, 24, 24, 8])
        finish_chunk(ctx, r1, 8)  # r1 done with prefill, row 0 kept
        ctx.total_request_count += 1
        chunked(ctx, r2, [20, 40, 36])
        first, second = table(ctx, 5), table(ctx, 6, row=1)
        assert second[:3] == first[:3] and not set(second[3:]) & set(first)
        alloc = ctx.kv_block_allocator
        parents, children = [-1] * alloc.total_count, [0] * alloc.total_count
        for row in (first, second):
            for parent, block in zip([-1, *row[:-1]], row):
                parents[block] = parent
        for block in set(first) | set(second):
            if parents[block] >= 0:
                children[parents[block]] += 1
        assert forest(ctx) == (parents, children)
