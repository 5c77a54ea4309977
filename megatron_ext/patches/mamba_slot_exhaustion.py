"""Fault H6 (issue 22): a Mamba slot pool held by live blocks leaks slots and fails the step.

Hybrid models with prefix caching snapshot Mamba states into a fixed pool of cache slots
(``prefix_caching_mamba_gb`` sizes it). After each forward pass
``MambaSlotAllocator.commit_intermediate_states`` allocates one slot per new snapshot block with
``allocate_slots_batch``, which takes what the free pool has and evicts the rest from blocks whose
ref count is 0 (``_evict_lru_slots_batch``). When the free slots plus the evictable ones are fewer
than the snapshots (slots held by blocks of live requests), ``_evict_lru_slots_batch`` raises
``RuntimeError("No evictable Mamba cache slots available")`` after ``allocate_slots_batch`` took
the free slots: those slots are neither free nor mapped to a block (leaked until ``reset``), and
the error leaves the engine step (the snapshots only serve future cache hits). Same code in
0.17.0 to 0.19.2.

Megatron-LM #6091 (2026-07-30, main; in no release) mirrored here:

- ``allocate_slots_batch`` reserves the whole batch atomically: when the new (distinct, slotless)
  blocks outnumber the free plus evictable slots it raises :class:`MambaSlotCapacityError` (a
  ``RuntimeError``) before changing anything;
- ``commit_intermediate_states`` keeps, in collection order, the snapshots of blocks that already
  have a slot and new blocks up to the available slots, and commits those; the rest are dropped
  (those requests continue from their live Mamba state; a later request recomputes more).

The commit runs the released function on the kept snapshots: the wrapper collects the commit data
once (``_collect_commit_data``), and hands the kept subset to the released commit through an
instance attribute that shadows ``_collect_commit_data`` for that one call. Not mirrored: #6091's
``topk`` in place of ``argsort`` for choosing LRU victims (cost only), and its in-place refills of
``block_bag`` / ``free_slots`` in ``reset`` (``torch.inference_mode`` during CUDA-graph setup).
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from ..mcore import MAMBA_SLOT_ALLOCATOR_MODULE
from ..patching import Patch, ShadowedMethod, Target

ALLOCATE = Target(MAMBA_SLOT_ALLOCATOR_MODULE, "MambaSlotAllocator.allocate_slots_batch")
COMMIT = Target(MAMBA_SLOT_ALLOCATOR_MODULE, "MambaSlotAllocator.commit_intermediate_states")
EVICT = Target(MAMBA_SLOT_ALLOCATOR_MODULE, "MambaSlotAllocator._evict_lru_slots_batch")
COLLECT = Target(MAMBA_SLOT_ALLOCATOR_MODULE, "MambaSlotAllocator._collect_commit_data")


class MambaSlotCapacityError(RuntimeError):
    """The Mamba cache cannot give ``required`` new slots: only ``available`` are free or evictable.

    As Megatron-LM #6091's class of the same name (slot counts, ints); raised before the allocator
    changes anything.
    """

    def __init__(self, required: int, available: int):
        self.required = required
        self.available = available
        super().__init__(f"Mamba cache requires {required} new durable slots, but only "
                         f"{available} free or evictable slots are available")


def new_block_count(allocator: Any, block_ids: list[int]) -> int:
    """How many distinct blocks of ``block_ids`` (KV block IDs) hold no Mamba slot yet."""
    if not block_ids:
        return 0
    ids = torch.tensor(block_ids, dtype=torch.int64, device=allocator.block_to_slot.device)
    return len({b for b, slot in zip(block_ids, allocator.block_to_slot[ids].tolist()) if slot < 0})


def evictable_count(allocator: Any) -> int:
    """Slots held by blocks with ref count 0 (the ones ``_evict_lru_slots_batch`` may take)."""
    kv = allocator.context.kv_block_allocator
    has_slot = allocator.block_to_slot[: kv.total_count] >= 0
    ref_zero = kv.block_ref_counts[: kv.total_count].to(has_slot.device) == 0
    return int((has_slot & ref_zero).sum())


def available_slots(allocator: Any, required: int) -> int:
    """Free slots, plus evictable ones when the free pool alone holds fewer than ``required``."""
    if required <= allocator.free_count:
        return allocator.free_count  # no eviction needed: skip the scan of the block table
    return allocator.free_count + evictable_count(allocator)


def _allocate_wrapper(wrapped: Callable, allocator: Any, args: tuple, kwargs: dict) -> list:
    """``allocate_slots_batch(block_ids)``: refuse, unchanged, a batch the pool cannot hold.

    Raises:
        MambaSlotCapacityError: the distinct new blocks outnumber the free plus evictable slots.
    """
    block_ids = kwargs["block_ids"] if "block_ids" in kwargs else args[0]
    required = new_block_count(allocator, block_ids)
    available = available_slots(allocator, required)
    if available < required:
        raise MambaSlotCapacityError(required, available)
    return wrapped(*args, **kwargs)


def fit_to_capacity(allocator: Any, collected: tuple) -> tuple:
    """The subset of ``_collect_commit_data``'s tuple the slot pool can hold, as #6091 keeps it.

    ``collected`` is ``(intermediate_bids, src_offsets, eos_bids, eos_ctx_indices, all_hashes)``
    (lists; ``all_hashes`` covers intermediate then EOS blocks). Kept, in order: every entry whose
    block already has a slot or was kept before, and new blocks while fewer than the available
    slots were kept. Returns a tuple of the same shape (unchanged when everything fits).
    """
    intermediate_bids, src_offsets, eos_bids, eos_ctx_indices, all_hashes = collected
    all_bids = intermediate_bids + eos_bids
    required = new_block_count(allocator, all_bids)
    available = available_slots(allocator, required)
    if available >= required:
        return collected
    ids = torch.tensor(all_bids, dtype=torch.int64, device=allocator.block_to_slot.device)
    kept, kept_new = [], set()
    for index, (block, slot) in enumerate(zip(all_bids, allocator.block_to_slot[ids].tolist())):
        if slot >= 0 or block in kept_new:
            kept.append(index)
        elif len(kept_new) < available:
            kept_new.add(block)
            kept.append(index)
    n = len(intermediate_bids)
    return ([all_bids[i] for i in kept if i < n], [src_offsets[i] for i in kept if i < n],
            [all_bids[i] for i in kept if i >= n], [eos_ctx_indices[i - n] for i in kept if i >= n],
            [all_hashes[i] for i in kept])


def _commit_wrapper(wrapped: Callable, allocator: Any, args: tuple, kwargs: dict) -> None:
    """``commit_intermediate_states()``: commit only the snapshots the slot pool can hold."""
    collected = allocator._collect_commit_data()
    if collected is None:  # nothing to commit; the released helper cleared the rows itself
        return None
    kept = fit_to_capacity(allocator, collected)
    if not kept[0] and not kept[2]:  # no slot for any snapshot
        allocator._clear_intermediate_state()
        return None
    # the released commit calls self._collect_commit_data() once: give it the kept subset
    with ShadowedMethod(allocator, COLLECT.attribute, lambda: kept):
        return wrapped(*args, **kwargs)


def _probe_allocator() -> Any:
    """A MambaSlotAllocator with only what ``allocate_slots_batch`` reads (no ``__init__``: that
    needs a GPU): 2 blocks with ref count 1 and no slot, one free slot."""
    allocator = object.__new__(ALLOCATE.owner())
    allocator.context = types.SimpleNamespace(kv_block_allocator=types.SimpleNamespace(
        total_count=2, pool_size=2, block_ref_counts=torch.ones(2, dtype=torch.int32),
        block_timestamps=torch.zeros(2, dtype=torch.int64), block_hashes=torch.full((2,), -1)))
    allocator.block_to_slot = torch.full((2,), -1, dtype=torch.int32)
    allocator.slot_to_block = torch.full((1,), -1, dtype=torch.int32)
    allocator.free_slots = torch.arange(1, dtype=torch.int32)
    allocator.free_count = 1
    return allocator


def leaks_on_exhaustion(allocate: Callable) -> tuple[bool, str]:
    """Whether a failed ``allocate_slots_batch`` consumes free slots.

    Runs it on a stand-in allocator (CPU tensors): 2 new blocks, 1 free slot, nothing evictable.
    Returns ``(has_fault, evidence)``.
    """
    allocator = _probe_allocator()
    try:
        allocate(allocator, [0, 1])
    except RuntimeError as error:
        if allocator.free_count == 1:
            return False, ("a failed allocate_slots_batch leaves the free slot free "
                           f"({type(error).__name__}, as Megatron-LM #6091)")
        return True, (f"a failed allocate_slots_batch ({error}) took the free slot: free count "
                      f"{allocator.free_count} of 1, the slot mapped to no block")
    return True, "allocate_slots_batch gave 2 slots from a pool of 1"


class MambaSlotExhaustionPatch(Patch):
    """Atomic Mamba slot allocation and a commit that fits the pool (see module docstring)."""

    name = "mamba-slot-exhaustion"
    fault = "H6"

    def wrappers(self) -> dict[Target, Callable]:
        return {ALLOCATE: _allocate_wrapper, COMMIT: _commit_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        # what the wrappers rely on: eviction takes only ref-0 slots, the commit data's shape
        return (ALLOCATE, COMMIT, EVICT, COLLECT)

    def needed(self) -> tuple[bool, str]:
        return leaks_on_exhaustion(ALLOCATE.original())
