"""Fix 2: tokens recomputed inside hash-matched KV blocks write to the dummy block.

Block size 16. Request R1 (row 0) computes a prompt and registers its blocks; request R2 (row 1)
then matches some of them. The tests assert, for every token each ``add_request`` call adds, the
exact KV block it writes to. How many matched tokens are recomputed depends on the release:
0.17 recomputes only the last prompt token (skip capped at ``chunk - 1``); from 0.18 the >= 2-token
clamp rounds the skip down to a block boundary, recomputing a whole matched block.
Unpatched (``MEGATRON_EXT_TEST_UNPATCHED=1``) those tokens write into R1's blocks and the tests fail.
"""

from __future__ import annotations

import pytest

from .context_factory import (
    add_and_collect_writes,
    block_table,
    finish_chunk,
    make_request,
    prefix_caching_context,
)

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

P48 = list(range(1000, 1048))  # three full blocks
P32 = P48[:32]  # two full blocks


@pytest.fixture(params=["REF_ZERO", "LRU"])
def context(request, runtime_patches):
    with prefix_caching_context(request.param) as ctx:
        yield ctx


def recomputed_positions(series: str, skip_cap: int, clamp_start: int) -> range:
    """Positions of matched tokens the release recomputes: 0.17 only the last one, 0.18+ a block."""
    return range(skip_cap, skip_cap + 1) if series == "0.17" else range(clamp_start, skip_cap + 1)


def prefill_r1(ctx, tokens):
    writes = add_and_collect_writes(ctx, make_request(1, tokens))
    table = block_table(ctx, 0, len(tokens) // 16)
    assert writes == [(p, table[p // 16]) for p in range(len(tokens))]  # first-time: own blocks
    return table


def test_fully_matched_prompt_that_fills_its_blocks(context, mcore_series):
    a0, a1 = prefill_r1(context, P32)
    dummy = context.kv_block_allocator.dummy_block_idx
    writes = add_and_collect_writes(context, make_request(2, P32))
    assert block_table(context, 1, 2) == [a0, a1]  # reads still come from the matched blocks
    assert writes == [(p, dummy) for p in recomputed_positions(mcore_series, 31, 16)]


def test_prompt_one_token_longer_than_matched_blocks(context, mcore_series):
    a0, a1 = prefill_r1(context, P32)
    dummy = context.kv_block_allocator.dummy_block_idx
    writes = add_and_collect_writes(context, make_request(2, P32 + [5000]))
    b0, b1, own = block_table(context, 1, 3)
    assert (b0, b1) == (a0, a1)
    assert own not in (a0, a1, dummy)
    recomputed = [] if mcore_series == "0.17" else [(p, dummy) for p in range(16, 32)]
    assert writes == recomputed + [(32, own)]


def test_partial_match_writes_new_tokens_to_own_blocks(context):
    a0, a1 = prefill_r1(context, P32)
    dummy = context.kv_block_allocator.dummy_block_idx
    prompt = P32[:16] + list(range(2000, 2021))  # first block shared, then 21 new tokens
    writes = add_and_collect_writes(context, make_request(2, prompt))
    b0, own1, own2 = block_table(context, 1, 3)
    assert b0 == a0
    assert {own1, own2}.isdisjoint({a0, a1, dummy})
    assert writes == [(p, own1) for p in range(16, 32)] + [(p, own2) for p in range(32, 37)]


@pytest.mark.parametrize("shared_blocks", [3, 2], ids=["all-matched", "two-of-three-matched"])
def test_chunked_prefill_whose_chunks_split_matched_blocks(context, mcore_series, shared_blocks):
    r1_table = prefill_r1(context, P48[: 16 * shared_blocks])
    dummy = context.kv_block_allocator.dummy_block_idx
    prompt = P48[: 16 * shared_blocks] + list(range(3000, 3000 + 48 - 16 * shared_blocks))
    r2 = make_request(2, prompt)

    # Chunk 1: tokens 0..23 cover matched blocks 0 and 1; matched token 23 (0.17) or 16..23
    # (0.18+, clamp) is recomputed and must not land in R1's block 1.
    chunk_1 = add_and_collect_writes(context, r2, 24)
    assert chunk_1 == [(p, dummy) for p in recomputed_positions(mcore_series, 23, 16)]
    finish_chunk(context, r2, 24)

    # Chunk 2: tokens 24..31 still fall in matched block 1 (matched during chunk 1); tokens
    # 32..47 fall in block 2, matched now (all-matched) or the request's own (two-of-three).
    chunk_2 = add_and_collect_writes(context, r2, 24)
    table = block_table(context, 1, 3)
    assert table[:shared_blocks] == r1_table[:shared_blocks]
    block_2 = dummy if shared_blocks == 3 else table[2]
    if shared_blocks == 2:
        assert block_2 not in (*r1_table, dummy)
    assert chunk_2 == [(p, dummy) for p in range(24, 32)] + [(p, block_2) for p in range(32, 48)]
