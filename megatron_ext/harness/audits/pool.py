"""KV pool pressure and prefix-cache counters: what a run did to the pool, not an invariant.

Measured after every step: peak blocks held by live requests, peak blocks outside the free pool,
paused requests; counted as they happen: cached blocks evicted (LRU) or deregistered (both
policies), and at each ``add_request`` the blocks matched and prefill tokens skipped (megatron-core's
own counters differ between releases and the engine resets them while logging).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

from .base import AuditLog, free_blocks, pool_blocks


@dataclass
class PrefixCacheCounters:
    """Prefix-cache counters over a run, measured at ``add_request``.

    Attributes:
        cache_hits: ``add_request`` calls that matched at least one block.
        blocks_matched: blocks obtained by a hash match.
        prefill_tokens_skipped: prompt tokens not computed thanks to a match.
        prefill_tokens_computed: prompt tokens computed.
    """

    cache_hits: int = 0
    blocks_matched: int = 0
    prefill_tokens_skipped: int = 0
    prefill_tokens_computed: int = 0


@dataclass
class PoolPressure:
    """How hard a run pressed on the KV pool (blocks exclude the dummy block).

    Attributes:
        total_blocks: blocks in the pool.
        peak_blocks_held: the most distinct blocks in live block tables after a step.
        peak_blocks_not_free: the most blocks outside the free pool (held or cached).
        peak_paused_requests: the most requests paused at once (no KV block for their next token).
        steps_with_paused_requests: steps after which some request was paused.
        requests_paused: distinct requests left paused after some step (a request megatron-core
            pauses and evicts within one ``update_requests`` counts under ``requests_evicted`` only).
        cached_blocks_evicted: cached blocks evicted by LRU to make room (0 with caching off).
        blocks_deregistered_at_ref_zero: cached blocks dropped when their ref count reached
            zero (REF_ZERO; 0 with caching off).
        requests_evicted: requests megatron-core evicted from a full pool to be re-run later (its
            ``evicted_request_count``, filled in by the step loop at the end of a run).
    """

    total_blocks: int = 0
    peak_blocks_held: int = 0
    peak_blocks_not_free: int = 0
    peak_paused_requests: int = 0
    steps_with_paused_requests: int = 0
    requests_paused: int = 0
    cached_blocks_evicted: int = 0
    blocks_deregistered_at_ref_zero: int = 0
    requests_evicted: int = 0


@dataclass
class PoolAudit:
    """Measures KV pool pressure and prefix-cache counters over a run (nothing it sees is a violation).

    Attributes:
        log: the context's :class:`AuditLog`.
        counters: :class:`PrefixCacheCounters` so far.
        pressure: :class:`PoolPressure` so far.
    """

    log: AuditLog
    counters: PrefixCacheCounters = field(default_factory=PrefixCacheCounters)
    pressure: PoolPressure = field(default_factory=PoolPressure)
    _paused_ids: set[int] = field(default_factory=set)
    _in_lru_eviction: bool = False

    def added(self, matched: int, chunk: int, computed: int) -> None:
        """An ``add_request`` of ``chunk`` prompt tokens matched ``matched`` blocks and computed ``computed`` tokens."""
        self.counters.blocks_matched += matched
        self.counters.cache_hits += int(matched > 0)
        self.counters.prefill_tokens_computed += computed
        self.counters.prefill_tokens_skipped += chunk - computed

    @contextlib.contextmanager
    def lru_eviction(self) -> Iterator[None]:
        """Blocks deregistered inside this block were evicted by LRU."""
        self._in_lru_eviction = True
        try:
            yield
        finally:
            self._in_lru_eviction = False

    def deregistered(self, count: int) -> None:
        """``count`` cached blocks were deregistered (evicted under :meth:`lru_eviction`, else at ref count 0)."""
        if self._in_lru_eviction:
            self.pressure.cached_blocks_evicted += count
        else:
            self.pressure.blocks_deregistered_at_ref_zero += count

    def end_step(self, owners: Counter) -> None:
        """Peak pool use and paused requests after this step."""
        ctx, allocator = self.log.context, self.log.context.kv_block_allocator
        usable = pool_blocks(allocator) - 1  # the dummy block is never handed out
        peak = self.pressure
        peak.total_blocks = usable
        peak.peak_blocks_held = max(peak.peak_blocks_held, len(owners))
        peak.peak_blocks_not_free = max(peak.peak_blocks_not_free, usable - free_blocks(allocator))
        paused = int(ctx.paused_request_count)
        peak.peak_paused_requests = max(peak.peak_paused_requests, paused)
        if paused:
            peak.steps_with_paused_requests += 1
            self._paused_ids.update(int(r) for r in ctx.request_ids[:paused].tolist())
        peak.requests_paused = len(self._paused_ids)
