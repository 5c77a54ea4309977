"""Model-based property tests of megatron-core's real ``KVBlockAllocator`` (prefix caching on).

A hypothesis ``RuleBasedStateMachine`` drives the allocator the way ``DynamicInferenceContext``
does, with megatron-ext's runtime patches applied (fixture ``runtime_patches``; on 0.19 the
release patch is not needed and upstream's code runs), next to a reference model of owners
(``allocator_model.OwnerModel``). Each hypothesis step is one engine step (``EnginePlan``) made
of allocator operations, each one call into the allocator, in this order:

- release: the requests that finish in this step release together, in one
  ``release_memory_blocks`` call, so a block shared by k of them appears k times, mixed with
  their private (unhashed) blocks; sometimes every live request finishes (a drain);
- registration: a later prefill chunk completes some of a request's blocks and their hashes are
  registered (``register_kv_block_hashes``, with ``parent_hashes`` where the release takes them:
  0.19, or 0.17/0.18 with megatron-ext's leaf-first eviction); or a chunk that ended inside a
  block the request holds by hash makes the next chunk register that block again (fault 5: a
  no-op when registration is idempotent);
- decode: one ``allocate_memory_blocks`` call for every request that needs one more block;
- admission (``add_request``): match the longest cached prefix of the prompt by hash, pin the
  matched blocks (``block_ref_counts[ids] += 1`` and, under LRU, ``update_timestamps``), then
  allocate the other blocks, which may be refused when the pool is exhausted (the pin is then
  rolled back) or, under LRU, evict cached zero-ref blocks; maybe register the complete blocks;
- ``reset()``, rarely, at the start of a step.

The LRU clock (``context.prefix_cache_lru_clock``) advances once per operation. Prompts are
drawn from a small space and often repeated (N samples of one prompt), so prefixes are shared.

After every operation the allocator must agree with the model: each block's ref count equals its
live owners, never negative; the free IDs (``block_bag[:total_avail]``) are unique, never the
dummy block, disjoint from live and cached blocks, and with them account for every block (no
leak); ``kv_hash_to_block_id`` and ``block_hashes`` agree with each other and with the model;
REF_ZERO leaves no hashed block at ref 0; LRU keeps released hashed blocks in the hash map and
evictable, with the model's timestamps; an allocation is refused exactly when the model says the
free plus evictable blocks do not suffice (``is_memory_available`` agrees), evicts exactly the
missing number of blocks, only cached ones (never a pinned block), oldest first; when no request
is live every block is free or cached. On 0.19 LRU the evicted set must equal upstream's
leaf-peel choice, ``block_parent_id`` / ``block_child_count`` must match the model and prefix
chains stay whole (a registered block's parent is registered); REF_ZERO keeps chains whole on
every release. 0.17/0.18's oldest-first ``evict_lru_blocks`` may evict a parent before its child
(an upstream fault, fixed in 0.19, outside fix 1): there the broken chains are counted and
printed, not asserted.

Every run prints the number of allocator operations executed per policy and asserts it reached
``MIN_OPERATIONS``. Runs are reproducible: ``derandomize=True``, no example database.
"""

from __future__ import annotations

import functools
import random
import time
import types
from collections import Counter
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, note, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from megatron_ext import mcore
from megatron_ext.patches.lru_leaf_first_eviction import takes_parent_hashes
from megatron_ext.patches.release_refcount import RELEASE

from .allocator_factory import free_count, make_allocator
from .allocator_model import OwnerModel, parent_hash, prefix_hash
from .conftest import UNPATCHED

MIN_OPERATIONS = 10_000
STEPS_PER_EXAMPLE = 100
EXAMPLES = 60

SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS_PER_EXAMPLE,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: (policy, name) -> count, filled while the machines run; printed and checked per test.
STATS: Counter = Counter()


