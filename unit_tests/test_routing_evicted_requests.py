"""Fault R3: a request the engine evicts (KV pool full) and re-adds keeps the routing of every token.

A 2-layer MoE GPT (4 experts, top-2, routing replay on, greedy sampling) on megatron-core's real
engine (CPU backend), REF_ZERO, 6 requests of 20-token prompts arriving together, each generating
up to 44 tokens (64 tokens, 4 blocks of 16, at the end). With a pool of 8 usable blocks they
cannot all grow: the engine evicts requests 2 and 4 and re-adds them later (prompt: the original
prompt and what they had generated), so their records hold two requests. Every request's merged
``routing_indices`` has ``prompt + generated - 1`` rows (63; 44 and 21 for requests 0 and 1,
which reach the end-of-document token early), equal to the same request's with a pool of 64
blocks, where nothing is evicted. Released (``MEGATRON_EXT_TEST_UNPATCHED=1``), prefix caching on or
off, 0.18 and 0.19 return None for each evicted request, and 0.17, which builds routing step by
step, 95 rows (the 32 rows of the tokens before the eviction, then the re-added request's 63).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

pytest.importorskip("megatron.core")

from megatron_ext.harness.cases import parse_case  # noqa: E402
from unit_tests.moe_engine import run_requests  # noqa: E402
from megatron_ext.harness.step_loop import merged_record  # noqa: E402

PROMPTS = {i: list(range(40 + 30 * i, 60 + 30 * i)) for i in range(6)}  # 20 tokens each, no prefix shared
GENERATE = 44
#: fp32 KV of 2 layers x 32 channels x K,V x 16 tokens = 8 KiB a block; megatron-core adds one dummy block.
BLOCK_BYTES = 2 * 32 * 2 * 16 * 4
SMALL_POOL_BLOCKS = 8
#: the requests the small pool evicts (and the engine re-adds)
EVICTED = {2, 4}
#: ``prompt + generated - 1`` per request (requests 0 and 1 reach the end-of-document token early)
ROWS = {0: 44, 1: 21, 2: 63, 3: 63, 4: 63, 5: 63}
CASE_TEXT = """
name: routing-evicted-requests
model: {{num_layers: 2, hidden_size: 32, num_attention_heads: 2, params_dtype: fp32, seed: 1234,
        init_method_std: 0.1, num_experts: 4, moe_router_topk: 2, moe_ffn_hidden_size: 64,
        moe_enable_routing_replay: true}}
inference: {{block_size_tokens: 16, buffer_size_gb: {gb}, max_requests: 8, max_tokens: 64,
            max_sequence_length: 256, enable_chunked_prefill: true}}
requests: [{{prompt: unused}}]
"""


def _routing(usable_blocks: int, prefix_caching: bool) -> tuple[dict[int, list | None], set[int]]:
    """Each request's merged ``routing_indices`` (``[tokens - 1][layers][topk]`` ints, or None) and
    the IDs of the requests the engine evicted (records of more than one request)."""
    case = parse_case(CASE_TEXT.format(gb=(usable_blocks + 1) * BLOCK_BYTES / 1024**3))
    records, _ = run_requests(case, {i: (prompt, 0) for i, prompt in PROMPTS.items()}, prefix_caching, GENERATE,
                              max_steps=400)
    routing = {}
    for i, record in records.items():
        merged = merged_record(record).routing_indices
        routing[i] = None if merged is None else merged.tolist()
    return routing, {i for i, r in records.items() if len(r.requests) > 1}


@pytest.mark.usefixtures("runtime_patches")
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["caching-off", "caching-on"])
def test_evicted_requests_return_the_routing_of_every_token(prefix_caching):
    evicted_run, evicted = _routing(SMALL_POOL_BLOCKS, prefix_caching)
    roomy_run, none_evicted = _routing(64, prefix_caching)
    assert none_evicted == set()
    assert evicted == EVICTED
    assert {i: None if r is None else len(r) for i, r in evicted_run.items()} == ROWS
    assert evicted_run == roomy_run
