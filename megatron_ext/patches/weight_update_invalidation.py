"""Fault 8: after a weight update, prefix caching serves KV that the old weights computed.

megatron-core keys its prefix cache by prompt tokens only (``compute_block_hashes_batched``: a
SHA-256 chain seeded with zeros, no salt, in every release 0.17 to 0.19 and on Megatron-LM main
up to d98e8a64),
and nothing drops it when the model's weights change: ``engine.suspend()`` / ``resume()`` keep
the hash map, ref counts and LRU timestamps under PERSIST (Megatron-LM RL's default) and OFFLOAD,
and ``megatron.core.resharding.refit.swap_model_weights`` writes the new weights through
``param.data``. A request admitted after the update then matches blocks computed by the old
weights and its output differs from caching off, with no error.

The fix flushes the prefix cache of a context at each weight update, without resetting anything
a live request holds:

- every cached block at ref count 0 (LRU) is deregistered at once by the released
  ``_deregister_blocks`` (hash map, Mamba slots, parent/child counts, back to the free pool);
- every registered block still held by a live request (in flight, paused, mid chunked prefill)
  loses its hash: its hash-map entry goes, ``block_hashes`` becomes -1 and it leaves the prefix
  forest, so nothing can match it; its holders keep reading it and release it as an ordinary
  private block (the released ``release_memory_blocks`` frees ref-0 blocks without a hash);
- each context counts its flushes (``epoch``: the weight version its forward passes run under);
  a request's books (:mod:`.weight_versions`, kept beside the request object, never in its
  ``__dict__``, which ``serialize()`` copies) hold the epoch in which its prefill began. A request
  from an older epoch, or one whose prefill began before the patch saw it (before ``apply()`` or
  while reverted: older than any update), is stale for the rest of its prefill (a chunked prefill
  straddling the update: its KV depends on the old weights' KV of its first chunks): it neither
  matches nor registers blocks. Both are done in ``_find_kv_match_count``, which every prefix
  match goes through and which ``add_request`` calls before it allocates or registers: the stale
  request's ``precomputed_block_hashes`` are set aside until it starts its prefill over
  (``revert()`` gives them back), so ``add_request`` registers none of them.
- the same books record, per generated token, the epoch of its logits and the oldest epoch of its
  KV prefix (:func:`megatron_ext.token_weight_versions`).

An update is recognised in three places: ``DynamicInferenceContext.reinitialize_inference_state_buffers``
when it really reallocates (that is ``DynamicInferenceEngine.resume()`` after ``suspend()``, in
every ``kv_cache_management_mode``); ``swap_model_weights`` (it bumps a process-wide weight
version that each context compares at its next prefix match or engine step
(``initialize_attention_state``), so the flush happens on the engine's own thread, at the same
step on every rank); and the explicit :func:`megatron_ext.invalidate_prefix_cache`. The swap is
process-wide: every context of the process flushes, a reference model's engine too (a lost cache
hit there, never a stale one). The wrapper replaces ``swap_model_weights`` in every loaded module
that holds it under that name; a reference kept under another name or in a container before
``apply()`` calls the released function, which no context sees: call ``invalidate_prefix_cache``
after it. ``apply()`` after a ``revert()`` counts as an update (swaps made while reverted went
unseen). ``MEGATRON_EXT_ON_WEIGHT_UPDATE=keep``, read by ``apply()``, leaves the patch out
(upstream behaviour). No upstream change to mirror: no release and not Megatron-LM main up to
d98e8a64 (2026-08-22) invalidates or salts the prefix cache on a weight update (main's later #6497
salts the hashes of image requests only; text prompts stay unsalted).

The source patches of ``patches/`` (``0006-weight-update-invalidation`` on 0.17/0.18,
``0004-`` on 0.19) put the same fix into the code: ``DynamicInferenceContext.invalidate_prefix_cache()``,
``prefix_cache_epoch``, ``megatron.core.inference.contexts.dynamic_context.notify_model_weight_update``
(called by ``swap_model_weights``). On such a tree this patch is "not needed" (recognised by the
source-patched fingerprints of the three functions it wraps), and source-patched code invalidates
whatever ``MEGATRON_EXT_ON_WEIGHT_UPDATE`` says: revert the source patches for upstream behaviour.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import mcore
from ..env import choice
from ..guards import Guarded
from ..patching import Patch, PatchResult, PatchState, Target
from . import weight_versions
# swap_model_weights' wrapper, shared with fault H11's patch (each installs itself as an owner)
from .swap_hook import REFIT_MODULE, SWAP, SWAP_HOOK  # noqa: F401  REFIT_MODULE, SWAP: tests read them here

ON_WEIGHT_UPDATE_ENV = "MEGATRON_EXT_ON_WEIGHT_UPDATE"
ON_WEIGHT_UPDATE_MODES = ("invalidate", "keep")

# Relied on: it matches through _find_kv_match_count before it allocates, and registers only
# the hashes in the request's precomputed_block_hashes.
ADD_REQUEST = Target(mcore.DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.add_request")
FIND_MATCH = Target(mcore.DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext._find_kv_match_count")
REINITIALIZE = Target(mcore.DYNAMIC_CONTEXT_MODULE,
                      "DynamicInferenceContext.reinitialize_inference_state_buffers")
# Called once per engine step, before the forward pass, in every release.
STEP = Target(mcore.DYNAMIC_CONTEXT_MODULE, "DynamicInferenceContext.initialize_attention_state")
# Relied on: the flush deregisters through it, and releases of unhashed blocks free them.
DEREGISTER = Target(mcore.KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator._deregister_blocks")
RELEASE = Target(mcore.KV_BLOCK_ALLOCATOR_MODULE, "KVBlockAllocator.release_memory_blocks")


#: Per context: flushes so far (the epoch); the process weight version it last flushed for.
EPOCH_ATTR = "_megatron_ext_prefix_cache_epoch"
SEEN_VERSION_ATTR = "_megatron_ext_weight_version_seen"
#: The source-patched context's own flush count (patches/: ``prefix_cache_epoch``).
SOURCE_EPOCH_ATTR = "prefix_cache_epoch"


#: Bumped by every ``swap_model_weights`` call, and by ``apply()`` after a ``revert()`` (swaps made
#: meanwhile went unseen); contexts flush when theirs is behind.
_current_version = 0
# One flush at a time, whoever asks (the engine's thread, a trainer thread calling the API).
_LOCK = threading.RLock()
_log = logging.getLogger("megatron_ext")
_warned: set[str] = set()


@dataclass(frozen=True)
class InvalidationResult:
    """What one flush of a context's prefix cache did.

    Attributes:
        blocks_unreachable: registered blocks still held by live requests, now unhashed (they
            stay allocated to their holders and go back to the free pool when released).
        blocks_freed: cached blocks at ref count 0 (LRU), deregistered and returned to the
            free pool.
        kept: True when ``MEGATRON_EXT_ON_WEIGHT_UPDATE=keep`` was in force at ``apply()``: nothing
            was done.
        epoch: the context's weight version after the flush (its flush count); None when kept.
        still_matchable: blocks a request could still match afterwards (0 unless something
            outside megatron-ext re-registered them meanwhile; a warning names them).
    """

    blocks_unreachable: int = 0
    blocks_freed: int = 0
    kept: bool = False
    epoch: Optional[int] = None
    still_matchable: int = 0


def on_weight_update_mode() -> str:
    """``MEGATRON_EXT_ON_WEIGHT_UPDATE``: ``invalidate`` (default) or ``keep``. Read by ``apply()``
    and ``status()`` only: the patch and :func:`megatron_ext.invalidate_prefix_cache` follow what
    the last ``apply()`` read.

    Raises:
        MegatronExtError: any other value (named, with the accepted ones).
    """
    return choice(ON_WEIGHT_UPDATE_ENV, ON_WEIGHT_UPDATE_MODES)


def warn_once(key: str, message: str) -> None:
    """Warn through the ``megatron_ext`` logger, once per process for each ``key``."""
    if key not in _warned:
        _warned.add(key)
        _log.warning(message)


def _runtime_epoch(context: Any) -> int:
    return context.__dict__.get(EPOCH_ATTR, 0)


def context_epoch(context: Any) -> int:
    """How many times this context's prefix cache was flushed (0 before the first flush): the
    weight version its next forward pass runs under.

    The runtime patch's count once it has flushed the context; otherwise a source-patched
    context's own ``prefix_cache_epoch`` (0 on released code, which never flushes).
    """
    if EPOCH_ATTR in context.__dict__:
        return context.__dict__[EPOCH_ATTR]
    return getattr(context, SOURCE_EPOCH_ATTR, 0)


def flush(context: Any) -> InvalidationResult:
    """Make every block registered in ``context``'s prefix cache unmatchable (module docstring).

    Args:
        context: a ``DynamicInferenceContext``; with prefix caching off only the epoch advances.

    Returns:
        An :class:`InvalidationResult`. Ref counts, block tables and the blocks live requests
        hold are unchanged.
    """
    with _LOCK:
        epoch = _runtime_epoch(context) + 1
        context.__dict__[EPOCH_ATTR] = epoch
        context.__dict__[SEEN_VERSION_ATTR] = _current_version
        weight_versions.note_flush(context, epoch)
        allocator = context.kv_block_allocator
        if not allocator.enable_prefix_caching:
            return InvalidationResult(epoch=epoch)
        registered = torch.nonzero(allocator.block_hashes != -1).flatten()
        held = allocator.block_ref_counts[registered] > 0
        cached, live = registered[~held], registered[held]
        if cached.numel():
            # a block's parent is cached whenever the block is, so the forest stays whole
            allocator._deregister_blocks(cached.to(allocator.block_bag.dtype))
        if live.numel():
            _unhash_live_blocks(allocator, live)
        allocator.kv_hash_to_block_id.clear()  # every registered block is gone from it now
        return checked(context, InvalidationResult(int(live.numel()), int(cached.numel()), epoch=epoch))


def checked(context: Any, result: InvalidationResult) -> InvalidationResult:
    """``result`` with the blocks a request could still match after a flush counted; a warning
    (once) names them, so that a flush never does nothing silently. Unchanged with prefix caching
    off (the allocator has no hash table then)."""
    allocator = context.kv_block_allocator
    if not allocator.enable_prefix_caching:
        return result
    left = int((allocator.block_hashes != -1).sum()) + len(allocator.kv_hash_to_block_id)
    if left:
        warn_once("still-matchable", f"invalidate_prefix_cache: {left} prefix-cache entries are still matchable "
                  "after the flush (something re-registered blocks meanwhile); their KV may be the old weights'")
    return dataclasses.replace(result, still_matchable=left)


def _unhash_live_blocks(allocator: Any, blocks: torch.Tensor) -> None:
    """Remove ``blocks`` (int64, on the bookkeeping device) from the prefix cache, allocation
    untouched. Their parents are live too (a request holds its whole prefix), so the whole
    subforest goes and the parent / child tables are simply cleared for them."""
    ids = blocks.tolist()
    hashes = allocator.block_hashes[blocks].tolist()
    callback = getattr(allocator, "on_blocks_deregistered", None)
    if callback is not None:  # the Mamba state cache of hybrid models, keyed by the same hashes
        callback(ids, set(hashes))
    allocator.block_hashes[blocks] = -1
    if hasattr(allocator, "block_parent_id"):  # LRU: 0.19's forest, or the backport of fix 3
        allocator.block_parent_id[blocks] = -1
        allocator.block_child_count[blocks] = 0


def _sync_weight_version(context: Any) -> None:
    """Flush ``context`` if ``swap_model_weights`` ran (or ``apply()`` followed a ``revert()``)
    since it last flushed. A context met for the first time flushes only if it already caches
    blocks (the patch cannot know their weights); an empty one keeps epoch 0."""
    if SWAP_HOOK.pending:
        SWAP_HOOK.wrap_if_ready()
    state = context.__dict__
    if SEEN_VERSION_ATTR not in state and not _has_cached_blocks(context):
        state[SEEN_VERSION_ATTR] = _current_version  # first met, nothing cached: nothing to flush
    elif state.get(SEEN_VERSION_ATTR) != _current_version:
        flush(context)


def _has_cached_blocks(context: Any) -> bool:
    """Whether blocks are registered in the context's prefix cache (on a context first met: cached
    before the patch saw it, by weights it cannot know)."""
    allocator = context.kv_block_allocator
    return bool(allocator.enable_prefix_caching and (allocator.block_hashes != -1).any())


def _find_match_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict):
    """``_find_kv_match_count(req, start_block, end_block)``: every prefix match goes through it
    (``check_availability``, ``add_request`` before it allocates or registers anything, the
    engine's scheduler), so one wrapper serves all of them and the budgets agree.

    A request that has not begun its prefill (``finished_chunk_token_count == 0``) matches as
    released (its hashes back if it was stale before). One whose prefill began in an older epoch,
    or before the patch saw it (before ``apply()``, or while reverted: no books, so older than any
    update), is stale: it matches nothing, and its block hashes are set aside until it starts
    over, so ``add_request``, which registers only the hashes of ``precomputed_block_hashes``,
    registers nothing either. Inlined: it runs on every admission with prefix caching on
    (guarded: ``enable_prefix_caching``).
    """
    state = context.__dict__
    if SWAP_HOOK.pending or state.get(SEEN_VERSION_ATTR) != _current_version:
        _sync_weight_version(context)
    req = kwargs["req"] if "req" in kwargs else args[0]
    books = weight_versions.books_of(req)
    if req.finished_chunk_token_count == 0:  # a new request, or one re-added from scratch
        if books is not None and books.stashed_hashes is not None:
            req.precomputed_block_hashes, books.stashed_hashes = books.stashed_hashes, None
    elif books is None or books.prefill_epoch != state.get(EPOCH_ATTR, 0):  # straddles a flush
        if books is None:
            books = weight_versions.open_books(req, context, None)
        if books.stashed_hashes is None:
            books.stashed_hashes, req.precomputed_block_hashes = req.precomputed_block_hashes, []
        return [], 0
    return wrapped(*args, **kwargs)


def _add_request_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict):
    """``add_request(req, prefill_chunk_length=None)``: a first chunk (or a start over) opens the
    request's books in the current epoch, after a flush if the weights were swapped."""
    req = kwargs["req"] if "req" in kwargs else args[0]
    if req.finished_chunk_token_count == 0:
        state = context.__dict__
        if SWAP_HOOK.pending or state.get(SEEN_VERSION_ATTR) != _current_version:
            _sync_weight_version(context)
        weight_versions.open_books(req, context, state.get(EPOCH_ATTR, 0))
    return wrapped(*args, **kwargs)


def _step_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict):
    """``initialize_attention_state(...)``: once per engine step, before the forward pass. A swap
    since the last flush flushes here at the latest, so that the epoch (the weight version the
    tokens are recorded under) moves with the weights even in steps that admit nobody."""
    if SWAP_HOOK.pending or context.__dict__.get(SEEN_VERSION_ATTR) != _current_version:
        _sync_weight_version(context)
    return wrapped(*args, **kwargs)