def decode_prompt(code: int) -> tuple[int, ...]:
    """The prompt described by one byte: ``code % 6`` complete blocks (0-5), whose contents are
    the low bits of ``code >> 3`` (2 possible contents per block, so prefixes are shared a lot)."""
    return tuple((code >> (3 + k)) & 1 for k in range(code % 6))


@dataclass(frozen=True)
class Arrival:
    prompt: tuple[int, ...]  # contents of its complete blocks
    reuse: int | None  # if set: take the reuse-th most recent prompt again (N samples of a prompt)
    private: int  # blocks never hashed: partial last prompt block, room to decode
    register_now: bool  # register its complete blocks in the same call, as add_request does


@dataclass(frozen=True)
class EnginePlan:
    """What happens to the allocator in one engine step, decoded from ``PLAN_BYTES`` bytes.

    One hypothesis choice per step (a byte string) keeps generation cheap enough for 10,000+
    operations per policy; all-zero bytes mean "nothing happens", so shrinking removes actions
    (the failing run prints each step's decoded plan).

    - byte 0: 252-255: ``reset()`` first; 236-251: every live request finishes (a drain);
    - bytes 1-8: a nibble per live request (in request order, at most 16): 12-15 it finishes,
      10-11 it gets one decode block, 7-9 a later prefill chunk completes 1-3 more of its blocks
      (their hashes are registered), 6 its last hashed block is registered again;
    - byte 9 seeds a shuffle of the released IDs (0: request order);
    - byte 10 % 4 requests arrive, request j described by bytes 11+4j .. 14+4j.

    Operations, in this order, each one call into the allocator: the release of all finishing
    requests together, one registration per completing request, one allocation for all decoding
    requests, one admission per arrival.
    """

    reset: bool
    finish: tuple[int, ...]  # indexes into the live requests (after a reset: none live)
    register: tuple[tuple[int, int], ...]  # (index, number of blocks)
    register_again: tuple[int, ...]
    decode: tuple[int, ...]
    order: int
    arrivals: tuple[Arrival, ...]

    @classmethod
    def decode_bytes(cls, plan: bytes, live: int) -> "EnginePlan":
        reset = plan[0] >= 252
        if reset:
            live = 0
        nibbles = [plan[1 + i // 2] >> 4 * (i % 2) & 15 for i in range(min(live, 16))]
        if 236 <= plan[0] < 252:
            nibbles = [15] * live
        arrivals = tuple(
            Arrival(
                prompt=decode_prompt(plan[j]),
                reuse=plan[j + 1] % 8 if plan[j + 1] % 16 >= 8 else None,
                private=plan[j + 2] % 3,
                register_now=bool(plan[j + 3] & 1),
            )
            for j in range(11, 11 + 4 * (plan[10] % 4), 4)
        )
        return cls(
            reset=reset,
            finish=tuple(i for i, n in enumerate(nibbles) if n >= 12),
            register=tuple((i, n - 6) for i, n in enumerate(nibbles) if 7 <= n < 10),
            register_again=tuple(i for i, n in enumerate(nibbles) if n == 6),
            decode=tuple(i for i, n in enumerate(nibbles) if 10 <= n < 12),
            order=plan[9],
            arrivals=arrivals,
        )


PLAN_BYTES = 23
PLANS = st.binary(min_size=PLAN_BYTES, max_size=PLAN_BYTES)


def release_ids(blocks: list[int]) -> torch.Tensor:
    """Block IDs as ``release_memory_blocks_from_request_indexes`` passes them."""
    return torch.tensor(blocks, dtype=torch.int32)


def upstream_lookup_raises(kv_hash_to_block_id: dict, prompt: tuple[int, ...]) -> bool:
    """Whether upstream ``_find_kv_match_count`` (searches from the end, assumes whole chains)
    would raise KeyError for this prompt: a cached block whose ancestor is gone."""
    hashes = [prefix_hash(prompt, k) for k in range(len(prompt))]
    for i in range(len(hashes) - 1, -1, -1):
        if hashes[i] in kv_hash_to_block_id:
            return any(h not in kv_hash_to_block_id for h in hashes[:i])
    return False


class AllocatorMachine(RuleBasedStateMachine):
    """The real allocator and the owner model, operation by operation."""

    POLICY = "REF_ZERO"

    def __init__(self) -> None:
        super().__init__()
        self.allocator = None
        self.model: OwnerModel | None = None
        self.lru = self.POLICY == "LRU"
        self.prompts_seen: list[tuple[int, ...]] = []
        self.log: list[str] = []  # what say() reported, when run outside hypothesis

    # ------------------------------------------------------------------------- helpers
    def count(self, name: str, n: int = 1) -> None:
        STATS[self.POLICY, name] += n

    def say(self, message: str) -> None:
        """Narrate an operation: hypothesis prints these notes with a failing example."""
        if currently_in_test_context():
            note(message)
        else:
            self.log.append(message)

    def tick(self, name: str) -> None:
        """One operation: advance the LRU clock (as the engine does per step) and count it."""
        self.allocator.context.prefix_cache_lru_clock += 1
        self.count("operations")
        self.count(name)

    @property
    def clock(self) -> int:
        return self.allocator.context.prefix_cache_lru_clock

    @property
    def chain_aware(self) -> bool:
        """0.19's LRU keeps prefix chains whole (``block_parent_id`` / leaf-peel eviction)."""
        return self.lru and hasattr(self.allocator, "block_parent_id")

    def live_rids(self) -> list[int]:
        return sorted(self.model.requests)

    def run_operations(self, operations) -> None:
        """Run allocator operations in order, checking the invariants between them (hypothesis
        checks them after the last one)."""
        for i, operation in enumerate(operations):
            if i:
                self.agrees_with_model()
            operation()

    def allocate(self, count: int) -> list[int] | None:
        """``allocate_memory_blocks(count)``: checks refusal and eviction choices against the
        model and applies the evictions to it; the caller hands the blocks to their owners."""
        allocator, model = self.allocator, self.model
        expect_ok = model.allocation_succeeds(count)
        assert bool(allocator.is_memory_available(count)) == expect_ok, "is_memory_available"
        cached_before = model.cached()
        free_before = model.free_count()
        expected_peel = None
        if self.chain_aware and expect_ok and count > free_before:
            expected_peel = model.lru_leaf_peel(count - free_before)
        got = allocator.allocate_memory_blocks(count)
        if got is None:
            assert not expect_ok, f"allocation of {count} refused with {free_before} free"
            self.count("allocations refused")
            self.say(f"  refused: {count} needed, {free_before} free, {len(cached_before)} cached")
            return None
        assert expect_ok, (
            f"allocated {count} blocks with only {free_before} free + {len(cached_before)} cached"
        )
        got = got.tolist()  # a view of block_bag: copy before the bag changes
        assert len(got) == count and len(set(got)) == count, f"allocated {got}"
        hashes_now = allocator.block_hashes.tolist()
        evicted = {b for b in cached_before if hashes_now[b] == -1}
        pinned_lost = [b for b in model.hash_of if b not in cached_before and hashes_now[b] == -1]
        assert not pinned_lost, f"evicted blocks {pinned_lost}, which live requests hold"
        assert len(evicted) == max(0, count - free_before), (
            f"evicted {sorted(evicted)} to allocate {count} with {free_before} free"
        )
        if evicted:
            self.count("blocks evicted", len(evicted))
            if expected_peel is not None:
                assert evicted == expected_peel, (
                    f"evicted {sorted(evicted)}, 0.19 leaf-peel order gives {sorted(expected_peel)}"
                )
            else:
                assert model.is_oldest_first(evicted, cached_before), (
                    f"evicted {sorted(evicted)} but kept older cached blocks "
                    f"{sorted(cached_before - evicted)} (timestamps {model.ts})"
                )
        orphans_before = set(model.orphans())
        model.deregister(sorted(evicted))
        new_orphans = set(model.orphans()) - orphans_before
        self.say(
            f"  allocated {got}"
            + (f", evicting cached {sorted(evicted)}" if evicted else "")
            + (f", which orphans cached {sorted(new_orphans)}" if new_orphans else "")
        )
        if new_orphans:
            # Only 0.17/0.18 LRU gets here (the invariant forbids orphans elsewhere).
            self.count("prefix chains broken by eviction")
        return got

    def register(self, req, count: int) -> None:
        ids, hashes, parents, stopped = self.model.registrable(req, count)
        if ids:
            if self.takes_parent_hashes:
                self.allocator.register_kv_block_hashes(ids, hashes, parent_hashes=parents)
            else:
                self.allocator.register_kv_block_hashes(ids, hashes)
            self.count("blocks registered", len(ids))
            self.say(f"  request {req.rid} registers blocks {ids}")
        if stopped:
            self.say(f"  request {req.rid}: next hash is held by another block, rest stays private")
        self.model.register(req, ids, hashes, parents, stopped)

    # ------------------------------------------------------------------------- operations
    def admit(self, arrival: Arrival) -> None:
        """add_request: match, pin, allocate (maybe evicting, maybe refused), maybe register."""
        self.tick("admissions")
        allocator, model = self.allocator, self.model
        if arrival.reuse is not None and self.prompts_seen:
            prompt = self.prompts_seen[-1 - arrival.reuse % len(self.prompts_seen)]
        else:
            prompt = arrival.prompt
            self.prompts_seen = (self.prompts_seen + [prompt])[-8:]
        private = max(arrival.private, 0 if prompt else 1)
        if upstream_lookup_raises(allocator.kv_hash_to_block_id, prompt):
            self.count("prompts upstream's lookup would raise KeyError on")
        req = model.new_request(prompt)
        matched = model.match(prompt)
        self.say(
            f"request {req.rid} arrives: prompt {prompt} + {private} private block(s), "
            f"matches {matched}"
        )
        matched_ids = torch.tensor(matched, dtype=torch.int32) if matched else None
        if matched:
            allocator.block_ref_counts[matched_ids] += 1
            if self.lru:
                allocator.update_timestamps(matched_ids)
            self.count("blocks matched", len(matched))
        model.pin(req, matched, self.clock)
        need = len(prompt) - len(matched) + private
        if need > 0:
            got = self.allocate(need)
            if got is None:
                if matched:  # roll the pin back, as 0.19's add_request does
                    allocator.block_ref_counts[matched_ids] -= 1
                model.unpin(req)
                return
            model.allocated(req, got, self.clock)
        if arrival.register_now:
            self.register(req, len(prompt))

    def decode(self, rids: list[int]) -> None:
        """update_requests: one allocation for every request that needs a new (private) block."""
        self.tick("decode allocations")
        self.say(f"requests {rids} need a decode block each")
        got = self.allocate(len(rids))
        if got is not None:
            for rid, block in zip(rids, got):
                self.model.allocated(self.model.requests[rid], [block], self.clock)

    def release(self, rids: list[int], order: int) -> None:
        """Requests finish in the same step: one release call, shared IDs once per owner, in the
        order ``release_memory_blocks_from_request_indexes`` gives (shuffled if ``order``)."""
        self.tick("release calls")
        blocks = [b for rid in rids for b in self.model.requests[rid].blocks]
        if order:
            random.Random(order).shuffle(blocks)
        if len(blocks) != len(set(blocks)):
            self.count("release calls with duplicated IDs")
        self.count("requests released", len(rids))
        self.say(f"requests {rids} finish: release_memory_blocks({blocks})")
        if blocks:
            self.allocator.release_memory_blocks(release_ids(blocks))
        self.model.release(rids)
        if self.lru:  # released hashed blocks stay cached and evictable
            evictable, cached = int(self.allocator.get_evictable_block_count()), self.model.cached()
            assert evictable == len(cached), (
                f"get_evictable_block_count() = {evictable}, but the released hashed blocks "
                f"{sorted(cached)} should all be evictable (ref counts "
                f"{self.allocator.block_ref_counts.tolist()})"
            )
        if not self.model.requests:
            self.count("drains")
            self.check_drained()

    def register_again(self, req) -> None:
        """A chunk ended inside the request's last hashed block: the next chunk's ``add_request``
        registers it again ("range 1"). Registration must change nothing (fault 5)."""
        self.tick("re-registrations")
        position, block = self.model.last_hashed_position(req)
        h = prefix_hash(req.prompt, position)
        self.say(f"  request {req.rid} registers its hashed block {block} again")
        if self.takes_parent_hashes:
            parent = parent_hash(req.prompt, position)
            self.allocator.register_kv_block_hashes([block], [h], parent_hashes=[parent])
        else:
            self.allocator.register_kv_block_hashes([block], [h])

    def register_chunk(self, req, count: int) -> None:
        """A later prefill chunk completes some of a request's blocks: register their hashes."""
        self.tick("registrations")
        self.register(req, min(count, req.unregistered_complete()))

    def reset(self) -> None:
        self.tick("resets")
        self.say("reset()")
        with mock.patch.object(torch.cuda, "current_device", return_value="cpu"):  # 0.17
            self.allocator.reset()
        self.allocator.context.prefix_cache_lru_clock = 0  # as DynamicInferenceContext.reset
        self.model.reset()
        self.check_drained()

    # ------------------------------------------------------------------------- rules
    @initialize(total_count=st.integers(4, 24))
    def build(self, total_count: int) -> None:
        self.allocator = make_allocator(self.POLICY, total_count=total_count, paused_count=1)
        self.model = OwnerModel(total_count, self.lru)
        # 0.19 takes the prefix chain's parent hashes; so do 0.17/0.18 with leaf-first eviction.
        self.takes_parent_hashes = takes_parent_hashes()
        self.say(f"{self.POLICY} allocator, {total_count} blocks ({total_count - 1} usable)")

    @rule(plan=PLANS)
    def engine_step(self, plan: bytes) -> None:
        """One engine step, as DynamicInferenceContext drives the allocator (see EnginePlan)."""
        self.count("engine steps")
        self.say("-- engine step")
        rids = self.live_rids()
        step = EnginePlan.decode_bytes(plan, len(rids))
        operations = []
        if step.reset:
            operations.append(self.reset)
        if step.finish:
            finishing = [rids[i] for i in step.finish]
            operations.append(functools.partial(self.release, finishing, step.order))
        for i, n in step.register:
            req = self.model.requests[rids[i]]
            if req.unregistered_complete():
                operations.append(functools.partial(self.register_chunk, req, n))
        for i in step.register_again:
            req = self.model.requests[rids[i]]
            if self.model.last_hashed_position(req) is not None:
                operations.append(functools.partial(self.register_again, req))
        if step.decode:
            operations.append(functools.partial(self.decode, [rids[i] for i in step.decode]))
        operations += [functools.partial(self.admit, arrival) for arrival in step.arrivals]
        self.run_operations(operations)

    # ------------------------------------------------------------------------- invariants
    def check_drained(self) -> None:
        """No request is live: every block is free or cached, and no block has an owner."""
        assert not self.model.requests
        owned = [(b, n) for b, n in enumerate(self.allocator.block_ref_counts.tolist()) if n]
        assert not owned, f"drained, but (block, ref count) {owned} still have owners"
        free = set(self.allocator.block_bag.tolist()[: free_count(self.allocator)])
        lost = set(range(self.model.usable)) - free - set(self.model.hash_of)
        assert not lost, f"drained, but blocks {sorted(lost)} are neither free nor cached"

    @invariant()
    def agrees_with_model(self) -> None:
        allocator, model = self.allocator, self.model
        if allocator is None:
            return
        ref_counts = allocator.block_ref_counts.tolist()
        assert min(ref_counts) >= 0, f"negative ref count: {ref_counts}"
        expected = model.ref_counts()
        assert ref_counts == expected, (
            f"ref counts {ref_counts} != live owners {expected} "
            f"(requests: { {r.rid: r.blocks for r in model.requests.values()} })"
        )

        hashes = allocator.block_hashes.tolist()
        hash_of = {b: h for b, h in enumerate(hashes) if h != -1}
        kv_map = allocator.kv_hash_to_block_id
        # The allocator's two views of the registry agree with each other ...
        assert len(kv_map) == len(hash_of), f"kv_hash_to_block_id {kv_map} vs block_hashes {hash_of}"
        for h, b in kv_map.items():
            assert hashes[b] == h, f"kv_hash_to_block_id[{h}] = {b} but block_hashes[{b}] = {hashes[b]}"
        # ... and with the model.
        assert hash_of == model.hash_of, f"block_hashes {hash_of} != model {model.hash_of}"
        assert kv_map == model.block_of

        usable = model.usable
        free = allocator.block_bag.tolist()[: free_count(allocator)]
        assert len(free) == len(set(free)), f"duplicate free IDs {sorted(free)}"
        assert all(0 <= b < usable for b in free), f"free IDs {sorted(free)} include the dummy block"
        live = model.live()
        registered = set(model.hash_of)
        for req in model.requests.values():  # fault 4 hands a matched block back as a new one
            assert len(set(req.blocks)) == len(req.blocks), f"block table {req.blocks} repeats an ID"
        assert not set(free) & live, f"live blocks {sorted(set(free) & live)} are in the free pool"
        assert not set(free) & registered, f"cached blocks {sorted(set(free) & registered)} are free"
        assert len(free) + len(live | registered) == usable, (
            f"leak: {usable} blocks, {len(free)} free, {len(live)} live, "
            f"{len(registered - live)} cached"
        )

        if self.lru:
            # Cached blocks (registered, not live) are checked above; get_evictable_block_count()
            # after every release and through is_memory_available() in allocate().
            stamps = allocator.block_timestamps.tolist()
            for b in live | registered:
                assert stamps[b] == model.ts[b], f"timestamp of block {b}: {stamps[b]} != {model.ts[b]}"
        else:
            zero_hashed = [b for b in registered if ref_counts[b] == 0]
            assert not zero_hashed, f"REF_ZERO left hashed blocks {zero_hashed} at ref count 0"

        if self.chain_aware or not self.lru:
            assert not model.orphans(), f"prefix chain broken: orphaned blocks {model.orphans()}"
        if self.chain_aware:
            parent_ids = allocator.block_parent_id.tolist()
            child_counts = allocator.block_child_count.tolist()
            children = Counter(model.parent_block_of[b] for b in registered)
            for b in range(model.total_count):
                assert parent_ids[b] == model.parent_block_of.get(b, -1), f"block_parent_id[{b}]"
                assert child_counts[b] == children.get(b, 0), f"block_child_count[{b}]"
            evictable = int(allocator.get_evictable_block_count())
            freeable = leaf_peel_reach(model.cached(), parent_ids, child_counts)
            assert evictable == freeable, (
                f"get_evictable_block_count() = {evictable}, but leaf-first eviction can free only "
                f"{freeable} of the cached blocks (child counts {child_counts})"
            )


def leaf_peel_reach(cached: set[int], parent_ids: list[int], child_counts: list[int]) -> int:
    """How many of the ``cached`` blocks a leaf-first eviction can free, peeling by the
    allocator's own ``block_parent_id`` / ``block_child_count`` (a parent whose child count
    never reaches 0 stays, with its ancestors)."""
    remaining = {b: child_counts[b] for b in cached}
    leaves = [b for b, n in remaining.items() if n == 0]
    freed = 0
    while leaves:
        block = leaves.pop()
        freed += 1
        parent = parent_ids[block]
        if parent in remaining:
            remaining[parent] -= 1
            if remaining[parent] == 0:
                leaves.append(parent)
    return freed


class RefZeroMachine(AllocatorMachine):
    POLICY = "REF_ZERO"


class LruMachine(AllocatorMachine):
    POLICY = "LRU"


MACHINES = {"REF_ZERO": RefZeroMachine, "LRU": LruMachine}


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_allocator_agrees_with_owner_model(runtime_patches, policy, capsys, record_property):
    """The state machine, ``EXAMPLES`` x ``STEPS_PER_EXAMPLE`` engine steps; prints what ran."""
    for key in [k for k in STATS if k[0] == policy]:
        del STATS[key]
    started = time.perf_counter()
    run_state_machine_as_test(MACHINES[policy], settings=SETTINGS)
    seconds = time.perf_counter() - started
    operations = STATS[policy, "operations"]
    patch_state = next(
        (r.state.value for r in runtime_patches if r.patch == "release-refcount"),
        "unpatched" if UNPATCHED else "absent",
    )
    details = ", ".join(
        f"{name} {n}"
        for (p, name), n in sorted(STATS.items())
        if p == policy and name not in ("operations", "engine steps")
    )
    record_property("allocator_operations", operations)
    with capsys.disabled():
        print(
            f"\n[allocator properties] megatron-core {mcore.installed_version()} {policy} "
            f"(release-refcount: {patch_state}): {operations} operations in "
            f"{STATS[policy, 'engine steps']} engine steps, {seconds:.1f} s ({details})"
        )
    assert operations >= MIN_OPERATIONS, f"only {operations} allocator operations executed"


def replay_shrunk_counterexample(machine) -> None:
    """The counterexample hypothesis shrinks to on unpatched 0.17/0.18, as explicit operations:
    three requests share one hashed block (the first registers it, two match it); two of them
    finish in the same step, so ``release_memory_blocks([b, b])``; then the third finishes."""
    machine.build(total_count=4)
    shared_prompt = Arrival(prompt=(0,), reuse=None, private=0, register_now=True)
    for _ in range(3):
        machine.admit(shared_prompt)
        machine.agrees_with_model()
    assert machine.model.ref_counts()[2] == 3
    machine.release([0, 2], order=0)  # two of the three owners finish together
    machine.agrees_with_model()
    machine.release([1], order=0)  # the last owner: block 2 is cached (LRU) or free (REF_ZERO)
    machine.agrees_with_model()
    machine.teardown()


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_shrunk_counterexample(runtime_patches, policy):
    """Fails unpatched on 0.17/0.18 (``MEGATRON_EXT_TEST_UNPATCHED=1``), passes patched and on 0.19."""
    replay_shrunk_counterexample(MACHINES[policy]())


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_model_catches_the_released_release(policy, mcore_series):
    """The model has teeth: with megatron-core's own ``release_memory_blocks`` (unwrapped, even
    if a patch is installed) the invariants fail exactly where the notes say the fault is."""
    machine = MACHINES[policy]()
    original = RELEASE.original()
    machine_build = machine.build

    def build_with_original_release(total_count: int) -> None:
        machine_build(total_count=total_count)
        machine.allocator.release_memory_blocks = types.MethodType(original, machine.allocator)

    machine.build = build_with_original_release
    if mcore_series in ("0.17", "0.18"):
        with pytest.raises(AssertionError, match=r"ref counts \[0, 0, 2, 0\] != live owners \[0, 0, 1, 0\]"):
            replay_shrunk_counterexample(machine)
    else:
        replay_shrunk_counterexample(machine)
