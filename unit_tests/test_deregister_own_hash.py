"""Fault 9: deregistering a block pops the hash-map entry of another block holding the same hash.

Scenario (8 blocks, block 7 is the dummy block): blocks 6 and 5 are allocated in that order and
both registered with hash H, 6 first (the older holder), so the map says ``{H: 5}`` while block 6
keeps ``block_hashes == H``. Block 4 holds its own hash G. Deregistering the older block 6 must
leave ``{H: 5}``: the released code pops the entry (block 5 becomes unreachable though cached),
so the tests that deregister the older block first fail with ``MEGATRON_EXT_TEST_UNPATCHED=1`` on
every release. The reverse order (the map's own block first) is correct in the released code too
and is checked as a regression guard. Deregistration is reached the way the engine reaches it:
REF_ZERO through the last owner's release, LRU through ``evict_lru_blocks``. Every test runs
with the runtime patches applied in ALL_PATCHES order and reversed.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.patches.deregister_own_hash import blocks_with_foreign_hash

from .allocator_factory import free_ids, make_allocator, ref_counts

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

H, G = 1_000_009, 1_000_004
OLDER, NEWER, OTHER = 6, 5, 4


class Recorder:
    """An ``on_blocks_deregistered`` callback (the Mamba slot allocator's hook) that records calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], set[int]]] = []

    def __call__(self, block_ids: list[int], hashes: set[int]) -> None:
        self.calls.append((list(block_ids), set(hashes)))


def one_hash_on_two_blocks(policy: str):
    """The allocator of the module docstring, every block held once (ref count 1), plus a recorder.

    Under LRU the allocation clock makes 6 the oldest block, then 5, then 4.
    """
    allocator = make_allocator(policy)
    allocator.on_blocks_deregistered = recorder = Recorder()
    for clock, block in enumerate((OLDER, NEWER, OTHER), start=1):
        allocator.context.prefix_cache_lru_clock = clock
        assert allocator.allocate_memory_blocks(1).tolist() == [block]
    allocator.register_kv_block_hashes([OLDER], [H])
    allocator.register_kv_block_hashes([NEWER], [H])
    allocator.register_kv_block_hashes([OTHER], [G])
    assert allocator.kv_hash_to_block_id == {H: NEWER, G: OTHER}
    assert allocator.block_hashes[[OLDER, NEWER, OTHER]].tolist() == [H, H, G]
    assert ref_counts(allocator, [OLDER, NEWER, OTHER]) == [1, 1, 1]
    assert free_ids(allocator) == [0, 1, 2, 3]
    return allocator, recorder


def release(allocator, ids: list[int]) -> None:
    allocator.release_memory_blocks(torch.tensor(ids, dtype=torch.int32))


def hashes_of(allocator) -> list[int]:
    return allocator.block_hashes[[OLDER, NEWER, OTHER]].tolist()


# -- REF_ZERO: the last owner's release deregisters ------------------------------------------

def test_ref_zero_release_of_older_holder_keeps_newer_entry(runtime_patches_either_order):
    allocator, recorder = one_hash_on_two_blocks("REF_ZERO")
    release(allocator, [OLDER])
    assert allocator.kv_hash_to_block_id == {H: NEWER, G: OTHER}
    assert hashes_of(allocator) == [-1, H, G]
    assert ref_counts(allocator, [OLDER, NEWER, OTHER]) == [0, 1, 1]
    assert free_ids(allocator) == [0, 1, 2, 3, OLDER]
    assert recorder.calls == [([OLDER], set())]
    release(allocator, [NEWER])  # the entry's own block: now it goes
    assert allocator.kv_hash_to_block_id == {G: OTHER}
    assert hashes_of(allocator) == [-1, -1, G]
    assert ref_counts(allocator, [OLDER, NEWER, OTHER]) == [0, 0, 1]
    assert free_ids(allocator) == [0, 1, 2, 3, NEWER, OLDER]
    assert recorder.calls == [([OLDER], set()), ([NEWER], {H})]


def test_ref_zero_release_of_newer_holder_first(runtime_patches_either_order):
    allocator, recorder = one_hash_on_two_blocks("REF_ZERO")
    release(allocator, [NEWER])
    assert allocator.kv_hash_to_block_id == {G: OTHER}
    assert hashes_of(allocator) == [H, -1, G]
    assert ref_counts(allocator, [OLDER, NEWER, OTHER]) == [1, 0, 1]
    assert free_ids(allocator) == [0, 1, 2, 3, NEWER]
    release(allocator, [OLDER])  # no entry left for H: nothing to pop, H reported as released
    assert allocator.kv_hash_to_block_id == {G: OTHER}
    assert hashes_of(allocator) == [-1, -1, G]
    assert ref_counts(allocator, [OLDER, NEWER, OTHER]) == [0, 0, 1]
    assert free_ids(allocator) == [0, 1, 2, 3, NEWER, OLDER]
    assert recorder.calls == [([NEWER], {H}), ([OLDER], {H})]


def test_ref_zero_release_of_older_holder_with_others_in_one_call(runtime_patches_either_order):
    """Only the foreign hash is withheld: G (own entry) goes, and so does an unhashed block."""
    allocator, recorder = one_hash_on_two_blocks("REF_ZERO")
    assert allocator.allocate_memory_blocks(1).tolist() == [3]  # unhashed (a partial block)
    release(allocator, [OLDER, OTHER, 3])
    assert allocator.kv_hash_to_block_id == {H: NEWER}
    assert hashes_of(allocator) == [-1, H, -1]
    assert ref_counts(allocator, [OLDER, NEWER, OTHER, 3]) == [0, 1, 0, 0]
    assert free_ids(allocator) == [0, 1, 2, 3, OTHER, OLDER]
    assert len(recorder.calls) == 1
    ids, dropped = recorder.calls[0]
    assert sorted(ids) == [3, OTHER, OLDER] and dropped == {G}


def test_ref_zero_release_of_both_holders_in_one_call_drops_the_entry(runtime_patches_either_order):
    allocator, recorder = one_hash_on_two_blocks("REF_ZERO")
    release(allocator, [OLDER, NEWER])
    assert allocator.kv_hash_to_block_id == {G: OTHER}
    assert hashes_of(allocator) == [-1, -1, G]
    assert ref_counts(allocator, [OLDER, NEWER, OTHER]) == [0, 0, 1]
    assert free_ids(allocator) == [0, 1, 2, 3, NEWER, OLDER]
    assert [(sorted(ids), dropped) for ids, dropped in recorder.calls] == [([NEWER, OLDER], {H})]


# -- LRU: released blocks stay cached; eviction deregisters -----------------------------------

def test_lru_eviction_of_older_holder_keeps_newer_entry(runtime_patches_either_order):
    allocator, recorder = one_hash_on_two_blocks("LRU")
    release(allocator, [OLDER, NEWER, OTHER])  # all cached (ref count 0, hashed)
    assert free_ids(allocator) == [0, 1, 2, 3]
    assert allocator.evict_lru_blocks(1)  # the oldest: block 6
    assert allocator.kv_hash_to_block_id == {H: NEWER, G: OTHER}
    assert hashes_of(allocator) == [-1, H, G]
    assert ref_counts(allocator, [OLDER, NEWER, OTHER]) == [0, 0, 0]
    assert free_ids(allocator) == [0, 1, 2, 3, OLDER]
    assert recorder.calls == [([OLDER], set())]
    assert int(allocator.get_evictable_block_count()) == 2
    assert allocator.evict_lru_blocks(1)  # block 5, the entry's own block
    assert allocator.kv_hash_to_block_id == {G: OTHER}
    assert hashes_of(allocator) == [-1, -1, G]
    assert free_ids(allocator) == [0, 1, 2, 3, NEWER, OLDER]
    assert recorder.calls == [([OLDER], set()), ([NEWER], {H})]


def test_lru_eviction_of_newer_holder_first(runtime_patches_either_order):
    allocator, recorder = one_hash_on_two_blocks("LRU")
    release(allocator, [OLDER, NEWER, OTHER])
    allocator.context.prefix_cache_lru_clock = 9
    allocator.update_timestamps(torch.tensor([OLDER]))  # 6 touched last: 5 is now the oldest
    assert allocator.evict_lru_blocks(1)
    assert allocator.kv_hash_to_block_id == {G: OTHER}
    assert hashes_of(allocator) == [H, -1, G]
    assert free_ids(allocator) == [0, 1, 2, 3, NEWER]
    assert allocator.evict_lru_blocks(1)  # then 4 (clock 3) before 6 (clock 9)
    assert allocator.evict_lru_blocks(1)
    assert allocator.kv_hash_to_block_id == {}
    assert hashes_of(allocator) == [-1, -1, -1]
    assert ref_counts(allocator, [OLDER, NEWER, OTHER]) == [0, 0, 0]
    assert free_ids(allocator) == [0, 1, 2, 3, OTHER, NEWER, OLDER]
    assert recorder.calls == [([NEWER], {H}), ([OTHER], {G}), ([OLDER], {H})]


def test_lru_newer_holder_stays_matchable_and_evictable_after_older_goes(runtime_patches_either_order):
    """The cached block whose entry the released code dropped: still found by its hash, and
    evicted like any cached block (not left cached with no entry)."""
    allocator, _ = one_hash_on_two_blocks("LRU")
    release(allocator, [OLDER, NEWER, OTHER])
    assert allocator.evict_lru_blocks(1)
    assert allocator.kv_hash_to_block_id.get(H) == NEWER
    assert allocator.evict_lru_blocks(2)
    assert allocator.kv_hash_to_block_id == {}
    assert int(allocator.get_evictable_block_count()) == 0
    assert free_ids(allocator) == [0, 1, 2, 3, OTHER, NEWER, OLDER]


# -- the fast path's answer ---------------------------------------------------------------------

def test_blocks_with_foreign_hash():
    allocator, _ = one_hash_on_two_blocks("REF_ZERO")
    assert allocator.allocate_memory_blocks(1).tolist() == [3]  # unhashed
    ids = torch.tensor([3, OTHER, NEWER, OLDER], dtype=torch.int32)
    assert blocks_with_foreign_hash(allocator, ids) == [OLDER]
    assert blocks_with_foreign_hash(allocator, ids[:3]) == []
    del allocator.kv_hash_to_block_id[G]  # no entry at all: left to the released code
    assert blocks_with_foreign_hash(allocator, ids[:3]) == []
