"""Two rounds of the ``hybrid_tiny`` case with a weight update between them, on the CPU backend:
run from the repository root as ``python scripts/probes/mamba_decode_a_cache.py MODE PATH ...``
under ``TRITON_INTERPRET=1 MAMBA_DETERMINISTIC=1``; prints one line ``PROBE {json}``.

MODE ``patched``: megatron-ext's runtime patches as ``apply()`` decides; ``unpatched``: none.
Round 1 runs the case's two requests (greedy, 6 and 4 tokens, prefix caching off) on an engine
over the model; then the weights are updated by PATH:

* ``add``: every parameter ``.data.add_(0.02 * noise)``, ``A_log`` ``+0.5``, inside
  ``engine.suspend()`` / ``resume()``;
* ``load_state_dict``: the same new weights through ``model.load_state_dict`` inside
  ``suspend()`` / ``resume()``;
* ``new_engine``: the same new weights written in place with ``.data.copy_``, then a new engine
  (and context) on the same model;
* ``a_log``: only ``A_log.data.add_(0.5)``, inside ``suspend()`` / ``resume()``.

Round 2 runs the same requests again (new IDs) and is compared with a fresh model holding the
updated weights on a fresh engine. Per path: ``same`` (tokens and log-probs bit for bit),
``decode_logprobs_differ`` (positions after the first token whose log-prob bits differ) and
``max_abs_dlogprob``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

CASE = str(Path(__file__).resolve().parents[2] / "functional_tests" / "cases" / "hybrid_tiny.yaml")
NOISE, A_LOG_SHIFT = 0.02, 0.5


def _no_cuda_memory_stats(*_args, **_kwargs) -> dict[str, int]:
    # suspend()/resume() log CUDA memory statistics; the CPU stand-ins have none
    return {"allocated_bytes.all.current": 0, "reserved_bytes.all.current": 0}


def new_weights(model: Any, a_log_only: bool) -> dict[str, Any]:
    """name -> the updated value of each parameter (seeded noise; ``A_log`` shifted by 0.5)."""
    import torch

    generator = torch.Generator().manual_seed(11)
    updated = {}
    for name, p in model.named_parameters():
        is_a_log = name.endswith("A_log")
        if a_log_only and not is_a_log:
            continue
        noise = NOISE * torch.randn(p.shape, generator=generator).to(p.dtype)
        updated[name] = p.detach().clone() + (A_LOG_SHIFT if is_a_log else (0 if a_log_only else noise))
    return updated


def run(engine: Any, context: Any, case: Any, planned: list, offset: int) -> dict[int, Any]:
    from megatron_ext.harness.step_loop import RunRecord, drive

    record = RunRecord(False, None)
    drive(engine, context, case, [p.model_copy(update={"request_id": p.request_id + offset}) for p in planned], record)
    if record.error:
        raise RuntimeError(record.error)
    return {rid - offset: (out.tokens, out.log_probs) for rid, out in record.outputs.items()}


def scenario(path: str) -> dict[str, Any]:
    import torch

    from megatron_ext.harness.cases import load_case, plan_requests
    from megatron_ext.harness.engine import build_engine, build_model
    from megatron_ext.harness.tokenizer import default_tokenizer

    case = load_case(CASE)
    planned = plan_requests(case, default_tokenizer())
    model = build_model(case)
    engine, context = build_engine(model, case, False, "ref_zero")
    run(engine, context, case, planned, 0)
    updated = new_weights(model, a_log_only=path == "a_log")
    params = dict(model.named_parameters())
    if path == "new_engine":
        for name, value in updated.items():
            params[name].data.copy_(value)
        engine, context = build_engine(model, case, False, "ref_zero")
    else:
        engine.suspend()
        if path == "load_state_dict":
            model.load_state_dict({**model.state_dict(), **updated})
        else:  # add / a_log: through .data, as a refit does (no version bump)
            for name, value in updated.items():
                params[name].data.add_(value - params[name].data)
        engine.resume()
    second = run(engine, context, case, planned, 1000)
    fresh = build_model(case)
    fresh_params = dict(fresh.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            fresh_params[name].copy_(p)
    fresh_engine, fresh_context = build_engine(fresh, case, False, "ref_zero")
    expected = run(fresh_engine, fresh_context, case, planned, 2000)
    bits = lambda xs: [torch.tensor(x, dtype=torch.float64).view(torch.int64).item() for x in xs]  # noqa: E731
    differ = {rid: [i for i, (a, b) in enumerate(zip(bits(second[rid][1]), bits(expected[rid][1]))) if a != b]
              for rid in expected}
    return {
        "same": second == expected,
        "tokens_same": {rid: second[rid][0] == expected[rid][0] for rid in expected},
        "decode_logprobs_differ": {rid: [i for i in positions if i > 0] for rid, positions in differ.items()},
        "max_abs_dlogprob": max(abs(a - b) for rid in expected for a, b in zip(second[rid][1], expected[rid][1])),
        "generated": {rid: len(expected[rid][0]) for rid in expected},
    }


def main(mode: str, paths: list[str]) -> dict[str, Any]:
    import torch

    import megatron_ext
    import megatron_ext.cpu_backend  # noqa: F401  before apply(): how the Mamba mixer is imported
    from megatron_ext.harness.ab import backend
    from megatron_ext.harness.engine import ensure_model_parallel

    with backend("cpu", mamba=True):
        torch.cuda.memory_stats = _no_cuda_memory_stats
        ensure_model_parallel(1, 1)
        results = megatron_ext.apply() if mode == "patched" else []
        state = {r.patch: r.state.value for r in results}.get("mamba-decode-a-cache", "not applied")
        try:
            out = {"patch": state, **{path: scenario(path) for path in paths}}
        finally:
            megatron_ext.revert()
    return out


if __name__ == "__main__":
    print("PROBE " + json.dumps(main(sys.argv[1], sys.argv[2:])))
