"""Three rounds of a shipped case on one engine, ``engine.suspend()`` / ``resume()`` after the first.

Run as ``python -m functional_tests.suspend_resume_rounds MODE`` (MODE ``apply``: megatron-ext's
runtime patches as ``apply()`` decides; ``revert``: none). Prints one JSON line: the fault-8
patch's state and, per eviction policy, the blocks matched in each round (counted at
``add_request`` by the harness audit: the engine resets megatron-core's own counters). Resume
after suspend is a weight update: round 2 must match no block cached in round 1, so it matches
exactly what round 1 matched within itself; round 3 matches round 2's cached blocks (LRU).
No weights change here: the counts, not the outputs, show what was served from the cache.
"""

from __future__ import annotations

import json
import sys

import megatron_ext
from megatron_ext.harness.ab import backend
from megatron_ext.harness.cases import load_case, plan_requests
from megatron_ext.harness.engine import build_engine, build_model, ensure_model_parallel
from megatron_ext.harness.step_loop import RunRecord, drive
from megatron_ext.harness.tokenizer import default_tokenizer

CASE = "shared_system_prompt"  # a 10-block system prompt shared by five questions
ROUNDS = 3


def _no_cuda_memory_stats(*_args, **_kwargs) -> dict[str, int]:
    # suspend()/resume() log CUDA memory statistics; the CPU stand-ins have none
    return {"allocated_bytes.all.current": 0, "reserved_bytes.all.current": 0}


def main(mode: str) -> None:
    import torch

    megatron_ext.apply() if mode == "apply" else megatron_ext.revert()
    state = {r.patch: r.state.value for r in megatron_ext.status()}["weight-update-invalidation"]
    case = load_case(CASE)
    planned = plan_requests(case, default_tokenizer())
    matched: dict[str, list[int]] = {}
    for policy in case.prefix_caching_eviction_policies:
        with backend("cpu"):
            torch.cuda.memory_stats = _no_cuda_memory_stats
            ensure_model_parallel(1, 1)
            engine, context = build_engine(build_model(case), case, True, policy)
            matched[policy] = []
            for round_index in range(ROUNDS):
                record = RunRecord(True, policy)
                requests = [p.model_copy(update={"request_id": p.request_id + 1000 * round_index})
                            for p in planned]
                drive(engine, context, case, requests, record)
                if record.error:
                    raise RuntimeError(f"{policy} round {round_index + 1}: {record.error}")
                matched[policy].append(record.counters.blocks_matched)
                if round_index == 0:
                    engine.suspend()
                    engine.resume()
    print(json.dumps({"weight_update_patch": state, "blocks_matched": matched}))


if __name__ == "__main__":
    main(sys.argv[1])
