"""A real megatron-core ``KVBlockAllocator`` on the CPU around a small stand-in context.

The allocator only reads ``prefix_cache_lru_clock`` (LRU timestamps) and ``block_size_tokens``
from its context in the paths tested here; upstream's own allocator tests use the same trick.
0.17 puts its bookkeeping on ``torch.cuda.current_device()``, which is pointed at the CPU while
the allocator is built.
"""

from __future__ import annotations

import inspect
import types
from unittest import mock

import torch

from megatron_ext import mcore


def eviction_policy(name: str):
    """megatron-core's ``PrefixCachingEvictionPolicy`` member by name ("REF_ZERO" or "LRU")."""
    return getattr(mcore.import_module("megatron.core.inference.config").PrefixCachingEvictionPolicy, name)


def make_allocator(policy: str, total_count: int = 8, paused_count: int = 1):
    """KVBlockAllocator with prefix caching on; block ``total_count - 1`` is the dummy block."""
    module = mcore.import_module(mcore.KV_BLOCK_ALLOCATOR_MODULE)
    context = types.SimpleNamespace(prefix_cache_lru_clock=1, block_size_tokens=16)
    # Megatron-LM main (after 0.19) renamed the sizes: pool_size (dummy block included) and
    # paused_limit (the paused-request retention budget)
    if "pool_size" in inspect.signature(module.KVBlockAllocator.__init__).parameters:
        sizes = {"pool_size": total_count, "paused_limit": paused_count}
    else:
        sizes = {"total_count": total_count, "paused_count": paused_count}
    with mock.patch.object(torch.cuda, "current_device", return_value="cpu"):
        return module.KVBlockAllocator(
            context,
            **sizes,
            enable_prefix_caching=True,
            prefix_caching_eviction_policy=eviction_policy(policy),
        )


def free_count(allocator) -> int:
    """How many IDs the free pool holds (``block_bag[:free_count]``): ``total_avail`` up to 0.19,
    ``pool_avail`` on Megatron-LM main after it."""
    return int(allocator.pool_avail if hasattr(allocator, "pool_avail") else allocator.total_avail)


def block_count(allocator) -> int:
    """Blocks in the allocator, the dummy block included: ``total_count`` up to 0.19, ``pool_size``
    on Megatron-LM main after it."""
    return int(allocator.pool_size if hasattr(allocator, "pool_size") else allocator.total_count)


def free_ids(allocator) -> list[int]:
    """The IDs in the free pool, sorted."""
    return sorted(allocator.block_bag[: free_count(allocator)].tolist())


def ref_counts(allocator, ids: list[int]) -> list[int]:
    return [int(allocator.block_ref_counts[i]) for i in ids]


def pin(allocator, ids: list[int]) -> None:
    """What ``add_request`` does to blocks it got from a hash match: one more owner each."""
    allocator.block_ref_counts[torch.tensor(ids)] += 1
