"""Model-based property tests of megatron-core's real ``DynamicInferenceContext`` under LRU
prefix caching with chunked prefill and small pools (faults 3-6, and 1 on 0.17/0.18).

A hypothesis ``RuleBasedStateMachine`` drives a real context on the CPU (built like
``test_lru_faults.four_block_lru_context``: 2 layers, fp32 KV cache, KV blocks of 16 tokens, LRU
eviction policy, chunked prefill on) with 4 to 12 usable blocks plus the dummy block, the way
the dynamic engine drives it, with megatron-ext's runtime patches applied (fixture
``runtime_patches``; none with ``MEGATRON_EXT_TEST_UNPATCHED=1``). Rules, one engine operation
each:

- ``admit``: a request arrives; ``check_availability`` decides, then ``add_request`` adds the
  whole prompt or only a first prefill chunk, whose length may end inside a KV block (also inside
  a block obtained by a hash match). Prompts come from a small space so prefixes are shared a
  lot: fresh prompts of 1-4 blocks whose contents are one of two per position, N samples of a
  recent prompt, prompts that extend a recent one; lengths are a multiple of 16 or one more.
- ``continue_chunk``: at the start of a step the request under chunked prefill (its row kept
  after the last one, as ``update_requests`` leaves it) gets ``check_availability`` on its
  remaining prompt and then the next chunk's ``add_request`` (partial again, or final). As in
  the engine's ``schedule_chunked_prefill`` nothing else is admitted before it and nothing after
  a partial chunk; ``abort_chunk`` releases it when its remainder does not fit.
- ``retire``: some requests finish together: ``release_memory_blocks_from_request_indexes``
  for their rows (a block shared by k of them appears k times), then the remaining rows,
  including the one of a request under chunked prefill, move down with the context's own
  ``_swap_book_keeping_tensors`` so rows ``< total_request_count`` stay the live requests; the
  request under chunked prefill continues across steps while others finish.
- ``next_step``: the step ends: a partial chunk is finished (``context_factory.finish_chunk``:
  the request keeps its row and block table for its next chunk), the LRU clock
  (``prefix_cache_lru_clock``) advances, the step's token count restarts.
- ``pause_and_resume``: a single request remains and its last KV block is full
  (``request_last_kv_block_offset[0] == block_size - 1``), so its next token needs a block:
  ``update_requests`` would pause it (``paused_request_count = 1``) and call
  ``resume_paused_requests(0, tensor([request_id]))``, as ``test_fault6`` does. If it may not
  resume it is released (the engine evicts it with a paused buffer of 0).

After every operation the invariants below are read from the real context and allocator; every
megatron-core exception (``KeyError``, ``AssertionError``, ``BlockOverflowError``...) fails the
run with the operation's name. Counts of the situations that trigger each fault are printed per
run and must be non-zero, so a pass says the faults' triggers were reached, not avoided.

Runs are reproducible: ``derandomize=True``, no example database.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from megatron_ext import mcore
from megatron_ext.cpu_backend import cuda_on_cpu
from megatron_ext.harness.factories import small_prefix_caching_context

from .allocator_factory import block_count, free_count
from .conftest import UNPATCHED
from .context_factory import BLOCK, finish_chunk, make_request
from .test_allocator_properties import leaf_peel_reach

KV_BYTES_PER_BLOCK = 2 * 2 * BLOCK * 4 * 16 * 4  # K and V, 2 layers, 16 tokens, 4 heads x 16, fp32
MAX_REQUESTS = 8
MAX_TOKENS = 256
MAX_PROMPT_BLOCKS = 5

EXAMPLES = 200
STEPS_PER_EXAMPLE = 60
MIN_OPERATIONS = 5_000

SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS_PER_EXAMPLE,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)

#: name -> count, filled while the machine runs; printed and checked by the test.
STATS: Counter = Counter()

#: The trigger situation of each fault; each must occur in every run (the run reaches the fault).
FAULT_TRIGGERS = {
    "fault 1: releases listing a block once per finishing owner (k > 1)":
        "release calls with a duplicated block ID",
    "fault 3: evictions where oldest-first order takes a parent before its cached child":
        "evictions where oldest-first order would orphan a cached child",
    "fault 4: admissions where allocate-before-pin would evict the request's own matched block":
        "admissions whose ref-0 matched blocks oldest-first eviction would take",
    "fault 5: next chunks after a chunk ended inside a block obtained by a hash match":
        "next chunks re-registering a matched block",
    "fault 6: resumes that needed eviction (empty free pool, evictable cached blocks)":
        "resumes into an evictable block with an empty free pool",
}


def prompt_tokens(blocks: tuple[int, ...], tail: bool) -> list[int]:
    """Token IDs of a prompt: block ``k`` of content ``c`` (0 or 1) is 16 tokens that depend only on
    ``c`` (the parent-chained block hash makes equal blocks at different positions distinct);
    ``tail`` adds one token after the last complete block (a partial last KV block)."""
    tokens = [t for c in blocks for t in range(1000 * (c + 1), 1000 * (c + 1) + BLOCK)]
    return tokens + ([7] if tail else [])


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


PROMPTS = st.tuples(
    st.sampled_from(("fresh", "again", "extend")),  # how the prompt is chosen
    st.integers(1, 4),  # blocks of a fresh prompt / added by an extension
    st.integers(0, 15),  # their contents, one bit per block
    st.booleans(),  # one more token after the last complete block
    st.integers(0, 7),  # which recent prompt is sampled again / extended
)
#: None: the whole (remaining) prompt; n: a chunk of n tokens if the prompt is longer.
CHUNKS = st.one_of(st.none(), st.integers(1, 40))


@dataclass
class Live:
    """A request the context holds: its row's KV block table as the context gave it to it."""

    rid: int
    req: Any  # DynamicInferenceRequest
    prompt: str
    blocks: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens added so far (all chunks, the current one included)
    decode_blocks: int = 0  # blocks added by resume_paused_requests
    chunk: int | None = None  # length of the partial chunk added in this step
    ended_inside_match: bool = False  # the last chunk ended inside a block got by a hash match


