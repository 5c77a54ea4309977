"""Property test: ``apply()`` / ``revert()`` / ``apply()`` interleaved with a live LRU context.

A hypothesis ``RuleBasedStateMachine`` drives a real ``DynamicInferenceContext`` (LRU, 8 usable
KV blocks of 16 tokens, whole-prompt prefills) and switches megatron-ext's runtime patches on and
off between operations, as a job that reverts and re-applies the fix set would. While the patches
are reverted it only does what the released code does correctly (fresh prompts that match nothing,
admitted without eviction; one request retiring at a time; plain evictions, whose parent-first
order on 0.17/0.18 may leave a cached child without its parent); while they are applied anything
goes: shared prompts, siblings retiring together, evictions under pressure, weight-update flushes.

After every operation with the patches applied the books are read from the real allocator:
the hash map and ``block_hashes`` name each other (one hash, one block), ref counts equal the
owners in live block tables, every block is free, held or cached exactly once, the prefix forest
has no registered block whose parent is gone and its child counts are exact, and every prompt
seen so far can be looked up (``_find_kv_match_count`` never raises ``KeyError``). Before the
resync of issue 20 section 2 this failed on 0.17.1 and 0.18.2 within a few examples.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

import megatron_ext
from megatron_ext.cpu_backend import cuda_on_cpu
from megatron_ext.harness.factories import small_prefix_caching_context

from .conftest import SOURCE_PATCHED, UNPATCHED
from .context_factory import BLOCK, make_request

KV_BYTES_PER_BLOCK = 2 * 2 * BLOCK * 4 * 16 * 4  # K and V, 2 layers, 16 tokens, 4 heads x 16, fp32
USABLE = 8
SETTINGS = settings(max_examples=15, stateful_step_count=30, deadline=None, derandomize=True,
                    database=None, print_blob=False, suppress_health_check=list(HealthCheck))
#: Operations by kind over the whole run, checked non-zero so a pass says they happened.
STATS: Counter = Counter()


def prompt(blocks: tuple[int, ...]) -> list[int]:
    """Whole blocks; block k's contents are one of two per position, so prefixes are shared."""
    return [1000 * (k + 1) + 100 * bit + i for k, bit in enumerate(blocks) for i in range(BLOCK)]


PROMPTS = st.lists(st.integers(0, 1), min_size=1, max_size=3).map(tuple)


