"""Fault 5: under LRU with chunked prefill, a hash-matched block is registered a second time.

When a prefill chunk ends inside a block the request got by a hash match, the next chunk's
``add_request`` registers that block again (its "range 1": blocks the previous chunk left
incomplete). In 0.19 ``KVBlockAllocator.register_kv_block_hashes`` then counts the block as its
parent's child a second time, while ``_deregister_blocks`` removes it once: the parent never
becomes an evictable leaf, yet ``get_evictable_block_count`` still counts it, and
``evict_lru_blocks`` fails ``leaf peel evicted ... parent graph is not a forest``.

The fix mirrors Megatron-LM main #5995 (2026-07-31, in no release): registration skips every
block that already holds the hash being registered, so registering again changes nothing.
0.17/0.18 keep no child counts (``register_kv_block_hashes`` takes no ``parent_hashes``): there
the fault does not exist, and megatron-ext's leaf-first eviction registers idempotently itself.
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable

import torch

from ..mcore import KV_BLOCK_ALLOCATOR_MODULE, import_module
from ..guards import Guarded, lru_only
from ..patching import Patch, Target

REGISTER = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.register_kv_block_hashes")
DEREGISTER = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator._deregister_blocks")


def bind_registration(block_ids: list[int], block_hashes: list[int], parent_hashes: list[int] | None = None):
    """``register_kv_block_hashes``' arguments, however passed: ``(block_ids, block_hashes,
    parent_hashes)`` (0.19's signature; None where the caller gives no parents)."""
    return block_ids, block_hashes, parent_hashes


def unregistered(
    allocator: Any, block_ids: list[int], block_hashes: list[int], parent_hashes: list[int] | None,
) -> tuple[list[int], list[int], list[int] | None]:
    """A registration narrowed to the blocks that do not hold their hash yet.

    Args:
        allocator: a ``KVBlockAllocator``.
        block_ids, block_hashes: equal-length lists of ints; ``parent_hashes``: the same length, or
            None. Returned unchanged when no block holds its hash, narrowed alike otherwise (all
            three empty when every block holds its hash).

    The hash map answers for most blocks without reading ``block_hashes`` (a gather costs more
    than the whole check on the admission path): registration puts a block's hash on the block
    and in the map, a block's own deregistration takes both away, so a block the map points at
    holds that hash, and a hash the map does not know is held by no block. The map can miss a
    hash a block still holds only after one hash was put on two blocks and the one the map points
    at was deregistered: ``add_request`` never registers a hash the map has (it matches first),
    so the engine cannot get there. Only a block whose hash the map gives to another block (one
    hash on two blocks) is looked up in ``block_hashes``.
    """
    if allocator.kv_hash_to_block_id.keys().isdisjoint(block_hashes):  # the common case, in C
        return block_ids, block_hashes, parent_hashes
    owners = list(map(allocator.kv_hash_to_block_id.get, block_hashes))
    keep = [i for i, (block, owner) in enumerate(zip(block_ids, owners)) if owner != block]
    shared = [i for i in keep if owners[i] is not None]
    if shared:  # one hash on two blocks: does this block hold it too?
        held = allocator.block_hashes[torch.tensor([block_ids[i] for i in shared], dtype=torch.int64)].tolist()
        holding = {i for i, old in zip(shared, held) if old == block_hashes[i]}
        keep = [i for i in keep if i not in holding]
    if len(keep) == len(block_ids):
        return block_ids, block_hashes, parent_hashes
    return ([block_ids[i] for i in keep], [block_hashes[i] for i in keep],
            None if parent_hashes is None else [parent_hashes[i] for i in keep])


def _register_wrapper(wrapped: Callable, allocator: Any, args: tuple, kwargs: dict) -> None:
    """Register only the blocks that do not hold their hash yet (:func:`unregistered`). Only LRU
    keeps child counts, so only LRU changes (guarded: ``prefix_caching_eviction_policy``)."""
    block_ids, block_hashes, parent_hashes = bind_registration(*args, **kwargs)
    if block_ids:
        block_ids, block_hashes, parent_hashes = unregistered(allocator, block_ids, block_hashes, parent_hashes)
        if not block_ids:
            return None  # every block already holds its hash: registering again changes nothing
    return wrapped(block_ids, block_hashes, parent_hashes)


def probe_double_registration(register: Callable) -> tuple[bool, str]:
    """Register block 1 (child of block 0) twice on a stand-in LRU allocator; report the child count.

    The stand-in holds the state ``register_kv_block_hashes`` reads and writes (CPU tensors, so
    the probe runs without a GPU on every release). Returns ``(counts_twice, evidence)``.
    """
    policy = import_module("megatron.core.inference.config").PrefixCachingEvictionPolicy
    stand_in = types.SimpleNamespace(
        prefix_caching_eviction_policy=policy.LRU,
        block_hashes=torch.full((4,), -1, dtype=torch.int64),
        kv_hash_to_block_id={},
        block_parent_id=torch.full((4,), -1, dtype=torch.int64),
        block_child_count=torch.zeros(4, dtype=torch.int64),
    )
    register(stand_in, [0, 1], [11, 22], [0, 11])
    register(stand_in, [1], [22], [11])
    children = int(stand_in.block_child_count[0])
    return children != 1, f"probe: block 1 (parent 0) registered twice -> block 0 child count {children}"


class LruRegisterOncePatch(Patch):
    """Makes 0.19's ``register_kv_block_hashes`` idempotent (see module docstring)."""

    name = "lru-register-once"
    fault = "5"

    def wrappers(self) -> dict[Target, Guarded]:
        return {REGISTER: lru_only(_register_wrapper)}

    def checked_functions(self) -> tuple[Target, ...]:
        return (REGISTER, DEREGISTER)

    def needed(self) -> tuple[bool, str]:
        register = REGISTER.original()
        if "parent_hashes" not in inspect.signature(register).parameters:
            return False, ("register_kv_block_hashes takes no parent_hashes: no child counts "
                           "to count twice (0.17/0.18)")
        return probe_double_registration(register)
