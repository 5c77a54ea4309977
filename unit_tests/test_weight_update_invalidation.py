"""Fault 8: no request admitted after a weight update matches a block cached before it.

A real ``DynamicInferenceContext`` on the CPU with 8 usable KV blocks of 16 tokens (block 8 is the
dummy block); ``add_request`` takes new blocks from the end of the free pool, so a fresh pool
hands out [6, 7] first. Prompts: A is two blocks, B one block. The weight update is what a user's
loop does: ``engine.resume()`` after ``suspend()`` (the context's buffers reallocated),
``swap_model_weights``, or ``megatron_ext.invalidate_prefix_cache``. With
``MEGATRON_EXT_TEST_UNPATCHED=1`` every test that flushes fails (on every release: no release
has a fix). With ``MEGATRON_EXT_TEST_SOURCE_PATCHED=1`` (functional_tests/test_source_patches.py)
the same behaviour tests run against the source patches of ``patches/`` with no runtime patch
applied; the tests of megatron-ext's own wrapping machinery are skipped there.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import pytest
import torch

import megatron_ext
from megatron_ext.cpu_backend import cuda_on_cpu
from megatron_ext.errors import MegatronExtError, WeightUpdatePatchNotApplied
from megatron_ext.fingerprints import known_trees
from megatron_ext.harness.factories import small_prefix_caching_context
from megatron_ext.harness.step_loop import taken_in
from megatron_ext.patches import ALL_PATCHES
from megatron_ext.patches import weight_update_invalidation as fault8
from megatron_ext.patches import weight_versions
from megatron_ext.patches.matched_block_writes import MATCHED_RANGES

from .allocator_factory import free_count
from .conftest import SOURCE_PATCHED, UNPATCHED
from .context_factory import BLOCK, finish_chunk, make_request

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

A = list(range(1000, 1032))
B = list(range(2000, 2016))
DUMMY = 8
KV_BYTES_PER_BLOCK = 2 * 2 * BLOCK * 4 * 16 * 4  # K and V, 2 layers, 16 tokens, 4 heads x 16, fp32


@pytest.fixture(params=["REF_ZERO", "LRU"])
def ctx(request, runtime_patches):
    with cuda_on_cpu():
        yield small_prefix_caching_context(
            request.param, block_size_tokens=BLOCK, buffer_size_gb=9 * KV_BYTES_PER_BLOCK / 2**30,
            max_requests=8, max_tokens=256, max_sequence_length=256,
        )


def invalidate(context) -> fault8.InvalidationResult:
    """The weight update, as a loop without suspend/resume reports it (unpatched: nothing)."""
    if UNPATCHED:
        return fault8.InvalidationResult()
    return megatron_ext.invalidate_prefix_cache(context)


def lru(context) -> bool:
    return context.kv_block_allocator.prefix_caching_eviction_policy.name == "LRU"


def registered(context) -> dict[int, int]:
    """Block ID -> hash of every registered block."""
    return {b: h for b, h in enumerate(context.kv_block_allocator.block_hashes.tolist()) if h != -1}


def ref_counts(context) -> list[int]:
    return context.kv_block_allocator.block_ref_counts.tolist()


def table(context, row: int, count: int) -> list[int]:
    return context.request_to_kv_block_ids[row][:count].tolist()


def retire(context, rows: list[int]) -> None:
    """The requests in ``rows`` finish: their blocks are released (rows stay, as in a test)."""
    context.release_memory_blocks_from_request_indexes(torch.tensor(rows))


def test_cached_and_live_blocks_become_unmatchable_and_the_books_stay_whole(ctx):
    allocator = ctx.kv_block_allocator
    ctx.add_request(make_request(1, A))  # row 0 holds [6, 7]
    ctx.add_request(make_request(2, B))  # row 1 holds [5]
    assert table(ctx, 0, 2) == [6, 7] and table(ctx, 1, 1) == [5]
    retire(ctx, [1])  # B finishes: LRU keeps block 5 cached at ref 0; REF_ZERO frees it
    hash_a = make_request(0, A).precomputed_block_hashes
    assert registered(ctx) == ({6: hash_a[0], 7: hash_a[1], 5: make_request(0, B).precomputed_block_hashes[0]}
                               if lru(ctx) else {6: hash_a[0], 7: hash_a[1]})
    avail_before = free_count(allocator)

    result = invalidate(ctx)

    assert result == fault8.InvalidationResult(blocks_unreachable=2, blocks_freed=1 if lru(ctx) else 0, epoch=1)
    assert registered(ctx) == {} and allocator.kv_hash_to_block_id == {}
    assert ref_counts(ctx)[5:8] == [0, 1, 1]  # A's holder keeps its blocks
    assert free_count(allocator) == avail_before + (1 if lru(ctx) else 0)  # cached B back in the pool
    if lru(ctx):
        assert allocator.block_parent_id.tolist() == [-1] * 9
        assert allocator.block_child_count.tolist() == [0] * 9

    # A request with A's prompt matches nothing, computes its own blocks and registers them ...
    matched = ctx.prefix_cache_blocks_matched
    ctx.add_request(make_request(3, A))
    own = table(ctx, 2, 2)
    assert ctx.prefix_cache_blocks_matched == matched
    assert set(own).isdisjoint({6, 7, DUMMY})
    assert registered(ctx) == {own[0]: hash_a[0], own[1]: hash_a[1]}
    # ... which the next one matches: caching works within a weight version.
    ctx.add_request(make_request(4, A + [7]))
    assert table(ctx, 3, 2) == own
    assert ctx.prefix_cache_blocks_matched == matched + 2

    # A's first holder finishes: its unhashed blocks go back to the free pool under both policies.
    avail = free_count(allocator)
    retire(ctx, [0])
    assert ref_counts(ctx)[6:8] == [0, 0]
    assert free_count(allocator) == avail + 2
    assert sorted(allocator.block_bag[free_count(allocator) - 2: free_count(allocator)].tolist()) == [6, 7]


def test_a_chunked_prefill_straddling_the_update_neither_matches_nor_registers(ctx):
    prompt = A + B  # three blocks, prefilled in two chunks of 24 tokens
    hashes = make_request(0, prompt).precomputed_block_hashes
    straddler = make_request(1, prompt)
    ctx.add_request(straddler, 24)  # row 0: blocks [6, 7]; block 6 complete and registered
    finish_chunk(ctx, straddler, 24)
    assert registered(ctx) == {6: hashes[0]}

    invalidate(ctx)
    # After the update another request computes the whole prompt and registers its blocks.
    allocator = ctx.kv_block_allocator
    fresh = allocator.allocate_memory_blocks(3).tolist()
    assert fresh == [3, 4, 5]
    allocator.register_kv_block_hashes(fresh, hashes)

    # The straddler's last chunk: its KV so far is the old weights', so it neither matches the
    # fresh block 2 nor registers the blocks it completes now (7, and its new block 2).
    matched = ctx.prefix_cache_blocks_matched
    ctx.add_request(straddler, 24)
    assert ctx.prefix_cache_blocks_matched == matched
    assert table(ctx, 0, 3) == [6, 7, 2]
    assert registered(ctx) == dict(zip(fresh, hashes))
    assert allocator.kv_hash_to_block_id == {h: b for b, h in zip(fresh, hashes)}
    if not UNPATCHED and not SOURCE_PATCHED:  # set aside until it starts over
        assert straddler.precomputed_block_hashes == []
        assert weight_versions.books_of(straddler).stashed_hashes == hashes
    if not UNPATCHED:  # the source patch restamps at the first prefix match too (hashes kept)
        # Started over from scratch (RECOMPUTE, or evicted and re-added): current again, it
        # matches the blocks cached after the update.
        straddler.finished_chunk_token_count = 0
        assert ctx._find_kv_match_count(straddler, 0, 3) == (fresh, hashes[2])
        assert straddler.precomputed_block_hashes == hashes


def begin_unseen(context, request) -> None:
    """The request's first chunk runs where the patch cannot see it: under released code (the
    patch reverted, runtime) or with no epoch recorded (a request from before the source patch)."""
    if SOURCE_PATCHED:
        context.add_request(request, 24)
        request.prefix_cache_epoch = None
    else:
        megatron_ext.revert()
        context.add_request(request, 24)
        megatron_ext.apply()
    finish_chunk(context, request, 24)


def test_a_prefill_begun_before_apply_and_straddling_an_update_is_stale(ctx):
    """A request whose prefill began before the patch saw it counts as older than any update."""
    prompt = A + B
    hashes = make_request(0, prompt).precomputed_block_hashes
    straddler = make_request(1, prompt)
    begin_unseen(ctx, straddler)  # row 0: blocks [6, 7]; block 6 registered by the released code
    invalidate(ctx)
    allocator = ctx.kv_block_allocator
    fresh = allocator.allocate_memory_blocks(3).tolist()
    allocator.register_kv_block_hashes(fresh, hashes)
    matched = ctx.prefix_cache_blocks_matched
    ctx.add_request(straddler, 24)  # unpatched 0.19: KeyError; 0.17/0.18: matches and registers
    assert ctx.prefix_cache_blocks_matched == matched
    assert table(ctx, 0, 3) == [6, 7, 2]
    assert registered(ctx) == dict(zip(fresh, hashes))


@pytest.mark.skipif(SOURCE_PATCHED, reason="revert() undoes megatron-ext's runtime patch")
def test_revert_gives_stale_requests_their_hashes_back_and_apply_counts_as_an_update(ctx):
    prompt = A + B
    hashes = make_request(0, prompt).precomputed_block_hashes
    straddler = make_request(1, prompt)
    ctx.add_request(straddler, 24)
    finish_chunk(ctx, straddler, 24)
    invalidate(ctx)
    assert ctx._find_kv_match_count(straddler, 0, 3) == ([], 0)  # stale: hashes set aside
    epoch = fault8.context_epoch(ctx)
    megatron_ext.revert()
    assert straddler.precomputed_block_hashes == hashes  # as the released code expects
    assert not [key for key in vars(straddler) if "megatron_ext" in key]
    refit = importlib.import_module(fault8.REFIT_MODULE)
    with pytest.raises(TypeError):  # a swap the reverted patch cannot see
        refit.swap_model_weights(None, None, refit_method=object())
    megatron_ext.apply()
    ctx.add_request(make_request(2, B))  # the first match after apply() flushes
    assert fault8.context_epoch(ctx) == (epoch if UNPATCHED else epoch + 1)


@pytest.mark.skipif(UNPATCHED or SOURCE_PATCHED, reason="the runtime patch's per-token books")
def test_a_request_that_ran_while_reverted_has_no_recorded_weight_versions(ctx):
    """Tokens generated between revert() and apply() ran under weights the patch could not see (a
    swap meanwhile goes unseen): their versions are unknown, not the version before the revert. A
    request that made no progress meanwhile keeps its versions."""
    busy, idle = make_request(1, A), make_request(2, B)
    ctx.add_request(busy)
    ctx.add_request(idle)  # both prefills begin at weight version 0
    busy.generated_tokens, idle.generated_tokens = [5], [6]
    megatron_ext.revert()
    busy.generated_tokens.append(7)  # decoded while reverted
    megatron_ext.apply()
    invalidate(ctx)  # weight version 1
    busy.generated_tokens.append(8)
    idle.generated_tokens.append(9)
    with pytest.raises(megatron_ext.WeightVersionsNotRecorded, match="request 1: it ran while megatron-ext was reverted"):
        megatron_ext.token_weight_versions(busy)
    assert megatron_ext.token_weight_versions(idle) == megatron_ext.TokenWeightVersions(logits=(0, 1), kv_prefix=(0, 0))


@pytest.mark.parametrize("stage", ["queued", "chunked", "stale", "finished"])
def test_requests_and_records_round_trip_after_the_patches_touched_them(ctx, stage):
    """``deserialize(serialize())`` of a request at each stage of a straddling prefill that matched
    a cached block (and of its 0.18+ record) gives back the same fields: the state fixes 2 and 8
    keep per request is beside it (runtime) or in request fields (source patches)."""
    ctx.add_request(make_request(9, A))  # row 0: A's two blocks, registered
    request = make_request(1, A + B)
    if stage != "queued":
        ctx.add_request(request, 24)  # matches A's two blocks (fix 2 keeps the matched range)
        finish_chunk(ctx, request, 24)
        if not UNPATCHED:
            assert (request._matched_kv_token_ranges if SOURCE_PATCHED else MATCHED_RANGES.get(request)) == [(0, 32)]
    if stage in ("stale", "finished"):
        invalidate(ctx)
        ctx.add_request(request, 24)
    if stage == "finished":
        finish_chunk(ctx, request, 24)
        request.generated_tokens = [7, 8]
    fields = ("request_id", "finished_chunk_token_count", "precomputed_block_hashes", "generated_tokens")
    again = type(request).deserialize(request.serialize())  # the patches' books are not in the wire
    assert [getattr(again, f) for f in fields] == [getattr(request, f) for f in fields]
    record_type = getattr(importlib.import_module("megatron.core.inference.inference_request"),
                          "DynamicInferenceRequestRecord", None)
    if record_type is not None:  # 0.18+
        again = record_type.deserialize(record_type.from_request(request).serialize())
        assert [getattr(again[-1], f) for f in fields] == [getattr(request, f) for f in fields]


def test_in_flight_tokens_of_a_chunked_prefill_count_the_matched_blocks_it_reads(ctx):
    """``ab`` judges whether an update reached a request at the same token with caching on and off
    by the tokens whose KV it holds. A chunk ending inside a matched block leaves the rest of that
    block's KV (computed before the update) to be read, not recomputed under the new weights: those
    tokens count (0.17/0.18 engines end a chunk there; unpatched, fault 2 recomputes them into the
    shared block)."""
    ctx.add_request(make_request(9, A))
    request = make_request(1, A + B)
    ctx.add_request(request, 24)  # matches A's two blocks, prefills 24 tokens
    finish_chunk(ctx, request, 24)
    engine = types.SimpleNamespace(requests={1: types.SimpleNamespace(record=[request])}, waiting_request_ids=[1])
    assert taken_in(engine, 1) == (24 if UNPATCHED else 32)


def test_a_request_queued_before_the_update_matches_only_blocks_cached_after_it(ctx):
    queued = make_request(9, A)  # created (hashes computed) before the update
    ctx.add_request(make_request(1, A))
    retire(ctx, [0])
    invalidate(ctx)
    matched = ctx.prefix_cache_blocks_matched
    ctx.add_request(queued)
    assert ctx.prefix_cache_blocks_matched == matched
    assert set(table(ctx, 1, 2)) == set(registered(ctx))


def test_resume_after_suspend_is_a_weight_update(ctx):
    ctx.add_request(make_request(1, A))
    ctx.reinitialize_inference_state_buffers()  # not suspended: nothing happens
    assert len(registered(ctx)) == 2
    ctx.deallocate_inference_state_buffers()  # engine.suspend() (PERSIST: bookkeeping kept)
    ctx.reinitialize_inference_state_buffers()  # engine.resume()
    assert registered(ctx) == {}
    assert ref_counts(ctx)[6:8] == [1, 1]


def test_swap_model_weights_flushes_every_context_at_its_next_prefix_match(ctx):
    refit = importlib.import_module(fault8.REFIT_MODULE)
    package = importlib.import_module("megatron.core.resharding")
    ctx.add_request(make_request(1, A))
    retire(ctx, [0])
    epoch = fault8.context_epoch(ctx)
    assert package.swap_model_weights is refit.swap_model_weights  # one name, every module
    with pytest.raises(TypeError):  # fails before copying anything: still counts as an update
        refit.swap_model_weights(None, None, refit_method=object())
    assert len(registered(ctx)) == (2 if lru(ctx) else 0)  # lazily: nothing happened yet
    matched = ctx.prefix_cache_blocks_matched
    ctx.add_request(make_request(2, A))
    assert ctx.prefix_cache_blocks_matched == matched
    assert fault8.context_epoch(ctx) == epoch + 1


def test_the_first_weight_update_of_a_job_moves_the_epoch_after_a_round_that_left_nothing_cached(ctx, monkeypatch):
    # The RL loop from the start of a job: weight version 0, a rollout round that finishes (REF_ZERO
    # then caches nothing), a refit, the next round. Its tokens run under version 1: the context
    # was met in round one, so it flushes (its epoch moves) although nothing is cached.
    monkeypatch.setattr(fault8, "_current_version", 0)  # the job's first update, whatever ran before
    refit = importlib.import_module(fault8.REFIT_MODULE)
    ctx.add_request(make_request(1, A))
    retire(ctx, [0])
    assert fault8.context_epoch(ctx) == 0
    with pytest.raises(TypeError):  # fails before copying anything: still counts as an update
        refit.swap_model_weights(None, None, refit_method=object())
    ctx.add_request(make_request(2, A))
    assert fault8.context_epoch(ctx) == 1


@pytest.mark.skipif(SOURCE_PATCHED, reason="the runtime wrapper of swap_model_weights is megatron-ext's; "
                    "source-patched code bumps the weight version inside swap_model_weights itself")
def test_swap_model_weights_is_restored_by_revert(runtime_patches):
    refit = importlib.import_module(fault8.REFIT_MODULE)
    package = importlib.import_module("megatron.core.resharding")
    wrapped = refit.swap_model_weights
    megatron_ext.revert()
    assert refit.swap_model_weights is package.swap_model_weights
    assert not hasattr(refit.swap_model_weights, "__wrapped__")
    if not UNPATCHED:
        assert wrapped.__wrapped__ is refit.swap_model_weights


def test_invalidate_is_idempotent(ctx):
    ctx.add_request(make_request(1, A))
    first, second = invalidate(ctx), invalidate(ctx)
    assert (first.blocks_unreachable, second) == (2, fault8.InvalidationResult(epoch=2))


def test_invalidate_without_prefix_caching_only_moves_the_weight_version(runtime_patches):
    """Caching off (``ab``'s baseline run calls it too): nothing to flush, the epoch advances."""
    with cuda_on_cpu():
        context = small_prefix_caching_context(
            "REF_ZERO", block_size_tokens=BLOCK, buffer_size_gb=9 * KV_BYTES_PER_BLOCK / 2**30, max_requests=8,
            max_tokens=256, max_sequence_length=256, prefix_caching=False)
    assert invalidate(context) == fault8.InvalidationResult(epoch=1)
    assert fault8.context_epoch(context) == 1


@pytest.mark.skipif(UNPATCHED, reason="the API itself is megatron-ext's")
def test_api_takes_an_engine_or_a_context_and_refuses_anything_else(ctx):
    engine = type("Engine", (), {"context": ctx})()
    ctx.add_request(make_request(1, A))
    assert megatron_ext.invalidate_prefix_cache(engine).blocks_unreachable == 2
    with pytest.raises(TypeError, match="DynamicInferenceEngine or DynamicInferenceContext, not int"):
        megatron_ext.invalidate_prefix_cache(3)


@pytest.mark.skipif(UNPATCHED, reason="the API itself is megatron-ext's")
@pytest.mark.skipif(SOURCE_PATCHED, reason="keep governs the runtime patch; source-patched code always "
                    "invalidates (test_source_patched_tree_needs_no_runtime_patch_and_the_api_flushes_it)")
def test_keep_leaves_the_patch_out_and_invalidate_does_nothing(ctx, monkeypatch, caplog):
    """The mode is read once, by apply(): changing the variable afterwards changes nothing, and
    the no-op says so (once) through the megatron_ext logger."""
    megatron_ext.revert()
    monkeypatch.setenv(fault8.ON_WEIGHT_UPDATE_ENV, "keep")
    state = {r.patch: r for r in megatron_ext.apply()}["weight-update-invalidation"]
    assert state.state.value == "not applied" and "MEGATRON_EXT_ON_WEIGHT_UPDATE=keep" in state.reason
    monkeypatch.delenv(fault8.ON_WEIGHT_UPDATE_ENV)
    monkeypatch.setattr(fault8, "_warned", set())
    ctx.add_request(make_request(1, A))
    with caplog.at_level("WARNING", logger="megatron_ext"):
        assert megatron_ext.invalidate_prefix_cache(ctx) == fault8.InvalidationResult(kept=True)
        assert megatron_ext.invalidate_prefix_cache(ctx) == fault8.InvalidationResult(kept=True)
    assert [r.getMessage() for r in caplog.records if r.name == "megatron_ext"] == [
        "invalidate_prefix_cache did nothing: MEGATRON_EXT_ON_WEIGHT_UPDATE=keep at megatron_ext.apply(), so "
        "prefix-cached KV of the old weights stays matchable"]
    assert len(registered(ctx)) == 2
    megatron_ext.revert()
    megatron_ext.apply()  # invalidate now; a later keep in the environment does not undo it
    monkeypatch.setenv(fault8.ON_WEIGHT_UPDATE_ENV, "keep")
    assert megatron_ext.invalidate_prefix_cache(ctx).blocks_unreachable == 2


@pytest.mark.skipif(UNPATCHED or SOURCE_PATCHED, reason="the runtime flush's own check")
def test_a_flush_that_leaves_a_block_matchable_says_so(ctx, monkeypatch, caplog):
    ctx.add_request(make_request(1, A))
    allocator = ctx.kv_block_allocator
    # something outside megatron-ext keeps one entry: the flush must not pass silently
    monkeypatch.setattr(allocator, "kv_hash_to_block_id",
                        type("KeepsEntries", (dict,), {"clear": lambda self: None})(allocator.kv_hash_to_block_id))
    monkeypatch.setattr(fault8, "_warned", set())
    with caplog.at_level("WARNING", logger="megatron_ext"):
        result = megatron_ext.invalidate_prefix_cache(ctx)
    assert (result.blocks_unreachable, result.still_matchable) == (2, 2)
    assert "2 prefix-cache entries are still matchable" in caplog.text


@pytest.mark.skipif(UNPATCHED, reason="the API itself is megatron-ext's")
def test_a_bad_mode_is_one_line_naming_the_values(monkeypatch):
    monkeypatch.setenv(fault8.ON_WEIGHT_UPDATE_ENV, "flush")
    with pytest.raises(MegatronExtError, match="MEGATRON_EXT_ON_WEIGHT_UPDATE='flush' is not one of invalidate, keep"):
        megatron_ext.status()


@pytest.mark.skipif(UNPATCHED, reason="the API itself is megatron-ext's")
@pytest.mark.skipif(SOURCE_PATCHED, reason="a source-patched context flushes itself without the patch")
def test_invalidate_without_the_patch_says_to_apply_it(ctx):
    megatron_ext.revert()
    with pytest.raises(WeightUpdatePatchNotApplied, match=r"call megatron_ext.apply\(\) first"):
        megatron_ext.invalidate_prefix_cache(ctx)


@pytest.mark.skipif(SOURCE_PATCHED, reason="the runtime patch is not needed on source-patched code: "
                    "nothing is wrapped")
def test_auto_apply_wraps_swap_model_weights_imported_after_it():
    """Importing the refit package imports the dynamic context first, where MEGATRON_EXT_AUTO
    applies: the refit module is wrapped by a post-import hook when it has loaded."""
    code = ("import megatron.core.resharding.refit as r, megatron.core.resharding as p; "
            "print(hasattr(r.swap_model_weights, '__wrapped__'), p.swap_model_weights is r.swap_model_weights)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")}
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env={**env, "MEGATRON_EXT_AUTO": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


@pytest.mark.skipif(UNPATCHED, reason="the hook itself is megatron-ext's")
@pytest.mark.skipif(SOURCE_PATCHED, reason="the hook is the runtime patch's; source-patched code needs none")
def test_a_half_imported_refit_module_is_wrapped_at_the_next_prefix_match(ctx, monkeypatch):
    refit = importlib.import_module(fault8.REFIT_MODULE)
    megatron_ext.revert()
    original = refit.swap_model_weights
    monkeypatch.setitem(sys.modules, fault8.REFIT_MODULE, types.ModuleType(fault8.REFIT_MODULE))  # no function yet
    megatron_ext.apply()
    assert fault8.SWAP_HOOK.pending
    monkeypatch.setitem(sys.modules, fault8.REFIT_MODULE, refit)  # the import finished
    ctx.add_request(make_request(1, A))
    assert not fault8.SWAP_HOOK.pending
    assert refit.swap_model_weights.__wrapped__ is original


@pytest.mark.skipif(not SOURCE_PATCHED, reason="needs a tree carrying the source patches of patches/")
def test_source_patched_tree_needs_no_runtime_patch_and_the_api_flushes_it(ctx, mcore_version, monkeypatch):
    states = {r.patch: r for r in megatron_ext.status()}
    state = states["weight-update-invalidation"]
    assert state.state.value == "not needed"
    # the known trees whose source-patched code this is: the release, or a Megatron-LM commit of
    # that version ("0.20.0": 2a75ac12c5)
    trees = state.evidence.rsplit(" for ", 1)[1].split(", ")
    tree = next(name for name in trees if known_trees()[name].version == mcore_version)
    assert all(f"{name.split('.')[-1]} {digest}" in state.evidence
               for name, digest in fault8.WeightUpdateInvalidationPatch.source_patched_fingerprints[tree].items())
    request = make_request(1, A)
    ctx.add_request(request)  # row 0 holds [6, 7]
    assert megatron_ext.invalidate_prefix_cache(ctx) == fault8.InvalidationResult(blocks_unreachable=2, epoch=1)
    assert registered(ctx) == {} and fault8.context_epoch(ctx) == ctx.prefix_cache_epoch == 1
    # no runtime patch, so no per-token books: the error says so rather than "call apply()"
    request.generated_tokens = [5]
    with pytest.raises(megatron_ext.WeightVersionsNotRecorded, match="request 1: .*carries megatron-ext's source patches"):
        megatron_ext.token_weight_versions(request)
    # keep only governs the runtime patch: status says so, the source-patched code still flushes
    monkeypatch.setenv(fault8.ON_WEIGHT_UPDATE_ENV, "keep")
    state = {r.patch: r for r in megatron_ext.status()}["weight-update-invalidation"]
    assert state.state.value == "not needed" and "keep does not apply to source-patched code" in state.reason


@pytest.mark.skipif(UNPATCHED or SOURCE_PATCHED, reason="the API's source-patched path, on released code")
def test_api_calls_the_contexts_own_flush_where_the_runtime_patch_is_not_needed(monkeypatch):
    """The dispatch of :func:`megatron_ext.invalidate_prefix_cache` on a source-patched tree,
    with a stand-in context: the patch reports "not needed", so its flush must not run."""
    calls = []

    class SourcePatchedContext:
        kv_block_allocator = types.SimpleNamespace(enable_prefix_caching=True, block_hashes=torch.full((4,), -1),
                                                   kv_hash_to_block_id={})
        prefix_cache_epoch = 5

        def invalidate_prefix_cache(self):
            calls.append("context")
            return 3, 2

    monkeypatch.setattr(fault8, "flush", lambda context: calls.append("runtime"))
    patch = next(p for p in ALL_PATCHES if p.name == "weight-update-invalidation")
    monkeypatch.setattr(patch, "needed", lambda: (False, "source-patched"))
    engine = type("Engine", (), {"context": SourcePatchedContext()})()
    assert megatron_ext.invalidate_prefix_cache(engine) == fault8.InvalidationResult(3, 2, epoch=5)
    assert calls == ["context"]
