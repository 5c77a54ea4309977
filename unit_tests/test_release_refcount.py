"""Fix 1: ``release_memory_blocks`` drops ref counts once per occurrence of a block ID.

Scenario (8 blocks, block 7 is the dummy block, so 7 are usable): request A allocates blocks 5
and 6 and registers their hashes; requests B and C match both (ref count 3); B also holds a private
unhashed block 4. A and B finish in the same step (batch 1: IDs 5 and 6 twice, 4 once), then C
(batch 2). These tests run against the installed code with the runtime patches applied, so they
fail on unpatched 0.17/0.18 (``MEGATRON_EXT_TEST_UNPATCHED=1``) and pass patched and on 0.19.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.patches.release_refcount import (
    RELEASE,
    RefCountUnderflowError,
    release_blocks_per_occurrence,
)

from .allocator_factory import free_count, free_ids, make_allocator, pin, ref_counts
from .conftest import SOURCE_PATCHED

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

HASH_5, HASH_6 = 1_000_005, 1_000_006
BATCH_1 = [5, 6, 5, 6, 4]  # A's blocks, then B's blocks and B's private block
BATCH_2 = [5, 6]  # C's blocks


def shared_prefix_allocator(policy: str):
    """Allocator in the state described in the module docstring."""
    allocator = make_allocator(policy)
    shared = allocator.allocate_memory_blocks(2)
    assert shared.tolist() == [5, 6]
    allocator.register_kv_block_hashes([5, 6], [HASH_5, HASH_6])
    pin(allocator, [5, 6])  # B matches
    pin(allocator, [5, 6])  # C matches
    assert allocator.allocate_memory_blocks(1).tolist() == [4]  # B's private block
    assert ref_counts(allocator, [4, 5, 6]) == [1, 3, 3]
    assert free_count(allocator) == 4
    return allocator


def release(allocator, ids: list[int]) -> None:
    allocator.release_memory_blocks(torch.tensor(ids, dtype=torch.int32))


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_first_batch_drops_each_shared_block_once_per_owner(runtime_patches, policy):
    allocator = shared_prefix_allocator(policy)
    release(allocator, BATCH_1)
    assert ref_counts(allocator, [4, 5, 6]) == [0, 1, 1]
    assert free_ids(allocator) == [0, 1, 2, 3, 4]  # the private block is back, exactly once
    assert free_count(allocator) == 5
    assert allocator.kv_hash_to_block_id == {HASH_5: 5, HASH_6: 6}
    assert allocator.block_hashes[[5, 6]].tolist() == [HASH_5, HASH_6]


def test_ref_zero_deregisters_shared_blocks_when_last_owner_releases(runtime_patches):
    allocator = shared_prefix_allocator("REF_ZERO")
    release(allocator, BATCH_1)
    release(allocator, BATCH_2)
    assert ref_counts(allocator, [4, 5, 6]) == [0, 0, 0]
    assert free_ids(allocator) == [0, 1, 2, 3, 4, 5, 6]
    assert free_count(allocator) == 7
    assert allocator.kv_hash_to_block_id == {}
    assert allocator.block_hashes[[5, 6]].tolist() == [-1, -1]


def test_lru_keeps_released_shared_blocks_cached_and_evictable(runtime_patches):
    allocator = shared_prefix_allocator("LRU")
    release(allocator, BATCH_1)
    release(allocator, BATCH_2)
    assert ref_counts(allocator, [4, 5, 6]) == [0, 0, 0]
    assert free_ids(allocator) == [0, 1, 2, 3, 4]
    assert allocator.kv_hash_to_block_id == {HASH_5: 5, HASH_6: 6}
    assert int(allocator.get_evictable_block_count()) == 2
    # The whole pool can be used again: both cached blocks are evicted to make room.
    everything = allocator.allocate_memory_blocks(7)
    assert sorted(everything.tolist()) == [0, 1, 2, 3, 4, 5, 6]
    assert allocator.kv_hash_to_block_id == {}


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_all_owners_in_one_call_free_each_block_once(runtime_patches, policy):
    allocator = shared_prefix_allocator(policy)
    release(allocator, [5, 5, 5, 6, 6, 6, 4])
    assert ref_counts(allocator, [4, 5, 6]) == [0, 0, 0]
    free = free_ids(allocator)
    assert len(free) == len(set(free))
    if policy == "REF_ZERO":
        assert free == [0, 1, 2, 3, 4, 5, 6]
        assert allocator.kv_hash_to_block_id == {}
    else:
        assert free == [0, 1, 2, 3, 4]
        assert allocator.kv_hash_to_block_id == {HASH_5: 5, HASH_6: 6}


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_over_release_is_refused_and_changes_nothing(policy):
    allocator = shared_prefix_allocator(policy)
    with pytest.raises(RefCountUnderflowError, match=r"KV blocks \[4\].*held \[1\], released \[2\]"):
        release_blocks_per_occurrence(allocator, torch.tensor([5, 4, 4], dtype=torch.int32))
    assert ref_counts(allocator, [4, 5, 6]) == [1, 3, 3]
    assert free_count(allocator) == 4


def test_original_code_leaks_exactly_where_the_notes_say(mcore_series):
    """The installed function itself (unwrapped): the fault on released 0.17/0.18, fixed on 0.19
    and on trees that carry megatron-ext's source patches."""
    allocator = shared_prefix_allocator("REF_ZERO")
    RELEASE.original()(allocator, torch.tensor([5, 6, 5, 6, 5, 6], dtype=torch.int32))
    expected = {"0.17": [2, 2], "0.18": [2, 2], "0.19": [0, 0], "0.20": [0, 0]}[mcore_series]
    if SOURCE_PATCHED:
        expected = [0, 0]
    assert ref_counts(allocator, [5, 6]) == expected