class LifecycleMachine(RuleBasedStateMachine):
    @initialize()
    def build(self) -> None:
        megatron_ext.apply()
        self.applied = True
        self.ctx = small_prefix_caching_context(
            "LRU", block_size_tokens=BLOCK, buffer_size_gb=(USABLE + 1) * KV_BYTES_PER_BLOCK / 2**30,
            max_requests=8, max_tokens=256, max_sequence_length=256)
        self.live: list[int] = []  # request ID per live row
        self.seen: set[tuple[int, ...]] = set()
        self.next_id = 0

    @property
    def allocator(self):
        return self.ctx.kv_block_allocator

    # -- operations ---------------------------------------------------------------------------

    @precondition(lambda self: len(self.live) < 8)
    @rule(blocks=PROMPTS)
    def admit(self, blocks) -> None:
        hashes = make_request(0, prompt(blocks)).precomputed_block_hashes
        if not self.applied:  # the released code without faults: no match, no eviction
            fresh = not any(h in self.allocator.kv_hash_to_block_id for h in hashes)
            if not fresh or self.allocator.total_avail < len(blocks):
                return
        req = make_request(self.next_id, prompt(blocks))
        self.next_id += 1
        if not all(self.ctx.check_availability(req)):
            return
        self.ctx.add_request(req)
        self.ctx.total_request_count, self.ctx.active_token_count = len(self.live) + 1, 0
        self.ctx.num_prefill_requests = 0
        self.live.append(req.request_id)
        self.seen.add(blocks)
        STATS["admit"] += 1

    @precondition(lambda self: self.live)
    @rule(mask=st.integers(1, 255))
    def retire(self, mask: int) -> None:
        rows = [r for r in range(len(self.live)) if mask >> r & 1] or [0]
        if not self.applied:
            rows = rows[:1]  # siblings retiring together leak on released 0.17/0.18 (fault 1)
        self.ctx.release_memory_blocks_from_request_indexes(torch.tensor(rows))
        keep = [r for r in range(len(self.live)) if r not in rows]
        tables = self.ctx.request_to_kv_block_ids[keep].clone()
        counts = self.ctx.request_kv_block_counts[keep].clone()
        self.ctx.request_to_kv_block_ids[: len(keep)] = tables
        self.ctx.request_kv_block_counts[: len(keep)] = counts
        self.ctx.request_to_kv_block_ids[len(keep):] = -1
        self.ctx.request_kv_block_counts[len(keep):] = 0
        self.live = [self.live[r] for r in keep]
        self.ctx.total_request_count = len(self.live)
        self.ctx.prefix_cache_lru_clock += 1
        STATS["retire"] += 1

    @rule(n=st.integers(1, 3))
    def evict(self, n: int) -> None:
        self.allocator.evict_lru_blocks(n)
        STATS["evict"] += 1

    @precondition(lambda self: self.applied)
    @rule()
    def revert(self) -> None:
        megatron_ext.revert()
        self.applied = False
        STATS["revert"] += 1

    @precondition(lambda self: not self.applied)
    @rule()
    def apply(self) -> None:
        megatron_ext.apply()
        self.applied = True
        STATS["apply"] += 1

    @precondition(lambda self: self.applied)
    @rule()
    def weight_update(self) -> None:
        megatron_ext.invalidate_prefix_cache(self.ctx)
        STATS["weight update"] += 1

    # -- the books ----------------------------------------------------------------------------

    @invariant()
    def books_balance(self) -> None:
        if not hasattr(self, "ctx") or not self.applied:
            return
        allocator = self.allocator
        hashes = allocator.block_hashes.tolist()
        refs = allocator.block_ref_counts.tolist()
        registered = {b: h for b, h in enumerate(hashes) if h != -1}
        assert allocator.kv_hash_to_block_id == {h: b for b, h in registered.items()}
        owners: Counter = Counter()
        for row in range(len(self.live)):
            owners.update(self.ctx.request_to_kv_block_ids[row][: int(self.ctx.request_kv_block_counts[row])].tolist())
        free = allocator.block_bag[: allocator.total_avail].tolist()
        assert len(set(free)) == len(free)
        for block in range(USABLE):
            assert refs[block] == owners[block], f"block {block}: ref {refs[block]}, {owners[block]} owners"
            states = [block in free, refs[block] > 0, refs[block] == 0 and block in registered]
            assert sum(states) == 1, f"block {block}: free/held/cached {states}"
        for blocks in self.seen:  # a lookup of any prefix seen never raises KeyError
            self.ctx._find_kv_match_count(make_request(0, prompt(blocks)), 0, len(blocks))
        self.check_forest({b: h for b, h in enumerate(allocator.block_hashes.tolist()) if h != -1})

    def check_forest(self, registered: dict[int, int]) -> None:
        parents = self.allocator.block_parent_id.tolist()
        counts = self.allocator.block_child_count.tolist()
        children = Counter(parents[b] for b in registered if parents[b] >= 0)
        for block in range(USABLE):
            if block in registered and parents[block] >= 0:
                assert parents[block] in registered, f"block {block}'s parent {parents[block]} is gone"
            assert counts[block] == children[block], f"block {block}: {counts[block]} children counted"


@pytest.mark.skipif(UNPATCHED or SOURCE_PATCHED, reason="switches megatron-ext's runtime patches on and off")
def test_apply_revert_apply_with_a_live_lru_context(capsys):
    STATS.clear()
    try:
        with cuda_on_cpu():
            run_state_machine_as_test(LifecycleMachine, settings=SETTINGS)
    finally:
        megatron_ext.revert()
    with capsys.disabled():
        print(f"\n[lifecycle properties] {dict(sorted(STATS.items()))}")
    assert all(STATS[k] > 0 for k in ("admit", "retire", "evict", "revert", "apply", "weight update"))
