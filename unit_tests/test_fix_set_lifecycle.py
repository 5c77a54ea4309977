"""The fix set with allocators that outlive ``apply()`` / ``revert()`` (issue 20, section 2).

LRU on 0.17/0.18 keeps the prefix forest (``block_parent_id``, ``block_child_count``) beside the
allocator. Blocks registered, deregistered or evicted by the released code while the patch is not
applied leave those tables wrong; at the allocator's first call after ``apply()`` the tables are
remade: cached blocks whose links are unknown are deregistered, live blocks linked from their block
tables. Before that change the triggers here failed on 0.17.1 and 0.18.2 (``PrefixForestError``,
``KeyError`` in ``_find_kv_match_count``, an inference-tensor ``RuntimeError``); 0.19's own forest
lives inside its allocator and passes them unpatched.
"""

from __future__ import annotations

import pytest
import torch

import megatron_ext
from megatron_ext.patches.lru_leaf_first_eviction import takes_parent_hashes

from .allocator_factory import free_ids, make_allocator
from .context_factory import make_request
from .test_lru_faults import A, B, C, cached, four_block_lru_context, retire_all, step, table

# Test stand-in allocators have 7 usable blocks (0-6) and the dummy block 7.


@pytest.fixture(autouse=True)
def clean_patches():
    megatron_ext.revert()
    yield
    megatron_ext.revert()


def register(allocator, blocks: list[int], hashes: list[int]) -> None:
    """Register ``blocks`` as one prefix chain (parents passed where the code takes them)."""
    if takes_parent_hashes():
        allocator.register_kv_block_hashes(blocks, hashes, [0, *hashes[:-1]])
    else:  # 0.17/0.18 released code: no parents
        allocator.register_kv_block_hashes(blocks, hashes)


def chain(allocator, hashes: list[int]) -> list[int]:
    """Allocate one block per hash, register them as one prefix chain, release them (cached)."""
    blocks = allocator.allocate_memory_blocks(len(hashes)).tolist()
    register(allocator, blocks, hashes)
    allocator.release_memory_blocks(torch.tensor(blocks))
    return blocks


def test_reapply_after_revert_with_a_live_allocator_keeps_the_forest_whole():
    megatron_ext.apply()
    allocator = make_allocator("LRU")
    parent, child = chain(allocator, [11, 22])
    megatron_ext.revert()
    assert allocator.evict_lru_blocks(2)  # the released eviction: the tables never hear of it
    megatron_ext.apply()
    again = allocator.allocate_memory_blocks(2).tolist()
    assert parent in again  # the parent's ID comes back
    register(allocator, [parent], [33])  # now a root
    allocator.release_memory_blocks(torch.tensor(again))
    assert allocator.evict_lru_blocks(1)  # before: PrefixForestError, 0 evictable leaves
    assert allocator.kv_hash_to_block_id == {}
    assert allocator.block_child_count.tolist() == [0] * 8
    assert allocator.block_parent_id.tolist() == [-1] * 8
    assert free_ids(allocator) == list(range(7))


def test_a_chain_cached_before_apply_is_never_served_without_its_parent():
    with four_block_lru_context() as ctx:
        step(ctx, (1, A))  # unpatched: blocks [2, 3] cached as a chain with no parent links
        assert sorted(cached(ctx)) == [2, 3]
        megatron_ext.apply()
        step(ctx, (2, C))  # the first call after apply: the unlinked chain is dropped, not served
        step(ctx, (3, B))  # needs two blocks: evicts
        step(ctx, (4, A))  # before: evicting the parent first left the child; KeyError here
        allocator = ctx.kv_block_allocator
        parents = allocator.block_parent_id.tolist()
        for block in cached(ctx):  # every cached block's parent is cached or it is a root
            assert parents[block] == -1 or parents[block] in cached(ctx)


def test_tables_first_made_inside_inference_mode_take_registrations_outside_it():
    allocator = make_allocator("LRU")
    chain(allocator, [11])  # cached by the released code
    megatron_ext.apply()  # the allocator predates apply(): its tables are made at its first call
    with torch.inference_mode():
        assert allocator.evict_lru_blocks(1)  # the tables are made here (0.17/0.18)
    assert allocator.kv_hash_to_block_id == {}
    blocks = allocator.allocate_memory_blocks(2).tolist()
    register(allocator, blocks, [33, 44])  # before: "Inplace update to inference tensor outside InferenceMode"
    assert allocator.block_parent_id[blocks[1]].item() == blocks[0]
    assert allocator.block_child_count[blocks[0]].item() == 1


def test_live_blocks_keep_their_links_through_revert_and_apply(monkeypatch):
    # fault 8's patch left out: under it apply() after revert() counts as a weight update and A's
    # live blocks lose their hashes (test_weight_update_invalidation.py); the links are fix 3's
    monkeypatch.setenv("MEGATRON_EXT_ON_WEIGHT_UPDATE", "keep")
    with four_block_lru_context() as ctx:
        megatron_ext.apply()
        ctx.add_request(make_request(1, A))  # row 0 holds [2, 3], registered as a chain
        megatron_ext.revert()
        megatron_ext.apply()
        ctx.add_request(make_request(2, C))  # the first call after apply, A still live: relinked
        assert table(ctx, 1, row=1) == [1]
        allocator = ctx.kv_block_allocator
        assert allocator.block_parent_id[3].item() == 2 and allocator.block_child_count[2].item() == 1
        retire_all(ctx)
        assert sorted(cached(ctx)) == [1, 2, 3]
        assert allocator.evict_lru_blocks(2)  # leaves 1 and 3 (ties to the lower ID); never 2 before 3
        assert sorted(cached(ctx)) == [2]
