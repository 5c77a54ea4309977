"""What fault H11's lazy check (``mamba-decode-a-cache``) adds to each Mamba decode step.

``MambaMixer._get_decode_A_neg_exp`` runs once per Mamba layer and decode step; the patch's
wrapper reads a stamp of ``A_log`` (``data_ptr``, ``_version``, a generation count) and compares
it with the mixer's. Timed here: the released function and the function ``apply()`` installs
(:func:`megatron_ext.patching.wrap_method` over it, not installed: no global state changes), each
called as a bound method of a module holding the attributes ``MambaMixer.__init__`` sets (64
heads, ``headdim`` 64, ``d_state`` 128: the shapes change only the expand view, not the check),
under ``torch.inference_mode`` as the engine calls it, with the cache filled. Per round both
variants run ``CALLS`` calls back to back, alternating which goes first; reported: the median
over rounds of ns per call, of the per-round difference (~95% sign-test interval,
:func:`benchmarks.stats.paired_summary`) and the ratio it gives, and
the added µs per decode step for ``LAYERS`` (50) Mamba layers.

    .venv/bin/python -m benchmarks.mamba_decode_a [--rounds 40] [--calls 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch

import megatron_ext.cpu_backend  # noqa: F401  before the mixer module is imported (its stand-ins)
from megatron_ext.patches import mamba_decode_a_cache as h11
from megatron_ext.patching import wrap_method

from .stats import paired_summary

HEADS, HEAD_DIM, STATE_DIM = 64, 64, 128
LAYERS = 50


def mixer_with(function: Callable) -> Any:
    """A module with ``MambaMixer``'s decode-cache attributes and ``function`` as its method."""

    class Mixer(torch.nn.Module):
        decode_a = function

        def __init__(self) -> None:
            super().__init__()
            self.A_log = torch.nn.Parameter(torch.log(torch.arange(1.0, HEADS + 1.0)))
            self._A_neg_exp_cache = torch.empty(HEADS, dtype=torch.float32)
            self._A_neg_exp_cache_stale = True
            self.headdim, self.d_state = HEAD_DIM, STATE_DIM

    return Mixer().eval()


def time_calls(mixer: Any, calls: int) -> float:
    """ns per call of ``mixer.decode_a()`` under inference mode."""
    call = mixer.decode_a
    with torch.inference_mode():
        start = time.perf_counter_ns()
        for _ in range(calls):
            call()
        return (time.perf_counter_ns() - start) / calls


def run(rounds: int, calls: int) -> dict[str, Any]:
    released = h11.DECODE_A.original()
    variants = {"released": mixer_with(released),
                "patched": mixer_with(wrap_method(released, h11._decode_a_wrapper, h11.MambaDecodeACachePatch.name))}
    for mixer in variants.values():  # fill the caches, stamp the patched one
        time_calls(mixer, 10)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(time_calls(variants[name], calls))
    paired = paired_summary(times["patched"], times["released"], scale=1.0)  # ns
    return {
        "rounds": rounds, "calls": calls, "torch": torch.__version__,
        "released_ns": statistics.median(times["released"]), "patched_ns": statistics.median(times["patched"]),
        "added_ns": paired["diff"], "added_ns_95": [paired["diff_lo"], paired["diff_hi"]], "ratio": paired["ratio"],
        "added_us_per_step": paired["diff"] * LAYERS / 1000, "layers": LAYERS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = run(args.rounds, args.calls)
    print(f"_get_decode_A_neg_exp, {result['rounds']} rounds x {result['calls']} calls: released "
          f"{result['released_ns']:.0f} ns, patched {result['patched_ns']:.0f} ns per call; patched adds "
          f"{result['added_ns']:.0f} ns (~95% {result['added_ns_95'][0]:.0f} to {result['added_ns_95'][1]:.0f}), "
          f"ratio {result['ratio']:.3f}x; {result['added_us_per_step']:.1f} us per decode step at "
          f"{LAYERS} Mamba layers")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
