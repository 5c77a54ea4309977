"""A real hybrid (Mamba + attention) ``DynamicInferenceContext`` on the CPU, for add_request-level
tests of the Mamba prefix cache: the context, hand-made Mamba snapshots, and the restores.

No model is built: the context only needs the Mamba state shapes (``MambaInferenceStateConfig``).
Mamba snapshots are made the way the engine's ``commit_intermediate_states`` leaves them after a
prefill (a slot per block, the block's hash registered), with a known value in every element, so
that a restore can be checked bit for bit.
"""

from __future__ import annotations

import collections
import contextlib
import types
from typing import Any, Iterator

import torch

from megatron_ext import mcore
from megatron_ext.cpu_backend import cuda_on_cpu
from megatron_ext.harness.engine import ensure_model_parallel

from .context_factory import BLOCK

MAMBA_CHUNK = 16  # the Mamba SSM chunk size: snapshots at block boundaries are exact


@contextlib.contextmanager
def hybrid_prefix_caching_context(policy: str = "REF_ZERO", max_tokens: int = 256,
                                  prefix_caching: bool = True) -> Iterator[Any]:
    """Yield a hybrid DynamicInferenceContext (layers ``M*``: one Mamba, one attention; fp32; block
    size 16, Mamba chunk 16) with prefix caching, a Mamba prefix cache and chunked prefill on
    (``prefix_caching=False``: chunked prefill only), inside the CPU stand-ins."""
    config = mcore.import_module("megatron.core.inference.config")
    transformer = mcore.import_module("megatron.core.transformer.transformer_config")
    dynamic_context = mcore.import_module(mcore.DYNAMIC_CONTEXT_MODULE)
    with cuda_on_cpu():
        ensure_model_parallel()
        model_config = transformer.TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16,
            params_dtype=torch.float32,
        )
        mamba = config.MambaInferenceStateConfig(
            layer_type_list=["M", "*"], conv_states_shape=(96, 3), ssm_states_shape=(4, 16, 8),
            conv_states_dtype=torch.float32, ssm_states_dtype=torch.float32,
            mamba_chunk_size=MAMBA_CHUNK,
        )
        inference = config.InferenceConfig(
            block_size_tokens=BLOCK, buffer_size_gb=0.01, max_requests=8, max_tokens=max_tokens,
            max_sequence_length=256, enable_prefix_caching=prefix_caching, enable_chunked_prefill=True,
            prefix_caching_eviction_policy=getattr(config.PrefixCachingEvictionPolicy, policy),
            mamba_inference_state_config=mamba, **({"prefix_caching_mamba_gb": 0.001} if prefix_caching else {}),
        )
        yield dynamic_context.DynamicInferenceContext(model_config, inference)


def snapshot_value(block_id: int) -> float:
    """The value every element of ``block_id``'s hand-made Mamba snapshot holds."""
    return float(block_id) + 0.5


def cache_mamba_state(context: Any, block_ids: list[int]) -> None:
    """Give each (registered, hashed) KV block a Mamba snapshot, as a prefill commit does: a cache
    slot, the block's hash in ``hash_to_block_id``, conv and SSM states all ``snapshot_value``."""
    slots = context.mamba_slot_allocator
    allocator = context.kv_block_allocator
    for block_id, slot in zip(block_ids, slots.allocate_slots_batch(block_ids)):
        slots.conv_states[:, slot] = snapshot_value(block_id)
        slots.ssm_states[:, slot] = snapshot_value(block_id)
    hashes = allocator.block_hashes[torch.tensor(block_ids, dtype=torch.int64)].tolist()
    slots.register_block_hashes_batch(block_ids, hashes)


def engine_mamba_match(context: Any, req: Any) -> None:
    """What 0.17's / 0.18's engine scheduler does before it admits a request to a hybrid context:
    ``req._mamba_num_matched_blocks = DynamicInferenceEngine._find_mamba_match_count(req)`` (the
    released engine function, over the whole prompt). 0.19's engine has no such step (#4758)."""
    engine_class = mcore.import_module(mcore.DYNAMIC_ENGINE_MODULE).DynamicInferenceEngine
    find = getattr(engine_class, "_find_mamba_match_count", None)
    if find is not None:
        req._mamba_num_matched_blocks = find(types.SimpleNamespace(context=context), req)


def run_pending_mamba_ops(context: Any) -> None:
    """The restores and zeroing ``add_request`` left for the next step (0.18+ defer them to
    ``initialize_attention_state``; 0.17 runs them inside ``add_request``)."""
    execute = getattr(context, "_execute_pending_mamba_ops", None)
    if execute is not None:
        execute()


def live_mamba_values(context: Any, row: int) -> set[float]:
    """The distinct values in the live conv and SSM states of the request in ``row``."""
    index = int(context.mamba_metadata.request_to_mamba_state_idx[row])
    conv = context.mamba_conv_states[:, index]
    ssm = context.mamba_ssm_states[:, index]
    return set(torch.cat([conv.flatten(), ssm.flatten()]).tolist())


def scheduled_chunks(context: Any, requests: list[Any]) -> list[tuple[int, int]]:
    """Run the engine's ``DynamicInferenceEngine.schedule_chunked_prefill`` (as installed: released
    or patched) once, with ``requests`` waiting in that order, on an engine stand-in around the real
    ``context`` (the scheduler's own helpers bound to it; no model, no event loop). Returns
    ``(request_id, prompt tokens admitted)`` per request admitted (a chunk, or the whole rest)."""
    engine_class = mcore.import_module(mcore.DYNAMIC_ENGINE_MODULE).DynamicInferenceEngine
    by_id = {req.request_id: req for req in requests}
    before = {req.request_id: len(req.remaining_prompt_tokens) for req in requests}
    engine = types.SimpleNamespace(
        context=context, waiting_request_ids=collections.deque(by_id), get_request=by_id.__getitem__,
        _loop=types.SimpleNamespace(call_soon_threadsafe=lambda *args: None, create_task=None),
        _notify_cond_for_new_request=lambda: None, _prefix_coordination_waits=0,
        _cg_admission_gating_active=lambda: False,
    )
    for helper in ("_can_schedule_chunked_prefill", "_find_mamba_match_count"):  # 0.19 / 0.17-0.18
        if hasattr(engine_class, helper):
            setattr(engine, helper, getattr(engine_class, helper).__get__(engine))
    engine_class.schedule_chunked_prefill(engine)
    return [(rid, before[rid] - len(by_id[rid].remaining_prompt_tokens)) for rid in by_id
            if len(by_id[rid].remaining_prompt_tokens) != before[rid]]
