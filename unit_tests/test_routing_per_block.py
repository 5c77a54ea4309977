"""Faults R1 and R2: every MoE request's ``routing_indices`` cover every token it has.

A 2-layer MoE GPT (4 experts, top-2, routing replay on, greedy sampling) on megatron-core's real
engine (CPU backend), chunked prefill of at most 64 tokens, REF_ZERO:

- request 0: an 80-token prompt (5 blocks of 16), prefilled in 2 chunks;
- request 1: the same prompt while 0 decodes: 5 blocks matched, 79 tokens skipped;
- request 2: the prompt's first 32 tokens and 100 others: 2 blocks matched, the rest in 2
  chunks (the second chunk starts past position 0 but is not a skipped prefix).

Every request's ``routing_indices`` has ``prompt + generated - 1`` rows, and they are the ones
the same request gets with prefix caching off (so request 1's equal request 0's, and request 2's
first 32 equal request 0's). Released code (``MEGATRON_EXT_TEST_UNPATCHED=1``) fails both ways:
0.17 (R1) returns 21 rows for request 1 and 103 for request 2 with caching on (their matched
prefixes left out); 0.18 and 0.19 (R2) return None for request 0 with caching off (it finishes
in the step its last block, freed, is allocated to another request, and the allocation drops the
block's routing).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

pytest.importorskip("megatron.core")

from megatron_ext.harness.cases import parse_case  # noqa: E402
from unit_tests.moe_engine import run_requests  # noqa: E402
from megatron_ext.harness.step_loop import merged_record  # noqa: E402

PROMPT = list(range(32, 112))  # 80 tokens, 5 blocks
OTHER = PROMPT[:32] + list(range(120, 220))  # 132 tokens: 2 blocks shared
GENERATE = 4
CASE = parse_case("""
name: routing-per-block
model: {num_layers: 2, hidden_size: 32, num_attention_heads: 2, params_dtype: fp32, seed: 1234,
        init_method_std: 0.1, num_experts: 4, moe_router_topk: 2, moe_ffn_hidden_size: 64,
        moe_enable_routing_replay: true}
inference: {block_size_tokens: 16, buffer_size_gb: 0.004, max_requests: 8, max_tokens: 64,
            max_sequence_length: 256, enable_chunked_prefill: true}
requests: [{prompt: unused}]
""")
#: request ID -> (prompt, arrival step): 1 and 2 arrive while 0 decodes.
REQUESTS = {0: (PROMPT, 0), 1: (PROMPT, 3), 2: (OTHER, 4)}


def _routing(prefix_caching: bool) -> dict[int, list]:
    """Each request's ``routing_indices`` as nested ints, ``[tokens - 1][layers][topk]``."""
    records, matched = run_requests(CASE, REQUESTS, prefix_caching, GENERATE, max_steps=100)
    assert matched == (7 if prefix_caching else 0)  # 5 for request 1, 2 for request 2
    return {i: merged_record(r).routing_indices.tolist() for i, r in records.items()}


@pytest.mark.usefixtures("runtime_patches")
def test_prefix_cached_requests_return_the_routing_of_every_token():
    cached, uncached = _routing(True), _routing(False)
    assert {i: len(r) for i, r in cached.items()} == {0: 83, 1: 83, 2: 135}
    assert cached == uncached
    assert cached[1] == cached[0]
    assert cached[2][:32] == cached[0][:32]
    assert cached[2][32:] != cached[0][32:83]  # other tokens, other experts somewhere
