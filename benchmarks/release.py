"""Section 1 (worker side): time ``KVBlockAllocator.release_memory_blocks`` on a rebuilt state.

The workload models N-sample RL rollouts finishing in one engine step: groups of ``group``
sibling requests share ``prefix`` hashed blocks and each also holds one private, unhashed tail
block (a partially filled last block). Released IDs are listed request by request, as
``release_memory_blocks_from_request_indexes`` passes them (int32), truncated to ``n_ids``;
each block's ref count is its number of occurrences, so a correct release drops every block to
zero. The rest of the pool is half held by other live requests (ref count 1, hashed, in the
hash map) and half free, with all IDs scattered at random over the pool.

Before every timed call the state the release touches is put back (ref counts, hashes, LRU
timestamps / parent links of the released blocks, their hash-map entries, the free-pool bag slice
and ``total_avail``); only the call itself is timed.
"""

from __future__ import annotations

import types
from typing import Any
from unittest import mock

import torch

from megatron_ext import mcore
from .stats import time_calls

#: Per-block bookkeeping tensors a release (or the deregistration it triggers) may write.
PER_BLOCK_TENSORS = ("block_ref_counts", "block_hashes", "block_timestamps", "block_parent_id",
                     "block_child_count")


def release_ids(n_ids: int, group: int = 8, prefix: int = 7) -> tuple[list[int], set[int]]:
    """Abstract block IDs (0, 1, ... in allocation order) released by sibling groups, and the hashed ones.

    Returns ``(ids, hashed)``: ``ids`` has length ``n_ids`` in request-major order; ``hashed`` are
    the shared prefix blocks (the private tail blocks are unhashed).
    """
    ids: list[int] = []
    hashed: set[int] = set()
    next_id = 0
    while len(ids) < n_ids:
        shared = list(range(next_id, next_id + prefix))
        next_id += prefix
        hashed.update(shared)
        for _ in range(group):
            ids.extend(shared + [next_id])
            next_id += 1
    ids = ids[:n_ids]
    used = set(ids)
    return ids, hashed & used


