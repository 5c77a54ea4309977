"""Faults 3-6: LRU prefix caching under memory pressure, each from its smallest trigger.

A real ``DynamicInferenceContext`` on the CPU with 4 usable KV blocks of 16 tokens (block 4 is
the dummy block); ``add_request`` takes new blocks from the end of the free pool, so a fresh pool
hands out [2, 3] before [0, 1]. One engine step = the LRU clock advances, requests are added, and
finished requests release their blocks (``release_memory_blocks_from_request_indexes``).
Prompts: A and B are two blocks each, C one block.

The expected books are those of megatron-core 0.19's own code where it has the fix (faults 3
and 4: the patched 0.17/0.18 must match them exactly). Every test runs with the runtime patches
applied in the listed order and in reverse order (they compose in any order). With
``MEGATRON_EXT_TEST_UNPATCHED=1`` they fail on the releases that have the fault: 3, 4 and the
``check_availability`` test on 0.17/0.18, 5 on 0.19, 6 everywhere.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_ext.cpu_backend import cuda_on_cpu
from megatron_ext.harness.factories import small_prefix_caching_context
from megatron_ext.patches.lru_leaf_first_eviction import PrefixForestError, evict_leaves_first, prefix_forest

from .allocator_factory import block_count, free_ids, make_allocator
from .context_factory import BLOCK, finish_chunk, make_request

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

A = list(range(1000, 1032))
B = list(range(2000, 2032))
C = list(range(3000, 3016))
D = list(range(4000, 4016))
DUMMY = 4  # the dummy block of a 4-block pool
KV_BYTES_PER_BLOCK = 2 * 2 * BLOCK * 4 * 16 * 4  # K and V, 2 layers, 16 tokens, 4 heads x 16, fp32


def hashes(tokens: list[int]) -> list[int]:
    return make_request(0, tokens).precomputed_block_hashes


@contextlib.contextmanager
def lru_context(usable_blocks: int = 4, max_tokens: int = 256):
    """A real LRU context with ``usable_blocks`` KV blocks (and the dummy block), inside the CUDA
    stand-ins (0.17's ``add_request`` asks CUDA for its device)."""
    with cuda_on_cpu():
        yield small_prefix_caching_context(
            "LRU", block_size_tokens=BLOCK, buffer_size_gb=(usable_blocks + 1) * KV_BYTES_PER_BLOCK / 2**30,
            max_requests=8, max_tokens=max_tokens, max_sequence_length=max_tokens,
        )


def four_block_lru_context():
    return lru_context()


def predecessor_books(total: int, rows: list[list[int]]) -> tuple[list[int], list[int]]:
    """``(block_parent_id, block_child_count)`` as 0.19 keeps them for the block-table ``rows``
    given: each block's parent is the entry before it in its row (-1 first)."""
    parents, children = [-1] * total, [0] * total
    for row in rows:
        for parent, block in zip([-1, *row[:-1]], row):
            parents[block] = parent
    for block in {block for row in rows for block in row}:
        if parents[block] >= 0:
            children[parents[block]] += 1
    return parents, children


def step(ctx, *requests) -> None:
    """One engine step in which ``requests`` (id, tokens) are added and then finish."""
    ctx.prefix_cache_lru_clock += 1
    for request_id, tokens in requests:
        ctx.add_request(make_request(request_id, tokens))
    retire_all(ctx)


def retire_all(ctx) -> None:
    """Every request in the context finishes: its blocks are released and its row dropped."""
    ctx.release_memory_blocks_from_request_indexes(torch.arange(ctx.total_request_count))
    ctx.total_request_count = ctx.active_token_count = ctx.num_prefill_requests = 0


def cached(ctx) -> dict[int, int]:
    """Block ID -> hash of every registered block."""
    return {b: h for b, h in enumerate(ctx.kv_block_allocator.block_hashes.tolist()) if h != -1}


def forest(ctx) -> tuple[list[int], list[int]]:
    allocator = ctx.kv_block_allocator
    return allocator.block_parent_id.tolist(), allocator.block_child_count.tolist()


def table(ctx, count: int, row: int = 0) -> list[int]:
    return ctx.request_to_kv_block_ids[row][:count].tolist()


def test_fault3_parent_outlives_its_cached_child(runtime_patches_either_order):
    a1, a2 = hashes(A)
    b1, b2 = hashes(B)
    (c1,) = hashes(C)
    with four_block_lru_context() as ctx:
        step(ctx, (1, A))  # A -> blocks [2, 3], cached at ts 1
        step(ctx, (2, B))  # B -> blocks [0, 1], cached at ts 2: the pool is full of cached blocks
        assert cached(ctx) == {0: b1, 1: b2, 2: a1, 3: a2}
        assert forest(ctx) == ([-1, 0, -1, 2, -1], [1, 0, 1, 0, 0])
        step(ctx, (3, C))  # evicts one block: A's leaf (3, ts 1), not its parent (2, ts 1)
        assert cached(ctx) == {0: b1, 1: b2, 2: a1, 3: c1}
        assert forest(ctx) == ([-1, 0, -1, -1, -1], [1, 0, 0, 0, 0])
        ctx.prefix_cache_lru_clock += 1
        again = make_request(4, A)
        ctx.add_request(again)  # released 0.17/0.18: KeyError (block 3's parent hash a1 is gone)
        allocator = ctx.kv_block_allocator
        assert table(ctx, 2) == [2, 1]  # matched A's parent, evicted B's leaf for its 2nd block
        assert allocator.block_ref_counts.tolist() == [0, 1, 1, 0, 0]
        assert allocator.kv_hash_to_block_id == {a1: 2, a2: 1, b1: 0, c1: 3}
        assert forest(ctx) == ([-1, 2, -1, -1, -1], [0, 0, 1, 0, 0])
        assert allocator.block_timestamps.tolist() == [2, 4, 4, 3, 0]
        assert free_ids(allocator) == []


def test_fault4_matched_blocks_are_pinned_before_allocating(runtime_patches_either_order):
    a1, a2 = hashes(A)
    with four_block_lru_context() as ctx:
        step(ctx, (1, A))  # [2, 3], ts 1: the oldest cached blocks
        step(ctx, (2, B))  # [0, 1], ts 2
        ctx.prefix_cache_lru_clock += 1
        longer = make_request(3, A + list(range(4000, 4032)))  # matches [2, 3], needs 2 new
        assert ctx.check_availability(longer)[2]
        ctx.add_request(longer)
        # released 0.17/0.18: [2, 3, 2, 3], A's own matched blocks evicted and handed back
        assert table(ctx, 4) == [2, 3, 1, 0]
        x1, x2 = hashes(A + list(range(4000, 4032)))[2:]
        allocator = ctx.kv_block_allocator
        assert allocator.block_ref_counts.tolist() == [1, 1, 1, 1, 0]
        assert allocator.kv_hash_to_block_id == {a1: 2, a2: 3, x1: 1, x2: 0}
        assert forest(ctx) == ([1, 3, -1, 2, -1], [0, 1, 1, 1, 0])
        assert allocator.block_timestamps.tolist() == [3, 3, 3, 3, 0]


def test_add_request_matches_its_prefix_once(runtime_patches_either_order):
    """The admission path computes a request's prefix match once: lru-pin-before-allocate (0.17/0.18)
    hands the match it computed to the released add_request instead of letting it match again.
    Regression guard for the admission cost (benchmarks/README.md), on every release."""
    with four_block_lru_context() as ctx:
        step(ctx, (1, A))
        step(ctx, (2, B))  # the pool is full of cached blocks: allocation must evict
        ctx.prefix_cache_lru_clock += 1
        compute, calls = ctx._compute_prefix_match, []

        def counted(req, chunk, *more, **options):
            calls.append((req.request_id, chunk))
            return compute(req, chunk, *more, **options)

        ctx._compute_prefix_match = counted
        ctx.add_request(make_request(3, A + list(range(4000, 4032))))
        assert calls == [(3, 64)]
        assert ctx.__dict__["_compute_prefix_match"] is counted  # the instance's own attribute is back
        assert table(ctx, 4) == [2, 3, 1, 0]


def test_fault4_check_availability_does_not_count_unpinned_matches_as_evictable(runtime_patches_either_order):
    with four_block_lru_context() as ctx:
        step(ctx, (1, A))
        step(ctx, (2, B))
        ctx.prefix_cache_lru_clock += 1
        # Matches A's 2 cached blocks and needs 3 more: 0 free + 4 cached, of which 2 are the
        # request's own matches, leaves 2 evictable. Released 0.17/0.18 say it fits.
        longest = make_request(3, A + list(range(5000, 5048)))
        assert ctx.check_availability(longest) == (True, True, False)
        assert ctx.total_request_count == 0


def test_fault5_matched_block_registered_again_by_the_next_chunk(runtime_patches_either_order):
    a1, a2 = hashes(A)
    with four_block_lru_context() as ctx:
        step(ctx, (1, A))  # A -> [2, 3], cached
        ctx.prefix_cache_lru_clock += 1
        again = make_request(2, A)
        ctx.add_request(again, 24)  # the first chunk ends inside matched block 3
        finish_chunk(ctx, again, 24)
        ctx.add_request(again, 8)  # "range 1" registers block 3 again
        allocator = ctx.kv_block_allocator
        assert table(ctx, 2) == [2, 3]
        assert allocator.kv_hash_to_block_id == {a1: 2, a2: 3}
        if hasattr(allocator, "block_child_count"):  # 0.19, or 0.17/0.18 with leaf-first eviction
            assert forest(ctx) == ([-1, -1, -1, 2, -1], [0, 0, 1, 0, 0])  # released 0.19: 2 children
        retire_all(ctx)
        assert allocator.block_ref_counts.tolist() == [0, 0, 0, 0, 0]
        # Released 0.19: "leaf peel evicted 1 of 2 requested ... parent graph is not a forest".
        assert allocator.evict_lru_blocks(2)
        assert cached(ctx) == {} and allocator.kv_hash_to_block_id == {}
        assert free_ids(allocator) == [0, 1, 2, 3]


def test_fault6_paused_request_resumes_into_an_evictable_block(runtime_patches_either_order):
    (c1,) = hashes(C)
    prompt = A + list(range(6000, 6016))  # 48 tokens: 3 full blocks, the last token at offset 15
    with four_block_lru_context() as ctx:
        step(ctx, (1, C))  # C -> block 3, cached
        ctx.prefix_cache_lru_clock += 1
        ctx.add_request(make_request(2, prompt))  # -> [0, 1, 2]: no free block left
        allocator = ctx.kv_block_allocator
        assert (free_ids(allocator), cached(ctx)[3]) == ([], c1)
        assert ctx.request_last_kv_block_offset[0] == BLOCK - 1  # its next token needs a block
        ctx.paused_request_count = 1  # update_requests paused it for that block
        ctx.prefix_cache_lru_clock += 1
        active, still_paused = ctx.resume_paused_requests(0, torch.tensor([2]))
        # Released code: (0, tensor([2])): it stays paused, and with nothing else active the
        # engine step fails "active_request_count == 0 with no hidden chunked prefill".
        assert (active, still_paused.tolist(), ctx.paused_request_count) == (1, [], 0)
        assert table(ctx, 4) == [0, 1, 2, 3]  # C's cached block 3 was evicted for it
        assert 3 not in cached(ctx) and c1 not in allocator.kv_hash_to_block_id
        assert allocator.block_ref_counts.tolist() == [1, 1, 1, 1, 0]
        assert ctx.request_kv_block_counts[0] == 4 and ctx.request_last_kv_block_id[0] == 3


def test_fault6_evicts_only_the_blocks_resumed_requests_take(runtime_patches_either_order):
    # Two paused requests, an empty free pool, two cached blocks: only the request whose next
    # token crosses a block boundary takes a block, so one cached block is evicted, not two (#5995)
    (c1,), (d1,) = hashes(C), hashes(D)
    full = list(range(6000, 6016))  # one full block, registered while held
    (f1,) = hashes(full)
    with four_block_lru_context() as ctx:
        step(ctx, (1, C))  # C -> block 3, cached at ts 1
        step(ctx, (2, D))  # D -> block 2, cached at ts 2
        ctx.prefix_cache_lru_clock += 1
        ctx.add_request(make_request(3, full))  # -> [1]: its next token needs a block
        ctx.add_request(make_request(4, list(range(7000, 7010))))  # -> [0]: room for 6 more tokens
        allocator = ctx.kv_block_allocator
        assert free_ids(allocator) == [] and cached(ctx) == {1: f1, 2: d1, 3: c1}
        ctx.paused_request_count = 2  # update_requests paused both
        ctx.prefix_cache_lru_clock += 1
        active, still_paused = ctx.resume_paused_requests(0, torch.tensor([3, 4]))
        # Released code: (0, [3, 4]): nothing resumes. The patch before #5995's bound evicted
        # both cached blocks (one per resumed request) and left block 2 free.
        assert (active, still_paused.tolist(), ctx.paused_request_count) == (2, [], 0)
        assert table(ctx, 2, row=0) == [1, 3] and table(ctx, 1, row=1) == [0]  # C's block 3, the older
        assert cached(ctx) == {1: f1, 2: d1} and allocator.kv_hash_to_block_id == {f1: 1, d1: 2}
        assert free_ids(allocator) == [] and allocator.block_ref_counts.tolist() == [1, 1, 0, 1, 0]
        assert ctx.request_kv_block_counts[:2].tolist() == [2, 1]
        assert ctx.request_last_kv_block_id[:2].tolist() == [3, 0]


def test_fault6_nothing_is_evicted_when_the_free_pool_suffices(runtime_patches_either_order):
    with four_block_lru_context() as ctx:
        step(ctx, (1, C))  # C -> block 3, cached
        ctx.prefix_cache_lru_clock += 1
        ctx.add_request(make_request(2, A))  # -> [1, 2]; block 0 stays free
        ctx.paused_request_count = 1
        active, _ = ctx.resume_paused_requests(0, torch.tensor([2]))
        assert active == 1 and table(ctx, 3) == [1, 2, 0]
        assert cached(ctx)[3] == hashes(C)[0]  # the cached block survived


def test_leaf_first_eviction_refuses_a_cyclic_forest_and_evicts_nothing():
    """A block-hash collision could link two cached blocks as each other's parent."""
    allocator = make_allocator("LRU", total_count=4)
    blocks = allocator.allocate_memory_blocks(2).tolist()
    allocator.block_hashes[torch.tensor(blocks)] = torch.tensor([11, 22])
    allocator.kv_hash_to_block_id.update({11: blocks[0], 22: blocks[1]})
    parent_id, child_count = prefix_forest(allocator)
    parent_id[torch.tensor(blocks)] = torch.tensor(blocks[::-1])
    child_count[torch.tensor(blocks)] = 1
    allocator.block_ref_counts[torch.tensor(blocks)] = 0
    with pytest.raises(PrefixForestError, match="found 0 evictable leaves of 1 needed among 2 cached"):
        evict_leaves_first(allocator, 1)
    assert allocator.kv_hash_to_block_id == {11: blocks[0], 22: blocks[1]}
    assert free_ids(allocator) == [0]


def test_registration_is_narrowed_to_blocks_not_holding_their_hash():
    """``unregistered``: the hash map answers for blocks it points at and hashes it does not know;
    a block whose hash the map gives to another block (one hash on two blocks) is read from
    ``block_hashes``. Block 1 holds 11 (map -> 1), block 2 holds 22 though the map gives 22 to
    block 3, block 0 holds nothing."""
    from types import SimpleNamespace

    from megatron_ext.patches.lru_register_once import unregistered

    allocator = SimpleNamespace(block_hashes=torch.tensor([-1, 11, 22, 22, -1]),
                                kv_hash_to_block_id={11: 1, 22: 3})
    ids, hashes_, parents = unregistered(allocator, [0, 1, 2, 4], [33, 11, 22, 22], [0, 33, 11, 11])
    assert (ids, hashes_, parents) == ([0, 4], [33, 22], [0, 11])
    assert unregistered(allocator, [1, 2], [11, 22], None) == ([], [], None)
    assert unregistered(allocator, [0, 4], [44, 55], None) == ([0, 4], [44, 55], None)


def test_long_and_short_registration_runs_link_each_block_to_its_table_predecessor(runtime_patches_either_order):
    """A 40-block prompt registers one run longer than the scalar-write limit of the 0.17/0.18
    backport (vectorized links), a 35-block match plus 5 new blocks a short one (scalar writes
    through NumPy views); the books are 0.19's own. A reset clears the forest in place, as 0.19's
    ``reset`` does (NumPy views of the tables stay valid)."""
    long_prompt = list(range(10_000, 10_000 + 40 * BLOCK))
    extended = long_prompt[: 35 * BLOCK] + list(range(20_000, 20_000 + 5 * BLOCK))
    with lru_context(usable_blocks=95, max_tokens=2048) as ctx:
        ctx.prefix_cache_lru_clock += 1
        ctx.add_request(make_request(1, long_prompt))
        ctx.add_request(make_request(2, extended))
        first, second = table(ctx, 40), table(ctx, 40, row=1)
        assert second[:35] == first[:35] and not set(second[35:]) & set(first)
        expected_parents, expected_children = predecessor_books(block_count(ctx.kv_block_allocator), [first, second])
        assert expected_children[first[34]] == 2  # first[35] and second[35]
        assert forest(ctx) == (expected_parents, expected_children)
        allocator = ctx.kv_block_allocator
        parent_id, child_count = allocator.block_parent_id, allocator.block_child_count
        ctx.reset()
        assert allocator.block_parent_id is parent_id and allocator.block_child_count is child_count
        assert forest(ctx) == ([-1] * block_count(allocator), [0] * block_count(allocator))
