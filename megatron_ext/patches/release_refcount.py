"""Fix 1: ``KVBlockAllocator.release_memory_blocks`` drops ref counts once per occurrence.

The released code does ``block_ref_counts[blocks] -= 1``. With advanced indexing a block ID that
appears k times in ``blocks`` (k requests sharing a prefix finish in the same step) is decremented
once, so shared blocks keep a positive ref count forever: never deregistered under REF_ZERO,
never evictable under LRU, and the KV pool shrinks until no request can be admitted.

Mirrors the upstream fix on Megatron-LM main of 2026-07-28, first released in megatron-core
0.19.0: decrement with an accumulating scatter, then deregister / return each block that reached
zero exactly once.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from ..errors import MegatronExtError
from ..mcore import KV_BLOCK_ALLOCATOR_MODULE, import_module
from ..patching import Patch, Target

RELEASE = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.release_memory_blocks")
DEREGISTER = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator._deregister_blocks")


class RefCountUnderflowError(MegatronExtError, ValueError):
    """A release would drive a block's ref count below zero (a block released more often than held)."""


def release_blocks_per_occurrence(allocator: Any, blocks: torch.Tensor) -> None:
    """Release KV blocks with prefix caching on, decrementing once per occurrence of each ID.

    Args:
        allocator: a megatron-core ``KVBlockAllocator`` with ``enable_prefix_caching`` set.
        blocks: 1-D integer tensor of block IDs, shape ``[n]``, any integer dtype, on the
            allocator's bookkeeping device (GPU on 0.17, CPU from 0.18). IDs may repeat: one
            occurrence per releasing owner.

    Every block whose ref count reaches zero is then handled exactly once, even when its ID
    was duplicated: under REF_ZERO it is deregistered and returned to the free pool; under LRU it
    stays cached if it has a hash, and goes back to the free pool if it has none.

    Cost: one accumulating scatter, one gather and one host sync when no block reaches zero;
    only the IDs that reached zero are deduplicated, in linear time (see ``scripts/bench.py``).

    Raises:
        RefCountUnderflowError: some block would drop below zero. Nothing is changed.
        IndexError / RuntimeError from torch: an ID outside ``[0, total_count)`` (callers filter
        the block tables' -1 padding, as upstream's fix assumes too). Not pre-checked: a range
        check costs about a tenth of a small release (benchmarks/README.md).
        Any exception raised while handing back the blocks that reached zero (for instance by
        ``_deregister_blocks`` or its Mamba hook) propagates after ref counts, hash map, hashes
        and free pool are restored to what they were before the call. Not restored: whatever
        the Mamba hook itself changed in the Mamba state cache before raising (its entries for
        those hashes may be gone; the next match then recomputes instead of reusing them).
    """
    ref_counts = allocator.block_ref_counts
    ids = blocks
    if ids.device != ref_counts.device or ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(device=ref_counts.device, dtype=torch.int64)
    if ids.numel() == 0:
        return
    # index_add_ accumulates duplicate indices: an ID listed k times drops by k.
    ref_counts.index_add_(0, ids, _ones(ref_counts, -1, ids.numel()))
    after = ref_counts.index_select(0, ids)
    lowest = int(after.min())  # the one host sync of the common path
    if lowest < 0:
        _undo_decrement(ref_counts, ids)
        raise _underflow_error(ref_counts, ids)
    if lowest > 0:
        return  # no block reached zero
    if allocator.prefix_caching_eviction_policy.name == "REF_ZERO":
        _deregister_reached_zero(allocator, ids, after == 0)
    else:
        _free_unhashed_reached_zero(allocator, ids, after == 0)


def _free_count_name(allocator: Any) -> str:
    """The allocator's free-pool count attribute: ``total_avail`` (0.17 to 0.19) or ``pool_avail``
    (Megatron-LM main after 0.19, which renamed it)."""
    return "total_avail" if hasattr(allocator, "total_avail") else "pool_avail"