def test_without_prefix_caching_the_original_path_runs(runtime_patches):
    allocator = make_allocator("REF_ZERO")
    allocator.enable_prefix_caching = False  # the plain stack path, no ref counts
    blocks = allocator.allocate_memory_blocks(3)
    release(allocator, blocks.tolist())
    assert free_count(allocator) == 7
    assert free_ids(allocator) == [0, 1, 2, 3, 4, 5, 6]


def many_owner_allocator(policy: str):
    """64 hashed blocks with 40 owners each, plus 64 unhashed blocks with one owner each: a release
    of every owner lists 64 * 40 + 64 = 2,624 IDs, enough for the linear dedupe path."""
    allocator = make_allocator(policy, total_count=200, paused_count=1)
    hashed = allocator.allocate_memory_blocks(64).tolist()
    allocator.register_kv_block_hashes(hashed, [2_000_000 + b for b in hashed])
    for _ in range(39):
        pin(allocator, hashed)
    private = allocator.allocate_memory_blocks(64).tolist()
    ids = hashed * 40 + private
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    return allocator, hashed, private, torch.tensor(ids, dtype=torch.int32)[order]


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_thousands_of_duplicated_ids_free_each_block_once(runtime_patches, policy):
    allocator, hashed, private, ids = many_owner_allocator(policy)
    assert ids.numel() == 2_624 and free_count(allocator) == 199 - 128
    allocator.release_memory_blocks(ids)
    assert ref_counts(allocator, hashed + private) == [0] * 128
    free = allocator.block_bag[: free_count(allocator)].tolist()
    assert len(free) == len(set(free))
    if policy == "REF_ZERO":
        assert sorted(free) == list(range(199))
        assert allocator.kv_hash_to_block_id == {}
    else:
        assert sorted(free) == sorted(set(range(199)) - set(hashed))
        assert allocator.kv_hash_to_block_id == {2_000_000 + b: b for b in hashed}


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_linear_and_sorting_dedupe_leave_the_same_books(monkeypatch, policy):
    """megatron-ext's release with the linear dedupe (2,624 IDs) and with torch.unique forced."""
    from megatron_ext.patches import release_refcount

    books = []
    for linear_from in (release_refcount._LINEAR_DEDUPE_FROM, 10**9):
        monkeypatch.setattr(release_refcount, "_LINEAR_DEDUPE_FROM", linear_from)
        allocator, _, _, ids = many_owner_allocator(policy)
        release_blocks_per_occurrence(allocator, ids)
        books.append((allocator.block_ref_counts.tolist(), allocator.block_hashes.tolist(),
                       dict(allocator.kv_hash_to_block_id), free_count(allocator),
                       sorted(allocator.block_bag[: free_count(allocator)].tolist())))
    assert books[0] == books[1]


def test_empty_release_changes_nothing():
    allocator = shared_prefix_allocator("REF_ZERO")
    release_blocks_per_occurrence(allocator, torch.tensor([], dtype=torch.int32))
    assert ref_counts(allocator, [4, 5, 6]) == [1, 3, 3]
    assert free_count(allocator) == 4