def _reinitialize_wrapper(wrapped: Callable, context: Any, args: tuple, kwargs: dict):
    """``reinitialize_inference_state_buffers()``: called by ``engine.resume()``; a real
    reallocation (the context was suspended) means the weights may have changed meanwhile."""
    was_suspended = not context.is_tensor_state_allocated
    result = wrapped(*args, **kwargs)
    if was_suspended:
        flush(context)
    return result


def _on_swap() -> None:
    """After each ``swap_model_weights`` (:data:`SWAP_HOOK`): every context flushes at its next
    prefix match or step."""
    global _current_version
    with _LOCK:
        _current_version += 1


class WeightUpdateInvalidationPatch(Patch):
    """Flushes the prefix cache at each weight update and records each request's weight versions
    (see module docstring)."""

    name = "weight-update-invalidation"
    fault = "8"
    source_patched_targets = (FIND_MATCH, REINITIALIZE, ADD_REQUEST)
    fault_evidence = ("no megatron-core release up to 0.19.2, nor Megatron-LM main up to d98e8a64 "
                      "(2026-08-22), drops or salts the prefix cache of text prompts when weights change "
                      "(main's later #6497 salts image requests only)")

    def __init__(self) -> None:
        super().__init__()
        #: What the last ``apply()`` read from ``MEGATRON_EXT_ON_WEIGHT_UPDATE``; None before one,
        #: after ``revert()``, or where the patch was refused or skipped.
        self.mode: Optional[str] = None
        self._reverted = False

    def wrappers(self) -> dict[Target, Callable | Guarded]:
        return {FIND_MATCH: Guarded(_find_match_wrapper, "enable_prefix_caching"),
                ADD_REQUEST: _add_request_wrapper,
                STEP: _step_wrapper,
                REINITIALIZE: _reinitialize_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        return (*self.wrappers(), DEREGISTER, RELEASE)

    def plan(self, version: str, force: bool) -> PatchResult:
        if on_weight_update_mode() == "keep" and not self.installed:
            planned = super().plan(version, force)
            if planned.state is PatchState.NOT_NEEDED:
                # the env variable only governs this patch: source-patched code always invalidates
                return self.result(PatchState.NOT_NEEDED, f"the installed code does not have this fault; "
                                   f"{ON_WEIGHT_UPDATE_ENV}=keep does not apply to source-patched code "
                                   "(revert the source patches for upstream behaviour)", planned.evidence)
            return self.result(PatchState.NOT_APPLIED, f"{ON_WEIGHT_UPDATE_ENV}=keep: prefix-cached KV "
                               "is reused across weight updates (upstream behaviour)")
        return super().plan(version, force)

    def settled(self, result: PatchResult) -> None:
        # one reading: invalidate_prefix_cache follows the mode the last apply() acted on
        if result.state is PatchState.NOT_APPLIED and ON_WEIGHT_UPDATE_ENV in result.reason:
            self.mode = "keep"
        elif result.state in (PatchState.APPLIED, PatchState.NOT_NEEDED):
            self.mode = "invalidate"
        else:  # reverted, refused, skipped
            self.mode = None

    def install(self) -> None:
        global _current_version
        super().install()
        SWAP_HOOK.install(self.name, _on_swap)
        if self._reverted:  # weights may have been swapped unseen while reverted
            with _LOCK:
                _current_version += 1
            weight_versions.note_reapply()

    def uninstall(self) -> bool:
        SWAP_HOOK.uninstall(self.name)
        weight_versions.restore_all_hashes()
        weight_versions.note_revert()
        self._reverted = True
        return super().uninstall()
