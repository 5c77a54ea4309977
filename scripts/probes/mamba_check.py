"""The Mamba batch-invariance self-check on the real kernels and on kernels made batch-variant:
run from the repository root as ``python scripts/probes/mamba_check.py`` under ``TRITON_INTERPRET=1
MAMBA_DETERMINISTIC=1`` (Triton reads them at import); prints one line ``PROBE {json}``.

In one process, in this order (a GPT backend first, so nothing Mamba is imported before it):

* ``gpt``: ``ab.backend("cpu")`` as a GPT-only run enters it: its result, and whether megatron's
  Mamba mixer or :mod:`megatron_ext.cpu_backend.mamba_check` got imported;
* ``hybrid``: ``ab.backend("cpu", mamba=True)`` (fp32): its combined result;
* ``bf16``: :func:`mamba_self_check` with bf16 activations and conv states, fp32 SSM states;
* ``scan_variant`` / ``all_variant``: the check with megatron's varlen scan (resp. all four kernels)
  wrapped so that each output row also depends on the row before it, a neighbour in a batch.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable

import torch

#: A kernel made batch-variant adds this much of the previous output row (token or request).
LEAK = 1e-3


def _leaks_into_next_row(original: Callable, result_is_out: bool) -> Callable:
    """``original`` with each output row plus ``LEAK`` times the row before it (row 0: the last),
    so a row's bits depend on what it is batched with. ``result_is_out``: the kernel returns its
    output; otherwise it writes ``out=`` (the varlen scan, which returns states)."""

    @functools.wraps(original)  # the check reads the scan's signature (release differences)
    def variant(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        out = result if result_is_out else kwargs["out"]
        out.add_(out.roll(1, 0) * LEAK)
        return result

    return variant


def main() -> dict[str, Any]:
    from megatron_ext import mcore
    from megatron_ext.cpu_backend._swap import AttributeSwap
    from megatron_ext.harness.ab import backend

    results: dict[str, Any] = {}
    with backend("cpu") as (ok, detail):
        results["gpt"] = {"ok": ok, "detail": detail,
                          "imported": sorted(m for m in ("megatron.core.ssm.mamba_mixer",
                                                         "megatron_ext.cpu_backend.mamba_check")
                                             if m in sys.modules)}
    with backend("cpu", mamba=True) as (ok, detail):
        results["hybrid"] = {"ok": ok, "detail": detail}
        from megatron_ext.cpu_backend import mamba_check

        bf16 = mamba_check.MambaDtypes(torch.bfloat16, torch.float32, torch.bfloat16)
        results["bf16"] = mamba_check.mamba_self_check(bf16)
        mixer = mcore.import_module(mamba_check.MAMBA_MIXER_MODULE)
        conv_varlen = mcore.import_module(mamba_check.CONV_VARLEN_MODULE)
        kernels = [(mixer, "mamba_chunk_scan_combined_varlen", False), (conv_varlen, "causal_conv1d_varlen_fn", True),
                   (mixer, "causal_conv1d_update", True), (mixer, "selective_state_update", True)]
        for key, wrapped in (("scan_variant", kernels[:1]), ("all_variant", kernels)):
            swap = AttributeSwap()
            try:
                for owner, name, returns_out in wrapped:
                    swap.set(owner, name, _leaks_into_next_row(getattr(owner, name), returns_out))
                results[key] = mamba_check.mamba_self_check()
            finally:
                swap.restore()
    return results


if __name__ == "__main__":
    print("PROBE " + json.dumps(main()))
