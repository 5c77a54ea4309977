"""Fault H9 (issue 22): chunked prefill cuts a hybrid prompt off the Mamba chunk grid.

The engine's released ``schedule_chunked_prefill`` runs on a real hybrid context (layers ``M*``,
block 16, Mamba chunk 16) through an engine stand-in (:func:`scheduled_chunks`); the requests wait
in the order given and the tests read how many prompt tokens each one was admitted.

* A 17-token request, then a 64-token one with ``max_tokens`` 64: released, the second gets the 47
  tokens left (0.19 with the Mamba prefix cache on snaps that to the block boundary 32, #5952);
  patched 32, a multiple of the Mamba chunk.
* A 54-token request first: 10 tokens left, no whole Mamba chunk: released 10; patched the second
  request waits for the next step.
* A 30-token request, then a 33-token one with ``max_tokens`` 62: 32 left would leave one token,
  so the released guard admits 31; patched 16.
* A GPT context keeps the released chunks (the patch returns at once).

With ``MEGATRON_EXT_TEST_UNPATCHED=1`` the hybrid tests fail on 0.17.x, 0.18.x and 0.19.x (0.19 with
prefix caching on: the first case is the released snap's, the other two fail). Run under both patch
orders.
"""

from __future__ import annotations

import pytest

from megatron_ext.patches.mamba_aligned_chunks import MambaAlignedChunksPatch, aligned_chunk_end

from .conftest import SOURCE_PATCHED
from .context_factory import make_request, prefix_caching_context
from .hybrid_context_factory import hybrid_prefix_caching_context, scheduled_chunks

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

CACHING = pytest.mark.parametrize("prefix_caching", [False, True], ids=["caching off", "caching on"])


def _requests(*lengths: int) -> list:
    """Requests 1, 2, ... with unrelated prompts of the given lengths (no prefix matches)."""
    return [make_request(index + 1, [1000 * (index + 1) + t for t in range(length)])
            for index, length in enumerate(lengths)]


@CACHING
def test_partial_chunk_ends_on_the_mamba_grid(runtime_patches_either_order, prefix_caching):
    with hybrid_prefix_caching_context(max_tokens=64, prefix_caching=prefix_caching) as context:
        assert scheduled_chunks(context, _requests(17, 64)) == [(1, 17), (2, 32)]
        assert context.active_token_count == 49
        assert context.max_tokens == 64  # the lowered budget is put back


@CACHING
def test_no_whole_mamba_chunk_left_waits(runtime_patches_either_order, prefix_caching):
    with hybrid_prefix_caching_context(max_tokens=64, prefix_caching=prefix_caching) as context:
        assert scheduled_chunks(context, _requests(54, 64)) == [(1, 54)]
        assert (context.active_token_count, context.total_request_count, context.max_tokens) == (54, 1, 64)


@CACHING
def test_one_token_tail_moves_back_a_mamba_chunk(runtime_patches_either_order, prefix_caching):
    with hybrid_prefix_caching_context(max_tokens=62, prefix_caching=prefix_caching) as context:
        assert scheduled_chunks(context, _requests(30, 33)) == [(1, 30), (2, 16)]


def test_gpt_chunks_unchanged(runtime_patches_either_order):
    with prefix_caching_context(max_tokens=64) as context:
        assert scheduled_chunks(context, _requests(17, 64)) == [(1, 17), (2, 47)]


def test_aligned_chunk_end():
    assert [aligned_chunk_end(0, end, 64, 16) for end in (15, 16, 47, 63)] == [0, 16, 32, 48]
    assert aligned_chunk_end(16, 40, 41, 16) == 32
    assert aligned_chunk_end(0, 32, 33, 16) == 16  # 32 would leave one token


def test_needed_unless_source_patched():
    needed, evidence = MambaAlignedChunksPatch().needed()
    assert needed == (not SOURCE_PATCHED), evidence
