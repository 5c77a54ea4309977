"""Audits of a live ``DynamicInferenceContext``, independent of the runtime patches.

* KV write audit: every KV append is checked, token by token, against the writing request's own
  blocks. A request's own blocks are those in its block table that it did not get from a hash
  match; the audit learns which ones were matched by watching each ``add_request`` call and the
  allocator calls made inside it (new block-table entries that were not freshly allocated are
  matched). A write is legal if it lands in an own block or in the dummy block.
* Ref-count audit: after every engine step each block's ref count equals the number of live
  owners (block tables of active, paused and mid-chunked-prefill requests), free IDs are unique and
  hold neither owners nor hashes; at drain every block is free or cached with ref count 0.
* Block-table and prefix-chain audit (faults 3-5, LRU under memory pressure), after every step:
  no live block table holds one block ID twice (fault 4: a matched block evicted and handed back
  as a new one); every registered block's parent hash is registered too, else the next lookup of
  that prefix raises ``KeyError`` (fault 3: a parent evicted before its child); where the
  allocator keeps a prefix forest (``block_child_count``, 0.19 or fix 3), each block's child count
  equals the registered blocks naming it parent (fault 5: a block registered twice).

Besides the audits it measures how hard the run pressed on the KV pool (:attr:`ContextAudit.pressure`):
peak blocks held by live requests, peak blocks outside the free pool, paused requests, and cached
blocks evicted (LRU) or deregistered (both policies).

The audit attaches instance-level wrappers (the engine calls ``context.add_request`` and the
attention layer ``context.append_key_value_cache``), so it stacks on top of whatever class-level
code is installed (patched or not) and is removed with :meth:`ContextAudit.detach`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..mcore import uses_lru_prefix_caching


@dataclass(frozen=True)
class Violation:
    """One broken invariant.

    Attributes:
        kind: ``kv_write``, ``ref_count``, ``free_pool``, ``drain``, ``block_table``,
            ``prefix_chain`` or ``child_count`` (see :data:`FAULT_OF_KIND`).
        step: engine step (0-based) at which it was seen.
        block: the KV block ID concerned.
        request_id: the request concerned (``kv_write`` only), else -1.
        detail: one human sentence.
    """

    kind: str
    step: int
    block: int
    request_id: int
    detail: str


#: Violation kind -> the megatron-ext fix whose fault it shows.
FAULT_OF_KIND = {
    "kv_write": "fix 2 fault (matched-block-writes)",
    "ref_count": "fix 1 fault (release-refcount)", "free_pool": "fix 1 fault (release-refcount)",
    "drain": "fix 1 fault (release-refcount)",
    "block_table": "fix 4 fault (lru-pin-before-allocate)",
    "prefix_chain": "fix 3 fault (lru-leaf-first-eviction)",
    "child_count": "fix 5 fault (lru-register-once)",
}


@dataclass
class ContextAudit:
    """Attach to a context, call :meth:`end_step` after each engine step and :meth:`drain` at the end.

    Attributes:
        counters: prefix-cache counters measured at ``add_request`` (megatron-core's own ones
            differ between releases and the engine resets them while logging): ``cache_hits``,
            ``blocks_matched``, ``prefill_tokens_skipped``, ``prefill_tokens_computed``.
        violations: unique violations seen so far (a KV write violation is counted once per
            step, request and block, not once per layer or token).
        kv_writes_checked: number of (token, layer) KV writes inspected.
        steps_checked: number of ref-count checks performed.
        pressure: KV pool pressure measured after every step, all ints (see :meth:`summary`).
    """

    context: Any
    check_ref_counts: bool = True  # False with prefix caching off: no ref counts exist then
    step: int = 0
    violations: list[Violation] = field(default_factory=list)
    kv_writes_checked: int = 0
    steps_checked: int = 0
    matched_blocks: dict[int, set[int]] = field(default_factory=dict)
    counters: Counter = field(default_factory=Counter)
    pressure: Counter = field(default_factory=Counter)
    _seen: set[tuple] = field(default_factory=set)
    _allocated_in_call: list[int] = field(default_factory=list)
    _paused_ids: set[int] = field(default_factory=set)
    _in_lru_eviction: bool = False
    _parent_hash: dict[int, int] = field(default_factory=dict)  # block hash -> parent hash (0: root)

    # -- wiring ---------------------------------------------------------------------------------

    def attach(self) -> "ContextAudit":
        ctx, allocator = self.context, self.context.kv_block_allocator
        add_request, append = ctx.add_request, ctx.append_key_value_cache
        allocate = allocator.allocate_memory_blocks

        def audited_allocate(num_blocks: int, *args, **kwargs):
            blocks = allocate(num_blocks, *args, **kwargs)
            if blocks is not None:
                self._allocated_in_call.extend(blocks.tolist())
            return blocks

        def audited_add_request(req, prefill_chunk_length=None):
            self._allocated_in_call.clear()
            self._learn_parent_hashes(req)
            row, finished = ctx.total_request_count, req.finished_chunk_token_count
            chunk = req.remaining_prompt_length if prefill_chunk_length is None else prefill_chunk_length
            first_token = ctx.active_token_count
            result = add_request(req, prefill_chunk_length)
            matched = self._record_matches(req.request_id, row, finished)
            computed = ctx.active_token_count - first_token
            self.counters.update(blocks_matched=matched, cache_hits=int(matched > 0),
                                 prefill_tokens_computed=computed,
                                 prefill_tokens_skipped=chunk - computed)
            return result

        def audited_append(layer_number, key, value):
            self._check_kv_writes()
            return append(layer_number, key, value)

        ctx.add_request = audited_add_request
        ctx.append_key_value_cache = audited_append
        allocator.allocate_memory_blocks = audited_allocate
        if hasattr(allocator, "_deregister_blocks"):  # count evictions (none with prefix caching off)
            deregister, evict = allocator._deregister_blocks, allocator.evict_lru_blocks

            def counted_deregister(block_ids, *args, **kwargs):
                key = "cached_blocks_evicted" if self._in_lru_eviction else "blocks_deregistered_at_ref_zero"
                self.pressure[key] += int(block_ids.numel())
                return deregister(block_ids, *args, **kwargs)

            def counted_evict(num_blocks_needed, *args, **kwargs):
                self._in_lru_eviction = True
                try:
                    return evict(num_blocks_needed, *args, **kwargs)
                finally:
                    self._in_lru_eviction = False

            allocator._deregister_blocks = counted_deregister
            allocator.evict_lru_blocks = counted_evict
        return self

    def detach(self) -> None:
        allocator = self.context.kv_block_allocator
        for owner, name in ((self.context, "add_request"), (self.context, "append_key_value_cache"),
                            (allocator, "allocate_memory_blocks"), (allocator, "_deregister_blocks"),
                            (allocator, "evict_lru_blocks")):
            owner.__dict__.pop(name, None)

    # -- KV write audit -------------------------------------------------------------------------

    def _record_matches(self, request_id: int, row: int, finished_tokens: int) -> int:
        """Remember which new block-table entries came from a hash match; return how many."""
        ctx = self.context
        first_new = -(-finished_tokens // ctx.block_size_tokens)  # blocks held before this chunk
        count = int(ctx.request_kv_block_counts[row])
        new_entries = ctx.request_to_kv_block_ids[row][first_new:count].tolist()
        matched = set(new_entries) - set(self._allocated_in_call)
        if finished_tokens == 0:  # a first chunk: a new request or one re-added after eviction
            self.matched_blocks[request_id] = set()
        self.matched_blocks.setdefault(request_id, set()).update(matched)
        return len(matched)

    def _check_kv_writes(self) -> None:
        ctx = self.context
        tokens = ctx.active_token_count
        view = getattr(ctx, "gpu_view", None) or ctx  # what the KV append kernel reads
        written = view.token_to_block_idx[:tokens].tolist()
        rows = ctx.token_to_request_idx[:tokens].tolist()
        dummy = ctx.kv_block_allocator.dummy_block_idx
        own_blocks: dict[int, set[int]] = {}
        for row, block in zip(rows, written):
            self.kv_writes_checked += 1
            if block == dummy:
                continue
            if row not in own_blocks:
                own_blocks[row] = self._own_blocks(row)
            if block not in own_blocks[row]:
                request_id = int(ctx.request_ids[row])
                why = "obtained by hash match" if block in self.matched_blocks.get(request_id, ()) \
                    else "not in its block table"
                self._add(Violation("kv_write", self.step, block, request_id,
                                    f"request {request_id} wrote KV into block {block}, {why}"))

    def _own_blocks(self, row: int) -> set[int]:
        ctx = self.context
        table = ctx.request_to_kv_block_ids[row][: int(ctx.request_kv_block_counts[row])].tolist()
        return set(table) - self.matched_blocks.get(int(ctx.request_ids[row]), set())

    # -- ref-count audit ------------------------------------------------------------------------

    def live_rows(self) -> range:
        """Rows holding blocks: paused + active, plus a chunked-prefill request between chunks."""
        ctx = self.context
        end = ctx.total_request_count
        if getattr(ctx, "chunked_prefill_request_id", -1) != -1 and end < ctx.max_requests:
            if int(ctx.request_ids[end]) == ctx.chunked_prefill_request_id:
                end += 1  # update_requests leaves the chunked request's row just past the end
        return range(0, end)

    def owner_counts(self) -> Counter:
        """Block ID -> number of live block tables that hold it (an owner per table entry)."""
        ctx = self.context
        owners: Counter = Counter()
        for row in self.live_rows():
            count = int(ctx.request_kv_block_counts[row])
            owners.update(b for b in ctx.request_to_kv_block_ids[row][:count].tolist() if b >= 0)
        return owners

    def end_step(self) -> None:
        """Check ref counts against live owners and the free pool; then advance the step."""
        owners = self.owner_counts()
        self._note_pressure(owners)
        if not self.check_ref_counts:
            self.step += 1
            return
        allocator = self.context.kv_block_allocator
        ref_counts = allocator.block_ref_counts.tolist()
        for block in range(allocator.dummy_block_idx):
            if ref_counts[block] != owners.get(block, 0):
                self._add(Violation("ref_count", self.step, block, -1,
                                    f"block {block} has ref count {ref_counts[block]} but "
                                    f"{owners.get(block, 0)} live owners"))
        self._check_free_pool(owners)
        self._check_block_tables()
        self._check_prefix_chains()
        self.steps_checked += 1
        self.step += 1

    def end_failed_step(self) -> None:
        """After megatron-core raised mid-step: only the checks that hold at any point of a step
        (block tables, prefix chains), so the fault behind the exception is named. Ref counts and
        the free pool are not checked: a step cut short leaves them half updated."""
        if self.check_ref_counts:
            self._check_block_tables()
            self._check_prefix_chains()

    def _note_pressure(self, owners: Counter) -> None:
        """Peak pool use and paused requests after this step (see :meth:`summary`)."""
        ctx, allocator = self.context, self.context.kv_block_allocator
        usable = int(allocator.total_count) - 1  # the dummy block is never handed out
        peak = self.pressure
        peak["total_blocks"] = usable
        peak["peak_blocks_held"] = max(peak["peak_blocks_held"], len(owners))
        peak["peak_blocks_not_free"] = max(peak["peak_blocks_not_free"], usable - int(allocator.total_avail))
        paused = int(ctx.paused_request_count)
        peak["peak_paused_requests"] = max(peak["peak_paused_requests"], paused)
        if paused:
            peak["steps_with_paused_requests"] += 1
            self._paused_ids.update(int(r) for r in ctx.request_ids[:paused].tolist())
        peak["requests_paused"] = len(self._paused_ids)

    def _check_free_pool(self, owners: Counter) -> None:
        allocator = self.context.kv_block_allocator
        free = allocator.block_bag[: allocator.total_avail].tolist()
        hashes = allocator.block_hashes.tolist()
        for block, times in Counter(free).items():
            if times > 1:
                self._add(Violation("free_pool", self.step, block, -1,
                                    f"block {block} is in the free pool {times} times"))
            if owners.get(block) or hashes[block] != -1:
                self._add(Violation("free_pool", self.step, block, -1,
                                    f"free block {block} has {owners.get(block, 0)} owners and "
                                    f"hash {hashes[block]}"))

    # -- block-table and prefix-chain audit -----------------------------------------------------

    def _learn_parent_hashes(self, req: Any) -> None:
        """Record each block hash's parent hash from the request's chained block hashes."""
        hashes = list(getattr(req, "precomputed_block_hashes", None) or [])
        self._parent_hash.update(zip(hashes, [0] + hashes[:-1]))

    def _check_block_tables(self) -> None:
        ctx = self.context
        for row in self.live_rows():
            count = int(ctx.request_kv_block_counts[row])
            table = [b for b in ctx.request_to_kv_block_ids[row][:count].tolist() if b >= 0]
            for block, times in Counter(table).items():
                if times > 1:
                    request_id = int(ctx.request_ids[row])
                    self._add(Violation("block_table", self.step, block, request_id,
                                        f"request {request_id}'s block table holds block {block} "
                                        f"{times} times"))

    def _check_prefix_chains(self) -> None:
        allocator = self.context.kv_block_allocator
        hash_map = allocator.kv_hash_to_block_id
        for block_hash, block in hash_map.items():
            parent = self._parent_hash.get(block_hash, 0)
            if parent != 0 and parent not in hash_map:
                self._add(Violation("prefix_chain", self.step, block, -1,
                                    f"cached block {block} outlived its parent block: a lookup of "
                                    "its prefix raises KeyError"))
        if not hasattr(allocator, "block_child_count") or not uses_lru_prefix_caching(allocator):
            return
        registered = [b for b, h in enumerate(allocator.block_hashes.tolist()) if h != -1]
        parent_ids = allocator.block_parent_id.tolist()
        named = Counter(parent_ids[b] for b in registered if parent_ids[b] >= 0)
        for block, counted in enumerate(allocator.block_child_count.tolist()):
            if counted != named.get(block, 0):
                self._add(Violation("child_count", self.step, block, -1,
                                    f"block {block} counts {counted} cached children but "
                                    f"{named.get(block, 0)} registered blocks name it parent: it can "
                                    "never be evicted, yet counts as evictable"))

    def drain(self) -> None:
        """At drain: every block is free or cached (hashed) with ref count 0, each exactly once."""
        allocator = self.context.kv_block_allocator
        free = set(allocator.block_bag[: allocator.total_avail].tolist())
        hashes = allocator.block_hashes.tolist()
        ref_counts = allocator.block_ref_counts.tolist()
        for block in range(allocator.dummy_block_idx):
            cached = hashes[block] != -1
            if ref_counts[block] != 0 or (block in free) == cached:
                state = "free" if block in free else ("cached" if cached else "neither free nor cached")
                self._add(Violation("drain", self.step, block, -1,
                                    f"at drain block {block} is {state} with ref count "
                                    f"{ref_counts[block]}"))

    # -- results --------------------------------------------------------------------------------

    def _add(self, violation: Violation) -> None:
        key = (violation.kind, violation.step, violation.block, violation.request_id)
        if key not in self._seen:
            self._seen.add(key)
            self.violations.append(violation)

    def count(self, *kinds: str) -> int:
        return sum(1 for v in self.violations if v.kind in kinds)

    #: Keys of ``summary()["pressure"]``.
    PRESSURE_KEYS = ("total_blocks", "peak_blocks_held", "peak_blocks_not_free", "peak_paused_requests",
                     "steps_with_paused_requests", "requests_paused", "cached_blocks_evicted",
                     "blocks_deregistered_at_ref_zero")

    def summary(self) -> dict[str, Any]:
        """Counts per audit, and the first few violations of each kind as text.

        ``pressure`` (all ints, blocks exclude the dummy block): ``total_blocks`` in the pool;
        ``peak_blocks_held``, the most distinct blocks in live block tables after a step;
        ``peak_blocks_not_free``, the most blocks outside the free pool (held or cached);
        ``peak_paused_requests``, the most requests paused at once (no KV block for their next
        token); ``steps_with_paused_requests``; ``requests_paused``, distinct requests ever
        paused; ``cached_blocks_evicted``, cached blocks evicted by LRU to make room;
        ``blocks_deregistered_at_ref_zero``, cached blocks dropped when their ref count reached
        zero (REF_ZERO). The last two stay 0 with prefix caching off.
        """
        first = {}
        for v in self.violations:
            first.setdefault(v.kind, []).append(f"step {v.step}: {v.detail}")
        return {
            "prefix_cache": {k: int(self.counters.get(k, 0)) for k in
                             ("cache_hits", "blocks_matched", "prefill_tokens_skipped",
                              "prefill_tokens_computed")},
            "kv_write_violations": self.count("kv_write"),
            "refcount_violations": self.count("ref_count", "free_pool", "drain"),
            "lru_violations": self.count("block_table", "prefix_chain", "child_count"),
            "violations_by_kind": dict(Counter(v.kind for v in self.violations)),
            "kv_writes_checked": self.kv_writes_checked,
            "steps_checked": self.steps_checked,
            "pressure": {k: int(self.pressure.get(k, 0)) for k in self.PRESSURE_KEYS},
            "examples": {k: lines[:3] for k, lines in first.items()},
        }

