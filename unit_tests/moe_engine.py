"""Drive megatron-core's real engine (CPU backend, greedy) over a case's model until every request
finishes: the shared loop of the MoE routing tests."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext import mcore
from megatron_ext.harness import engine as harness_engine
from megatron_ext.harness.ab import backend


def run_requests(case: Any, arrivals: dict[int, tuple[list[int], int]], prefix_caching: bool,
                 generate: int, max_steps: int) -> tuple[dict[int, Any], int]:
    """Add each request ``id -> (prompt token IDs, arrival step)`` at its step, step the engine
    until all finish (REF_ZERO), and return each request's ``DynamicInferenceRequestRecord`` and
    the blocks the engine counted as matched.

    Raises:
        AssertionError: the batch-invariant CPU backend is off, or ``max_steps`` steps passed.
    """
    sampling = mcore.import_module("megatron.core.inference.sampling_params").SamplingParams(
        top_k=1, num_tokens_to_generate=generate)
    records, step = {}, 0
    with backend("cpu") as (invariant, detail), torch.inference_mode():
        assert invariant, detail
        harness_engine.ensure_model_parallel()
        engine, _ = harness_engine.build_engine(harness_engine.build_model(case), case, prefix_caching, "ref_zero")
        while len(records) < len(arrivals) or engine.requests:
            for request_id, (prompt, arrival) in arrivals.items():
                if arrival == step:
                    engine.add_request(request_id, prompt, sampling)
                    records[request_id] = engine.requests[request_id].record
            if engine.requests:
                engine.step_modern()
            step += 1
            assert step < max_steps, "the engine made no progress"
        # the engine sums the context's per-step count here (and resets the context's)
        return records, engine._prefix_cache_blocks_matched
