"""A reference model of prefix-cached KV block ownership, for the allocator property tests.

Pure Python, no megatron-core: it says what ``KVBlockAllocator``'s bookkeeping must be, given the
requests that are alive, and which eviction choices are legal. ``test_allocator_properties.py``
drives the real allocator and this model side by side.

Vocabulary: a *request* holds a block table (block IDs in position order). Its first
``len(prompt)`` positions are complete prompt blocks, which may carry a hash; positions after that
are private blocks (the partial last prompt block, decode blocks) that never get one. A block is
*live* while some request holds it (ref count = number of requests holding it), *registered*
while it has a hash, *cached* when registered but not live (LRU only: REF_ZERO deregisters at
zero), and *free* otherwise.

Hashes are parent-chained like megatron-core's: the hash of block k names the whole prompt prefix
``prompt[: k + 1]``, so equal hashes mean equal prefixes, and the parent of block k is block k-1
(hash 0 for the root).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

#: Hashes are offset so they can never be confused with block IDs, -1 ("no hash") or 0 (root).
HASH_BASE = 1_000_000


def prefix_hash(prompt: tuple[int, ...], position: int) -> int:
    """Hash of the prefix ``prompt[: position + 1]`` (collision-free for symbols 0..8)."""
    value = 0
    for symbol in prompt[: position + 1]:
        value = value * 10 + symbol + 1
    return HASH_BASE + value


def parent_hash(prompt: tuple[int, ...], position: int) -> int:
    """Parent hash of block ``position``: the previous block's hash, 0 for the root."""
    return prefix_hash(prompt, position - 1) if position > 0 else 0


@dataclass
class Request:
    rid: int
    prompt: tuple[int, ...]
    blocks: list[int] = field(default_factory=list)
    #: Leading positions obtained by a hash match (pinned, not allocated).
    matched: int = 0
    #: Positions below this are done: hashed (matched, or registered by this request) or given
    #: up on; registration proceeds in position order, as add_request does chunk by chunk.
    registered_upto: int = 0

    def unregistered_complete(self) -> int:
        return max(0, min(len(self.prompt), len(self.blocks)) - self.registered_upto)


