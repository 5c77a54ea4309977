"""megatron's Mamba decode kernel launcher ``selective_state_update`` for one decode step on the
CPU: run from the repository root as ``python scripts/probes/mamba_decode.py [patched|unpatched]`` under
``TRITON_INTERPRET=1 MAMBA_DETERMINISTIC=1`` (the kernel runs under Triton's interpreter, which
reads them at import); prints one line ``PROBE {json}``.

Shapes and layouts are those ``MambaMixer._ssm_decode`` passes (3 requests in slots 3, 0, 4 of a
5-slot state, 2 heads of 4 channels, 8 state entries, fp32; ``dt``, ``A``, ``D``, ``dt_bias``
expanded over the channels). With the runtime patches applied (``patched``, unless the tree is
source-patched) and then with none (the released call, or the source-patched one), on copies of
the same inputs:

* ``plain``: no intermediate-state buffer (every non-speculative decode step);
* ``buffer``: a ``(5, 1, 2, 4, 8)`` intermediate-state buffer, which must receive each request's
  state in its slot.
"""

from __future__ import annotations

import json
import sys
from typing import Any

HEADS, HEAD_DIM, STATE_DIM, SLOTS = 2, 4, 8, 5
REQUEST_SLOTS = [3, 0, 4]


def decode_inputs() -> dict[str, Any]:
    """The arguments of one decode step (fresh tensors, seed 7)."""
    import torch

    generator = torch.Generator().manual_seed(7)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    batch = len(REQUEST_SLOTS)
    return {
        "state": randn(SLOTS, HEADS, HEAD_DIM, STATE_DIM),
        "x": randn(batch, 1, HEADS, HEAD_DIM),
        "dt": randn(batch, 1, HEADS, 1).expand(-1, -1, -1, HEAD_DIM),
        "A": -torch.rand(HEADS, generator=generator).view(-1, 1, 1).expand(-1, HEAD_DIM, STATE_DIM),
        "B": randn(batch, 1, 1, STATE_DIM),
        "C": randn(batch, 1, 1, STATE_DIM),
        "D": randn(HEADS, 1).expand(-1, HEAD_DIM),
        "dt_bias": randn(HEADS, 1).expand(-1, HEAD_DIM),
        "state_batch_indices": torch.tensor(REQUEST_SLOTS, dtype=torch.int64),
    }


def decode_step(launcher: Any, with_buffer: bool) -> dict[str, Any]:
    """One call on fresh inputs: its output, the state and buffer after it, and the elements of
    ``x`` whose bits it changed."""
    import torch

    inputs = decode_inputs()
    x_before = inputs["x"].clone()
    buffer = torch.zeros(SLOTS, 1, HEADS, HEAD_DIM, STATE_DIM) if with_buffer else None
    out = launcher(z=None, dt_softplus=True, intermediate_ssm_states=buffer, **inputs)
    changed = (inputs["x"].view(torch.int32) != x_before.view(torch.int32)).nonzero().tolist()
    return {"out": out, "state": inputs["state"], "buffer": buffer, "x": inputs["x"], "x_changed": changed}


def main(patched: bool) -> dict[str, Any]:
    import torch

    from megatron_ext import mcore
    from megatron_ext.api import apply, revert
    from megatron_ext.cpu_backend import cuda_on_cpu, mamba_on_cpu
    from megatron_ext.patches.mamba_decode_no_dummy import KERNEL, MAMBA_SSM_MODULE

    results = apply() if patched else revert()
    patch_state = next(r.state.value for r in results if r.patch == "mamba-decode-no-dummy") if patched else None
    launcher = mcore.import_module(MAMBA_SSM_MODULE).selective_state_update
    runs: dict[str, dict[str, Any]] = {}
    with mamba_on_cpu(), cuda_on_cpu():
        for label in ("plain", "buffer"):
            runs[label] = decode_step(launcher, with_buffer=label == "buffer")
        wrapped = KERNEL.current() is not KERNEL.original()
        revert()
        released = {label: decode_step(launcher, with_buffer=label == "buffer") for label in runs}

    def same(a: Any, b: Any) -> bool:
        return a is None and b is None or torch.equal(a.view(torch.int32), b.view(torch.int32))

    report: dict[str, Any] = {"patch": patch_state, "kernel_wrapped": wrapped}
    slots = torch.tensor(REQUEST_SLOTS)
    for label, run in runs.items():
        report[label] = {
            "x_changed": run["x_changed"],
            "released_x_changed": released[label]["x_changed"],
            "same_as_released": {key: same(run[key], released[label][key]) for key in ("out", "state", "buffer")},
        }
    buffer, state_after = runs["buffer"]["buffer"], runs["buffer"]["state"]
    report["buffer"]["holds_the_new_states"] = bool(torch.equal(buffer[slots, 0], state_after[slots]))
    # what the released call stores there: the last state element of the last program in grid
    # order (last request's slot, last head, last channel, last state entry)
    plain = released["plain"]
    report["plain"]["released_x0_is_last_state"] = bool(plain["x"][0, 0, 0, 0] == plain["state"][REQUEST_SLOTS[-1], -1, -1, -1])
    return report


if __name__ == "__main__":
    print("PROBE " + json.dumps(main(patched=sys.argv[1:] != ["unpatched"])))
