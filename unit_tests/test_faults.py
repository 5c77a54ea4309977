"""Faults inside the patched functions leave the books as they were (issue: reliability).

"The books": ref counts, the hash map, block hashes, the free pool and the block tables. Each test
injects a failure, checks the books are exactly as before, then checks the same call succeeds
once the failure is gone.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext import mcore
from megatron_ext.patches.matched_block_writes import MATCHED_RANGES
from megatron_ext.patches.release_refcount import RefCountUnderflowError, release_blocks_per_occurrence

from .allocator_factory import block_count, free_count
from .conftest import SOURCE_PATCHED
from .context_factory import add_and_collect_writes, make_request, prefix_caching_context

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

P32 = list(range(1000, 1032))


def books(ctx) -> tuple:
    allocator = ctx.kv_block_allocator
    return (
        allocator.block_ref_counts.tolist(),
        dict(allocator.kv_hash_to_block_id),
        sorted(allocator.block_bag[: free_count(allocator)].tolist()),
        ctx.total_request_count,
        ctx.active_token_count,
        allocator.block_hashes.tolist(),
        ctx.request_to_kv_block_ids[: ctx.total_request_count].tolist(),
    )


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_allocation_failure_in_patched_add_request_changes_nothing(runtime_patches, monkeypatch, policy):
    overflow = mcore.import_module(mcore.DYNAMIC_CONTEXT_MODULE).BlockOverflowError
    with prefix_caching_context(policy) as ctx:
        add_and_collect_writes(ctx, make_request(1, P32))
        before = books(ctx)
        second = make_request(2, P32 + list(range(2000, 2040)))  # matches 2 blocks, needs 3 more
        allocator = ctx.kv_block_allocator
        monkeypatch.setattr(allocator, "allocate_memory_blocks", lambda n: None)
        with pytest.raises(overflow):
            ctx.add_request(second)
        assert books(ctx) == before
        assert MATCHED_RANGES.get(second) is None
        monkeypatch.undo()
        # The same request is admitted afterwards, and its recomputed tokens still avoid R1's blocks.
        writes = add_and_collect_writes(ctx, second)
        shared = set(ctx.request_to_kv_block_ids[0][:2].tolist())
        assert not shared & {block for _, block in writes}


class InjectedFault(RuntimeError):
    pass


def three_owners_of_one_prompt(ctx) -> None:
    """R1, R2, R3 with the same 40-token prompt: 2 shared hashed blocks (ref count 3 each) and one
    private partial block per request."""
    for request_id in (1, 2, 3):
        ctx.add_request(make_request(request_id, P32 + list(range(3000, 3008))))


def raise_injected(*_args, **_kwargs):
    raise InjectedFault("injected")


@pytest.fixture
def install_megatron_ext_release(monkeypatch, mcore_series):
    """Make ``KVBlockAllocator.release_memory_blocks`` megatron-ext's fixed release, on every release.

    On a tree carrying the source patch of fix 1 (0.17/0.18 series) the tree's own method is the
    one under test; elsewhere the runtime function is installed, also on 0.19, where upstream's fix
    makes the runtime patch unnecessary but is not exception safe (the fault tests fail there).
    """
    if SOURCE_PATCHED and mcore_series in ("0.17", "0.18"):
        return
    allocator_cls = mcore.import_module(mcore.KV_BLOCK_ALLOCATOR_MODULE).KVBlockAllocator
    monkeypatch.setattr(allocator_cls, "release_memory_blocks", release_blocks_per_occurrence)


@pytest.mark.parametrize("where", ["entry", "after-hash-map-pops"])
def test_exception_inside_patched_release_restores_the_books(install_megatron_ext_release, monkeypatch, where):
    """REF_ZERO release of all three owners in one call (as a step finishing them does) fails
    inside ``_deregister_blocks``: at its entry, or in its Mamba hook, which runs after the hash-map
    entries were popped and before hashes, ref counts and free pool are reset.

    megatron-ext's release puts everything back."""
    with prefix_caching_context("REF_ZERO") as ctx:
        three_owners_of_one_prompt(ctx)
        allocator = ctx.kv_block_allocator
        shared = ctx.request_to_kv_block_ids[0][:2].tolist()
        assert [int(allocator.block_ref_counts[b]) for b in shared] == [3, 3]
        before = books(ctx)
        if where == "entry":
            monkeypatch.setattr(allocator, "_deregister_blocks", raise_injected)
        else:
            monkeypatch.setattr(allocator, "on_blocks_deregistered", raise_injected)
        with pytest.raises(InjectedFault):
            ctx.release_memory_blocks_from_request_indexes(torch.tensor([0, 1, 2]))
        assert books(ctx) == before
        if where == "entry":
            monkeypatch.delattr(allocator, "_deregister_blocks")  # the class's method again
        else:
            allocator.on_blocks_deregistered = None
        ctx.release_memory_blocks_from_request_indexes(torch.tensor([0, 1, 2]))
        assert allocator.block_ref_counts.tolist() == [0] * len(allocator.block_ref_counts)
        assert dict(allocator.kv_hash_to_block_id) == {}
        assert free_count(allocator) == block_count(allocator) - 1  # all but the dummy block


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_release_more_often_than_held_changes_nothing(install_megatron_ext_release, policy):
    """A fourth release of the shared blocks (held by three) raises RefCountUnderflowError and
    leaves every ref count, hash and the free pool as they were; LRU and REF_ZERO alike."""
    # The source patch cannot import megatron-ext's error class and raises a ValueError (its base).
    error = ValueError if SOURCE_PATCHED else RefCountUnderflowError
    with prefix_caching_context(policy) as ctx:
        three_owners_of_one_prompt(ctx)
        shared = ctx.request_to_kv_block_ids[0][:2]
        before = books(ctx)
        first, second = shared.tolist()
        expected = rf"KV blocks \[{first}, {second}\] would make their ref counts negative"
        with pytest.raises(error, match=expected):
            ctx.kv_block_allocator.release_memory_blocks(shared.repeat(4))
        assert books(ctx) == before
