"""Small megatron-core objects for tests and benchmarks (not used by ``ab`` / ``soak`` themselves).

A ``DynamicInferenceContext`` sized for ``add_request``-level work and the requests to add to
it, built from megatron-core's own classes like :mod:`megatron_ext.harness.engine` builds a
whole engine; :func:`recorded_restores` records the Mamba state restores of a hybrid context
(unit tests, ``scripts/probes/hybrid_state.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .. import mcore
from .engine import ensure_model_parallel


def small_prefix_caching_context(
    policy: str,
    *,
    block_size_tokens: int = 16,
    buffer_size_gb: float,
    max_requests: int,
    max_tokens: int,
    max_sequence_length: int,
    prefix_caching: bool = True,
    num_speculative_tokens: int = 0,
) -> Any:
    """A ``DynamicInferenceContext`` for add_request-level work (tests, benchmarks): 2 layers,
    4 heads of 16 channels, fp32 KV cache, prefix caching (unless ``prefix_caching=False``) and
    chunked prefill on; ``num_speculative_tokens`` draft tokens per decode step (0: none).

    ``policy`` is ``"REF_ZERO"`` or ``"LRU"``; ``buffer_size_gb`` is the KV buffer in GiB.
    On a CPU machine call it inside ``megatron_ext.cpu_backend.cuda_on_cpu()``.
    """
    config = mcore.import_module("megatron.core.inference.config")
    transformer = mcore.import_module("megatron.core.transformer.transformer_config")
    dynamic_context = mcore.import_module(mcore.DYNAMIC_CONTEXT_MODULE)
    ensure_model_parallel()
    model_config = transformer.TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16,
        params_dtype=torch.float32,
    )
    inference = config.InferenceConfig(
        block_size_tokens=block_size_tokens, buffer_size_gb=buffer_size_gb,
        max_requests=max_requests, max_tokens=max_tokens, max_sequence_length=max_sequence_length,
        enable_prefix_caching=prefix_caching, enable_chunked_prefill=True,
        prefix_caching_eviction_policy=getattr(config.PrefixCachingEvictionPolicy, policy),
        **({"num_speculative_tokens": num_speculative_tokens} if num_speculative_tokens else {}),
    )
    return dynamic_context.DynamicInferenceContext(model_config, inference)


def prefix_caching_request(request_id: int, tokens: list[int], block_size_tokens: int = 16) -> Any:
    """A ``DynamicInferenceRequest`` (int64 prompt tokens, 4 tokens to generate) whose block
    hashes are computed for ``block_size_tokens``-token blocks."""
    inference_request = mcore.import_module("megatron.core.inference.inference_request")
    sampling = mcore.import_module("megatron.core.inference.sampling_params")
    return inference_request.DynamicInferenceRequest(
        request_id=request_id,
        prompt_tokens=torch.tensor(tokens, dtype=torch.int64),
        sampling_params=sampling.SamplingParams(num_tokens_to_generate=4),
        block_size_tokens=block_size_tokens,
        enable_prefix_caching=True,
    )


@contextlib.contextmanager
def recorded_restores(context: Any) -> Iterator[list[tuple[int, bool]]]:
    """Record ``(block_id, restored)`` for every ``restore_to_live`` of the context's Mamba slot
    allocator (an instance attribute, removed afterwards)."""
    slots = context.mamba_slot_allocator
    released = slots.restore_to_live
    seen: list[tuple[int, bool]] = []

    def restore_to_live(request_idx: int, block_id: int) -> bool:
        restored = released(request_idx, block_id)
        seen.append((int(block_id), bool(restored)))
        return restored

    slots.restore_to_live = restore_to_live
    try:
        yield seen
    finally:
        del slots.restore_to_live
