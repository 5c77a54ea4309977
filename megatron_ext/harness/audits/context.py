"""The audits of a live ``DynamicInferenceContext`` behind one object, independent of the runtime patches.

:class:`ContextAudit` attaches instance-level wrappers (the engine calls ``context.add_request``
and the attention layer ``context.append_key_value_cache``; the allocator's
``allocate_memory_blocks``, ``register_kv_block_hashes``, ``_deregister_blocks`` and ``evict_lru_blocks``), so it stacks on
top of whatever class-level code is installed (patched or not) and is removed with
:meth:`ContextAudit.detach`. It feeds one module per invariant: :mod:`.kv_writes` (fault 2),
:mod:`.ref_counts` (fault 1), :mod:`.lru` (faults 3-5), :mod:`.stale_hits` (fault 8), :mod:`.mamba_snapshots` (hybrid models:
the Mamba state restores, fault H1; through the Mamba slot allocator's ``restore_to_live``),
:mod:`.routing_replay` (MoE models with routing replay: through the allocator's ``store_routing_per_block``,
``reconstruct_routing_from_blocks`` and ``reset``), :mod:`.speculative` (speculative decoding: no draft
in a hash-registered block, a whole rollback) and :mod:`.pool` (pool pressure and prefix-cache counters,
measured, not checked).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .base import AuditLog, Violation
from .kv_writes import KVWriteAudit
from .lru import LRUAudit
from .mamba_snapshots import MambaSnapshotAudit
from .pool import PoolAudit, PoolPressure, PrefixCacheCounters
from .ref_counts import RefCountAudit
from .routing_replay import RoutingReplayAudit
from .speculative import DraftCounts, SpeculativeAudit
from .stale_hits import StaleHitAudit


@dataclass
class AuditSummary:
    """What the audits found over a run.

    Attributes:
        kv_write_violations: KV writes into blocks the writer did not allocate (fault 2).
        refcount_violations: ref-count, free-pool and drain violations (fault 1).
        lru_violations: repeated block IDs, broken prefix chains, wrong child counts (faults 3-5).
        stale_hits: hash matches of blocks cached under older weights (fault 8; only runs with
            weight updates can have them).
        mamba_restore_violations: hybrid models: Mamba restores that failed while prefill tokens
            of the request were skipped, or skips with no restore (fault H1).
        violations_by_kind: violation kind -> count, kinds in the order first seen.
        kv_writes_checked: (token, layer) KV writes inspected.
        kv_writes_redirected: (token, layer) KV writes that went to the dummy block (tokens
            recomputed inside blocks obtained by a hash match, fix 2).
        mamba_restores: hybrid models: ``restore_to_live`` calls (0: not a hybrid model, or no
            Mamba prefix cache).
        mamba_restores_failed: of those, the ones that found no snapshot.
        mamba_restore_log: every restore as ``{step, request_id, block, tokens_skipped, restored}``.
        routing_replay_violations: MoE routing replay: finished requests given no routing (kind
            ``routing_missing``, fault R2), positions whose replayed expert IDs are stale, of another
            token, or differ from the request's own forward, a ``block_routing`` larger than the pool
            (:mod:`.routing_replay`).
        routing_tokens_checked: positions of reconstructed ``routing_indices`` checked.
        routing_reconstructions: ``reconstruct_routing_from_blocks`` calls checked.
        block_routing_max_entries: the most blocks ``block_routing`` held after a step (0: no
            routing replay, or a release without per-block routing).
        routing_unrebuilt: request IDs megatron-core rebuilt no routing for (fault R2).
        steps_checked: steps whose ref counts were checked.
        speculative_violations: speculative decoding: hash-registered blocks holding drafts
            (``draft_block``) and rollbacks that left the bookkeeping broken (``spec_rewind``).
        drafts: speculative decoding: :class:`~.speculative.DraftCounts` (all 0 without it).
        examples: violation kind -> its first three violations as ``step N: detail`` lines.
    """

    kv_write_violations: int = 0
    refcount_violations: int = 0
    lru_violations: int = 0
    stale_hits: int = 0
    mamba_restore_violations: int = 0
    violations_by_kind: dict[str, int] = field(default_factory=dict)
    kv_writes_checked: int = 0
    kv_writes_redirected: int = 0
    mamba_restores: int = 0
    mamba_restores_failed: int = 0
    mamba_restore_log: list[dict] = field(default_factory=list)
    routing_replay_violations: int = 0
    routing_tokens_checked: int = 0
    routing_reconstructions: int = 0
    block_routing_max_entries: int = 0
    routing_unrebuilt: tuple[int, ...] = ()
    steps_checked: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)
    speculative_violations: int = 0
    drafts: DraftCounts = field(default_factory=DraftCounts)


class ContextAudit:
    """Attach to a context, call :meth:`end_step` after each engine step and :meth:`drain` at the end.

    Args:
        context: the megatron-core ``DynamicInferenceContext``.
        check_ref_counts: False with prefix caching off (no ref counts exist then): only the KV
            writes and the pool are watched.
    """

    def __init__(self, context: Any, check_ref_counts: bool = True) -> None:
        self.context = context
        self.check_ref_counts = check_ref_counts
        self.log = AuditLog(context)
        self.kv_writes = KVWriteAudit(self.log)
        self.ref_counts = RefCountAudit(self.log)
        self.lru = LRUAudit(self.log)
        self.pool = PoolAudit(self.log)
        self.stale = StaleHitAudit(self.log)
        self.mamba = MambaSnapshotAudit(self.log)
        self.routing = RoutingReplayAudit(self.log)
        self.speculative = speculative_audit(self.log)
        self.steps_checked = 0
        self._allocator = None
        self._mamba_slots = None

    @property
    def violations(self) -> list[Violation]:
        """Unique violations seen so far, in order."""
        return self.log.violations

    @property
    def counters(self) -> PrefixCacheCounters:
        """Prefix-cache counters so far."""
        return self.pool.counters

    @property
    def pressure(self) -> PoolPressure:
        """KV pool pressure so far."""
        return self.pool.pressure

    # -- wiring ---------------------------------------------------------------------------------

    def attach(self) -> "ContextAudit":
        """Install the instance-level wrappers; returns ``self``."""
        ctx = self.context
        add_request, append = ctx.add_request, ctx.append_key_value_cache

        def audited_add_request(req, prefill_chunk_length=None):
            self.kv_writes.begin_add_request()
            self.lru.learn_parent_hashes(req)
            row, finished = ctx.total_request_count, req.finished_chunk_token_count
            self.stale.begin_add_request(req.request_id, finished)
            self.mamba.begin_add_request(req.request_id)
            self.routing.prompt(req.request_id, req.prompt_tokens)
            self.speculative.added(req)
            chunk = req.remaining_prompt_length if prefill_chunk_length is None else prefill_chunk_length
            first_token = ctx.active_token_count
            try:
                result = add_request(req, prefill_chunk_length)
            except BaseException:
                self.mamba.add_request_failed()
                raise
            matched = self.kv_writes.end_add_request(req.request_id, row, finished)
            self.stale.end_add_request(req.request_id, self.kv_writes.last_matched)
            computed = ctx.active_token_count - first_token
            self.pool.added(matched, chunk, computed)
            if self._mamba_slots is not None:  # a hybrid context with a Mamba prefix cache
                self.mamba.end_add_request(req.request_id, finished == 0, chunk - computed)
            return result

        def audited_append(layer_number, key, value):
            self.kv_writes.check_append()
            return append(layer_number, key, value)

        ctx.add_request = audited_add_request
        ctx.append_key_value_cache = audited_append
        self._attach_allocator()
        self._attach_mamba_slots()
        return self

    def _attach_mamba_slots(self) -> None:
        """Wrap the Mamba slot allocator's ``restore_to_live`` (hybrid contexts with a Mamba prefix cache)."""
        slots = getattr(self.context, "mamba_slot_allocator", None)
        if slots is None or not hasattr(slots, "restore_to_live"):
            return
        self._mamba_slots, restore = slots, slots.restore_to_live

        def audited_restore(request_idx: int, block_id: int, *args, **kwargs) -> bool:
            restored = restore(request_idx, block_id, *args, **kwargs)
            self.mamba.restore_called(request_idx, block_id, restored)
            return restored

        slots.restore_to_live = audited_restore

    def _attach_allocator(self) -> None:
        """Wrap the context's current allocator (allocate, register, deregister, evict)."""
        allocator = self._allocator = self.context.kv_block_allocator
        allocate = allocator.allocate_memory_blocks

        def audited_allocate(num_blocks: int, *args, **kwargs):
            blocks = allocate(num_blocks, *args, **kwargs)
            if blocks is not None:
                self.kv_writes.allocated(blocks.tolist())
                self.routing.allocated(blocks.tolist())
            return blocks

        allocator.allocate_memory_blocks = audited_allocate
        if hasattr(allocator, "store_routing_per_block"):  # 0.18+: per-block MoE routing
            store, rebuild, reset = (allocator.store_routing_per_block, allocator.reconstruct_routing_from_blocks,
                                     allocator.reset)

            def audited_store(flat_routing, *args, **kwargs):
                self.routing.stored(self.context, flat_routing)
                return store(flat_routing, *args, **kwargs)

            def audited_rebuild(block_ids, total_routing_tokens, *args, **kwargs):
                result = rebuild(block_ids, total_routing_tokens, *args, **kwargs)
                self.routing.reconstructed(list(block_ids), int(total_routing_tokens),
                                           int(self.context.block_size_tokens), result)
                return result

            def audited_reset(*args, **kwargs):
                self.routing.reset()
                return reset(*args, **kwargs)

            allocator.store_routing_per_block = audited_store
            allocator.reconstruct_routing_from_blocks = audited_rebuild
            allocator.reset = audited_reset
        if hasattr(allocator, "register_kv_block_hashes"):  # every release 0.17-0.19
            register = allocator.register_kv_block_hashes

            def audited_register(block_ids, *args, **kwargs):
                self.stale.registered(int(b) for b in block_ids)
                return register(block_ids, *args, **kwargs)

            allocator.register_kv_block_hashes = audited_register
        if hasattr(allocator, "_deregister_blocks"):  # count evictions (none with prefix caching off)
            deregister, evict = allocator._deregister_blocks, allocator.evict_lru_blocks

            def counted_deregister(block_ids, *args, **kwargs):
                self.pool.deregistered(int(block_ids.numel()))
                return deregister(block_ids, *args, **kwargs)

            def counted_evict(num_blocks_needed, *args, **kwargs):
                with self.pool.lru_eviction():
                    return evict(num_blocks_needed, *args, **kwargs)

            allocator._deregister_blocks = counted_deregister
            allocator.evict_lru_blocks = counted_evict

    def weights_updated(self) -> None:
        """The harness updated the model's weights (after ``engine.resume()`` or the explicit
        invalidation): the stale-hit audit moves to the next weight version; a context that built
        a new allocator meanwhile (RECOMPUTE resume) gets the allocator wrappers again (the Mamba
        slot allocator's too)."""
        self.stale.weights_updated()
        if self.context.kv_block_allocator is not self._allocator:
            self._detach_allocator()
            self.stale.allocator_replaced()
            self.routing.reset()
            self._attach_allocator()
        if getattr(self.context, "mamba_slot_allocator", None) is not self._mamba_slots:
            self._detach_mamba_slots()
            self._attach_mamba_slots()

    def _detach_allocator(self) -> None:
        for name in ("allocate_memory_blocks", "register_kv_block_hashes", "_deregister_blocks", "evict_lru_blocks",
                     "store_routing_per_block", "reconstruct_routing_from_blocks", "reset"):
            self._allocator.__dict__.pop(name, None)

    def detach(self) -> None:
        """Remove the wrappers :meth:`attach` installed."""
        for name in ("add_request", "append_key_value_cache"):
            self.context.__dict__.pop(name, None)
        if self._allocator is not None:
            self._detach_allocator()
        self._detach_mamba_slots()

    def _detach_mamba_slots(self) -> None:
        if self._mamba_slots is not None:
            self._mamba_slots.__dict__.pop("restore_to_live", None)
            self._mamba_slots = None

    # -- checkpoints of a run -------------------------------------------------------------------

    def end_step(self) -> None:
        """Check ref counts against live owners, the free pool, block tables and prefix chains; then advance the step."""
        owners = self.log.owner_counts()
        self.pool.end_step(owners)
        self.mamba.end_step()
        self.routing.end_step(self.context.kv_block_allocator)
        self.speculative.end_step()
        if self.check_ref_counts:
            self.ref_counts.check(owners)
            self.lru.check()
            self.steps_checked += 1
        self.log.step += 1

    def end_failed_step(self) -> None:
        """After megatron-core raised mid-step: only the checks that hold at any point of a step
        (block tables, prefix chains), so the fault behind the exception is named. Ref counts and
        the free pool are not checked: a step cut short leaves them half updated."""
        if self.check_ref_counts:
            self.lru.check()

    def drain(self) -> None:
        """At drain: every block is free or cached (hashed) with ref count 0, each exactly once."""
        self.ref_counts.drain()

    # -- results --------------------------------------------------------------------------------

    def count(self, *kinds: str) -> int:
        """Violations of any of ``kinds``."""
        return self.log.count(*kinds)

    def summary(self) -> AuditSummary:
        """Counts per audit, and the first few violations of each kind as text."""
        first: dict[str, list[str]] = {}
        for v in self.violations:
            first.setdefault(v.kind, []).append(f"step {v.step}: {v.detail}")
        return AuditSummary(
            kv_write_violations=self.count("kv_write", "kv_write_foreign"),
            refcount_violations=self.count("ref_count", "free_pool", "drain"),
            lru_violations=self.count("block_table", "prefix_chain", "child_count"),
            stale_hits=self.count("stale_hit"),
            mamba_restore_violations=self.count("mamba_restore"),
            violations_by_kind=dict(Counter(v.kind for v in self.violations)),
            kv_writes_checked=self.kv_writes.kv_writes_checked,
            kv_writes_redirected=self.kv_writes.kv_writes_redirected,
            mamba_restores=len(self.mamba.restores),
            mamba_restores_failed=self.mamba.failed(),
            mamba_restore_log=self.mamba.records(),
            routing_replay_violations=self.count("routing_replay", "routing_missing"),
            routing_tokens_checked=self.routing.tokens_checked,
            routing_reconstructions=self.routing.reconstructions,
            block_routing_max_entries=self.routing.max_entries,
            routing_unrebuilt=tuple(sorted(self.routing.unrebuilt)),
            steps_checked=self.steps_checked,
            examples={k: lines[:3] for k, lines in first.items()},
            speculative_violations=self.count("draft_block", "spec_rewind"),
            drafts=self.speculative.counts,
        )


def speculative_audit(log: AuditLog) -> SpeculativeAudit:
    """The speculative-decoding audit of ``log``'s context (its ``num_speculative_tokens``; 0 on a
    context without the field), hashing with megatron-core's own ``compute_block_hashes_batched``."""
    from ... import mcore

    n = int(getattr(log.context, "num_speculative_tokens", 0) or 0)
    hashes = mcore.import_module("megatron.core.inference.inference_request").compute_block_hashes_batched if n else None
    return SpeculativeAudit(log, n, hashes)
