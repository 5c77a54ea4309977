"""Property test: ``apply()`` / ``revert()`` / ``apply()`` and weight updates interleaved with a
live context.

A hypothesis ``RuleBasedStateMachine`` drives a real ``DynamicInferenceContext`` (8 usable KV
blocks of 16 tokens; the test runs once per eviction policy, REF_ZERO and LRU) and switches
megatron-ext's runtime patches on and off between operations, as a job that reverts and re-applies
the fix set would. Prompts are 1-3 whole blocks, admitted whole or as a first prefill chunk (the
request then stays hidden in the last row until a later step prefills the rest). Each example is a
fresh job: the process-wide weight version starts at 0, and half the examples build the context and
admit requests before the first ``apply()`` (the patch cannot know the weights of what they cache).
While the patches are reverted it only does what the released code does correctly (fresh prompts
that match nothing, admitted without eviction; one request retiring at a time; plain evictions,
whose parent-first order on 0.17/0.18 may leave a cached child without its parent); while they are
applied anything goes: shared prompts, siblings retiring together, evictions under pressure.

Weight updates (fault 8), applied or reverted: ``swap_model_weights`` (called with bad arguments:
it raises ``TypeError`` before copying, which still counts as an update; flushed lazily at the next
prefix match or engine step), ``megatron_ext.invalidate_prefix_cache`` (applied only; exact
counts), and ``suspend`` / ``resume`` of the context's buffers (PERSIST). An update made while
reverted goes unseen until ``apply()`` bumps the version. A decode step runs the patch's step hook
and gives every prefilled request one token.

The model keeps the weight version (``_current_version``), the version the context last saw, the
context's epoch, the epoch each registered block's KV was computed in (the epoch its request's
prefill began in; -1 while the patch could not see it) and each request's expected
``token_weight_versions``. After every operation the context's epoch / seen version and the
process version equal the model's. With the patches applied: no prefix match (at admission, at a
chunk, or a lookup of every prompt seen) returns a block of an older epoch, and once the context
is in sync with the weights every registered block is of the current epoch; each request's tokens
carry the weight versions of the model (or are not recorded, where it ran unseen); and the books are
read from the real allocator: the hash map and ``block_hashes`` name each other (one hash, one
block), ref counts equal the owners in live block tables, every block is free, held or cached
exactly once, the prefix forest (LRU) has no registered block whose parent is gone and its child
counts are exact, and every prompt seen so far can be looked up (``_find_kv_match_count`` never
raises ``KeyError``). Before the resync of issue 20 section 2 this failed on 0.17.1 and 0.18.2
within a few examples; with a never-synced context taken for one seen at version 0 (fault 8's
weight versions before its fix) it fails too: a block cached before ``apply()`` matched in epoch 1.
"""

from __future__ import annotations

import importlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

import megatron_ext
from megatron_ext.cpu_backend import cuda_on_cpu
from megatron_ext.harness.factories import small_prefix_caching_context
from megatron_ext.patches import ALL_PATCHES
from megatron_ext.patches import weight_update_invalidation as fault8

from .allocator_factory import free_count
from .conftest import SOURCE_PATCHED, UNPATCHED
from .context_factory import BLOCK, finish_chunk, make_request

KV_BYTES_PER_BLOCK = 2 * 2 * BLOCK * 4 * 16 * 4  # K and V, 2 layers, 16 tokens, 4 heads x 16, fp32
USABLE = 8
UNSEEN = -1  # the epoch label of KV computed while the patch could not see the request
SETTINGS = settings(max_examples=10, stateful_step_count=25, deadline=None, derandomize=True,
                    database=None, print_blob=False, suppress_health_check=list(HealthCheck))
#: Operations by kind over one run, checked non-zero so a pass says they happened.
STATS: Counter = Counter()
FAULT8 = next(p for p in ALL_PATCHES if p.name == "weight-update-invalidation")


def prompt(blocks: tuple[int, ...]) -> list[int]:
    """Whole blocks; block k's contents are one of two per position, so prefixes are shared."""
    return [1000 * (k + 1) + 100 * bit + i for k, bit in enumerate(blocks) for i in range(BLOCK)]


PROMPTS = st.lists(st.integers(0, 1), min_size=1, max_size=3).map(tuple)
#: None: the whole (remaining) prompt; n: a chunk of n tokens where the prompt is longer.
CHUNKS = st.one_of(st.none(), st.integers(1, 47))


