"""Fault 3: under LRU, ``KVBlockAllocator.evict_lru_blocks`` evicts a parent before its child.

Block hashes are parent-chained, and ``DynamicInferenceContext._find_kv_match_count`` relies on
every cached block having all its ancestors cached: it finds the longest matching hash from the
end of the prompt and then looks up every hash before it. The released eviction (0.17, 0.18)
takes the cached blocks with the oldest timestamps, ties to the lower block ID. All blocks
allocated in one step share a timestamp, and a chunked prefill gives a request's earlier (parent)
blocks older timestamps than its later ones, so a parent is evicted while its child stays
registered, and the next lookup of that prefix raises ``KeyError``.

The fix backports megatron-core 0.19's prefix forest (Megatron-LM #5822, 2026-07-23, first
released in 0.19.0), under upstream's names and meanings:

- ``block_parent_id`` (int64 ``[total_count]``, bookkeeping device; -1 = root or not
  registered) and ``block_child_count`` (int64 ``[total_count]``; registered children) on the
  allocator, made at construction and cleared by ``reset()``. An allocator built before
  ``apply()``, or one that lived through ``revert()`` / ``apply()``, had blocks registered,
  deregistered or evicted by the released code without them: at its first call after each
  ``apply()`` the tables are remade (:func:`sync_forest`): cached blocks, whose links are
  unknown, are deregistered into the free pool (never served, so never a lookup of a missing
  parent), and the blocks live requests hold are linked from their block tables. Tables are made
  with inference mode off, so a first call inside ``torch.inference_mode()`` cannot leave inference
  tensors that a registration outside it could not update;
- ``register_kv_block_hashes(block_ids, block_hashes, parent_hashes=None)`` links each newly
  registered block to its parent and counts it as the parent's child; a block that already holds
  the hash is skipped (registration is idempotent, as upstream's #5995 made it). Parents come
  from ``parent_hashes`` (resolved through the hash map, 0 = root) when given; the released
  ``add_request`` gives none, and then the parent of a block is the entry before it in the
  block table of the request being added (row ``total_request_count``, where ``add_request``
  has just placed its matched and new blocks);
- ``_deregister_blocks`` unlinks the blocks from their parents once it has succeeded;
- ``evict_lru_blocks`` peels the cached forest from its leaves: the evictable leaf with the
  oldest own timestamp (ties to the lower block ID) goes first, and a parent becomes a leaf
  when its last cached child is gone. That is 0.19's eviction order.

Only LRU changes; with REF_ZERO or prefix caching off every wrapper calls the released code.
"""

from __future__ import annotations

import heapq
import inspect
import types
from typing import Any, Callable

import numpy
import torch

from ..errors import MegatronExtError
from ..mcore import DYNAMIC_CONTEXT_MODULE, KV_BLOCK_ALLOCATOR_MODULE, uses_lru_prefix_caching
from ..guards import Guarded, lru_only
from ..patching import Patch, Target, installed_patches
from .lru_register_once import bind_registration, unregistered
from .views import cpu_view

