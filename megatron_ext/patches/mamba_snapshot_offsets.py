"""Fault H4 (issue 22): 0.17 / 0.18 pick Mamba snapshot offsets on a hard-coded 128-token chunk grid.

``MambaSlotAllocator.compute_and_store_offsets`` chooses, when a hybrid request is added, the
prompt positions whose Mamba state is snapshotted during its prefill (up to three candidate
block boundaries: the end of the KV match, the last complete block, the block before the last
one the request needs). A state can only be extracted at the end of a scan chunk, so it keeps a
candidate only if its offset from the prefill start is a multiple of the chunk size; in 0.17.0 to
0.18.2 that chunk size is a local ``mamba_chunk_size = 128``, while ``MambaMetadata`` converts the
kept offsets to chunk indices (``offset // chunk - 1``) with the model's own chunk size. So:

- chunk below 128 (e.g. 16): boundaries that are chunk ends but not multiples of 128 are never
  snapshotted, so later requests sharing the prefix restore less (lost cache hits);
- chunk above 128 (e.g. 256): an offset of 128 is kept though no chunk ends there; the metadata maps
  it to the chunk index before the request's first chunk (the previous request's last chunk, or
  index -1), so the block at token 128 gets another state: a later request restoring it runs from a
  wrong Mamba state, and its output differs from caching off.

Megatron-LM #5863 (2026-07-22, released in 0.19.0) reads the chunk size from the context
(``mamba_chunk_size = ctx.mamba_chunk_size``). A wrapper cannot change a local, so this patch runs
the released function, then, where the context's chunk size is not 128, redoes only its offset
filter for that request with the context's chunk size and rewrites the request's rows of the
intermediate offsets, block IDs and counts (``_intermediate_*_cpu`` from 0.18, ``*_gpu`` in 0.17).
The block-aligned end-of-prompt snapshot (``_eos_cache_block_id_*``) takes no chunk filter and is
left as the released code set it. On 0.17 the metadata uses the model's chunk size only with fault
H3 fixed (``mamba-chunk-size``); both patches read ``context.mamba_chunk_size``.
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable

import torch

from ..mcore import MAMBA_SLOT_ALLOCATOR_MODULE
from ..patching import Patch, Target

OFFSETS = Target(MAMBA_SLOT_ALLOCATOR_MODULE, "MambaSlotAllocator.compute_and_store_offsets")

#: The chunk size the released filter hard-codes (tokens).
RELEASED_CHUNK = 128


def snapshot_offsets(prompt_len: int, skip_tokens: int, prefill_chunk_length: int,
                     num_matched_blocks: int, overall_required_blocks: int, block_size: int,
                     mamba_chunk_size: int) -> list[int]:
    """The snapshot offsets #5863 keeps for a request's first prefill chunk, ascending.

    Offsets are token counts from the prefill start (after the ``skip_tokens`` restored from the
    prefix cache); a candidate block boundary is kept if it lies strictly inside the computed
    tokens (``0 < offset < prefill_chunk_length - skip_tokens``) and on the Mamba chunk grid
    (``offset % mamba_chunk_size == 0``). All arguments are token counts, except the two block
    counts. At most three offsets.
    """
    seq_len = prefill_chunk_length - skip_tokens
    boundaries = (num_matched_blocks * block_size, (prompt_len // block_size) * block_size,
                  (overall_required_blocks - 1) * block_size)
    offsets = {b - skip_tokens for b in boundaries}
    return sorted(o for o in offsets if 0 < o < seq_len and o % mamba_chunk_size == 0)


def _rows(allocator: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The allocator's per-request offsets ``[max_requests, 3]``, block IDs ``[max_requests, 3]``
    and counts ``[max_requests]`` (int32): CPU bookkeeping from 0.18, device tensors in 0.17."""
    suffix = "_cpu" if hasattr(allocator, "_intermediate_block_ids_cpu") else "_gpu"
    return (getattr(allocator, "_intermediate_offsets" + suffix),
            getattr(allocator, "_intermediate_block_ids" + suffix),
            getattr(allocator, "_intermediate_counts" + suffix))


def _arguments(req, current_id, skip_tokens, prefill_chunk_length, num_matched_blocks,
               matched_block_ids, overall_required_blocks) -> dict[str, Any]:
    """``compute_and_store_offsets``'s arguments by name, however the caller passed them."""
    return locals()


