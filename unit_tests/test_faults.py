"""Faults inside a patched add_request leave the books as they were (issue: reliability)."""

from __future__ import annotations

import pytest

from megatron_ext import mcore
from megatron_ext.patches.matched_block_writes import MATCHED_POSITIONS_ATTR

from .context_factory import add_and_collect_writes, make_request, prefix_caching_context

P32 = list(range(1000, 1032))


def books(ctx) -> tuple:
    allocator = ctx.kv_block_allocator
    return (
        allocator.block_ref_counts.tolist(),
        dict(allocator.kv_hash_to_block_id),
        sorted(allocator.block_bag[: allocator.total_avail].tolist()),
        ctx.total_request_count,
        ctx.active_token_count,
    )


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_allocation_failure_in_patched_add_request_changes_nothing(runtime_patches, monkeypatch, policy):
    overflow = mcore.import_module(mcore.DYNAMIC_CONTEXT_MODULE).BlockOverflowError
    with prefix_caching_context(policy) as ctx:
        add_and_collect_writes(ctx, make_request(1, P32))
        before = books(ctx)
        second = make_request(2, P32 + list(range(2000, 2040)))  # matches 2 blocks, needs 3 more
        allocator = ctx.kv_block_allocator
        monkeypatch.setattr(allocator, "allocate_memory_blocks", lambda n: None)
        with pytest.raises(overflow):
            ctx.add_request(second)
        assert books(ctx) == before
        assert MATCHED_POSITIONS_ATTR not in second.__dict__
        monkeypatch.undo()
        # The same request is admitted afterwards, and its recomputed tokens still avoid R1's blocks.
        writes = add_and_collect_writes(ctx, second)
        shared = set(ctx.request_to_kv_block_ids[0][:2].tolist())
        assert not shared & {block for _, block in writes}
