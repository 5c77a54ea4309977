"""Where a hybrid soak's caching-on run first differs from caching off, tensor by tensor: run as
``python -m unit_tests.hybrid_soak_probe [REQUESTS [SEED]]`` under ``TRITON_INTERPRET=1
MAMBA_DETERMINISTIC=1`` (``soak --hybrid``'s workload, caching off and LRU; the patches as
``MEGATRON_EXT_SKIP`` leaves them). Prints per request:

* the prefill chunks of each run (step: first-last+1 prompt positions computed);
* the first activation that differs between the runs, in position then layer order (each layer's
  output, the Mamba mixers' and the attention's ``linear_qkv``), with max |Δ|;
* per 16-token block of the request: the block it read at its prefill, who wrote each slot (request,
  step, prefill or decode) and the max |Δ| of that K / V against the KV the caching-off run's same
  request read there.

Findings: ``docs/hybrid.md``, "Fault H9: prefill chunks cut off the Mamba chunk grid". A diagnostic, not a test: seconds of CPU per step.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

BLOCK = 16


class Recorder:
    """Forward hooks on the model: per engine step the batch, the KV writes, the KV of every block
    in a block table before and after the step, and each hooked module's output per token."""

    def __init__(self) -> None:
        self.runs: dict[str, list[dict]] = {}
        self.run = ""
        self.context: Any = None
        self.model: Any = None

    def keys(self) -> list[tuple[int, int]]:
        ctx = self.context
        count = int(ctx.active_token_count)
        rows = ctx.request_ids.tolist()
        return [(rows[r], p) for r, p in zip(ctx.token_to_request_idx[:count].tolist(),
                                             ctx.token_to_pos_ids[:count].tolist())]

    def output_hook(self, name: str):
        def hook(module, inputs, output):
            out = (output[0] if isinstance(output, tuple) else output).detach()
            out = out[:, 0] if out.dim() == 3 else out
            for i, key in enumerate(self.keys()):
                self.runs[self.run][-1]["acts"][(name,) + key] = out[i].clone()
        return hook

    def before(self, module, args, kwargs):
        ctx = self.context
        n = ctx.total_request_count
        rows = ctx.request_ids[:n].tolist()
        count = int(ctx.active_token_count)
        tables = {rows[i]: ctx.request_to_kv_block_ids[i][:int(ctx.request_kv_block_counts[i])].tolist()
                  for i in range(n)}
        self.runs[self.run].append({
            "query": dict(zip(rows, ctx.request_query_lengths[:n].tolist())), "tables": tables, "acts": {},
            "writes": list(zip(self.keys(), ctx.token_to_block_idx[:count].tolist(),
                               ctx.token_to_local_position_within_kv_block[:count].tolist())),
            "dummy": int(ctx.kv_block_allocator.dummy_block_idx),
            "blocks": sorted({b for table in tables.values() for b in table if b >= 0}),
        })

    def after(self, module, args, kwargs, output):
        step = self.runs[self.run][-1]
        step["kv"] = {b: self.context.memory_buffer[:, :, b].clone() for b in step["blocks"]}

    def attach(self, model: Any) -> None:
        for i, layer in enumerate(model.decoder.layers):
            layer.register_forward_hook(self.output_hook(f"L{i}"))
            if hasattr(layer, "self_attention"):
                layer.self_attention.linear_qkv.register_forward_hook(self.output_hook(f"L{i}.qkv"))
            if hasattr(layer, "mixer"):
                layer.mixer.register_forward_hook(self.output_hook(f"L{i}.mixer"))
        model.register_forward_pre_hook(self.before, with_kwargs=True)
        model.register_forward_hook(self.after, with_kwargs=True)


def chunks(steps: list[dict], rid: int) -> list[tuple[int, int, int]]:
    out = []
    for i, step in enumerate(steps):
        positions = [key[2] for key in step["acts"] if key[0] == "L0" and key[1] == rid]
        if positions:
            out.append((i, min(positions), max(positions) + 1))
    return out


def first_values(steps: list[dict]) -> dict:
    values: dict = {}
    for step in steps:
        for key, value in step["acts"].items():
            values.setdefault(key, value)
    return values


