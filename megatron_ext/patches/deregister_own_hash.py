"""Fault 9: deregistering a block drops the hash-map entry of another block holding the same hash.

``KVBlockAllocator.register_kv_block_hashes`` writes ``kv_hash_to_block_id[h] = block`` without
looking at what was there, so when a second block is registered with a hash ``h`` an older block
already holds, the map points at the newer block while the older keeps ``block_hashes == h``.
``_deregister_blocks`` then pops the map entry of every hash its blocks hold, whoever the entry
points at (``keys_to_delete = set(hashes) - {-1}``), and tells ``on_blocks_deregistered`` (the
Mamba state cache) that those hashes are gone. Deregistering the older block (REF_ZERO: its last
owner releases it; LRU: it is evicted) therefore removes the newer block's entry: the newer block
stays registered and cached but nothing can match it any more (under LRU a cached block without a
map entry, evicted only by memory pressure), and the Mamba cache forgets the hash too. Present in
every release 0.17 to 0.19 and on Megatron-LM main (checked up to 2026-08-22): no upstream change
to mirror. The engine never registers one hash on two blocks today (``add_request`` matches an
existing hash before it registers), but direct context / allocator calls do.

The fix drops a map entry only when it points at a block being deregistered. Before the released
``_deregister_blocks`` runs, every block whose hash's map entry points at another block gets
``block_hashes = -1``: the released code then neither pops that entry nor reports the hash to
``on_blocks_deregistered``, and resets the block as usual (ref count, LRU timestamp and forest
links, back to the free pool). Blocks with hash -1, blocks whose entry points at themselves and
blocks whose hash has no entry at all are left to the released code unchanged. When two holders of
one hash are deregistered together, the entry (pointing at one of them) goes, as before.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..mcore import KV_BLOCK_ALLOCATOR_MODULE
from ..patching import Patch, Target

DEREGISTER = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator._deregister_blocks")


def blocks_with_foreign_hash(allocator: Any, block_ids: torch.Tensor) -> list[int]:
    """The blocks among ``block_ids`` whose hash's map entry points at another block.

    Args:
        allocator: a ``KVBlockAllocator`` with prefix caching on.
        block_ids: 1-D integer tensor of block IDs, shape ``[n]``, any integer dtype, on the
            allocator's bookkeeping device (the GPU on 0.17, the CPU from 0.18).

    Returns the IDs (Python ints, in ``block_ids`` order), empty in the common case. A block with
    hash -1, or whose hash has no map entry, is never in it. Cost without a collision: one gather,
    one host transfer and a C-level ``dict.get`` per block; a Python loop only when one exists.

    Raises:
        IndexError / RuntimeError from torch: an ID outside ``[0, total_count)``.
    """
    hashes = allocator.block_hashes
    if hashes.device.type == "cpu" and block_ids.device.type == "cpu":
        # NumPy views: a fraction of torch's per-operation cost (from 0.18 the books are on the CPU)
        ids = block_ids.numpy()
        ids_list, hash_list = ids.tolist(), hashes.numpy()[ids].tolist()
    else:
        ids = block_ids.to(device=hashes.device, dtype=torch.int64)
        ids_list, hash_list = torch.stack((ids, hashes[ids])).tolist()
    # A missing entry (or hash -1, never a key) defaults to the block itself: left as released.
    owners = list(map(allocator.kv_hash_to_block_id.get, hash_list, ids_list))
    if owners == ids_list:
        return []
    return [block for block, owner in zip(ids_list, owners) if owner != block]


def _deregister_wrapper(wrapped: Callable, allocator: Any, args: tuple, kwargs: dict) -> None:
    """``_deregister_blocks(block_ids)``: blocks holding a hash whose entry is another block's
    are unhashed first. If the released code raises, their hashes are put back (what it changed
    itself before raising stays as it left it)."""
    block_ids = kwargs["block_ids"] if "block_ids" in kwargs else args[0]
    if not allocator.enable_prefix_caching or block_ids.numel() == 0:
        return wrapped(*args, **kwargs)
    foreign = blocks_with_foreign_hash(allocator, block_ids)
    if not foreign:
        return wrapped(*args, **kwargs)
    hashes = allocator.block_hashes
    index = torch.tensor(foreign, dtype=torch.int64, device=hashes.device)
    saved = hashes[index]
    hashes[index] = -1
    try:
        return wrapped(*args, **kwargs)
    except BaseException:
        hashes[index] = saved
        raise


class DeregisterOwnHashPatch(Patch):
    """Drops a hash-map entry only with the block it points at (see module docstring)."""

    name = "deregister-own-hash"
    fault = "9"
    source_patched_targets = (DEREGISTER,)
    fault_evidence = ("no megatron-core release up to 0.19.2, nor Megatron-LM main up to d98e8a64 "
                      "(2026-08-22), checks whom a hash-map entry points at before popping it")

    def wrappers(self) -> dict[Target, Callable]:
        return {DEREGISTER: _deregister_wrapper}
