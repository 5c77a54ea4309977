"""A real megatron-core ``MambaSlotAllocator`` on the CPU around a small stand-in context.

The allocator reads from its context only the KV allocator's ref counts, timestamps and hashes,
the eviction policy, the request and block bookkeeping and (for a commit) the batch dimensions
and Mamba metadata: a ``SimpleNamespace`` holds them, as in upstream's own allocator tests
(Megatron-LM #6091). Its state tensors go on ``torch.cuda.current_device()``, pointed at the CPU
while it is built. One Mamba layer; each slot holds a conv state of shape ``[2]`` and an SSM state
of shape ``[2]`` (fp32).
"""

from __future__ import annotations

import types
from unittest import mock

import torch

from megatron_ext import mcore

from .allocator_factory import eviction_policy

BLOCK = 16  # tokens per KV block


def make_slot_allocator(*, max_slots: int = 4, total_blocks: int = 16, max_requests: int = 2,
                        mamba_chunk_size: int = 16, policy: str = "LRU"):
    """MambaSlotAllocator with ``max_slots`` slots over ``total_blocks`` KV blocks, all of ref
    count 1 (held by live requests), no hash. Request row r's block table is
    ``[100 r + 10, 100 r + 11, ...]`` (32 blocks)."""
    kv = types.SimpleNamespace(  # the block count under its name up to 0.19 and on main after it
        total_count=total_blocks, pool_size=total_blocks, block_ref_counts=torch.ones(total_blocks, dtype=torch.int32),
        block_timestamps=torch.zeros(total_blocks, dtype=torch.int64),
        block_hashes=torch.full((total_blocks,), -1, dtype=torch.int64))
    table = torch.arange(32, dtype=torch.int32) + 10 + 100 * torch.arange(max_requests, dtype=torch.int32)[:, None]
    context = types.SimpleNamespace(
        max_requests=max_requests, max_mamba_intermediate_states_per_step=3 * max_requests,
        prefix_caching_eviction_policy=eviction_policy(policy), kv_block_allocator=kv,
        block_size_tokens=BLOCK, mamba_chunk_size=mamba_chunk_size, request_to_kv_block_ids=table,
        paused_request_count=0,
        # read by Megatron-LM main's allocator from d98e8a64 on: a Mamba-only model's values (no
        # Gated Delta Product layers; chunk boundaries on the Mamba chunk grid)
        gdp_num_householder=0, ssm_chunk_alignment=mamba_chunk_size,
        batch_dimensions=types.SimpleNamespace(prefill_req_count=0, decode_req_count=0),
        mamba_conv_states=torch.zeros(1, max_requests, 2), mamba_ssm_states=torch.zeros(1, max_requests, 2))
    module = mcore.import_module(mcore.MAMBA_SLOT_ALLOCATOR_MODULE)
    with mock.patch.object(torch.cuda, "current_device", return_value="cpu"):
        return module.MambaSlotAllocator(
            context=context, max_slots=max_slots, num_mamba_layers=1, conv_states_shape=(2,),
            ssm_states_shape=(2,), conv_states_dtype=torch.float32, ssm_states_dtype=torch.float32)


def rows(allocator) -> dict[str, torch.Tensor]:
    """The per-request snapshot rows: CPU bookkeeping from 0.18 (``*_cpu``), 0.17's ``*_gpu``."""
    suffix = "_cpu" if hasattr(allocator, "_intermediate_block_ids_cpu") else "_gpu"
    return {name: getattr(allocator, f"_{name}{suffix}")
            for name in ("intermediate_offsets", "intermediate_block_ids", "intermediate_counts",
                         "eos_cache_block_id")}


def row(allocator, request: int = 0) -> tuple[list[int], list[int], int, int]:
    """Request row ``request``: (offsets, block IDs, count, end-of-prompt block ID)."""
    r = rows(allocator)
    return (r["intermediate_offsets"][request].tolist(), r["intermediate_block_ids"][request].tolist(),
            int(r["intermediate_counts"][request]), int(r["eos_cache_block_id"][request]))


def request(prompt_len: int):
    """What ``compute_and_store_offsets`` reads of a request, on its first prefill chunk."""
    return types.SimpleNamespace(prompt_tokens=list(range(prompt_len)), finished_chunk_token_count=0)


def stage_commit(allocator, intermediate_bids: list[int], eos_bid: int = -1) -> None:
    """One prefill request (row 0) that produced snapshots at ``intermediate_bids`` (the Mamba
    kernels wrote them to ``intermediate_*_out[:, 0..n-1]``) and, unless -1, its end-of-prompt
    state (its live state, ``mamba_*_states[:, 0]``) for block ``eos_bid``; every block's hash is
    ``100 + block``. Output buffer i holds the value i + 1, the live state 9.0."""
    context, r, n = allocator.context, rows(allocator), len(intermediate_bids)
    context.batch_dimensions.prefill_req_count = 1
    context.mamba_metadata = types.SimpleNamespace(
        intermediate_count=n, per_request_intermediate_counts=[n],
        request_to_mamba_state_idx=torch.tensor([0, 1], dtype=torch.int32))
    r["intermediate_block_ids"][0, :n] = torch.tensor(intermediate_bids, dtype=torch.int32)
    r["intermediate_counts"][0] = n
    r["eos_cache_block_id"][0] = eos_bid
    allocator._has_intermediates = True
    kv = context.kv_block_allocator
    kv.block_hashes.copy_(100 + torch.arange(kv.block_hashes.numel()))
    for i in range(allocator.intermediate_ssm_out.shape[1]):
        allocator.intermediate_ssm_out[:, i] = i + 1.0
        allocator.intermediate_conv_out[:, i] = i + 1.0
    context.mamba_ssm_states[:, 0] = 9.0
    context.mamba_conv_states[:, 0] = 9.0
