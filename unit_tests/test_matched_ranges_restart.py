"""Fix 2 (runtime patch, or source patch with MEGATRON_EXT_TEST_SOURCE_PATCHED=1)
on a request restarted after eviction: its matched ranges from the first attempt must be dropped,
so that the restarted prefill, which matches nothing (REF_ZERO deregistered the blocks), writes
every token into its own blocks."""

from __future__ import annotations

import torch

from .context_factory import add_and_collect_writes, block_table, finish_chunk, make_request, prefix_caching_context

P48 = list(range(1000, 1048))


def test_restarted_request_drops_its_matched_ranges(runtime_patches):
    with prefix_caching_context("REF_ZERO") as ctx:
        dummy = ctx.kv_block_allocator.dummy_block_idx
        add_and_collect_writes(ctx, make_request(1, P48))  # R1, row 0: registers 3 blocks
        r2 = make_request(2, P48[:32] + list(range(3000, 3016)))
        full_prompt = r2.remaining_prompt_tokens
        first = add_and_collect_writes(ctx, r2, 24)  # matches R1's blocks 0 and 1
        assert ctx.prefix_cache_blocks_matched == 2 and {b for _, b in first} <= {dummy}
        finish_chunk(ctx, r2, 24)
        # Both requests evicted: every block released, REF_ZERO deregisters them all.
        ctx.release_memory_blocks_from_request_indexes(torch.arange(2))
        ctx.total_request_count = ctx.active_token_count = ctx.num_prefill_requests = 0
        assert not ctx.kv_block_allocator.kv_hash_to_block_id
        r2.finished_chunk_token_count = 0  # restarted from scratch
        r2.remaining_prompt_tokens = full_prompt
        writes = add_and_collect_writes(ctx, r2)
        table = block_table(ctx, 0, 3)
        assert ctx.prefix_cache_blocks_matched == 2  # nothing matched this time
        assert writes == [(p, table[p // 16]) for p in range(48)]
        assert dummy not in table