def _deregister_reached_zero(allocator: Any, ids: torch.Tensor, reached_zero: torch.Tensor) -> None:
    """REF_ZERO: deregister each block that reached zero once; on any error, restore the books."""
    zero_ids = _distinct(allocator, ids.masked_select(reached_zero))
    hashes = allocator.block_hashes.index_select(0, zero_ids)
    free = _free_count_name(allocator)
    saved_avail = getattr(allocator, free)
    try:
        allocator._deregister_blocks(zero_ids)
    except BaseException:
        # _deregister_blocks pops hash-map entries, then resets hashes and ref counts, then
        # returns the blocks to the pool: put back whatever it got to. The map entries are
        # rebuilt, not saved beforehand (a dict of every entry would cost more than the release
        # itself): each popped entry pointed at its own block (with deregister-own-hash applied,
        # entries of other blocks are never popped).
        hash_map = allocator.kv_hash_to_block_id
        for block, block_hash in zip(zero_ids.tolist(), hashes.tolist()):
            if block_hash != -1:
                hash_map.setdefault(block_hash, block)
        allocator.block_hashes[zero_ids] = hashes
        setattr(allocator, free, saved_avail)
        _undo_decrement(allocator.block_ref_counts, ids)
        raise


def _free_unhashed_reached_zero(allocator: Any, ids: torch.Tensor, reached_zero: torch.Tensor) -> None:
    """LRU: hashed blocks stay cached (evictable); unhashed ones (a request's partial last block)
    have nothing to reuse and go back to the free pool, each once."""
    unhashed = ids.masked_select(reached_zero & (allocator.block_hashes.index_select(0, ids) == -1))
    if unhashed.numel() == 0:
        return
    free = _free_count_name(allocator)
    saved_avail = getattr(allocator, free)
    try:
        unhashed = _distinct(allocator, unhashed).to(allocator.block_bag.dtype)
        freed = unhashed.numel()
        allocator.block_bag[saved_avail : saved_avail + freed] = unhashed
        setattr(allocator, free, saved_avail + freed)
    except BaseException:
        setattr(allocator, free, saved_avail)
        _undo_decrement(allocator.block_ref_counts, ids)
        raise


#: Attribute kept on the allocator: an int32 scratch tensor, one slot per block (see _distinct).
_SCRATCH_ATTR = "_megatron_ext_dedupe_scratch"
_LINEAR_DEDUPE_FROM = 1536  # below this many IDs torch.unique is faster (see _distinct)
_ONES: dict[tuple, torch.Tensor] = {}
_POSITIONS: dict[torch.device, torch.Tensor] = {}