INIT = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.__init__")
REGISTER = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.register_kv_block_hashes")
DEREGISTER = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator._deregister_blocks")
RESET = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.reset")
EVICT = Target(KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.evict_lru_blocks")
# Relied on: the only caller of register_kv_block_hashes, with the block table row laid out.
ADD_REQUEST = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.add_request")
# Every prefix lookup: the first call after apply() may be one, before any allocator call.
FIND_MATCH = Target(DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext._find_kv_match_count")


class PrefixForestError(MegatronExtError, RuntimeError):
    """The cached blocks' parent links are not a forest, so leaf-first eviction cannot free enough."""


#: Installs of this patch so far. Tables kept from an earlier install may have missed what the
#: released code registered, deregistered or evicted while the patch was reverted.
_generation = 0
#: Allocator attribute: the install (``_generation``) its tables were last made for.
GENERATION_ATTR = "_megatron_ext_forest_generation"
_NOTHING = torch.empty(0, dtype=torch.int64)


def prefix_forest(allocator: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_parent_id, block_child_count)`` of an LRU allocator, made if it has none yet, and
    remade (:func:`sync_forest`) if they predate the patch's current install.

    Both int64, shape ``[total_count]``, on the device of ``block_hashes`` (the GPU on 0.17).
    """
    if _generation:
        sync_forest(allocator)
    elif not hasattr(allocator, "block_parent_id"):
        _new_tables(allocator)
    return allocator.block_parent_id, allocator.block_child_count


def sync_forest(allocator: Any) -> torch.Tensor:
    """Make the tables current for this install of the patch.

    Tables made under this install are kept. Otherwise (an allocator built before ``apply()``, or
    tables from before a ``revert()``) the links of cached blocks are unknown: every cached block
    (ref count 0, hashed) is deregistered into the free pool (never served, so never a lookup of a
    missing parent), and the blocks live requests hold are linked from their block tables (a
    request holds its whole prefix, entry k's parent is entry k-1).

    Returns the IDs (int64) of the cached blocks deregistered, empty if the tables were current.
    """
    if allocator.__dict__.get(GENERATION_ATTR) == _generation:
        return _NOTHING
    parent_id, child_count = _new_tables(allocator)
    dropped = torch.nonzero((allocator.block_ref_counts == 0) & (allocator.block_hashes != -1)).flatten()
    if dropped.numel():  # through the instance: audits and this patch's own wrapper see it
        allocator._deregister_blocks(dropped.to(allocator.block_bag.dtype))
    children, parents = _live_links(allocator)
    if children.numel():
        parent_id[children] = parents
        child_count.index_add_(0, parents, torch.ones_like(parents))
    return dropped.to(torch.int64)


def _new_tables(allocator: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh tables, stamped with the current install. Made with inference mode off: inference
    tensors made inside it could not be updated in place by a registration outside it."""
    device, count = allocator.block_hashes.device, allocator.total_count
    with torch.inference_mode(False):
        allocator.block_parent_id = torch.full((count,), -1, dtype=torch.int64, device=device)
        allocator.block_child_count = torch.zeros(count, dtype=torch.int64, device=device)
    allocator.__dict__[GENERATION_ATTR] = _generation
    return allocator.block_parent_id, allocator.block_child_count


def _live_links(allocator: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(children, parents)``: int64 block IDs, each child once, of consecutive hashed entries in
    the block tables of the context's live requests (paused, active, a chunked prefill between
    chunks). Empty for an allocator whose context has no block tables (a test stand-in)."""
    context = allocator.context
    tables = getattr(context, "request_to_kv_block_ids", None)
    if tables is None:
        return _NOTHING, _NOTHING
    end = context.total_request_count
    if getattr(context, "chunked_prefill_request_id", -1) != -1 and end < tables.shape[0]:
        end += int(context.request_ids[end]) == context.chunked_prefill_request_id
    hashed = allocator.block_hashes != -1
    links: dict[int, int] = {}
    for row in range(end):
        table = tables[row][: int(context.request_kv_block_counts[row])].to(torch.int64)
        table = table[table >= 0]
        pair = hashed[table[1:]] & hashed[table[:-1]]
        links.update(zip(table[1:][pair].tolist(), table[:-1][pair].tolist()))
    device = allocator.block_hashes.device
    return (torch.tensor(list(links), dtype=torch.int64, device=device),
            torch.tensor(list(links.values()), dtype=torch.int64, device=device))


def _init_wrapper(wrapped: Callable, allocator: Any, args: tuple, kwargs: dict) -> None:
    wrapped(*args, **kwargs)
    if uses_lru_prefix_caching(allocator):
        _new_tables(allocator)


def register_with_parents(
    allocator: Any, register: Callable, block_ids: list[int], block_hashes: list[int],
    parent_hashes: list[int] | None,
) -> None:
    """Register the blocks not yet holding their hash, then link each to its parent.

    Args:
        allocator: an LRU ``KVBlockAllocator``.
        register: the released ``register_kv_block_hashes`` (bound), called with the new blocks.
        block_ids, block_hashes: equal-length lists of ints; block ``k``'s parent is the block
            holding the hash before it in the prompt's chain.
        parent_hashes: each block's parent hash (0 for a root), or None: parents from the block
            table of the request ``add_request`` is adding.

    Blocks already holding their hash are left out (:func:`~.lru_register_once.unregistered`).
    """
    block_ids, block_hashes, parent_hashes = unregistered(allocator, block_ids, block_hashes, parent_hashes)
    if not block_ids:
        return  # every block already holds its hash: registering again changes nothing
    register(block_ids, block_hashes)
    if parent_hashes is None:
        _link_block_table_run(allocator.context, allocator, block_ids)
    else:
        hash_map = allocator.kv_hash_to_block_id
        _link(*prefix_forest(allocator), block_ids, [hash_map.get(h, -1) if h != 0 else -1 for h in parent_hashes])


def _link(parent_id: torch.Tensor, child_count: torch.Tensor, block_ids: list[int], parents: list[int]) -> None:
    """Set ``block_parent_id[block_ids[k]] = parents[k]`` and count each block as its parent's
    child (parent -1: a root, nothing counted)."""
    links = torch.tensor([block_ids, parents], dtype=torch.int64, device=parent_id.device)
    parent_id[links[0]] = links[1]
    linked = links[1][links[1] >= 0]
    child_count.index_add_(0, linked, torch.ones_like(linked))


#: Runs up to this many blocks are linked by scalar writes through NumPy views (a few hundred ns
#: each); longer ones by :func:`_link`'s vectorized torch writes (a fixed ~10 µs).
SCALAR_LINKS_MAX = 32


def _link_block_table_run(context: Any, allocator: Any, block_ids: list[int]) -> None:
    """Link the blocks ``add_request`` registers to their predecessors in its block table.

    The released ``add_request`` (0.17/0.18 ``_register_range``) registers a contiguous run of
    the block table of the request it is adding (row ``total_request_count``, whose block count it
    has set by then): the parent of the run's first block is the entry before it (-1 at the
    start), of every other block the one before it in the run. The row is read once as a list
    (through NumPy views where the tables live on the CPU, 0.18's bookkeeping); a run not found
    whole in the row (another caller) is linked entry by entry.
    """
    parent_id, child_count = prefix_forest(allocator)
    tables = getattr(context, "request_to_kv_block_ids", None)
    row = getattr(context, "total_request_count", None)
    if tables is None or row is None or row >= tables.shape[0]:
        return _link(parent_id, child_count, block_ids, [-1] * len(block_ids))
    count = int(cpu_view(context, "request_kv_block_counts")[row])
    entries = cpu_view(context, "request_to_kv_block_ids")[row, :count].tolist()
    start = _find_run(entries, block_ids)
    if start < 0:
        position = {block: k for k, block in enumerate(entries) if block >= 0}
        return _link(parent_id, child_count, block_ids,
                     [entries[position[b] - 1] if position.get(b, 0) > 0 else -1 for b in block_ids])
    parents = [entries[start - 1] if start > 0 else -1, *block_ids[:-1]]
    parent_view = cpu_view(allocator, "block_parent_id")
    if len(block_ids) > SCALAR_LINKS_MAX or not isinstance(parent_view, numpy.ndarray):  # long, or on the GPU
        return _link(parent_id, child_count, block_ids, parents)
    child_view = cpu_view(allocator, "block_child_count")
    for block, parent in zip(block_ids, parents):
        parent_view[block] = parent
        if parent >= 0:
            child_view[parent] += 1


def _find_run(entries: list[int], block_ids: list[int]) -> int:
    """Where ``block_ids`` starts as a contiguous run of ``entries``, or -1."""
    try:
        start = entries.index(block_ids[0])
    except ValueError:
        return -1
    return start if entries[start : start + len(block_ids)] == list(block_ids) else -1


def _register_wrapper(wrapped: Callable, allocator: Any, args: tuple, kwargs: dict) -> None:
    """Takes ``parent_hashes`` (0.19's signature) under every policy: callers ask
    :func:`takes_parent_hashes`. Only LRU keeps the forest."""
    block_ids, block_hashes, parent_hashes = bind_registration(*args, **kwargs)
    if not block_ids or not uses_lru_prefix_caching(allocator):
        return wrapped(block_ids, block_hashes)
    sync_forest(allocator)
    register_with_parents(allocator, wrapped, block_ids, block_hashes, parent_hashes)


def _deregister_wrapper(wrapped: Callable, allocator: Any, args: tuple, kwargs: dict) -> None:
    block_ids = kwargs["block_ids"] if "block_ids" in kwargs else args[0]
    if not uses_lru_prefix_caching(allocator):
        return wrapped(block_ids)
    dropped = sync_forest(allocator)
    if dropped.numel():  # the resync deregistered some of them already: never twice
        block_ids = block_ids[~torch.isin(block_ids.to(torch.int64), dropped.to(block_ids.device))]
    wrapped(block_ids)
    if block_ids.numel():
        parent_id, child_count = prefix_forest(allocator)
        ids = block_ids.to(device=parent_id.device, dtype=torch.int64)
        parents = parent_id[ids]
        linked = parents[parents >= 0]
        child_count.index_add_(0, linked, torch.full_like(linked, -1))
        parent_id[ids] = -1
        child_count[ids] = 0


def _reset_wrapper(wrapped: Callable, allocator: Any, args: tuple, kwargs: dict) -> None:
    wrapped(*args, **kwargs)
    if not uses_lru_prefix_caching(allocator):
        return
    if allocator.__dict__.get(GENERATION_ATTR) == _generation:  # nothing is registered after a reset
        allocator.block_parent_id.fill_(-1)  # in place: the tensors (and NumPy views of them) stay
        allocator.block_child_count.zero_()
    else:
        _new_tables(allocator)


def evict_leaves_first(allocator: Any, num_blocks_needed: int) -> bool:
    """Evict ``num_blocks_needed`` cached blocks (ref count 0, hashed), never a parent before its child.

    Args:
        allocator: an LRU ``KVBlockAllocator`` (``block_timestamps``: int64 LRU clock values).
        num_blocks_needed: how many blocks the free pool must gain.

    Returns:
        False, evicting nothing, if fewer blocks are cached; True once they are deregistered
        (back in the free pool).

    Raises:
        PrefixForestError: the leaves ran out before enough blocks were found (a cycle in the
            parent links: a block-hash collision). Nothing is evicted then.
    """
    if _generation:  # first: a resync may free cached blocks, which count towards the need
        num_blocks_needed -= int(sync_forest(allocator).numel())
    parent_id, child_count = prefix_forest(allocator)
    cached = torch.nonzero((allocator.block_ref_counts == 0) & (allocator.block_hashes != -1),
                           as_tuple=True)[0]
    if cached.numel() < num_blocks_needed:
        return False
    if num_blocks_needed <= 0:
        return True
    blocks = cached.tolist()
    stamp = dict(zip(blocks, allocator.block_timestamps[cached].tolist()))
    parent = dict(zip(blocks, parent_id[cached].tolist()))
    children = dict(zip(blocks, child_count[cached].tolist()))
    leaves = [(stamp[b], b) for b in blocks if children[b] == 0]
    heapq.heapify(leaves)
    victims: list[int] = []
    while leaves and len(victims) < num_blocks_needed:
        _, block = heapq.heappop(leaves)
        victims.append(block)
        up = parent[block]
        if up in children:  # a cached parent: a leaf once its last cached child is gone
            children[up] -= 1
            if children[up] == 0:
                heapq.heappush(leaves, (stamp[up], up))
    if len(victims) < num_blocks_needed:
        raise PrefixForestError(
            f"LRU eviction found {len(victims)} evictable leaves of {num_blocks_needed} needed among "
            f"{len(blocks)} cached blocks: the parent links are not a forest (a block registered twice in one chain, or a block-hash collision)"
        )
    allocator._deregister_blocks(torch.tensor(victims, dtype=cached.dtype, device=cached.device))
    return True


def _find_match_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict):
    """A lookup walks a matched chain down to its root: resync first, so no unlinked cached
    block (a child whose parent the released code evicted) is ever matched. Guarded
    (:func:`~megatron_ext.guards.lru_only`); only prefix caching matches."""
    sync_forest(context.kv_block_allocator)
    return wrapped(*args, **kwargs)


def _evict_wrapper(wrapped: Callable, allocator: Any, args: tuple, kwargs: dict) -> bool:
    """Replaces the released eviction: ``wrapped`` is never called."""
    num_blocks_needed = kwargs["num_blocks_needed"] if "num_blocks_needed" in kwargs else args[0]
    return evict_leaves_first(allocator, num_blocks_needed)


def probe_eviction_order(evict: Callable) -> tuple[bool, str]:
    """Run an eviction function on a stand-in allocator holding one cached parent-child chain.

    Block 0 (timestamp 4) is the parent of block 1 (timestamp 5), as after a chunked prefill;
    both are cached (ref count 0). Evicting one block must take the leaf, block 1. Returns
    ``(evicts_parent_first, evidence)``.
    """
    evicted: list[list[int]] = []
    stand_in = types.SimpleNamespace(
        block_ref_counts=torch.tensor([0, 0, 0], dtype=torch.int32),
        block_hashes=torch.tensor([11, 22, -1], dtype=torch.int64),
        block_timestamps=torch.tensor([4, 5, 0], dtype=torch.int64),
        block_parent_id=torch.tensor([-1, 0, -1], dtype=torch.int64),
        block_child_count=torch.tensor([1, 0, 0], dtype=torch.int64),
        _deregister_blocks=lambda ids: evicted.append(ids.tolist()),
    )
    evict(stand_in, 1)
    faulty = evicted != [[1]]
    verdict = "parent first" if faulty else "leaf first, as Megatron-LM #5822"
    return faulty, (f"probe: cached chain block 0 (ts 4) -> block 1 (ts 5), evict 1 -> evicted "
                    f"{evicted} ({verdict})")


class LruLeafFirstEvictionPatch(Patch):
    """Backports 0.19's leaf-first LRU eviction to 0.17/0.18 (see module docstring)."""

    name = "lru-leaf-first-eviction"
    fault = "3"

    def wrappers(self) -> dict[Target, Callable | Guarded]:
        return {INIT: _init_wrapper, REGISTER: _register_wrapper, DEREGISTER: _deregister_wrapper,
                RESET: _reset_wrapper, EVICT: _evict_wrapper, FIND_MATCH: lru_only(_find_match_wrapper)}

    def checked_functions(self) -> tuple[Target, ...]:
        return (INIT, REGISTER, DEREGISTER, RESET, EVICT, FIND_MATCH, ADD_REQUEST)

    def needed(self) -> tuple[bool, str]:
        return probe_eviction_order(EVICT.original())

    def install(self) -> None:
        global _generation
        _generation += 1  # every allocator resyncs its tables at its next call (sync_forest)
        super().install()


def takes_parent_hashes() -> bool:
    """Whether ``KVBlockAllocator.register_kv_block_hashes`` now accepts ``parent_hashes``
    (0.19's released code, or 0.17/0.18 with this patch applied)."""
    if "lru-leaf-first-eviction" in installed_patches(REGISTER):
        return True
    return "parent_hashes" in inspect.signature(REGISTER.original()).parameters
