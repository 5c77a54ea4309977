"""Section 6 (worker side): what the fault-8 patch (``weight-update-invalidation``) costs.

Three measurements, the first two as ratios against the same code without the patch:

* ``add_request`` with only this patch's wrappers installed (``add_request`` and
  ``_find_kv_match_count``; every other patch off in both variants) vs the release's own code:
  :class:`benchmarks.add_request.AddRequestBench`, the same primer / probe scheme as section 2;
* engine step time of a shipped case with every runtime patch vs every patch but this one
  (section 3's :class:`benchmarks.e2e.EndToEndBench`; the worker swaps the functions);
* the flush itself, :class:`FlushBench`: ``megatron_ext.invalidate_prefix_cache(context)`` on a
  real ``DynamicInferenceContext`` whose allocator holds ``registered`` hashed blocks, timed on
  the same state rebuilt before every call. Times are per call, in ns (the orchestrator reports
  ms).

A flush is the work of "free at once": ref-0 cached blocks (LRU) go back to the free pool by the
released ``_deregister_blocks``, blocks live requests hold lose their hash. The alternative
(:func:`age_out`) leaves ref-0 blocks where they are, unreachable (hash-map entries dropped,
``block_hashes`` kept) for eviction to reclaim later; held blocks are unhashed as in a flush (a
live request's block must not stay matchable either way). It is timed on the same states to
say what freeing at once costs; it is a cost model, not a drop-in: megatron-core's eviction of
such a block would then look up a hash-map entry that is gone.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_ext.cpu_backend import cuda_on_cpu
from megatron_ext.harness.factories import small_prefix_caching_context
from megatron_ext.patches import weight_update_invalidation as fault8
from .stats import time_calls

BLOCK = 16
#: KV bytes per block of ``small_prefix_caching_context``: K and V x 2 layers x 16 tokens x
#: 4 heads x 16 channels x 4 bytes (fp32).
KV_BYTES_PER_BLOCK = 2 * 2 * BLOCK * 4 * 16 * 4
#: Blocks per prompt chain (parent -> child) when the state is built: a 256-token prompt.
CHAIN = 16
#: The flush scenarios: eviction policy, and whether registered blocks are held by live requests
#: ("held"), all at ref count 0 ("cached", LRU only), or half and half by whole chains ("mixed").
SCENARIOS = {
    "lru_cached": ("LRU", "cached"),
    "ref_zero_held": ("REF_ZERO", "held"),
    "lru_held": ("LRU", "held"),
    "lru_mixed": ("LRU", "mixed"),
}
FLUSH_VARIANTS = ("flush", "age_out")
#: The patch this section measures.
FAULT8 = "weight-update-invalidation"


def age_out(context: Any) -> None:
    """The alternative to freeing ref-0 blocks at once (see module docstring): advance the
    epoch, unhash the blocks live requests hold, and drop every hash-map entry; ref-0 cached
    blocks keep their hash and their place in the LRU forest."""
    with fault8._LOCK:
        context.__dict__[fault8.EPOCH_ATTR] = fault8.context_epoch(context) + 1
        context.__dict__[fault8.SEEN_VERSION_ATTR] = fault8._current_version
        allocator = context.kv_block_allocator
        registered = torch.nonzero(allocator.block_hashes != -1).flatten()
        live = registered[allocator.block_ref_counts[registered] > 0]
        if live.numel():
            fault8._unhash_live_blocks(allocator, live)
        allocator.kv_hash_to_block_id.clear()


def build_pool_context(policy: str, pool_blocks: int) -> Any:
    """A prefix-caching context whose allocator has exactly ``pool_blocks`` blocks (dummy included).

    Raises:
        RuntimeError: the release sizes the pool in a way this does not hit exactly.
    """
    def build(blocks: int) -> Any:
        with cuda_on_cpu():
            return small_prefix_caching_context(
                policy, block_size_tokens=BLOCK, buffer_size_gb=blocks * KV_BYTES_PER_BLOCK / 2**30,
                max_requests=8, max_tokens=256, max_sequence_length=256,
            )
    context = build(pool_blocks)
    got = context.kv_block_allocator.total_count
    if got != pool_blocks:  # a release that sets aside part of the buffer: scale and retry once
        context = None
        context = build(pool_blocks + (pool_blocks - got))
        got = context.kv_block_allocator.total_count
    if got != pool_blocks:
        raise RuntimeError(f"asked for a {pool_blocks}-block pool, megatron-core built {got}")
    return context


class FlushBench:
    """One context with ``registered`` hashed blocks in chains of :data:`CHAIN`, in the
    scenario's state, and a snapshot of the allocator to rebuild it from before every call."""

    def __init__(self, scenario: str, pool_blocks: int, registered: int) -> None:
        policy, held = SCENARIOS[scenario]
        self.scenario, self.policy, self.held_mode = scenario, policy, held
        self.context = build_pool_context(policy, pool_blocks)
        alloc = self.allocator = self.context.kv_block_allocator
        if registered > alloc.total_avail:
            raise ValueError(f"{registered} blocks do not fit in a pool of {alloc.total_avail} free blocks")
        blocks = alloc.allocate_memory_blocks(registered)
        ids = blocks.tolist()
        n_chains = -(-registered // CHAIN)
        chains = [ids[i * CHAIN:(i + 1) * CHAIN] for i in range(n_chains)]
        next_hash = 1
        for chain in chains:  # one registration per prompt, parent first, as add_request does
            hashes = list(range(next_hash, next_hash + len(chain)))
            next_hash += len(chain)
            alloc.register_kv_block_hashes(chain, hashes, [0] + hashes[:-1])
        if held == "cached":
            released = chains
        elif held == "held":
            released = []
        else:
            released = chains[::2]
        for chain in released:
            alloc.release_memory_blocks(torch.tensor(chain, dtype=blocks.dtype, device=blocks.device))
        refs = alloc.block_ref_counts
        hashed = alloc.block_hashes != -1
        self.state = {
            "pool_blocks": int(alloc.total_count),
            "registered": int(hashed.sum()),
            "held": int((hashed & (refs > 0)).sum()),
            "cached_ref0": int((hashed & (refs == 0)).sum()),
            "hash_map": len(alloc.kv_hash_to_block_id),
            "free_pool": int(alloc.total_avail),
            "chains": n_chains,
        }
        if self.state["registered"] != registered or self.state["hash_map"] != registered:
            raise RuntimeError(f"built state {self.state}, meant {registered} registered blocks")
        self._snapshot = self._capture()

    # -- state -----------------------------------------------------------------------------

    def _capture(self) -> dict[str, Any]:
        """Every tensor, dict and number of the allocator, and the context's fault-8 attributes."""
        saved: dict[str, Any] = {}
        for name, value in vars(self.allocator).items():
            if isinstance(value, torch.Tensor):
                saved[name] = value.clone()
            elif isinstance(value, dict):
                saved[name] = dict(value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                saved[name] = value
        saved["context"] = {k: self.context.__dict__.get(k)
                            for k in (fault8.EPOCH_ATTR, fault8.SEEN_VERSION_ATTR)}
        return saved

    def rebuild(self) -> None:
        """Put the allocator back as it was built (the tensors and dicts in place)."""
        alloc = self.allocator
        for name, saved in self._snapshot.items():
            if name == "context":
                for key, value in saved.items():
                    if value is None:
                        self.context.__dict__.pop(key, None)
                    else:
                        self.context.__dict__[key] = value
                continue
            current = getattr(alloc, name)
            if isinstance(saved, torch.Tensor):
                current.copy_(saved)
            elif isinstance(saved, dict):
                current.clear()
                current.update(saved)
            else:
                setattr(alloc, name, saved)

    def check_rebuild(self) -> None:
        """Raise unless the allocator's whole state equals the snapshot."""
        now = self._capture()
        for name, before in self._snapshot.items():
            after = now[name]
            same = torch.equal(before, after) if isinstance(before, torch.Tensor) else before == after
            if not same:
                raise AssertionError(f"rebuild did not restore allocator.{name}")

    def outcome(self, result: Any = None) -> dict[str, Any]:
        """What a call did (after it ran, before a rebuild)."""
        alloc = self.allocator
        refs, hashed = alloc.block_ref_counts, alloc.block_hashes != -1
        return {
            "blocks_unreachable": getattr(result, "blocks_unreachable", None),
            "blocks_freed": getattr(result, "blocks_freed", None),
            "still_hashed_ref0": int((hashed & (refs == 0)).sum()),
            "still_hashed_held": int((hashed & (refs > 0)).sum()),
            "hash_map": len(alloc.kv_hash_to_block_id),
            "free_pool_gain": int(alloc.total_avail) - self.state["free_pool"],
        }

    # -- measurement -----------------------------------------------------------------------

    def call(self, variant: str) -> Any:
        if variant == "flush":
            import megatron_ext

            return megatron_ext.invalidate_prefix_cache(self.context)
        if variant == "age_out":
            return age_out(self.context)
        raise ValueError(f"variant must be one of {FLUSH_VARIANTS}")

    def probe(self) -> dict[str, dict[str, Any]]:
        """Each variant once: what it did; and that rebuild restores everything."""
        outcomes = {}
        for variant in FLUSH_VARIANTS:
            self.rebuild()
            outcomes[variant] = self.outcome(self.call(variant))
            self.rebuild()
            self.check_rebuild()
        return outcomes

    def time(self, variant: str, reps: int) -> tuple[list[int], list[int]]:
        """``reps`` timed calls of ``variant`` on the rebuilt state; (wall ns, thread CPU ns)."""
        context = self.context
        if variant == "flush":
            import megatron_ext

            def call() -> Any:
                return megatron_ext.invalidate_prefix_cache(context)
        else:
            def call() -> Any:
                return age_out(context)
        samples = time_calls(self.rebuild, call, reps)
        self.rebuild()
        return samples


def skip_env(names: list[str]) -> dict[str, str]:
    """``os.environ`` entries to set so that ``megatron_ext.apply()`` skips ``names``."""
    return {"MEGATRON_EXT_SKIP": ",".join(names)} if names else {}


def with_env(env: dict[str, str], action: Any) -> Any:
    """Run ``action()`` with ``env`` set in ``os.environ``, then put the old values back."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return action()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
