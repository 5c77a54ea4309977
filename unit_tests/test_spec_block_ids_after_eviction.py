"""Fault S1: with speculative decoding, an eviction in ``update_requests`` sends a resumed request's
pre-boundary tokens to another request's block.

Scenario (block size 8, 2 drafts: 3 tokens per decode step, a request pauses at offset >= 5; a pool
of 5 blocks, block 4 the dummy, so 4 are usable, none reserved for paused requests; max_requests 4):
E (request 1, 16 prompt tokens) holds blocks 2 and 3 (both full: hash-registered with caching on),
R (request 2, 6 tokens) block 1 and F (request 3, 4 tokens) block 0; E ends its prefill at offset 7,
R at 5. The first ``update_requests``
finishes F (block 0 free), pauses E and R (their next 3 tokens cross a block boundary), resumes R
(the right-most paused row: it gets block 0) and evicts E, whose row swaps with R's. R's tokens at
positions 6 and 7 belong in its block 1, position 8 in block 0. The released code reads E's
old last block for R's row: positions 6 and 7 go to block 3, which E no longer holds (with caching
on it stays registered under E's hash: a later request matching E's prefix reads R's KV). Fails
unpatched on every tree (``MEGATRON_EXT_TEST_UNPATCHED=1``), passes patched.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.cpu_backend import cuda_on_cpu
from megatron_ext.harness.audits.base import pool_blocks
from megatron_ext.harness.factories import prefix_caching_request, small_prefix_caching_context
from megatron_ext.patches.spec_block_ids_after_eviction import last_block_ids, route_pre_boundary_tokens

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

BLOCK = 8
DRAFTS = 2
#: bytes of one KV block of small_prefix_caching_context's model (fp32, K and V, 2 layers, 4 x 16)
BLOCK_BYTES = 4 * 2 * 2 * BLOCK * 4 * 16


def evicting_step(caching: bool) -> dict:
    """Run the scenario's prefill and first ``update_requests``; return what it left."""
    with cuda_on_cpu():
        ctx = small_prefix_caching_context(
            "LRU", block_size_tokens=BLOCK, buffer_size_gb=5 * BLOCK_BYTES / 1024**3, max_requests=4,
            max_tokens=64, max_sequence_length=64, prefix_caching=caching, num_speculative_tokens=DRAFTS)
        allocator = ctx.kv_block_allocator
        assert pool_blocks(allocator) == 5  # the dummy block and 4 usable
        for request_id, first, length in ((1, 100, 16), (2, 200, 6), (3, 300, 4)):
            ctx.add_request(prefix_caching_request(request_id, list(range(first, first + length)), BLOCK))
        tables = {int(ctx.request_ids[row]): ctx.request_to_kv_block_ids[row][:int(ctx.request_kv_block_counts[row])].tolist()
                  for row in range(ctx.total_request_count)}
        assert tables == {1: [2, 3], 2: [1], 3: [0]}
        out = ctx.update_requests(torch.tensor([1, 1, 0]), torch.tensor([1114, 1206, 1304]),
                                  torch.tensor([[2114, 2206, 2304], [3114, 3206, 3304]]))
        n = ctx.active_token_count
        return {
            "evicted": out["evict_request_ids"].tolist(),
            "rows": (ctx.paused_request_count, ctx.total_request_count),
            "request": int(ctx.request_ids[0]),
            "table": ctx.request_to_kv_block_ids[0][:int(ctx.request_kv_block_counts[0])].tolist(),
            "writes": list(zip(ctx.token_to_pos_ids[:n].tolist(), ctx.token_to_block_idx[:n].tolist())),
            "tokens": ctx.token_to_input_ids[:n].tolist(),
            "registered": sorted(getattr(allocator, "kv_hash_to_block_id", {}).values()) if caching else None,
        }


@pytest.mark.parametrize("caching", [False, True], ids=["caching off", "caching on"])
def test_resumed_request_writes_its_own_blocks_after_an_eviction(runtime_patches, caching):
    step = evicting_step(caching)
    assert step["evicted"] == [1]  # E
    assert step["rows"] == (0, 1)
    assert step["request"] == 2 and step["table"] == [1, 0]  # R resumed with block 0
    assert step["tokens"] == [1206, 2206, 3206]
    # Released code: [(6, 3), (7, 3), (8, 0)] -- block 3 was E's.
    assert step["writes"] == [(6, 1), (7, 1), (8, 0)]
    assert step["registered"] == ([2, 3] if caching else None)  # E's blocks: cached, not R's


def test_caching_off_and_on_write_the_same_blocks(runtime_patches):
    off, on = evicting_step(False), evicting_step(True)
    assert {**off, "registered": None} == {**on, "registered": None}


class _Context:
    """The fields :func:`route_pre_boundary_tokens` reads, for a step without a reorder."""

    def __init__(self):
        self.num_speculative_tokens, self.block_size_tokens = DRAFTS, BLOCK
        self.paused_request_count, self.total_request_count = 0, 2
        self.request_ids = torch.tensor([7, 9])
        # request 7 crossed (offset 5 -> 0, new block 4 after 6); request 9 did not (0 -> 3)
        self.request_last_kv_block_offset = torch.tensor([0, 3])
        self.request_last_kv_block_id = torch.tensor([4, 5])
        self.active_token_count = 6
        self.token_to_block_idx = torch.tensor([6, 6, 4, 5, 5, 5])


def test_unreordered_step_is_left_as_it_is():
    ctx = _Context()
    assert route_pre_boundary_tokens(ctx, {7: 6, 9: 5}) == 0
    assert ctx.token_to_block_idx.tolist() == [6, 6, 4, 5, 5, 5]
    assert last_block_ids(ctx) == {7: 4, 9: 5}


def test_reordered_rows_get_each_request_its_own_previous_block():
    ctx = _Context()
    ctx.token_to_block_idx = torch.tensor([3, 3, 4, 5, 5, 5])  # request 7 read another row's block 3
    assert route_pre_boundary_tokens(ctx, {7: 6, 9: 5}) == 2
    assert ctx.token_to_block_idx.tolist() == [6, 6, 4, 5, 5, 5]
