"""Mamba conv / SSM states after a short prefill slice, against a reference that computed the
whole prompt at once: run from the repository root as ``python scripts/probes/hybrid_state.py
[patched|unpatched]`` under ``TRITON_INTERPRET=1 MAMBA_DETERMINISTIC=1`` (megatron's Mamba kernels
under Triton's interpreter, which reads them at import); prints one line ``PROBE {json}``.

Model: ``functional_tests/cases/hybrid_mid_restore.yaml`` (``M*M``, d_conv 4, Mamba chunk 16,
block 16, fp32 states). Each probe is one request's live state right after the engine step that
ends its prompt, compared bit for bit (per state tensor: equal, and the conv columns that differ
in any layer) with the same prompt prefilled in one step with caching off:

* ``restore``: caching on; r0 (48 tokens) prefills and snapshots its Mamba state at token 32;
  r1 (r0's first 34 tokens) restores that snapshot, skips 32 tokens and computes 2.
* ``chunked``: caching off, chunked prefill with ``max_tokens`` 64: a 66-token prompt is
  prefilled in a 64-token and a 2-token chunk.
* ``eos``: the Mamba snapshot a block-aligned prompt commits at its end from the live state
  (``store_from_live_batch``, after the forward pass), when its last prefill slice is 2 tokens:
  caching on, chunked prefill with a budget of :data:`EOS_BUDGET` tokens a step, a 32-token prompt
  (the slices: 15, 15, 2 on 0.17 / 0.18; 15, 1, 14, 2 on 0.19, which stops a chunk on a block
  boundary and keeps a final one at >= 2 tokens). Compared with the live state of the prompt
  prefilled in one step, caching off. 0.17 / 0.18 commit no such snapshot: they pick it when the
  first chunk is added, and the prompt's last block is not allocated yet.
  The patches are applied without ``mamba-aligned-chunks`` (fault H9), which would cut the prompt
  on the Mamba chunk grid (16) only, never 2 tokens before a block boundary; the model is ``M*``, so
  that the one Mamba layer's conv inputs do not depend on where the chunks were cut (its SSM state
  does, fault H9: not compared).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

CASE = Path(__file__).resolve().parents[2] / "functional_tests" / "cases" / "hybrid_mid_restore.yaml"


def live_states(context: Any, request_id: int) -> tuple[Any, Any]:
    """Copies of the request's live conv ``(layers, conv_dim, d_conv)`` and SSM
    ``(layers, heads, head_dim, d_state)`` states."""
    rows = context.request_ids[:context.total_request_count].tolist()
    index = int(context.mamba_metadata.request_to_mamba_state_idx[rows.index(request_id)])
    return context.mamba_conv_states[:, index].clone(), context.mamba_ssm_states[:, index].clone()


def compare(got: tuple[Any, Any], want: tuple[Any, Any]) -> dict[str, Any]:
    """Bit-equality of conv and SSM states, and the conv columns that differ (per layer)."""
    import torch

    conv_diff = (got[0] != want[0]).any(dim=1)  # (layers, d_conv)
    return {"conv_equal": bool(torch.equal(got[0], want[0])), "ssm_equal": bool(torch.equal(got[1], want[1])),
            "conv_columns_differing": [row.nonzero().flatten().tolist() for row in conv_diff]}


#: The ``eos`` probe's token budget per step: what other requests leave of a busy step (emulated:
#: ``context.max_tokens`` is this while the engine schedules; megatron-core pads the step's tokens
#: to a multiple of 64, so a context cannot be built that small).
EOS_BUDGET = 15


def eos_snapshot(case: Any, prompt: list[int], params: Any) -> dict[str, Any]:
    """The ``eos`` probe (module docstring): the prefill slices, and the committed end-of-prompt
    snapshot compared with the reference live state."""
    from megatron_ext.harness.engine import build_engine, build_model

    eos_case = case.model_copy(update={
        "model": case.model.model_copy(update={"hybrid_layer_pattern": "M*", "num_layers": 2}),
        "inference": case.inference.model_copy(update={"enable_chunked_prefill": True})})
    model = build_model(eos_case)
    engine, context = build_engine(model, eos_case, True, "ref_zero")
    slices: list[int] = []
    released_add, released_schedule = context.add_request, engine.schedule_chunked_prefill

    def add_request(req: Any, prefill_chunk_length: Any = None) -> None:
        slices.append(len(req.remaining_prompt_tokens) if prefill_chunk_length is None else prefill_chunk_length)
        released_add(req, prefill_chunk_length)

    def schedule_chunked_prefill() -> None:
        saved, context.max_tokens = context.max_tokens, EOS_BUDGET
        try:
            released_schedule()
        finally:
            context.max_tokens = saved

    context.add_request, engine.schedule_chunked_prefill = add_request, schedule_chunked_prefill
    engine.add_request(9, prompt, params)
    while sum(slices) < len(prompt):
        engine.step_modern()
    rows = context.request_ids[:context.total_request_count].tolist()
    last_block = int(context.request_to_kv_block_ids[rows.index(9)][len(prompt) // context.block_size_tokens - 1])
    slots = context.mamba_slot_allocator
    slot = slots.get_slot(last_block)
    if slot < 0:  # 0.17 / 0.18 decide on the end-of-prompt snapshot when the first chunk is added
        return {"slices": slices, "committed": False}
    committed = (slots.conv_states[:, slot].clone(), slots.ssm_states[:, slot].clone())
    reference_engine, reference_context = build_engine(model, eos_case, False, "ref_zero")
    reference_engine.add_request(9, prompt, params)
    reference_engine.step_modern()
    return {"slices": slices, "committed": True, **compare(committed, live_states(reference_context, 9))}


def main(patched: bool) -> dict[str, Any]:
    from megatron_ext.api import apply, revert
    from megatron_ext.harness.ab import backend
    from megatron_ext.harness.cases import load_case, plan_requests
    from megatron_ext.harness.engine import build_engine, build_model, ensure_model_parallel
    from megatron_ext.harness.factories import recorded_restores
    from megatron_ext.harness.step_loop import sampling_params
    from megatron_ext.harness.tokenizer import default_tokenizer

    case = load_case(CASE)
    planned = plan_requests(case, default_tokenizer())
    prompt = list(planned[0].prompt_tokens)  # 48 tokens
    params = sampling_params(case, planned[0])
    chunked_case = case.model_copy(update={"inference": case.inference.model_copy(
        update={"max_tokens": 64, "enable_chunked_prefill": True})})
    patches = apply() if patched else revert()
    with backend("cpu", mamba=True):
        ensure_model_parallel()
        model = build_model(case)

        def prefilled(prompt_tokens: list[int], steps: int = 1, probe_case: Any = case) -> tuple[Any, Any]:
            engine, context = build_engine(model, probe_case, False, "ref_zero")
            engine.add_request(9, prompt_tokens, params)
            for _ in range(steps):
                engine.step_modern()
            return live_states(context, 9)

        engine, context = build_engine(model, case, True, "ref_zero")
        with recorded_restores(context) as restores:
            engine.add_request(0, prompt, params)
            engine.step_modern()
            engine.add_request(1, prompt[:34], params)
            engine.step_modern()
        restored = live_states(context, 1)
        long_prompt = prompt + prompt[:18]
        probes = {"applied": [p.patch for p in patches if p.state.value == "applied"],
                  "restore": {**compare(restored, prefilled(prompt[:34])),
                              "restores": [[block, ok] for block, ok in restores]},
                  "chunked": compare(prefilled(long_prompt, 2, chunked_case), prefilled(long_prompt))}
        if patched:
            revert()
            os.environ["MEGATRON_EXT_SKIP"] = ",".join(filter(None, [os.environ.get("MEGATRON_EXT_SKIP"),
                                                                    "mamba-aligned-chunks"]))
            apply()
        return {**probes, "eos": eos_snapshot(case, prompt[:32], params)}


if __name__ == "__main__":
    print("PROBE " + json.dumps(main(sys.argv[1:] != ["unpatched"])))
