"""Routing-replay audit (MoE models with ``moe_enable_routing_replay``, megatron-core 0.18+).

megatron-core 0.18 and 0.19 store each forwarded token's expert choices in the KV block its KV
lands in (``KVBlockAllocator.store_routing_per_block``, from ``token_to_block_idx``; tokens whose
KV goes to the dummy block are not stored), drop a block's entry when the block is allocated again
(``allocate_memory_blocks``) or the allocator is reset, and, when a request finishes, rebuild its
``routing_indices`` from the blocks of its block table (``reconstruct_routing_from_blocks``). A
prefix-cached request therefore returns, for its matched prefix, the routing that the request which
filled those blocks computed, not routing of its own forward.

The audit watches both ends:

* every ``store_routing_per_block`` call: per token, the request, its position, its token ID and
  its expert IDs (``[layers, topk]``), and per (block, offset) the last write in the block's
  current allocation (a block's *life*: the audit counts its allocations; the writes of a block's
  previous life are kept until it is allocated again, for a request that finished holding it);
* every ``reconstruct_routing_from_blocks`` call (the engine's, when a request finishes): the
  request is the live one whose block table was those blocks; for each position ``p`` it checks

  - ``missing``: megatron-core returned None, or nothing was written at ``p`` in the life of the
    block the request held (an entry left from an earlier life, or zeros, would be replayed: stale
    routing after a release, an eviction, a reuse or a flush);
  - ``value``: the replayed expert IDs equal the last ones stored there;
  - ``provenance``: they were stored for the same position by a request with the same tokens up to
    ``p`` (causal attention: the same routing in exact arithmetic);
  - ``own_forward``: where the request forwarded ``p`` itself (a recomputed matched token included),
    the replay equals what its own forward computed;

* after every step, ``len(block_routing)`` (reported; a violation past the pool's blocks, or an
  entry for the dummy block).

Violations are of kind ``routing_missing`` (no routing at all: fault R2) or ``routing_replay``. Caching on vs off is compared by ``ab`` itself (the
requests' ``routing`` in :class:`~megatron_ext.harness.compare.RequestDiff`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ...patches.routing_per_block import block_routing

import numpy as np

from .base import AuditLog, Violation, pool_blocks


@dataclass(frozen=True)
class RoutingWrite:
    """One token's routing as stored in a block: the block's life, the writer, the position."""

    life: int
    request_id: int
    position: int
    experts: tuple


@dataclass
class RoutingReplayAudit:
    """Checks what megatron-core replays from per-block routing against what its forwards computed.

    Attributes:
        log: the context's :class:`AuditLog`.
        tokens: request ID -> position -> token ID (prompts at ``add_request``, forwarded tokens
            at each store).
        computed: request ID -> position -> expert IDs (a tuple of per-layer tuples) its own forward
            computed last.
        writes: block ID -> offset in block -> the last :class:`RoutingWrite` there (current life).
        retired: block ID -> (life, its writes) of the block's previous life.
        lives: block ID -> allocations seen so far.
        tables: request ID -> its block table at the last store: (block ID, life held), in order.
        tokens_checked: positions checked in reconstructions.
        reconstructions: ``reconstruct_routing_from_blocks`` calls checked.
        unidentified: reconstructions whose blocks matched no (or several) live block tables.
        max_entries: the largest ``len(block_routing)`` seen after a step.
        unrebuilt: request IDs whose reconstruction gave no routing (fault R2).
    """

    log: AuditLog
    tokens: dict[int, dict[int, int]] = field(default_factory=dict)
    computed: dict[int, dict[int, tuple]] = field(default_factory=dict)
    writes: dict[int, dict[int, RoutingWrite]] = field(default_factory=dict)
    retired: dict[int, tuple[int, dict[int, RoutingWrite]]] = field(default_factory=dict)
    lives: dict[int, int] = field(default_factory=dict)
    tables: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    tokens_checked: int = 0
    reconstructions: int = 0
    unidentified: int = 0
    max_entries: int = 0
    unrebuilt: set[int] = field(default_factory=set)

    # -- feeding ----------------------------------------------------------------------------------

    def prompt(self, request_id: int, prompt_tokens: Any) -> None:
        """``add_request`` of ``request_id`` with ``prompt_tokens`` (a 1-D int tensor or list)."""
        known = self.tokens.setdefault(request_id, {})
        for position, token in enumerate(_ints(prompt_tokens)):
            known[position] = token

    def allocated(self, block_ids: list[int]) -> None:
        """``allocate_memory_blocks`` returned ``block_ids``: each starts a new life, empty."""
        for block in block_ids:
            self._retire(block)

    def reset(self) -> None:
        """The allocator was reset or replaced: no block holds routing, every block starts anew."""
        for block in list(self.writes):
            self._retire(block)

    def _retire(self, block: int) -> None:
        """``block`` starts a new life; its current writes become the previous life's."""
        life = self.lives.get(block, 0)
        self.retired[block] = (life, self.writes.pop(block, {}))
        self.lives[block] = life + 1

    def stored(self, context: Any, flat_routing: Optional[np.ndarray]) -> None:
        """``store_routing_per_block(flat_routing)`` is about to run on ``context``.

        Args:
            context: the ``DynamicInferenceContext`` (its ``token_to_*`` arrays still describe
                this step's active tokens).
            flat_routing: ``[active_token_count, layers, topk]`` int16/int32 expert IDs, or None.
        """
        if flat_routing is None:
            return
        count = int(context.active_token_count)
        rows = _ints(context.token_to_request_idx[:count])
        positions = _ints(context.token_to_position_in_request[:count])
        inputs = _ints(context.token_to_input_ids[:count])
        blocks = _ints(context.token_to_block_idx[:count])
        offsets = _ints(context.token_to_local_position_within_kv_block[:count])
        request_ids = _ints(context.request_ids)
        dummy = int(context.kv_block_allocator.dummy_block_idx)
        for row in sorted(set(rows)):
            table = context.request_to_kv_block_ids[row]
            self.tables[request_ids[row]] = [(b, self.lives.get(b, 0)) for b in _ints(table) if b >= 0]
        routing = np.asarray(flat_routing)
        for i in range(min(count, routing.shape[0])):
            request_id, position = request_ids[rows[i]], positions[i]
            experts = _experts(routing[i])
            self.tokens.setdefault(request_id, {})[position] = inputs[i]
            self.computed.setdefault(request_id, {})[position] = experts
            if blocks[i] != dummy and blocks[i] >= 0:
                self.writes.setdefault(blocks[i], {})[offsets[i]] = RoutingWrite(
                    self.lives.get(blocks[i], 0), request_id, position, experts)

    def reconstructed(self, block_ids: list[int], total: int, block_size: int,
                      result: Optional[np.ndarray]) -> None:
        """``reconstruct_routing_from_blocks(block_ids, total)`` returned ``result``
        (``[total, layers, topk]`` or None); ``block_size``: tokens per KV block."""
        block_ids = [int(b) for b in block_ids]
        owners = [rid for rid, table in self.tables.items() if [b for b, _ in table] == block_ids]
        if len(owners) != 1:
            self.unidentified += 1
            return
        request_id = owners[0]
        held = dict(enumerate(life for _, life in self.tables.pop(request_id)))  # it finished
        self.reconstructions += 1
        if result is None:
            self.unrebuilt.add(request_id)
            self._add(block_ids[0] if block_ids else -1, request_id,
                      f"request {request_id}: megatron-core reconstructed no routing from blocks {block_ids} "
                      f"({total} tokens expected)", kind="routing_missing")
            return
        result = np.asarray(result)
        reader = self.tokens.get(request_id, {})
        own = self.computed.get(request_id, {})
        for p in range(total):
            self.tokens_checked += 1
            block = block_ids[p // block_size] if p // block_size < len(block_ids) else -1
            replayed = _experts(result[p]) if p < result.shape[0] else None
            write = self._write(block, held.get(p // block_size, -1), p % block_size)
            where = f"request {request_id} position {p} (block {block}, offset {p % block_size})"
            if write is None:
                self._add(block, request_id, f"{where}: replays {replayed}, but nothing was stored there while "
                          "the request held the block (stale or zero routing)")
                continue
            if replayed != write.experts:
                self._add(block, request_id, f"{where}: replays {replayed}, the last routing stored there is "
                          f"{write.experts} (request {write.request_id})")
                continue
            if write.position != p or not _same_prefix(self.tokens.get(write.request_id, {}), reader, p):
                self._add(block, request_id, f"{where}: replays the routing request {write.request_id} stored "
                          f"for its position {write.position}, whose tokens up to there differ")
                continue
            if p in own and own[p] != replayed:
                self._add(block, request_id, f"{where}: replays {replayed}, its own forward computed {own[p]}")

    def _write(self, block: int, life: int, offset: int) -> Optional[RoutingWrite]:
        """The last write at ``offset`` of ``block`` in its life ``life`` (current or previous), or None."""
        if self.lives.get(block, 0) == life:
            return self.writes.get(block, {}).get(offset)
        retired_life, writes = self.retired.get(block, (-1, {}))
        return writes.get(offset) if retired_life == life else None

    def end_step(self, allocator: Any) -> None:
        """After a step: ``len(allocator.block_routing)`` within the pool, no dummy-block entry
        (0.17: the store of fault R1's patch, empty where it is not applied)."""
        routing = getattr(allocator, "block_routing", None)
        if routing is None:
            routing = block_routing(allocator)
        self.max_entries = max(self.max_entries, len(routing))
        dummy = int(allocator.dummy_block_idx)
        if len(routing) > pool_blocks(allocator) - 1:
            self._add(-1, -1, f"block_routing holds {len(routing)} entries, more than the pool's "
                      f"{pool_blocks(allocator) - 1} blocks")
        if dummy in routing:
            self._add(dummy, -1, f"block_routing holds an entry for the dummy block {dummy}")

    def _add(self, block: int, request_id: int, detail: str, kind: str = "routing_replay") -> None:
        self.log.add(Violation(kind, self.log.step, block, request_id, detail))


def _ints(values: Any) -> list[int]:
    """A 1-D tensor, array or list as Python ints."""
    return [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


def _experts(row: Any) -> tuple:
    """One token's ``[layers, topk]`` expert IDs as a tuple of per-layer tuples of ints."""
    return tuple(tuple(int(e) for e in layer) for layer in np.asarray(row).tolist())


def _same_prefix(writer: dict[int, int], reader: dict[int, int], p: int) -> bool:
    """Whether both requests hold the same known token at every position ``0..p``."""
    return all(q in writer and q in reader and writer[q] == reader[q] for q in range(p + 1))