class ReleaseBench:
    """One allocator + one release input, with a snapshot to rebuild from before every call."""

    def __init__(self, policy: str, pool: int, n_ids: int, group: int = 8, prefix: int = 7,
                 seed: int = 0) -> None:
        module = mcore.import_module(mcore.KV_BLOCK_ALLOCATOR_MODULE)
        config = mcore.import_module("megatron.core.inference.config")
        self.cls = module.KVBlockAllocator
        self.policy = policy
        context = types.SimpleNamespace(prefix_cache_lru_clock=1, block_size_tokens=16)
        with mock.patch.object(torch.cuda, "current_device", return_value="cpu"):  # 0.17
            self.allocator = alloc = self.cls(
                context, total_count=pool, paused_count=1, enable_prefix_caching=True,
                prefix_caching_eviction_policy=getattr(config.PrefixCachingEvictionPolicy, policy),
            )
        device = alloc.block_ref_counts.device
        generator = torch.Generator().manual_seed(seed + pool * 7 + n_ids)

        abstract, hashed = release_ids(n_ids, group, prefix)
        unique_abstract = sorted(set(abstract))
        usable = pool - 1  # the last block is the dummy block
        if len(unique_abstract) > usable:
            raise ValueError(f"pool of {pool} blocks is too small for {len(unique_abstract)} released blocks")
        perm = torch.randperm(usable, generator=generator)
        mapping = dict(zip(unique_abstract, perm[: len(unique_abstract)].tolist()))
        rest = perm[len(unique_abstract):]
        background = rest[: len(rest) // 2]
        free = rest[len(rest) // 2:]

        # Free pool first, then the allocated IDs (the release pushes freed IDs at total_avail).
        alloc.block_bag[: free.numel()] = free.to(alloc.block_bag.dtype)
        allocated = torch.cat([perm[: len(unique_abstract)], background])
        alloc.block_bag[free.numel(): free.numel() + allocated.numel()] = allocated.to(alloc.block_bag.dtype)
        alloc.total_avail = free.numel()

        hash_values = torch.randint(1, 2**62, (usable,), generator=generator, dtype=torch.int64)
        background_hashes = hash_values[background]
        alloc.block_ref_counts[background.to(device)] = 1
        alloc.block_hashes[background.to(device)] = background_hashes.to(device)
        alloc.kv_hash_to_block_id.update(zip(background_hashes.tolist(), background.tolist()))
        if hasattr(alloc, "block_timestamps"):
            alloc.block_timestamps[background.to(device)] = 1

        self.blocks = torch.tensor([mapping[a] for a in abstract], dtype=torch.int32, device=device)
        occurrences: dict[int, int] = {}
        for a in abstract:
            occurrences[mapping[a]] = occurrences.get(mapping[a], 0) + 1
        unique = sorted(occurrences)
        self.unique = torch.tensor(unique, dtype=torch.int64, device=device)
        alloc.block_ref_counts[self.unique] = torch.tensor(
            [occurrences[b] for b in unique], dtype=alloc.block_ref_counts.dtype, device=device)
        hashed_real = sorted(mapping[a] for a in hashed)
        for block in hashed_real:
            value = int(hash_values[block])
            alloc.block_hashes[block] = value
            alloc.kv_hash_to_block_id[value] = block
        if hasattr(alloc, "block_timestamps"):
            alloc.block_timestamps[self.unique] = 1

        self.n_ids = n_ids
        self.n_unique = len(unique)
        self.n_hashed = len(hashed_real)
        self._saved_tensors = {
            name: getattr(alloc, name)[self.unique].clone()
            for name in PER_BLOCK_TENSORS if hasattr(alloc, name)
        }
        self._saved_entries = {int(alloc.block_hashes[b]): b for b in hashed_real}
        self._saved_avail = alloc.total_avail
        self._saved_bag = alloc.block_bag[self._saved_avail: self._saved_avail + self.n_unique].clone()
        self._full = self._full_state()

    # -- state -----------------------------------------------------------------------------

    def rebuild(self) -> None:
        """Put back everything a release of ``self.blocks`` may have changed."""
        alloc = self.allocator
        for name, saved in self._saved_tensors.items():
            getattr(alloc, name)[self.unique] = saved
        alloc.kv_hash_to_block_id.update(self._saved_entries)
        alloc.block_bag[self._saved_avail: self._saved_avail + self.n_unique] = self._saved_bag
        alloc.total_avail = self._saved_avail

    def _full_state(self) -> dict[str, Any]:
        alloc = self.allocator
        state = {name: getattr(alloc, name).clone() for name in PER_BLOCK_TENSORS if hasattr(alloc, name)}
        state["block_bag"] = alloc.block_bag.clone()
        state["total_avail"] = alloc.total_avail
        state["hash_map"] = dict(alloc.kv_hash_to_block_id)
        return state

    def check_rebuild(self) -> None:
        """Raise unless the allocator's whole state equals the state before the first release."""
        now = self._full_state()
        for key, before in self._full.items():
            after = now[key]
            same = torch.equal(before, after) if isinstance(before, torch.Tensor) else before == after
            if not same:
                raise AssertionError(f"rebuild did not restore allocator.{key}")

    def outcome(self) -> dict[str, Any]:
        """What one release did (after it ran, before a rebuild): comparable across releases."""
        alloc = self.allocator
        freed = sorted(alloc.block_bag[self._saved_avail: alloc.total_avail].tolist())
        refs = alloc.block_ref_counts[self.unique]
        return {
            "freed_blocks": len(freed),
            "freed_ids_digest": hash(tuple(freed)) & 0xFFFFFFFF,
            "blocks_still_referenced": int((refs > 0).sum()),
            "ref_count_sum": int(refs.sum()),
            "hashed_blocks_left": int((alloc.block_hashes[self.unique] != -1).sum()),
            "hash_map_size": len(alloc.kv_hash_to_block_id),
        }

    # -- measurement -----------------------------------------------------------------------

    def probe(self, install: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Run each variant's release once; check it did what it does and that rebuild restores all."""
        results = {}
        for variant, function in install.items():
            self.rebuild()
            setattr(self.cls, "release_memory_blocks", function)
            self.allocator.release_memory_blocks(self.blocks)
            results[variant] = self.outcome()
            self.rebuild()
            self.check_rebuild()
        return results

    def time(self, function: Any, reps: int) -> tuple[list[int], list[int]]:
        """``reps`` back-to-back timed calls of ``function`` as ``release_memory_blocks``.

        The state is rebuilt before each call; returns (wall ns, thread CPU ns) per call.
        """
        setattr(self.cls, "release_memory_blocks", function)
        alloc, blocks = self.allocator, self.blocks
        samples = time_calls(self.rebuild, lambda: alloc.release_memory_blocks(blocks), reps)
        self.rebuild()
        return samples

    def time_rebuild(self, reps: int) -> tuple[list[int], list[int]]:
        """Control for the scaling table: time ``rebuild()`` alone, which touches the same entries
        of the same tables (ref counts, hashes, hash map, free-pool bag) as a release does, with no
        work that depends on the pool size. (wall ns, thread CPU ns) per call."""
        return time_calls(lambda: None, self.rebuild, reps)

    def describe(self) -> dict[str, Any]:
        return {"ids": self.n_ids, "unique": self.n_unique, "hashed": self.n_hashed,
                "hash_map_size": len(self._full["hash_map"]), "total_avail": self._saved_avail}
