"""Fault H8 (issue 22): a hybrid request's continuation prefill chunk keeps the KV skip over
matched blocks, but Mamba state is restored on the first chunk only.

On a real hybrid context (block 16, Mamba chunk 16, no Mamba snapshots): r0 (64 tokens) is
registered; r1 (r0's 64 tokens + 16) is admitted in chunks as the engine does it, 16 tokens then 48.
Its first chunk matches block 0 and no Mamba state, so it skips nothing; its second chunk (from
token 16) matches r0's blocks 1-3. Released: that chunk skips 32 tokens (0.18/0.19: 47 rounded down
by the >= 2-token clamp) or 47 (0.17) with no Mamba restore, so the Mamba layers never see them.
Patched: the chunk skips nothing and computes tokens 16-63, writing their KV to the dummy block
(fix 2). With ``MEGATRON_EXT_TEST_UNPATCHED=1`` the test fails on 0.17.x, 0.18.x and 0.19.x.
Run under both patch orders.
"""

from __future__ import annotations

import pytest

from megatron_ext.harness.factories import recorded_restores
from megatron_ext.patches.mamba_continuation_skip import MambaContinuationSkipPatch

from .conftest import SOURCE_PATCHED
from .context_factory import add_and_collect_writes, block_table, finish_chunk, make_request
from .hybrid_context_factory import engine_mamba_match, hybrid_prefix_caching_context, run_pending_mamba_ops

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

PROMPT = list(range(100, 180))


@pytest.mark.parametrize("policy", ["REF_ZERO", "LRU"])
def test_hybrid_continuation_chunk_skips_nothing(runtime_patches_either_order, policy):
    with hybrid_prefix_caching_context(policy) as context:
        context.add_request(make_request(1, PROMPT[:64]))
        r0_blocks = block_table(context, 0, 4)
        r1 = make_request(2, PROMPT)
        engine_mamba_match(context, r1)
        first = add_and_collect_writes(context, r1, 16)
        run_pending_mamba_ops(context)
        assert [position for position, _ in first] == list(range(16))  # no Mamba state: no skip
        finish_chunk(context, r1, 16)
        assert context._compute_prefix_match(r1, 48)[0] == r0_blocks[1:4]  # the continuation's KV match
        with recorded_restores(context) as restores:
            second = add_and_collect_writes(context, r1, 48)
            run_pending_mamba_ops(context)
        dummy = context.kv_block_allocator.dummy_block_idx
        assert context._compute_prefix_match(r1, 48)[4:] == (0, 48)
        assert second == [(position, dummy) for position in range(16, 64)]  # computed, r0's blocks read-only
        assert restores == []
        assert int(context.request_kv_length_offsets[1]) == 16


def test_needed_unless_source_patched():
    needed, evidence = MambaContinuationSkipPatch().needed()
    assert needed == (not SOURCE_PATCHED), evidence
