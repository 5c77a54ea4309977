"""Fault H3 (issue 22): 0.17's ``_allocate_mamba_states`` rebuilds the Mamba metadata with chunk 128.

On 0.17 the released function runs on a stand-in context (the attributes it reads, CPU backend):
the metadata it leaves must carry the context's chunk size (16), not MambaMetadata's default (128).
With ``MEGATRON_EXT_TEST_UNPATCHED=1`` on 0.17.x the first test fails (128); from 0.18.0 on the
release passes the chunk size itself (#4306), so the metadata keeps 16 with or without the patch.
The end-to-end proof is functional_tests/test_hybrid.py
(a chunk-16 hybrid model, caching on vs off bit-identical with a Mamba restore).
"""

from __future__ import annotations

import types

import pytest
import torch

import megatron_ext
from megatron_ext import mcore
from megatron_ext.cpu_backend import cpu_backend
from megatron_ext.patches.mamba_chunk_size import ALLOCATE, drops_chunk_size

from .conftest import SOURCE_PATCHED

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

SERIES = mcore.release_series(mcore.installed_version())
#: Whether the imported code drops the chunk size (0.17.x, unless it carries patches/).
HAS_FAULT = SERIES == "0.17" and not SOURCE_PATCHED


def stand_in_context(chunk: int) -> types.SimpleNamespace:
    """The attributes ``_allocate_mamba_states`` reads: 1 Mamba layer, 4 requests, 64 tokens."""
    management = mcore.import_module(mcore.DYNAMIC_CONTEXT_MODULE).KVCacheManagementMode
    return types.SimpleNamespace(
        is_hybrid_model=True, max_requests=4, max_tokens=64, mamba_chunk_size=chunk,
        mamba_conv_states_shape=(8, 4), mamba_ssm_states_shape=(2, 4, 4), num_mamba_layers=1,
        mamba_conv_states_dtype=torch.float32, mamba_ssm_states_dtype=torch.float32,
        num_speculative_tokens=0, kv_cache_management_mode=management.PERSIST,
        _uses_torch_memory_saver=False, unified_memory_level=0,
    )


def allocate(chunk: int) -> types.SimpleNamespace:
    context = stand_in_context(chunk)
    with cpu_backend():
        # bound as the engine calls it (the instance reaches a wrapper as ``instance``)
        ALLOCATE.current().__get__(context, type(context))()
    return context


#: 0.18+ pass the chunk size themselves ("not needed": test_apply, and the probe test below) and their
#: _allocate_mamba_states binds the context's CPU/GPU bookkeeping views, which a stand-in cannot hold;
#: functional_tests/test_hybrid.py runs their real contexts at chunk 16.
on_017 = pytest.mark.skipif(SERIES != "0.17", reason="0.17's function only: the release with fault H3")


@on_017
def test_metadata_keeps_the_context_chunk_size(runtime_patches):
    context = allocate(16)
    assert context.mamba_metadata.mamba_chunk_size == 16
    assert context.mamba_metadata.max_chunks == 64 // 16 + 4
    assert tuple(context.mamba_ssm_states.shape) == (1, 4, 2, 4, 4)


@on_017
def test_metadata_of_chunk_128_is_left_as_built(runtime_patches):
    context = allocate(128)
    assert context.mamba_metadata.mamba_chunk_size == 128
    assert context.mamba_metadata.max_chunks == 64 // 128 + 4


@on_017
def test_released_allocation_falls_back_to_chunk_128():
    megatron_ext.revert()
    context = allocate(16)
    assert context.mamba_metadata.mamba_chunk_size == (128 if HAS_FAULT else 16)


def test_probe_finds_the_fault_on_017_only():
    has_fault, evidence = drops_chunk_size(ALLOCATE.original())
    assert has_fault == HAS_FAULT, evidence


def test_probe_reads_the_construction_call():
    def without(self):
        self.mamba_metadata = MambaMetadata(max_requests=1, max_tokens=2, d_conv=3)  # noqa: F821

    def with_chunk(self):
        self.mamba_metadata = MambaMetadata(max_requests=1, mamba_chunk_size=self.mamba_chunk_size)  # noqa: F821

    def none(self):
        return None

    assert drops_chunk_size(without)[0] is True
    assert drops_chunk_size(with_chunk)[0] is False
    assert drops_chunk_size(none)[0] is False
