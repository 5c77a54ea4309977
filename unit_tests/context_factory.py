"""A real megatron-core ``DynamicInferenceContext`` on the CPU, for add_request-level tests.

Uses the CPU backend's CUDA stand-ins and a one-rank gloo process group for megatron-core's
parallel state (the context asks it how many layers this pipeline stage holds).
"""

from __future__ import annotations

import contextlib

from megatron_ext.cpu_backend import cuda_on_cpu
from megatron_ext.harness.factories import prefix_caching_request, small_prefix_caching_context

BLOCK = 16  # tokens per KV block in every context built here


@contextlib.contextmanager
def prefix_caching_context(policy: str = "REF_ZERO", max_tokens: int = 256):
    """Yield a DynamicInferenceContext (2 layers, 4 heads of 16, fp32, block size 16) with prefix
    caching and chunked prefill on, inside the CPU stand-ins."""
    with cuda_on_cpu():
        yield small_prefix_caching_context(
            policy, block_size_tokens=BLOCK, buffer_size_gb=0.01, max_requests=8,
            max_tokens=max_tokens, max_sequence_length=256,
        )


def make_request(request_id: int, tokens: list[int]):
    """A DynamicInferenceRequest with block hashes computed for BLOCK-token blocks."""
    return prefix_caching_request(request_id, tokens, BLOCK)


def add_and_collect_writes(context, req, chunk: int | None = None) -> list[tuple[int, int]]:
    """Call ``add_request`` and return, for each token it added, (position in request, KV block written)."""
    first = context.active_token_count
    context.add_request(req, chunk)
    end = context.active_token_count
    positions = context.token_to_position_in_request[first:end].tolist()
    blocks = context.token_to_block_idx[first:end].tolist()
    return list(zip(positions, blocks))


def finish_chunk(context, req, chunk: int) -> None:
    """What the engine does between two prefill chunks of one request: the request keeps its row
    (and block table) for the next chunk, the step's tokens are consumed."""
    req.finished_chunk_token_count += chunk
    req.remaining_prompt_tokens = req.remaining_prompt_tokens[chunk:]
    context.total_request_count -= 1
    context.num_prefill_requests -= 1
    context.active_token_count = 0


def block_table(context, row: int, count: int) -> list[int]:
    return context.request_to_kv_block_ids[row][:count].tolist()