def read_kv(steps: list[dict], rid: int) -> dict[int, tuple[Any, int, int]]:
    """position -> (K/V [2, heads, dim] the request read there, step, block) at its prefill steps."""
    out: dict = {}
    for i, step in enumerate(steps):
        own = [key[1] for key, _, _ in step["writes"] if key[0] == rid]
        if not own:
            continue
        table = step["tables"][rid]
        for p in range(max(own) + 1):
            if p not in out:
                out[p] = (step["kv"][table[p // BLOCK]][:, 0, p % BLOCK], i, table[p // BLOCK])
    return out


def writers(steps: list[dict]) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """(block, slot) -> [(step, request, query length)] of every KV write not to the dummy block."""
    out: dict = {}
    for i, step in enumerate(steps):
        for (rid, _), block, slot in step["writes"]:
            if block != step["dummy"]:
                out.setdefault((block, slot), []).append((i, rid, step["query"][rid]))
    return out


def report(recorder: Recorder, labels: dict[int, str]) -> None:
    off, on = recorder.runs["off"], recorder.runs["on"]
    off_values, on_values = first_values(off), first_values(on)
    order = ["L0.mixer", "L0", "L1.qkv", "L1", "L2.mixer", "L2"]
    wrote = writers(on)
    for rid in sorted(labels, key=labels.get):
        common = sorted((k for k in off_values if k[1] == rid and k in on_values),
                        key=lambda k: (k[2], order.index(k[0]) if k[0] in order else 99))
        first = next(((k[2], k[0], float((off_values[k] - on_values[k]).abs().max())) for k in common
                      if not torch.equal(off_values[k], on_values[k])), None)
        print(f"{labels[rid]}: chunks off {chunks(off, rid)} on {chunks(on, rid)}; first difference {first}")
        kv_on, kv_off = read_kv(on, rid), read_kv(off, rid)
        for start in range(0, max(kv_on) + 1, BLOCK):
            positions = [p for p in sorted(kv_on) if start <= p < start + BLOCK and p in kv_off]
            if not positions:
                continue
            _, step, block = kv_on[positions[0]]
            by = set()
            for p in positions:
                seen = [w for w in wrote.get((block, p % BLOCK), []) if w[0] <= kv_on[p][1]]
                if seen:
                    w = seen[-1]
                    by.add((labels.get(w[1], w[1]), w[0], "prefill" if w[2] > 1 else "decode"))
            dk = max(float((kv_on[p][0][0] - kv_off[p][0][0]).abs().max()) for p in positions)
            dv = max(float((kv_on[p][0][1] - kv_off[p][0][1]).abs().max()) for p in positions)
            differ = [p for p in positions if not torch.equal(kv_on[p][0], kv_off[p][0])]
            print(f"    positions {positions[0]}-{positions[-1]}: block {block} read from step {step}, written by "
                  f"{sorted(by)}; max |dK| {dk:.3g}, |dV| {dv:.3g} vs caching off; differing {differ}")


def main(requests: int, seed: int) -> None:
    from megatron_ext.harness import ab
    from megatron_ext.harness.soak import soak_case

    recorder = Recorder()
    build = ab.build_engine

    def build_engine(model, case, prefix_caching, policy, tokenizer=None):
        engine, context = build(model, case, prefix_caching, policy, tokenizer)
        recorder.context, recorder.run = context, ("on" if prefix_caching else "off")
        recorder.runs[recorder.run] = []
        if recorder.model is None:
            recorder.model = model
            recorder.attach(model)
        return engine, context

    ab.build_engine = build_engine
    result = ab.run_ab(soak_case(requests, seed, policies=("lru",), hybrid=True))
    labels = {rid: out.label for rid, out in result.baseline.outputs.items()}
    report(recorder, labels)
    print("differing requests:", [labels[d.request_id] for d in result.policies[0].diffs if not d.identical])


if __name__ == "__main__":
    given = [int(a) for a in sys.argv[1:3]]
    main(*(given + [8, 5][len(given):]))
