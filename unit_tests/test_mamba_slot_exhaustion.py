"""Fault H6 (issue 22): a Mamba slot pool held by live blocks leaks its free slots and fails the step.

A real ``MambaSlotAllocator`` around a stand-in context (``mamba_factory``): every KV block has ref
count 1 (held by a live request) unless a test sets it to 0. The released ``allocate_slots_batch``
takes the free slots before ``_evict_lru_slots_batch`` raises, and ``commit_intermediate_states``
lets that error out; with Megatron-LM #6091 (main, 2026-07-30) the allocation is atomic and the
commit keeps the snapshots that fit. The code is the same in 0.17.0 to 0.19.2: with
``MEGATRON_EXT_TEST_UNPATCHED=1`` three tests fail on every release.
"""

from __future__ import annotations

import pytest

from megatron_ext.patches.mamba_slot_exhaustion import ALLOCATE, MambaSlotExhaustionPatch, leaks_on_exhaustion

from .conftest import SOURCE_PATCHED
from .mamba_factory import make_slot_allocator, row, stage_commit

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run


def slots(allocator, n: int = 4) -> list[int]:
    return allocator.block_to_slot[:n].tolist()


def test_failed_allocation_changes_nothing(runtime_patches):
    allocator = make_slot_allocator(max_slots=2)
    assert allocator.allocate_slots_batch([0]) == [1]  # the free pool is a stack: slot 1 first
    with pytest.raises(RuntimeError) as error:
        allocator.allocate_slots_batch([1, 2])  # 2 new blocks, 1 free slot, nothing evictable
    assert allocator.free_count == 1  # released: 0, slot 0 mapped to no block
    assert slots(allocator) == [1, -1, -1, -1]
    assert allocator.slot_to_block.tolist() == [-1, 0]
    assert str(error.value) == ("Mamba cache requires 2 new durable slots, but only 1 free or "
                                "evictable slots are available")
    assert allocator.allocate_slots_batch([2]) == [0]  # the slot is still there for the next one


def test_commit_keeps_the_snapshots_that_fit(runtime_patches):
    allocator = make_slot_allocator(max_slots=3)
    allocator.allocate_slots_batch([0])  # a live block holds slot 2: 2 free, none evictable
    stage_commit(allocator, [1, 2], eos_bid=3)  # 3 new blocks: the end-of-prompt one is dropped
    allocator.commit_intermediate_states()
    assert slots(allocator) == [2, 0, 1, -1]
    assert allocator.slot_to_block.tolist() == [1, 2, 0]
    assert allocator.free_count == 0
    assert allocator.hash_to_block_id == {101: 1, 102: 2}
    assert allocator.ssm_states[0, :2].tolist() == [[1.0, 1.0], [2.0, 2.0]]  # output buffers 0, 1
    assert allocator.conv_states[0, :2].tolist() == [[1.0, 1.0], [2.0, 2.0]]
    assert row(allocator) == ([0, 0, 0], [-1, -1, -1], 0, -1)  # rows cleared for the next step


def test_commit_without_any_slot_commits_nothing_and_clears(runtime_patches):
    allocator = make_slot_allocator(max_slots=1)
    allocator.allocate_slots_batch([0])  # the only slot is held by a live block
    stage_commit(allocator, [1], eos_bid=2)
    allocator.commit_intermediate_states()
    assert slots(allocator) == [0, -1, -1, -1]
    assert allocator.free_count == 0
    assert allocator.hash_to_block_id == {}
    assert row(allocator) == ([0, 0, 0], [-1, -1, -1], 0, -1)
    assert allocator._has_intermediates is False


def test_commit_that_fits_by_eviction_is_unchanged(runtime_patches):
    allocator = make_slot_allocator(max_slots=2)
    allocator.allocate_slots_batch([0])  # slot 1
    allocator.register_block_hashes_batch([0], [100])
    allocator.context.kv_block_allocator.block_ref_counts[0] = 0  # cached, evictable
    stage_commit(allocator, [1], eos_bid=2)
    allocator.commit_intermediate_states()
    assert slots(allocator) == [-1, 0, 1, -1]  # block 1 took the free slot, block 2 block 0's
    assert allocator.hash_to_block_id == {101: 1, 102: 2}
    assert allocator.ssm_states[0].tolist() == [[1.0, 1.0], [9.0, 9.0]]  # output buffer 0, live state


def test_probe_finds_the_fault_in_every_release():
    # and agrees where the installed code is a tree recorded without the fault (Megatron-LM main
    # after #6091: its fault tests above pass unpatched)
    fixed = bool(MambaSlotExhaustionPatch().match().fixed)
    has_fault, evidence = leaks_on_exhaustion(ALLOCATE.original())
    assert has_fault == (not SOURCE_PATCHED and not fixed), evidence
