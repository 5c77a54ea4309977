"""Fault H5 (issue 22): with chunked prefill, 0.17/0.18 count a hybrid request's Mamba match over the
whole prompt but its KV match within the chunk, and ``add_request`` fails the assertion
``Mamba match (3) > KV match (2)``.

On a real hybrid context (block 16): r0's 48-token prompt is registered, its blocks get Mamba
snapshots (as a prefill commit leaves them), and r1, whose 64-token prompt starts with r0's, is
added with a first chunk of 20 tokens (2 blocks). The Mamba match is set as 0.17's / 0.18's engine
sets it (its own ``_find_mamba_match_count``, over the whole prompt: 3). With
``MEGATRON_EXT_TEST_UNPATCHED=1`` on 0.17.x / 0.18.x the chunked tests fail with that
AssertionError; 0.19 counts within the chunk itself (#4758), so they pass there with or without
the patch. Run under both patch orders (``runtime_patches_either_order``).
"""

from __future__ import annotations

import pytest

from megatron_ext import mcore
from megatron_ext.harness.factories import recorded_restores
from megatron_ext.patches.mamba_match_in_chunk import COMPUTE_PREFIX_MATCH, MambaMatchInChunkPatch

from .conftest import SOURCE_PATCHED
from .context_factory import block_table, make_request
from .hybrid_context_factory import (
    cache_mamba_state, engine_mamba_match, hybrid_prefix_caching_context, live_mamba_values, run_pending_mamba_ops,
    snapshot_value,
)

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

SERIES = mcore.release_series(mcore.installed_version())
PROMPT = list(range(100, 164))  # r1's 64 tokens; r0 has the first 48 (3 full blocks)


def chunked_admission(policy: str, snapshot_blocks: list[int], chunk: int):
    """r0 (48 tokens) added and its blocks ``snapshot_blocks`` (indices) given Mamba snapshots; r1
    (64 tokens) admitted as the engine does (Mamba match, then ``add_request(r1, chunk)``).

    Returns (r0's block IDs, r1's prefix match for the chunk, restores, r1's live Mamba values,
    r1's row: query length and KV offset, block table)."""
    with hybrid_prefix_caching_context(policy) as context:
        context.add_request(make_request(1, PROMPT[:48]))
        r0_blocks = block_table(context, 0, 3)
        cache_mamba_state(context, [r0_blocks[i] for i in snapshot_blocks])
        r1 = make_request(2, PROMPT)
        engine_mamba_match(context, r1)
        matched, _, _, _, skip, effective = context._compute_prefix_match(r1, chunk)
        with recorded_restores(context) as restores:
            context.add_request(r1, chunk)
            run_pending_mamba_ops(context)
        row = (int(context.request_query_lengths[1]), int(context.request_kv_length_offsets[1]),
               block_table(context, 1, 2))
        return r0_blocks, (matched, skip, effective), restores, live_mamba_values(context, 1), row


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_first_chunk_shorter_than_the_mamba_match_skips_nothing(runtime_patches_either_order, policy):
    # Snapshots after blocks 1 and 2 (what r0's prefill commits with Mamba chunk 16). The chunk's
    # 2 KV-matched blocks hold a snapshot at block 1, but skipping 32 tokens would leave nothing of
    # a 20-token chunk: the released back-off finds no earlier snapshot, so nothing is skipped.
    r0_blocks, (matched, skip, effective), restores, live, row = chunked_admission(policy, [1, 2], 20)
    assert matched == r0_blocks[:2]
    assert (skip, effective) == (0, 20)
    assert restores == []
    assert live == {0.0}  # a fresh Mamba state
    assert row == (20, 0, r0_blocks[:2])


def test_first_chunk_backs_off_to_a_snapshot_inside_it(runtime_patches_either_order):
    # Snapshots after blocks 0, 1 and 2: within the 20-token chunk the back-off lands on block 0,
    # whose snapshot is restored; 4 tokens are computed.
    r0_blocks, (matched, skip, effective), restores, live, row = chunked_admission("REF_ZERO", [0, 1, 2], 20)
    assert matched == r0_blocks[:2]
    assert (skip, effective) == (16, 4)
    assert restores == [(r0_blocks[0], True)]
    assert live == {snapshot_value(r0_blocks[0])}
    assert row == (4, 16, r0_blocks[:2])


def test_whole_prompt_admission_restores_the_farthest_snapshot(runtime_patches_either_order):
    # Not chunked (the engine's non-chunked path): the KV match covers r0's 3 blocks, the
    # snapshot after block 2 is restored and 48 tokens are skipped, on every release.
    r0_blocks, (matched, skip, effective), restores, live, row = chunked_admission("REF_ZERO", [1, 2], 64)
    assert matched == r0_blocks
    assert (skip, effective) == (48, 16)
    assert restores == [(r0_blocks[2], True)]
    assert live == {snapshot_value(r0_blocks[2])}
    assert row[:2] == (16, 48)


def test_needed_on_017_and_018_only():
    needed, evidence = MambaMatchInChunkPatch().needed()
    assert needed == (SERIES in ("0.17", "0.18") and not SOURCE_PATCHED), evidence
    has_context_count = "_find_mamba_match_count" in vars(COMPUTE_PREFIX_MATCH.owner())
    assert has_context_count == (not needed)