def store_offsets(allocator: Any, current_id: int, skip_tokens: int, offsets: list[int]) -> None:
    """Write request row ``current_id``: ``offsets`` (tokens after the ``skip_tokens`` restored;
    padded with 0), the KV block ID ending at each offset (from the request's block table
    ``context.request_to_kv_block_ids[current_id]``; padded with -1) and the count. The rows are
    int32, ``[max_requests, 3]`` and ``[max_requests]``, on the allocator's bookkeeping device."""
    offset_rows, block_rows, counts = _rows(allocator)
    context = allocator.context
    offset_rows[current_id] = 0
    block_rows[current_id] = -1
    if offsets:
        table = context.request_to_kv_block_ids[current_id]
        index = torch.tensor([(skip_tokens + o) // context.block_size_tokens - 1 for o in offsets],
                             dtype=torch.int64, device=table.device)
        count = len(offsets)
        offset_rows[current_id, :count] = torch.tensor(offsets, dtype=torch.int32, device=offset_rows.device)
        block_rows[current_id, :count] = table[index].to(device=block_rows.device, dtype=torch.int32)
        allocator._has_intermediates = True  # the released flag that makes commit read the rows
    counts[current_id] = len(offsets)


def _offsets_wrapper(wrapped: Callable, allocator: Any, args: tuple, kwargs: dict) -> None:
    """Run the released ``compute_and_store_offsets``, then refilter with the context's chunk size."""
    result = wrapped(*args, **kwargs)
    chunk = allocator.context.mamba_chunk_size
    if chunk == RELEASED_CHUNK:  # the released filter was right
        return result
    a = _arguments(*args, **kwargs)
    offsets = snapshot_offsets(len(a["req"].prompt_tokens), a["skip_tokens"], a["prefill_chunk_length"],
                               a["num_matched_blocks"], a["overall_required_blocks"],
                               allocator.context.block_size_tokens, chunk)
    store_offsets(allocator, a["current_id"], a["skip_tokens"], offsets)
    return result


def _probe_allocator() -> Any:
    """A MambaSlotAllocator with only what ``compute_and_store_offsets`` reads (no ``__init__``:
    that needs a GPU): one request, block and Mamba chunk 16, block table [10, 11, 12]."""
    owner = OFFSETS.owner()
    allocator = object.__new__(owner)
    allocator.context = types.SimpleNamespace(
        block_size_tokens=16, mamba_chunk_size=16,
        ssm_chunk_alignment=16,  # Megatron-LM main from d98e8a64 on: the Mamba chunk for a Mamba-only model
        request_to_kv_block_ids=torch.tensor([[10, 11, 12, -1]], dtype=torch.int32))
    suffix = "_cpu" if "_intermediate_block_ids_cpu" in inspect.getsource(owner.__init__) else "_gpu"
    for name, shape, fill in (("_intermediate_offsets", (1, 3), 0), ("_intermediate_block_ids", (1, 3), -1),
                              ("_intermediate_counts", (1,), 0), ("_eos_cache_block_id", (1,), -1)):
        setattr(allocator, name + suffix, torch.full(shape, fill, dtype=torch.int32))
    allocator._has_intermediates = False
    return allocator


def filters_on_chunk_128(compute: Callable) -> tuple[bool, str]:
    """Whether ``compute_and_store_offsets`` drops a snapshot on the model's chunk grid.

    Runs it on a stand-in allocator (CPU tensors): a fresh 40-token prompt, block size and Mamba
    chunk 16, nothing matched; token 32 (the last complete block) must be kept. Returns
    ``(has_fault, evidence)``.
    """
    allocator = _probe_allocator()
    request = types.SimpleNamespace(prompt_tokens=list(range(40)), finished_chunk_token_count=0)
    compute(allocator, request, 0, 0, 40, 0, [], 3)
    offsets, blocks, counts = _rows(allocator)
    found = offsets[0, :int(counts[0])].tolist()
    if found == [32]:
        return False, ("compute_and_store_offsets keeps the snapshot at token 32 of a 40-token prompt "
                       "with Mamba chunk 16 (the context's chunk size, Megatron-LM #5863)")
    return True, (f"compute_and_store_offsets keeps offsets {found} of a 40-token prompt with Mamba "
                  "chunk 16, not [32]: its filter uses a 128-token chunk")


class MambaSnapshotOffsetsPatch(Patch):
    """Filters Mamba snapshot offsets on the model's chunk grid (see module docstring)."""

    name = "mamba-snapshot-offsets"
    fault = "H4"

    def wrappers(self) -> dict[Target, Callable]:
        return {OFFSETS: _offsets_wrapper}

    def needed(self) -> tuple[bool, str]:
        return filters_on_chunk_128(OFFSETS.original())