@dataclass
class Snapshot:
    """The allocator's books before an operation, to see what it evicted."""

    hashes: list[int]
    refs: list[int]
    stamps: list[int]
    free: int

    def cached(self) -> set[int]:
        return {b for b, h in enumerate(self.hashes) if h != -1 and self.refs[b] == 0}


class ContextMachine(RuleBasedStateMachine):
    """One real ``DynamicInferenceContext`` (LRU, chunked prefill) and the requests it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.ctx = None
        self.rows: list[Live] = []  # rows 0 .. total_request_count - 1, in row order
        self.hidden: Live | None = None  # under chunked prefill, between steps: row total_request_count
        self.open_chunk: Live | None = None  # got a partial chunk in this step: the last row
        self.blocked = False  # the hidden request's remainder did not fit at its last try
        self.busy = False  # something happened in this step (else next_step would only tick)
        self.parent_of: dict[int, int] = {}  # block hash -> parent hash (0: first block)
        self.recent: list[tuple[tuple[int, ...], bool]] = []
        self.next_rid = 1
        self.log: list[str] = []

    # ------------------------------------------------------------------------- helpers
    @property
    def allocator(self):
        return self.ctx.kv_block_allocator

    def count(self, name: str, n: int = 1) -> None:
        STATS[name] += n

    def say(self, message: str) -> None:
        """Narrate an operation: hypothesis prints these notes with a failing example."""
        if currently_in_test_context():
            note(message)
        else:
            self.log.append(message)

    def mc(self, name: str, fn: Callable, *args):
        """Call into megatron-core; any exception fails the run, named after the operation."""
        self.count("operations")
        self.busy = True
        try:
            return fn(*args)
        except Exception as error:  # noqa: BLE001 - every megatron-core exception is a failure
            raise AssertionError(
                f"megatron-core raised {type(error).__name__} in {name}: {error}") from error

    def live_rows(self) -> list[tuple[int, Live]]:
        """(row, request) of every request holding blocks, the hidden chunked one included."""
        rows = list(enumerate(self.rows))
        if self.hidden is not None:
            rows.append((len(self.rows), self.hidden))
        return rows

    def snapshot(self) -> Snapshot:
        a = self.allocator
        return Snapshot(a.block_hashes.tolist(), a.block_ref_counts.tolist(),
                        a.block_timestamps.tolist(), int(free_count(a)))

    def hash_parents(self, hashes: list[int]) -> dict[int, int]:
        """Registered block -> the registered block holding its parent hash (-1: root or missing)."""
        block_of = {h: b for b, h in enumerate(hashes) if h != -1}
        return {b: (block_of.get(self.parent_of.get(h, 0), -1) if self.parent_of.get(h, 0) else -1)
                for b, h in enumerate(hashes) if h != -1}

    def forest(self) -> tuple[list[int], list[int]]:
        """``block_parent_id`` / ``block_child_count`` of the allocator, or (released 0.17/0.18
        without them) the same derived from the registered hashes."""
        a = self.allocator
        if hasattr(a, "block_parent_id"):
            return a.block_parent_id.tolist(), a.block_child_count.tolist()
        parents = self.hash_parents(a.block_hashes.tolist())
        parent_ids = [parents.get(b, -1) for b in range(block_count(a))]
        children = Counter(p for p in parents.values() if p >= 0)
        return parent_ids, [children.get(b, 0) for b in range(block_count(a))]

    def reach(self) -> int:
        """How many cached blocks (ref count 0, registered) a leaf-first eviction can free."""
        a = self.allocator
        cached = {b for b, (h, r) in enumerate(zip(a.block_hashes.tolist(), a.block_ref_counts.tolist()))
                  if h != -1 and r == 0}
        return leaf_peel_reach(cached, *self.forest())

    def expected_match(self, req, finished: int, length: int) -> tuple[list[int], int, int, int]:
        """What ``add_request(req, length)`` takes by hash match: (matched block IDs,
        already_allocated_blocks, overall_required_blocks, blocks from the pool)."""
        already = blocks_for(finished)
        overall = blocks_for(finished + length)
        hashes = req.precomputed_block_hashes[already:min(overall, len(req.precomputed_block_hashes))]
        kv_map = self.allocator.kv_hash_to_block_id
        matched: list[int] = []
        for h in hashes:  # whole chains (an invariant): the longest matching prefix
            if h not in kv_map:
                break
            matched.append(kv_map[h])
        return matched, already, overall, max(0, overall - already - len(matched))

    def expected_kv_available(self, req) -> tuple[bool, str]:
        """Whether the pool can supply what ``add_request(req)`` allocates: free blocks plus the
        cached blocks a leaf-first eviction can free, less the ref-0 matched blocks it pins first."""
        a = self.allocator
        matched, _, _, from_pool = self.expected_match(
            req, req.finished_chunk_token_count, req.remaining_prompt_length)
        refs = a.block_ref_counts.tolist()
        pinned_now = sum(1 for b in matched if refs[b] == 0)
        reach = self.reach()
        fits = free_count(a) >= from_pool or free_count(a) + reach - pinned_now >= from_pool
        why = (f"needs {from_pool} from the pool; {free_count(a)} free, {reach} evictable, "
               f"{pinned_now} of them its own ref-0 matches {matched}")
        return fits, why

    @staticmethod
    def oldest_first(snap: Snapshot, candidates: set[int], k: int) -> list[int]:
        """0.17/0.18's ``evict_lru_blocks`` choice: oldest timestamp first, ties to the lower ID."""
        return sorted(candidates, key=lambda b: (snap.stamps[b], b))[:k]

    def note_evictions(self, snap: Snapshot, pinned: set[int], where: str) -> list[int]:
        """Compare the books after an operation with ``snap``: count and narrate evictions."""
        after = self.allocator.block_hashes.tolist()
        evicted = sorted(b for b, h in enumerate(snap.hashes) if h != -1 and after[b] != h)
        if not evicted:
            return evicted
        self.count("evictions")
        self.count("blocks evicted", len(evicted))
        candidates = snap.cached() - pinned
        parents = self.hash_parents(snap.hashes)
        victims = set(self.oldest_first(snap, candidates, len(evicted)))
        orphaned = [c for c in candidates - victims if parents.get(c, -1) in victims]
        if orphaned:
            self.trigger("fault 3")
        self.say(f"  {where} evicted cached blocks {evicted}"
                 + (f" (oldest-first would take {sorted(victims)}, orphaning {orphaned})"
                    if orphaned else ""))
        return evicted

    def trigger(self, fault: str, n: int = 1) -> None:
        self.count(FAULT_TRIGGERS[next(k for k in FAULT_TRIGGERS if k.startswith(fault + ":"))], n)

    # ------------------------------------------------------------------------- operations
    def add(self, live: Live, chunk: int | None) -> None:
        """``add_request(req, chunk)`` at row ``total_request_count`` and its block table checked."""
        ctx, a, req = self.ctx, self.allocator, live.req
        finished = req.finished_chunk_token_count
        length = req.remaining_prompt_length if chunk is None else chunk
        matched, already, overall, from_pool = self.expected_match(req, finished, length)
        snap = self.snapshot()
        refs = snap.refs
        cached_matches = {b for b in matched if refs[b] == 0}
        need_eviction = from_pool - snap.free
        if need_eviction > 0 and cached_matches:
            self.count("admissions that evict while their matched blocks are cached at ref 0")
            if set(self.oldest_first(snap, snap.cached(), need_eviction)) & cached_matches:
                self.trigger("fault 4")
        if finished and live.ended_inside_match:
            self.trigger("fault 5")
        row = ctx.total_request_count
        self.say(f"  add_request(request {live.rid}, {chunk}) at row {row}: tokens "
                 f"{finished}..{finished + length} of {finished + req.remaining_prompt_length}, "
                 f"matches {matched}, {from_pool} from the pool ({snap.free} free)")
        self.mc("add_request", ctx.add_request, req, chunk)
        self.count("chunks added" if chunk is not None or finished else "whole prompts added")
        self.note_evictions(snap, set(matched), "add_request")
        n = int(ctx.request_kv_block_counts[row])
        table = ctx.request_to_kv_block_ids[row].tolist()
        assert n == overall, f"request {live.rid}: {n} KV blocks, {overall} expected"
        assert table[:len(live.blocks)] == live.blocks, (
            f"request {live.rid}: its earlier chunks' blocks {live.blocks} became "
            f"{table[:len(live.blocks)]}")
        assert table[already:already + len(matched)] == matched, (
            f"request {live.rid}: matched blocks {matched} are not in its block table {table[:n]}")
        live.blocks = table[:n]
        live.prefilled = finished + length
        end = finished + length
        live.ended_inside_match = bool(
            chunk is not None and end % BLOCK and end // BLOCK < already + len(matched))
        if live.ended_inside_match:
            self.count("chunks ending inside a matched block")
        self.say(f"    -> block table {live.blocks}")
        self.rows.append(live)
        if chunk is not None:
            live.chunk = chunk
            self.open_chunk = live
            ctx.chunked_prefill_request_id = live.rid
        else:
            ctx.chunked_prefill_request_id = -1

    def release_rows(self, chosen: list[int], why: str) -> None:
        """``release_memory_blocks_from_request_indexes(chosen)`` and drop the rows: the others
        (and a hidden chunked request's row, kept after them) move down, in order."""
        ctx = self.ctx
        total = ctx.total_request_count
        lives = [self.rows[i] if i < total else self.hidden for i in chosen]
        ids = [b for live in lives for b in live.blocks]
        if len(ids) != len(set(ids)):
            self.trigger("fault 1")
        self.say(f"  {why}: requests {[x.rid for x in lives]} (rows {chosen}) release {ids}")
        self.mc("release_memory_blocks_from_request_indexes",
                ctx.release_memory_blocks_from_request_indexes, torch.tensor(chosen, dtype=torch.int64))
        self.count("requests released", len(chosen))
        keep = [i for i in range(total + (self.hidden is not None)) if i not in chosen]
        for new, old in enumerate(keep):
            if new != old:
                self.mc("_swap_book_keeping_tensors", ctx._swap_book_keeping_tensors,
                        torch.tensor([old]), torch.tensor([new]))
        gone = sum(1 for i in chosen if i < total)
        ctx.total_request_count = total - gone
        if any(i >= total for i in chosen):
            self.hidden = None
            ctx.chunked_prefill_request_id = -1
        self.rows = [self.rows[i] for i in keep if i < total]

    # ------------------------------------------------------------------------- rules
    @initialize(usable=st.integers(4, 12))
    def build(self, usable: int) -> None:
        """A context whose KV buffer holds ``usable`` blocks of 16 tokens plus the dummy block."""
        self.ctx = small_prefix_caching_context(
            "LRU", block_size_tokens=BLOCK, buffer_size_gb=(usable + 1) * KV_BYTES_PER_BLOCK / 2**30,
            max_requests=MAX_REQUESTS, max_tokens=MAX_TOKENS, max_sequence_length=256,
        )
        a = self.allocator
        assert block_count(a) == usable + 1 and a.dummy_block_idx == usable, (
            f"context built with {block_count(a)} blocks, dummy {a.dummy_block_idx}")
        self.count("contexts")
        self.say(f"LRU context, {usable} usable KV blocks of {BLOCK} tokens (block {usable} is the dummy)")

    def choose_prompt(self, how: str, n: int, bits: int, tail: bool, pick: int):
        blocks = tuple((bits >> k) & 1 for k in range(n))
        if how == "again" and self.recent:
            blocks, tail = self.recent[pick % len(self.recent)]
        elif how == "extend" and self.recent:
            base = self.recent[pick % len(self.recent)][0]
            blocks = (base + blocks)[:MAX_PROMPT_BLOCKS]
        else:
            how = "fresh"
        prompt = (blocks, tail)
        if prompt in self.recent:
            self.recent.remove(prompt)
        self.recent = (self.recent + [prompt])[-8:]
        return how, blocks, tail

    @precondition(lambda self: self.ctx is not None and self.hidden is None and self.open_chunk is None)
    @rule(prompt=PROMPTS, chunk=CHUNKS)
    def admit(self, prompt, chunk) -> None:
        """A request arrives: ``check_availability``, then ``add_request`` (whole, or a first chunk)."""
        ctx = self.ctx
        how, blocks, tail = self.choose_prompt(*prompt)
        tokens = prompt_tokens(blocks, tail)
        live = Live(self.next_rid, make_request(self.next_rid, tokens), f"{how} {blocks}{'+1' if tail else ''}")
        self.next_rid += 1
        hashes = live.req.precomputed_block_hashes
        self.parent_of.update(zip(hashes, [0] + list(hashes[:-1])))
        self.count("arrivals")
        self.say(f"request {live.rid} arrives: prompt {live.prompt} ({len(tokens)} tokens), chunk {chunk}")
        can_add = ctx.total_request_count < ctx.max_requests and ctx.paused_request_count == 0
        kv_expected, why = self.expected_kv_available(live.req)
        fits = self.mc("check_availability", ctx.check_availability, live.req)
        assert bool(fits[0]) == can_add, f"check_availability says request fits {fits[0]}"
        assert bool(fits[2]) == kv_expected, (
            f"check_availability says KV blocks available: {bool(fits[2])}, but the request {why}")
        if chunk is not None and chunk >= len(tokens):
            chunk = None
        tokens_fit = bool(fits[1]) if chunk is None else ctx.active_token_count + chunk <= ctx.max_tokens
        if not (fits[0] and fits[2] and tokens_fit):
            self.count("admissions refused")
            self.say(f"  refused: {tuple(bool(f) for f in fits)} ({why})")
            return
        self.add(live, chunk)

    @precondition(lambda self: self.hidden is not None)
    @rule(chunk=CHUNKS)
    def continue_chunk(self, chunk) -> None:
        """The request under chunked prefill gets its next chunk, first in the step."""
        ctx, live = self.ctx, self.hidden
        req = live.req
        kv_expected, why = self.expected_kv_available(req)
        fits = self.mc("check_availability", ctx.check_availability, req)
        assert bool(fits[2]) == kv_expected, (
            f"check_availability says KV blocks available: {bool(fits[2])}, but request "
            f"{live.rid}'s remaining prompt {why}")
        if chunk is not None and chunk >= req.remaining_prompt_length:
            chunk = None
        self.say(f"request {live.rid} continues its chunked prefill at token "
                 f"{req.finished_chunk_token_count}, chunk {chunk}")
        if not fits[2]:
            self.blocked = True
            self.count("chunk continuations that must wait")
            self.say(f"  must wait: {why}")
            return
        self.blocked = False
        self.hidden = None
        self.add(live, chunk)

    @precondition(lambda self: self.hidden is not None and self.blocked)
    @rule()
    def abort_chunk(self) -> None:
        """The waiting request under chunked prefill is given up: its row's blocks are released."""
        self.blocked = False
        self.count("chunked requests aborted")
        self.release_rows([len(self.rows)], "chunked prefill aborted")

    @precondition(lambda self: any(live is not self.open_chunk for live in self.rows))
    @rule(mask=st.integers(0, 255))
    def retire(self, mask: int) -> None:
        """Requests finish together (``mask``: which of the live rows; 0: all of them)."""
        rows = [i for i, live in enumerate(self.rows) if live is not self.open_chunk]
        chosen = [i for k, i in enumerate(rows) if mask >> k & 1] or rows
        if len(chosen) == len(self.rows) and self.hidden is None:
            self.count("drains")
        self.release_rows(chosen, "finish")

    @precondition(lambda self: self.busy)
    @rule()
    def next_step(self) -> None:
        """The step ends: a partial chunk is finished, the LRU clock advances."""
        ctx = self.ctx
        if self.open_chunk is not None:
            live = self.open_chunk
            assert self.rows[-1] is live
            finish_chunk(ctx, live.req, live.chunk)
            self.rows.pop()
            self.hidden, self.open_chunk, live.chunk = live, None, None
        ctx.prefix_cache_lru_clock += 1
        ctx.active_token_count = 0
        ctx.num_prefill_requests = 0
        self.busy = False
        self.count("engine steps")
        self.say(f"-- step {ctx.prefix_cache_lru_clock}")

    @precondition(lambda self: len(self.rows) == 1 and self.hidden is None and self.open_chunk is None
                  and int(self.ctx.request_last_kv_block_offset[0]) == BLOCK - 1)
    @rule()
    def pause_and_resume(self) -> None:
        """The only request's next token needs a KV block: it is paused and resumed (fault 6)."""
        ctx, a, live = self.ctx, self.allocator, self.rows[0]
        snap = self.snapshot()
        reach = self.reach()
        before = int(ctx.request_kv_block_counts[0])
        ctx.paused_request_count = 1
        # up to 0.19 the blocks of active requests are capped by the active buffer; Megatron-LM main
        # (after 0.19) has no such buffer (get_active_avail is gone): free plus evictable blocks decide
        active_avail = int(a.get_active_avail()) if hasattr(a, "get_active_avail") else before + 1
        expected = (snap.free + reach >= 1 and before + 1 <= active_avail
                    and min(ctx.max_requests, ctx.max_tokens) >= 1)
        self.count("pauses")
        self.say(f"request {live.rid} (blocks {live.blocks}) is paused for a new block: "
                 f"{snap.free} free, {reach} evictable, active buffer {active_avail}")
        active, still_paused = self.mc("resume_paused_requests", ctx.resume_paused_requests,
                                       0, torch.tensor([live.rid]))
        evicted = self.note_evictions(snap, set(), "resume_paused_requests")
        if not expected:
            assert (active, ctx.paused_request_count) == (0, 1), "resumed beyond the released bounds"
            self.count("paused requests that cannot resume")
            ctx.paused_request_count = 0
            self.release_rows([0], "cannot resume, evicted")
            return
        assert (active, ctx.paused_request_count, still_paused.tolist()) == (1, 0, []), (
            f"request {live.rid} could resume ({snap.free} free + {reach} evictable blocks) but "
            f"resume_paused_requests returned ({active}, {still_paused.tolist()}), "
            f"paused_request_count {ctx.paused_request_count}")
        n = int(ctx.request_kv_block_counts[0])
        table = ctx.request_to_kv_block_ids[0].tolist()
        assert n == before + 1 and table[:before] == live.blocks, (
            f"resumed request {live.rid}: block table {live.blocks} became {table[:n]}")
        live.blocks = table[:n]
        live.decode_blocks += 1
        ctx.request_last_kv_block_offset[0] = 0  # its next token goes to the new block
        self.count("resumes")
        if snap.free == 0:
            assert evicted, "resumed into an empty free pool without evicting"
            self.trigger("fault 6")
        self.say(f"  resumed -> block table {live.blocks}")

    # ------------------------------------------------------------------------- invariants
    @invariant()
    def books_balance(self) -> None:
        """The context's block tables, the ref counts, the free pool and the prefix cache agree."""
        ctx = self.ctx
        if ctx is None:
            return
        a = self.allocator
        usable, dummy = block_count(a) - 1, a.dummy_block_idx
        assert ctx.total_request_count == len(self.rows), (
            f"total_request_count {ctx.total_request_count}, {len(self.rows)} rows live")
        assert ctx.paused_request_count == 0

        # Block tables (fault 4): row r < total_request_count (and the hidden chunked row) holds
        # request_kv_block_counts[r] distinct real blocks, then -1.
        uses: Counter = Counter()
        live_blocks: set[int] = set()
        for row, live in self.live_rows():
            n = int(ctx.request_kv_block_counts[row])
            table = ctx.request_to_kv_block_ids[row].tolist()
            blocks = table[:n]
            expected_n = blocks_for(live.prefilled) + live.decode_blocks
            assert n == expected_n, f"row {row} (request {live.rid}): {n} KV blocks, {expected_n} expected"
            assert len(set(blocks)) == n, (
                f"fault 4: block table of request {live.rid} (row {row}) holds a block twice: {blocks}")
            assert all(0 <= b < usable for b in blocks), (
                f"block table of request {live.rid} (row {row}) holds {blocks} (dummy block {dummy})")
            assert all(b == -1 for b in table[n:]), f"row {row} has entries past its {n} blocks: {table}"
            assert blocks == live.blocks, (
                f"block table of request {live.rid} (row {row}) changed from {live.blocks} to {blocks}")
            uses.update(blocks)
            live_blocks |= set(blocks)

        # Ref counts (fault 1): one per occurrence in a live block table, never negative.
        refs = a.block_ref_counts.tolist()
        assert min(refs) >= 0, f"negative ref count: {refs}"
        expected_refs = [uses.get(b, 0) for b in range(block_count(a))]
        assert refs == expected_refs, (
            f"ref counts {refs} != occurrences in live block tables {expected_refs} "
            f"(tables { {live.rid: live.blocks for _, live in self.live_rows()} })")

        # The hash map and block_hashes agree; the dummy block is never registered.
        hashes = a.block_hashes.tolist()
        registered = {b: h for b, h in enumerate(hashes) if h != -1}
        kv_map = a.kv_hash_to_block_id
        assert dummy not in registered, "the dummy block is registered"
        assert len(kv_map) == len(registered), (
            f"kv_hash_to_block_id has {len(kv_map)} entries, block_hashes {len(registered)}: "
            f"{kv_map} vs {registered}")
        for h, b in kv_map.items():
            assert hashes[b] == h, f"kv_hash_to_block_id[{h}] = {b} but block_hashes[{b}] = {hashes[b]}"

        # Free pool: unique, no dummy, disjoint from live and registered blocks; no leak.
        free = a.block_bag.tolist()[: free_count(a)]
        assert len(free) == len(set(free)), f"free pool {sorted(free)} repeats an ID"
        assert dummy not in free and all(0 <= b < usable for b in free), f"free pool {sorted(free)}"
        assert not set(free) & live_blocks, f"live blocks {sorted(set(free) & live_blocks)} are free"
        assert not set(free) & set(registered), f"registered blocks {sorted(set(free) & set(registered))} are free"
        assert len(free) + len(live_blocks | set(registered)) == usable, (
            f"leak: {usable} blocks, {len(free)} free, {len(live_blocks)} live, "
            f"{len(set(registered) - live_blocks)} cached")

        # Prefix chains stay whole (fault 3): a registered block's parent hash is registered,
        # else _find_kv_match_count raises KeyError on that prefix.
        for b, h in registered.items():
            assert h in self.parent_of, f"block {b} holds hash {h} of no prompt"
            parent = self.parent_of[h]
            assert parent == 0 or parent in kv_map, (
                f"fault 3: cached block {b} (ref {refs[b]}) hangs off an evicted parent: its parent "
                f"hash is not registered (registered: {registered})")

        # The prefix forest (fault 5): block_parent_id / block_child_count match the chains.
        parent_ids, child_counts = self.forest()
        parent_block = {b: (kv_map[self.parent_of[h]] if self.parent_of[h] else -1)
                        for b, h in registered.items()}
        children = Counter(p for p in parent_block.values() if p >= 0)
        for b in range(block_count(a)):
            assert parent_ids[b] == parent_block.get(b, -1), (
                f"block_parent_id[{b}] = {parent_ids[b]}, its parent block is {parent_block.get(b, -1)}")
            assert child_counts[b] == children.get(b, 0), (
                f"fault 5: block_child_count[{b}] = {child_counts[b]}, but {children.get(b, 0)} "
                f"registered blocks have it as parent (parents {parent_block})")

        # Everything get_evictable_block_count() promises, leaf-first eviction can free.
        cached = {b for b in registered if refs[b] == 0}
        evictable = int(a.get_evictable_block_count())
        freeable = leaf_peel_reach(cached, parent_ids, child_counts)
        assert evictable == freeable == len(cached), (
            f"get_evictable_block_count() = {evictable}, leaf-first eviction can free {freeable} "
            f"of the {len(cached)} cached blocks (child counts {child_counts})")


def test_context_state_machine(runtime_patches, capsys, record_property):
    """The state machine, ``EXAMPLES`` x ``STEPS_PER_EXAMPLE`` rules; prints what ran."""
    STATS.clear()
    started = time.perf_counter()
    with cuda_on_cpu():
        run_state_machine_as_test(ContextMachine, settings=SETTINGS)
    seconds = time.perf_counter() - started
    operations = STATS["operations"]
    applied = [r.patch for r in runtime_patches if r.state.value == "applied"]
    state = "unpatched" if UNPATCHED else f"runtime patches applied: {', '.join(applied) or 'none'}"
    details = "\n  ".join(f"{name}: {n}" for name, n in sorted(STATS.items()) if name != "operations")
    record_property("context_operations", operations)
    with capsys.disabled():
        print(f"\n[context properties] megatron-core {mcore.installed_version()} ({state}): "
              f"{operations} megatron-core calls, {seconds:.1f} s\n  {details}")
    assert operations >= MIN_OPERATIONS, f"only {operations} megatron-core calls executed"
    for fault, name in FAULT_TRIGGERS.items():
        assert STATS[name] > 0, f"the machine never reached {fault}"
