"""Fault H1 (issue 22): the >= 2-token clamp (0.18+) leaves a hybrid request's skip on a block
without a Mamba snapshot; the restore fails, the Mamba state is zeroed, and the skip is kept.

On a real hybrid context (block 16, Mamba chunk 16): r0's prompt is registered, some of its blocks
get Mamba snapshots (as a prefill commit leaves them, with a known value), and r1, whose prompt is
a prefix of r0's, is added whole (its first chunk). The tests check the skip, which block
``restore_to_live`` is asked for and whether it succeeds, r1's live Mamba state, and where r1's
KV writes go. With ``MEGATRON_EXT_TEST_UNPATCHED=1`` the first two tests fail on 0.18.x and 0.19.x
(the restore fails while tokens are skipped); 0.17 has no clamp (its skip ends on the snapshot,
r1 computes 1 token), so they pass there with or without the patch. Run under both patch orders.
"""

from __future__ import annotations

import pytest

from megatron_ext import mcore
from megatron_ext.harness.factories import recorded_restores
from megatron_ext.patches.mamba_clamp_restore import (
    COMPUTE_PREFIX_MATCH, MambaClampRestorePatch, has_clamp, restorable_skip,
)

from .conftest import SOURCE_PATCHED
from .context_factory import block_table, make_request
from .hybrid_context_factory import (
    cache_mamba_state, engine_mamba_match, hybrid_prefix_caching_context, live_mamba_values, run_pending_mamba_ops,
    snapshot_value,
)

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

SERIES = mcore.release_series(mcore.installed_version())
PROMPT = list(range(100, 164))


def admit_prefix(policy: str, r0_length: int, snapshot_blocks: list[int], r1_length: int):
    """r0 (``r0_length`` tokens) added, its blocks ``snapshot_blocks`` (indices) given Mamba
    snapshots; r1 = r0's first ``r1_length`` tokens admitted whole, as the engine does.

    Returns (r0's block IDs, (skip, effective chunk), restores, r1's live Mamba values,
    {token position: KV block written} of r1's added tokens, the dummy block)."""
    with hybrid_prefix_caching_context(policy) as context:
        context.add_request(make_request(1, PROMPT[:r0_length]))
        r0_blocks = block_table(context, 0, r0_length // 16)
        cache_mamba_state(context, [r0_blocks[i] for i in snapshot_blocks])
        r1 = make_request(2, PROMPT[:r1_length])
        engine_mamba_match(context, r1)
        skip, effective = context._compute_prefix_match(r1, r1_length)[4:]
        first = context.active_token_count
        with recorded_restores(context) as restores:
            context.add_request(r1)
            run_pending_mamba_ops(context)
        positions = context.token_to_position_in_request[first:context.active_token_count].tolist()
        writes = dict(zip(positions, context.token_to_block_idx[first:context.active_token_count].tolist()))
        assert context.request_kv_length_offsets[1] == skip
        assert positions == list(range(skip, r1_length))
        dummy = context.kv_block_allocator.dummy_block_idx
        return r0_blocks, (skip, effective), restores, live_mamba_values(context, 1), writes, dummy


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_clamp_to_a_block_without_snapshot_skips_nothing(runtime_patches_either_order, policy):
    # The trigger: snapshots after blocks 1 and 2 of a 48-token prompt; r1 = its first 33
    # tokens matches 2 blocks and would skip 32, leaving 1 token; the clamp rounds 31 down to 16,
    # and block 0 has no snapshot (released 0.18/0.19: skip 16, restore of block 0 fails, state 0).
    blocks, skip, restores, live, writes, dummy = admit_prefix(policy, 48, [1, 2], 33)
    if SERIES == "0.17":  # no clamp: the 1-token chunk restores the snapshot after block 1
        assert (skip, restores, live) == ((32, 1), [(blocks[1], True)], {snapshot_value(blocks[1])})
        return
    assert skip == (0, 33)
    assert restores == []
    assert live == {0.0}  # computed from the start: the zero state is the right one
    assert writes == {**{p: dummy for p in range(32)}, 32: writes[32]}  # matched blocks: read-only
    assert writes[32] not in blocks


def test_clamp_backs_off_to_an_earlier_snapshot(runtime_patches_either_order):
    # Snapshots after blocks 0, 2 and 3 of a 64-token prompt; r1 = its first 49 tokens matches 3
    # blocks and would skip 48; the clamp rounds 47 down to 32, block 1 has no snapshot: the skip
    # backs off to 16 and the snapshot after block 0 is restored (released: skip 32, restore fails).
    blocks, skip, restores, live, writes, dummy = admit_prefix("REF_ZERO", 64, [0, 2, 3], 49)
    if SERIES == "0.17":
        assert (skip, restores, live) == ((48, 1), [(blocks[2], True)], {snapshot_value(blocks[2])})
        return
    assert skip == (16, 33)
    assert restores == [(blocks[0], True)]
    assert live == {snapshot_value(blocks[0])}
    assert writes == {**{p: dummy for p in range(16, 48)}, 48: writes[48]}


def test_clamp_to_a_block_with_snapshot_is_left_alone(runtime_patches_either_order):
    # Snapshots after blocks 0, 1 and 2: the clamped skip (16) ends on a snapshot; nothing changes.
    blocks, skip, restores, live, _, _ = admit_prefix("REF_ZERO", 48, [0, 1, 2], 33)
    if SERIES == "0.17":
        assert (skip, restores) == ((32, 1), [(blocks[1], True)])
        return
    assert skip == (16, 17)
    assert restores == [(blocks[0], True)]
    assert live == {snapshot_value(blocks[0])}


def test_restorable_skip_backs_off_block_by_block():
    class Slots:
        def has_state(self, block_id):
            return block_id in {7, 9}

    class Context:
        block_size_tokens = 16
        mamba_slot_allocator = Slots()

    matched = [7, 8, 9, 10]
    assert restorable_skip(Context(), matched, 64) == 48  # block 9 (index 2) has state
    assert restorable_skip(Context(), matched, 48) == 48
    assert restorable_skip(Context(), matched, 32) == 16  # block 8 has none, block 7 has
    assert restorable_skip(Context(), matched, 16) == 16
    assert restorable_skip(Context(), [8, 10], 32) == 0


def test_needed_on_018_and_019_only():
    needed, evidence = MambaClampRestorePatch().needed()
    assert needed == (SERIES in ("0.18", "0.19", "0.20") and not SOURCE_PATCHED), evidence
    assert has_clamp(COMPUTE_PREFIX_MATCH.original()) == (SERIES != "0.17")
