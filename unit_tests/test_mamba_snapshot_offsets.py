"""Fault H4 (issue 22): 0.17 / 0.18 filter Mamba snapshot offsets on a 128-token chunk grid.

``MambaSlotAllocator.compute_and_store_offsets`` runs on a real allocator around a stand-in context
(``mamba_factory``); the request rows it leaves must hold the offsets on the context's chunk grid
(Megatron-LM #5863, 0.19.0). Block size 16; request row 0's block table is ``[10, 11, 12, ...]``.
With ``MEGATRON_EXT_TEST_UNPATCHED=1`` on 0.17.x / 0.18.x three tests fail (chunks 16, 32, 256);
0.19 has the fix, so every test passes there with or without the patch.
"""

from __future__ import annotations

import pytest

from megatron_ext import mcore
from megatron_ext.patches.mamba_snapshot_offsets import OFFSETS, filters_on_chunk_128, snapshot_offsets

from .conftest import SOURCE_PATCHED
from .mamba_factory import make_slot_allocator, request, row

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

SERIES = mcore.release_series(mcore.installed_version())
#: Whether the imported code filters on chunk 128 (0.17.x / 0.18.x, unless it carries patches/).
HAS_FAULT = SERIES in ("0.17", "0.18") and not SOURCE_PATCHED


def offsets_for(chunk: int, prompt_len: int, skip: int = 0, matched: int = 0):
    """Add a request's first (only) prefill chunk: the whole prompt, ``skip`` tokens restored."""
    allocator = make_slot_allocator(mamba_chunk_size=chunk)
    required = -(-prompt_len // 16)
    allocator.compute_and_store_offsets(request(prompt_len), 0, skip, prompt_len, matched,
                                        list(range(10, 10 + matched)), required)
    return allocator


def test_chunk_16_snapshots_the_last_complete_block(runtime_patches):
    # 40 tokens: the last complete block ends at token 32, a chunk-16 boundary (released: none)
    assert row(offsets_for(16, 40)) == ([32, 0, 0], [11, -1, -1], 1, -1)


def test_chunk_32_snapshots_the_match_end_and_the_last_block_after_a_restore(runtime_patches):
    # 100 tokens, 4 blocks matched (64 tokens), Mamba state restored at 32: the KV match end (64)
    # and the last complete block (96) are 32 and 64 tokens into the prefill (released: none)
    assert row(offsets_for(32, 100, skip=32, matched=4)) == ([32, 64, 0], [13, 15, -1], 2, -1)


def test_chunk_256_takes_no_snapshot_off_its_grid(runtime_patches):
    # 140 tokens: token 128 is no chunk-256 boundary (released: a snapshot at block 17, the
    # metadata then maps it to the chunk before the request's first)
    assert row(offsets_for(256, 140)) == ([0, 0, 0], [-1, -1, -1], 0, -1)


def test_chunk_128_is_left_as_released(runtime_patches):
    assert row(offsets_for(128, 260)) == ([256, 0, 0], [25, -1, -1], 1, -1)
    # block-aligned prompt end: the end-of-prompt state is cached instead (no chunk filter)
    assert row(offsets_for(128, 256)) == ([0, 0, 0], [-1, -1, -1], 0, 25)


def test_snapshot_offsets_are_the_chunk_multiples_inside_the_prefill():
    assert snapshot_offsets(40, 0, 40, 0, 3, 16, 16) == [32]
    assert snapshot_offsets(100, 32, 100, 4, 7, 16, 32) == [32, 64]
    assert snapshot_offsets(140, 0, 140, 0, 9, 16, 256) == []
    assert snapshot_offsets(140, 0, 140, 0, 9, 16, 128) == [128]
    assert snapshot_offsets(48, 0, 48, 0, 3, 16, 16) == [32]  # 48 is the prompt end: not inside
    assert snapshot_offsets(64, 16, 64, 2, 4, 16, 16) == [16, 32]  # relative to the restored 16


def test_probe_finds_the_fault_on_017_and_018_only():
    has_fault, evidence = filters_on_chunk_128(OFFSETS.original())
    assert has_fault == HAS_FAULT, evidence