@dataclass
class Live:
    """A request holding a row, and what the model expects of its weight versions."""

    req: Any
    blocks: tuple[int, ...]
    start: int  # epoch its prefill began in; UNSEEN: before apply() or while reverted
    tokens: list[tuple[int, int]] = field(default_factory=list)  # (logits, kv prefix) per token
    recorded: bool = True  # False once it began or made progress where the patch could not see

    def __post_init__(self) -> None:
        self.recorded = self.start != UNSEEN


class LifecycleMachine(RuleBasedStateMachine):
    POLICY = "LRU"

    @initialize(start_applied=st.booleans())
    def build(self, start_applied: bool) -> None:
        # A fresh job: weight version 0, and (start_applied False) a context filled before the
        # first apply(), which counts as no update (the states where fault 8 once mislabelled the epoch).
        megatron_ext.apply() if start_applied else megatron_ext.revert()
        fault8._current_version, FAULT8._reverted = 0, False
        self.applied = start_applied
        self.version, self.seen, self.epoch = 0, None, 0  # the model of the three counters
        self.ctx = small_prefix_caching_context(
            self.POLICY, block_size_tokens=BLOCK, buffer_size_gb=(USABLE + 1) * KV_BYTES_PER_BLOCK / 2**30,
            max_requests=8, max_tokens=256, max_sequence_length=256)
        self.refit = importlib.import_module(fault8.REFIT_MODULE)
        self.live: list[Live] = []  # one per row; a hidden chunked prefill is the last
        self.hidden = False
        self.seen_prompts: set[tuple[int, ...]] = set()
        self.labels: dict[int, int] = {}  # registered block -> epoch of its KV
        self.hashes = [-1] * USABLE
        self.next_id = 0

    @property
    def allocator(self):
        return self.ctx.kv_block_allocator

    @property
    def lru(self) -> bool:
        return self.POLICY == "LRU"

    # -- the model of fault 8 -----------------------------------------------------------------

    def sync(self) -> None:
        """A prefix match, admission or engine step with the patch applied: the context catches up
        with swaps. Met for the first time it flushes only if it caches blocks of unknown weights."""
        if self.seen is None and not self.labels:
            self.seen = self.version
        elif self.seen != self.version:
            self.flushed()

    def flushed(self) -> None:
        self.epoch += 1
        self.seen = self.version
        STATS["flushes"] += 1

    @property
    def in_sync(self) -> bool:
        return self.applied and self.seen == self.version

    def relabel(self, label: Optional[int] = None) -> None:
        """Read ``block_hashes``: a block newly registered gets ``label`` (None: none may be)."""
        hashes = self.allocator.block_hashes[:USABLE].tolist()
        for block, (old, new) in enumerate(zip(self.hashes, hashes)):
            if new != old:
                self.labels.pop(block, None)
                if new != -1:
                    assert label is not None, f"block {block} registered outside an admission"
                    self.labels[block] = label
        self.hashes = hashes

    def check_match(self, req, start: int, end: int) -> None:
        """What a prefix match returns is of the current epoch (applied: a sync point)."""
        matched = self.ctx._find_kv_match_count(req, start, end)[0]
        stale = {b: self.labels.get(b) for b in matched if self.labels.get(b) != self.epoch}
        assert not stale, f"matched blocks of older epochs {stale} (epoch {self.epoch})"

    # -- operations ---------------------------------------------------------------------------

    @precondition(lambda self: len(self.live) < 8 and not self.hidden)
    @rule(blocks=PROMPTS, chunk=CHUNKS)
    def admit(self, blocks, chunk) -> None:
        hashes = make_request(0, prompt(blocks)).precomputed_block_hashes
        if not self.applied:  # the released code without faults: no match, no eviction
            fresh = not any(h in self.allocator.kv_hash_to_block_id for h in hashes)
            if not fresh or free_count(self.allocator) < len(blocks):
                return
        req = make_request(self.next_id, prompt(blocks))
        self.next_id += 1
        if self.applied:
            self.sync()
        fits = all(self.ctx.check_availability(req))
        self.relabel()  # a flush there drops blocks, registers none
        if not fits:
            return
        if self.applied:
            self.check_match(req, 0, len(blocks))
        chunk = chunk if chunk is not None and chunk < len(req.prompt_tokens) else None
        live = Live(req, blocks, self.epoch if self.applied else UNSEEN)
        self.add(live, chunk, 0)
        self.seen_prompts.add(blocks)
        STATS["admit" if chunk is None else "first chunk"] += 1

    def add(self, live: Live, chunk: Optional[int], row_blocks: int) -> None:
        """``add_request`` at the last row; a partial chunk's step then ends (it stays hidden)."""
        matched = self.ctx.prefix_cache_blocks_matched
        self.ctx.add_request(live.req, chunk)
        used = self.ctx.request_to_kv_block_ids[self.ctx.total_request_count - 1]
        got = used[row_blocks: row_blocks + self.ctx.prefix_cache_blocks_matched - matched].tolist()
        stale = [b for b in got if self.labels.get(b) != self.epoch]
        assert not (self.applied and stale), f"add_request matched blocks {stale} of an older epoch"
        if live not in self.live:
            self.live.append(live)
        self.hidden = chunk is not None
        if self.hidden:
            finish_chunk(self.ctx, live.req, chunk)
        else:  # the step of its last chunk samples its first token (progress the patch can see)
            self.sample(live)
        self.ctx.total_request_count = len(self.live) - self.hidden
        self.ctx.active_token_count, self.ctx.num_prefill_requests = 0, 0
        self.relabel(live.start)

    def next_chunk(self, chunk: Optional[int]) -> Optional[Live]:
        """The hidden request's next chunk, first in its step (nothing else is admitted
        meanwhile); the request if this was its last."""
        live = self.live[-1]
        req = live.req
        if self.applied:
            self.sync()
        fits = all(self.ctx.check_availability(req))
        self.relabel()
        if not fits:
            return None
        done = req.finished_chunk_token_count // BLOCK
        if self.applied:  # a straddler (older epoch) matches nothing
            self.check_match(req, done, len(live.blocks))
        live.recorded &= self.applied
        chunk = chunk if chunk is not None and chunk < req.remaining_prompt_length else None
        self.add(live, chunk, done)
        STATS["next chunk"] += 1
        return None if self.hidden else live

    @precondition(lambda self: self.live)
    @rule(mask=st.integers(1, 255))
    def retire(self, mask: int) -> None:
        rows = [r for r in range(len(self.live)) if mask >> r & 1] or [0]
        if self.hidden:  # rows keep their other books in place: only the hidden one may go
            rows = [len(self.live) - 1]
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
        self.hidden &= len(self.live) - 1 in keep
        self.live = [self.live[r] for r in keep]
        self.ctx.total_request_count = len(self.live) - self.hidden
        self.ctx.prefix_cache_lru_clock += 1
        STATS["retire"] += 1

    @precondition(lambda self: self.lru)
    @rule(n=st.integers(1, 3))
    def evict(self, n: int) -> None:
        self.allocator.evict_lru_blocks(n)
        STATS["evict"] += 1

    @precondition(lambda self: self.live)
    @rule(chunk=CHUNKS)
    def step(self, chunk: Optional[int]) -> None:
        """An engine step: the hidden request's next chunk, then the patch's step hook (around
        ``initialize_attention_state``, which needs a real batch: a no-op stands in) catches up
        with swaps, then every other prefilled request samples one token."""
        done = self.next_chunk(chunk) if self.hidden else None
        if self.applied:
            self.sync()
            fault8._step_wrapper(lambda: None, self.ctx, (), {})
        for live in self.live[: len(self.live) - self.hidden]:
            if live is not done:
                self.sample(live)
        STATS["step"] += 1

    def sample(self, live: Live) -> None:
        live.req.generated_tokens = [*(live.req.generated_tokens or ()), 7]
        live.tokens.append((self.epoch, live.start))
        live.recorded &= self.applied

    @precondition(lambda self: self.applied)
    @rule()
    def revert(self) -> None:
        megatron_ext.revert()
        self.applied = False
        STATS["revert"] += 1

    @precondition(lambda self: not self.applied)
    @rule()
    def apply(self) -> None:
        if FAULT8._reverted:  # swaps made while reverted went unseen: apply() counts as one
            self.version += 1
        megatron_ext.apply()
        self.applied = True
        STATS["apply"] += 1

    @rule(how=st.sampled_from(("swap", "invalidate", "suspend/resume")))
    def weight_update(self, how: str) -> None:
        """One rule for the three kinds, so that updates do not crowd out admissions."""
        if how == "invalidate" and not self.applied:
            how = "swap"  # the API refuses while reverted (test_weight_update_invalidation)
        getattr(self, "_" + how.replace("/", "_"))()
        STATS[how if self.applied else f"{how} while reverted"] += 1

    def _swap(self) -> None:
        with pytest.raises(TypeError):  # fails before copying anything: still an update
            self.refit.swap_model_weights(None, None, refit_method=object())
        if self.applied:  # flushed at the next sync point; reverted: unseen, apply() bumps
            self.version += 1

    def _invalidate(self) -> None:
        refs = self.allocator.block_ref_counts.tolist()
        held = sum(1 for b in self.labels if refs[b] > 0)
        self.flushed()
        assert megatron_ext.invalidate_prefix_cache(self.ctx) == fault8.InvalidationResult(
            blocks_unreachable=held, blocks_freed=len(self.labels) - held, epoch=self.epoch)
        self.relabel()
        assert self.labels == {}

    def _suspend_resume(self) -> None:
        """``engine.suspend()`` / ``resume()`` under PERSIST: the buffers really reallocate, which
        the patch counts as an update (reverted: unseen, as a swap)."""
        self.ctx.deallocate_inference_state_buffers()
        self.ctx.reinitialize_inference_state_buffers()
        if self.applied:
            self.flushed()
        self.relabel()

    # -- the books ----------------------------------------------------------------------------

    @invariant()
    def versions_agree(self) -> None:
        if not hasattr(self, "ctx"):
            return
        self.relabel()
        assert (fault8._current_version, self.ctx.__dict__.get(fault8.SEEN_VERSION_ATTR),
                fault8.context_epoch(self.ctx)) == (self.version, self.seen, self.epoch)
        if self.in_sync:
            stale = {b: e for b, e in self.labels.items() if e != self.epoch}
            assert not stale, f"blocks of older epochs still registered: {stale} (epoch {self.epoch})"
        if self.applied:
            self.check_token_versions()

    def check_token_versions(self) -> None:
        for live in self.live:
            if not live.tokens:
                continue
            if not live.recorded:
                with pytest.raises(megatron_ext.WeightVersionsNotRecorded):
                    megatron_ext.token_weight_versions(live.req)
                continue
            logits, kv = zip(*live.tokens)
            assert megatron_ext.token_weight_versions(live.req) == megatron_ext.TokenWeightVersions(logits, kv)

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
        free = allocator.block_bag[: free_count(allocator)].tolist()
        assert len(set(free)) == len(free)
        for block in range(USABLE):
            assert refs[block] == owners[block], f"block {block}: ref {refs[block]}, {owners[block]} owners"
            states = [block in free, refs[block] > 0, refs[block] == 0 and block in registered]
            assert sum(states) == 1, f"block {block}: free/held/cached {states}"
        if self.in_sync:  # a lookup is a sync point: out of sync it would flush, ahead of the rules
            for blocks in self.seen_prompts:  # never raises KeyError, never returns an older epoch
                self.check_match(make_request(0, prompt(blocks)), 0, len(blocks))
        if self.lru and hasattr(allocator, "block_parent_id"):  # 0.17/0.18: made when the patch
            self.check_forest(registered)  # first meets a context built before apply()

    def check_forest(self, registered: dict[int, int]) -> None:
        parents = self.allocator.block_parent_id.tolist()
        counts = self.allocator.block_child_count.tolist()
        children = Counter(parents[b] for b in registered if parents[b] >= 0)
        for block in range(USABLE):
            if block in registered and parents[block] >= 0:
                assert parents[block] in registered, f"block {block}'s parent {parents[block]} is gone"
            assert counts[block] == children[block], f"block {block}: {counts[block]} children counted"


#: Every kind of operation, each reached in every run.
KINDS = ("admit", "first chunk", "next chunk", "retire", "step", "revert", "apply", "swap",
         "swap while reverted", "invalidate", "suspend/resume", "flushes")


@pytest.mark.skipif(UNPATCHED or SOURCE_PATCHED, reason="switches megatron-ext's runtime patches on and off")
@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_apply_revert_and_weight_updates_with_a_live_context(policy):
    STATS.clear()
    machine = type(f"LifecycleMachine{policy}", (LifecycleMachine,), {"POLICY": policy})
    saved = fault8._current_version  # the machine sets it back to 0 (a fresh job)
    try:
        with cuda_on_cpu():
            run_state_machine_as_test(machine, settings=SETTINGS)
    finally:
        megatron_ext.revert()
        fault8._current_version = saved  # revert() above left FAULT8._reverted set, as usual
    kinds = KINDS + (("evict",) if policy == "LRU" else ())
    assert [k for k in kinds if STATS[k] == 0] == []