def _distinct(allocator: Any, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` (1-D block IDs, shape ``[n]``) with repeats dropped, in no particular order.

    Short inputs go through ``torch.unique`` (sorted). From ``_LINEAR_DEDUPE_FROM`` IDs on, a
    linear pass replaces its sort: every occurrence scatters its position into its block's scratch
    slot and the occurrence whose write survived is kept (one per block; which one is
    deterministic on the CPU, not on the GPU, so on 0.17 the order blocks return to the free pool
    may vary between runs; the set does not). ``scatter_reduce_`` amin would fix the order but
    costs more. ``torch.unique``'s sort grows with the IDs, the linear pass costs a flat four ops
    of dispatch below ~1,000 IDs; the threshold sits where they cross (figures:
    benchmarks/README.md).
    """
    if ids.numel() < _LINEAR_DEDUPE_FROM:
        return torch.unique(ids)
    block_count = allocator.block_ref_counts.numel()
    device = allocator.block_ref_counts.device
    scratch = allocator.__dict__.get(_SCRATCH_ATTR)
    if scratch is None or scratch.numel() != block_count or scratch.device != device:
        scratch = torch.empty(block_count, dtype=torch.int32, device=device)
        allocator.__dict__[_SCRATCH_ATTR] = scratch
    positions = _positions(device, ids.numel())
    index = ids.to(torch.int64)
    scratch.scatter_(0, index, positions)
    return ids.masked_select(scratch.index_select(0, index) == positions)


def _positions(device: torch.device, length: int) -> torch.Tensor:
    """``arange(length)`` (int32) on ``device``, a view of a cached tensor grown as needed."""
    cached = _POSITIONS.get(device)
    if cached is None or cached.numel() < length:
        cached = _POSITIONS[device] = torch.arange(max(length, 4096), dtype=torch.int32, device=device)
    return cached[:length]


def _ones(ref_counts: torch.Tensor, sign: int, length: int) -> torch.Tensor:
    """``sign`` repeated ``length`` times in the ref counts' dtype and device, without a copy.

    A cached 1-element tensor expanded to ``length``: building a fresh ``[n]`` tensor per release
    costs more than the scatter itself for small releases.
    """
    key = (ref_counts.device, ref_counts.dtype, sign)
    one = _ONES.get(key)
    if one is None:
        one = _ONES[key] = torch.tensor([sign], dtype=ref_counts.dtype, device=ref_counts.device)
    return one.expand(length)


def _undo_decrement(ref_counts: torch.Tensor, ids: torch.Tensor) -> None:
    """Add back one per occurrence: ref counts exactly as before the release's decrement."""
    ref_counts.index_add_(0, ids, _ones(ref_counts, 1, ids.numel()))


def _underflow_error(ref_counts: torch.Tensor, ids: torch.Tensor) -> RefCountUnderflowError:
    """The error for a release that would go negative (ref counts already restored)."""
    unique_ids, occurrences = torch.unique(ids.to(torch.int64), return_counts=True)
    held = ref_counts[unique_ids]
    underflow = held < occurrences.to(held.dtype)
    return RefCountUnderflowError(
        f"releasing KV blocks {unique_ids[underflow].tolist()} would make their ref counts "
        f"negative (held {held[underflow].tolist()}, released {occurrences[underflow].tolist()} "
        "times); a block was released more often than it was allocated or matched. "
        "Nothing was released."
    )


def _release_wrapper(wrapped: Callable, allocator: Any, args: tuple, kwargs: dict) -> None:
    """wrapt wrapper: our release with prefix caching on; the original code path otherwise."""
    blocks = kwargs["blocks"] if "blocks" in kwargs else args[0]
    if not allocator.enable_prefix_caching or blocks.numel() == 0:
        return wrapped(*args, **kwargs)
    return release_blocks_per_occurrence(allocator, blocks)


def probe_release_semantics(release: Callable) -> tuple[bool, str]:
    """Run a release function on a two-owner stand-in allocator; report whether it still leaks.

    Releases block 0, held by two owners, twice in one call. Fixed code drops its ref count to
    0; the faulty code leaves 1. Returns ``(leaks, evidence)``.
    """
    policy = import_module("megatron.core.inference.config").PrefixCachingEvictionPolicy
    deregistered: list[list[int]] = []
    stand_in = types.SimpleNamespace(
        enable_prefix_caching=True,
        prefix_caching_eviction_policy=policy.REF_ZERO,
        block_ref_counts=torch.tensor([2, 0], dtype=torch.int32),
        block_hashes=torch.tensor([7, -1], dtype=torch.int64),
        kv_hash_to_block_id={7: 0},
        block_bag=torch.tensor([1, 0], dtype=torch.int32),
        total_avail=1,
        _deregister_blocks=lambda ids: deregistered.append(ids.tolist()),
    )
    release(stand_in, torch.tensor([0, 0], dtype=torch.int32))
    after = int(stand_in.block_ref_counts[0])
    evidence = (
        f"probe: block 0 held by 2 owners, released twice in one call -> ref count {after}"
        f", deregistered {deregistered}"
    )
    return after != 0, evidence


class ReleaseRefcountPatch(Patch):
    """Wraps ``KVBlockAllocator.release_memory_blocks`` (see module docstring)."""

    name = "release-refcount"
    fault = "1"

    def wrappers(self) -> dict[Target, Callable]:
        return {RELEASE: _release_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        return (RELEASE, DEREGISTER)

    def needed(self) -> tuple[bool, str]:
        return probe_release_semantics(RELEASE.original())