class OwnerModel:
    """Expected allocator state: owners per block, hash registry, LRU timestamps."""

    def __init__(self, total_count: int, lru: bool) -> None:
        self.total_count = total_count
        self.usable = total_count - 1  # the last block is the dummy block
        self.lru = lru
        self.requests: dict[int, Request] = {}
        self.next_rid = 0
        self.hash_of: dict[int, int] = {}  # block -> hash (expected block_hashes)
        self.block_of: dict[int, int] = {}  # hash -> block (expected kv_hash_to_block_id)
        self.parent_hash_of: dict[int, int] = {}  # registered block -> parent hash
        self.parent_block_of: dict[int, int] = {}  # registered block -> parent block at registration
        self.ts: dict[int, int] = {}  # LRU timestamp of every live or registered block

    # ----------------------------------------------------------------- derived state
    def ref_counts(self) -> list[int]:
        counts = [0] * self.total_count
        for req in self.requests.values():
            for block in req.blocks:
                counts[block] += 1
        return counts

    def live(self) -> set[int]:
        return {b for req in self.requests.values() for b in req.blocks}

    def cached(self) -> set[int]:
        return set(self.hash_of) - self.live() if self.lru else set()

    def free_count(self) -> int:
        return self.usable - len(self.live() | set(self.hash_of))

    def orphans(self) -> list[int]:
        """Registered blocks whose parent hash is not registered any more (a broken chain)."""
        return sorted(
            b for b, ph in self.parent_hash_of.items() if ph != 0 and ph not in self.block_of
        )

    def match(self, prompt: tuple[int, ...]) -> list[int]:
        """Blocks of the longest cached prefix of ``prompt``, walking the chain from the root."""
        matched = []
        for position in range(len(prompt)):
            block = self.block_of.get(prefix_hash(prompt, position))
            if block is None:
                break
            matched.append(block)
        return matched

    def allocation_succeeds(self, count: int) -> bool:
        """Whether ``allocate_memory_blocks(count)`` must succeed (after any pins were taken)."""
        supply = self.free_count() + (len(self.cached()) if self.lru else 0)
        return supply >= count

    # ----------------------------------------------------------------- eviction references
    def lru_leaf_peel(self, count: int) -> set[int]:
        """Blocks megatron-core 0.19's ``evict_lru_blocks(count)`` evicts (children first, then
        oldest own timestamp, ties by block ID)."""
        cached = self.cached()
        children = {b: 0 for b in cached}
        for child, parent in self.parent_block_of.items():
            if parent in children:
                children[parent] += 1
        heap = [(self.ts[b], b) for b in cached if children[b] == 0]
        heapq.heapify(heap)
        evicted: set[int] = set()
        while heap and len(evicted) < count:
            _, block = heapq.heappop(heap)
            evicted.add(block)
            parent = self.parent_block_of.get(block, -1)
            if parent in children:
                children[parent] -= 1
                if children[parent] == 0:
                    heapq.heappush(heap, (self.ts[parent], parent))
        return evicted

    def is_oldest_first(self, evicted: set[int], cached_before: set[int]) -> bool:
        """0.17/0.18's rule: no evicted block is younger than a cached block that was kept."""
        kept = cached_before - evicted
        if not evicted or not kept:
            return True
        return max(self.ts[b] for b in evicted) <= min(self.ts[b] for b in kept)

    # ----------------------------------------------------------------- transitions
    def new_request(self, prompt: tuple[int, ...]) -> Request:
        req = Request(self.next_rid, prompt)
        self.next_rid += 1
        return req

    def pin(self, req: Request, matched: list[int], clock: int) -> None:
        req.blocks = list(matched)
        req.matched = req.registered_upto = len(matched)
        for block in matched:
            self.ts[block] = clock
        self.requests[req.rid] = req

    def unpin(self, req: Request) -> None:
        del self.requests[req.rid]

    def deregister(self, blocks) -> None:
        for block in blocks:
            h = self.hash_of.pop(block)
            del self.block_of[h]
            del self.parent_hash_of[block]
            del self.parent_block_of[block]
            self.ts.pop(block, None)

    def allocated(self, req: Request, blocks: list[int], clock: int) -> None:
        req.blocks.extend(blocks)
        for block in blocks:
            self.ts[block] = clock

    def last_hashed_position(self, req: Request) -> tuple[int, int] | None:
        """(position, block) of the request's last block holding its own prefix hash (matched
        or registered by it), or None."""
        for position in reversed(range(min(req.registered_upto, len(req.prompt), len(req.blocks)))):
            block = req.blocks[position]
            if self.hash_of.get(block) == prefix_hash(req.prompt, position):
                return position, block
        return None

    def registrable(self, req: Request, count: int) -> tuple[list[int], list[int], list[int], bool]:
        """The next (up to) ``count`` complete blocks of ``req`` to register, in position order.

        Stops before a position whose hash is already registered to another block: the allocator
        keeps one block per hash, and add_request never registers a hash it could have matched;
        the request's remaining complete blocks then stay private. Returns (block IDs, hashes,
        parent hashes, stopped).
        """
        ids, hashes, parents = [], [], []
        end = min(len(req.prompt), len(req.blocks), req.registered_upto + count)
        for position in range(req.registered_upto, end):
            h = prefix_hash(req.prompt, position)
            if h in self.block_of:
                return ids, hashes, parents, True
            ids.append(req.blocks[position])
            hashes.append(h)
            parents.append(parent_hash(req.prompt, position))
        return ids, hashes, parents, False

    def register(self, req: Request, ids, hashes, parents, stopped: bool) -> None:
        for block, h, ph in zip(ids, hashes, parents):
            self.parent_block_of[block] = self.block_of.get(ph, -1) if ph != 0 else -1
            self.hash_of[block] = h
            self.block_of[h] = block
            self.parent_hash_of[block] = ph
        req.registered_upto = len(req.prompt) if stopped else req.registered_upto + len(ids)

    def release(self, rids: list[int]) -> None:
        released = [self.requests.pop(rid) for rid in rids]
        live = self.live()
        dropped = {b for req in released for b in req.blocks} - live
        if self.lru:
            for block in dropped:
                if block not in self.hash_of:
                    self.ts.pop(block, None)
        else:
            self.deregister(sorted(dropped & set(self.hash_of)))
            for block in dropped:
                self.ts.pop(block, None)

    def reset(self) -> None:
        self.requests.clear()
        self.hash_of.clear()
        self.block_of.clear()
        self.parent_hash_of.clear()
        self.parent_block_of.clear()
        self.ts.clear()
