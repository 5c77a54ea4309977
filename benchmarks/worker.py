"""The measurement process: ``python -m benchmarks.worker`` with one release's tree first on ``PYTHONPATH``.

Protocol: one JSON object per line. The worker first writes ``{"ready": info}``; then for each
request ``{"op": name, ...arguments}`` read from stdin it writes ``{"ok": true, "result": ...}``
or ``{"ok": false, "error": traceback}``. Only protocol lines go to the original stdout;
anything megatron-core or torch prints goes to stderr (the orchestrator keeps it in a log file).

Variants: ``unpatched`` is the release's own code; ``patched`` is what ``megatron_ext.apply()``
installs on this release (a patch the release does not need stays out, as in a real job). The
worker captures both function objects once and swaps the class attributes between them, exactly
the objects ``apply()`` / ``revert()`` install.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import traceback
from typing import Any


class Worker:
    def __init__(self) -> None:
        import torch

        import megatron_ext
        from megatron_ext import mcore

        torch.set_num_threads(1)
        self.torch = torch
        from megatron_ext.patches import ALL_PATCHES

        # Every function any patch wraps, by qualified name; "release" and "add_request" are the
        # two sections 1 and 2 time on their own.
        self.targets = {t.qualname: (t.owner(), t.attribute) for p in ALL_PATCHES for t in p.wrappers()}
        self.targets["release"] = self.targets["KVBlockAllocator.release_memory_blocks"]
        self.targets["add_request"] = self.targets["DynamicInferenceContext.add_request"]
        megatron_ext.revert()
        self.functions = {"unpatched": {k: c.__dict__[a] for k, (c, a) in self.targets.items()}}
        results = megatron_ext.apply()
        self.functions["patched"] = {k: c.__dict__[a] for k, (c, a) in self.targets.items()}
        megatron_ext.revert()
        self.patches = [{"patch": r.patch, "state": r.state.value, "reason": r.reason} for r in results]
        import megatron.core

        self.info = {
            "megatron_core_version": mcore.installed_version(),
            "megatron_core_path": os.path.dirname(megatron.core.__file__),
            "megatron_ext_path": os.path.dirname(megatron_ext.__file__),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(),
            "patches": self.patches,
        }
        self.release_bench = None
        self.add_benches: dict[tuple[str, int], Any] = {}
        self.add_bench = None
        self.e2e_bench = None

    def install(self, variant: str) -> None:
        for key, (cls, attribute) in self.targets.items():
            setattr(cls, attribute, self.functions[variant][key])

    # -- section 1 -------------------------------------------------------------------------

    def op_release_setup(self, policy: str, pool: int, ids: int, group: int = 8, prefix: int = 7) -> dict:
        from .release import ReleaseBench

        self.release_bench = None
        self.release_bench = bench = ReleaseBench(policy, pool, ids, group, prefix)
        outcomes = bench.probe({v: f["release"] for v, f in self.functions.items()})
        self.install("unpatched")
        gc.collect()
        return {"workload": bench.describe(), "outcomes": outcomes}

    def op_release_time(self, variant: str, reps: int) -> dict:
        wall, cpu = self.release_bench.time(self.functions[variant]["release"], reps)
        self.install("unpatched")
        return {"wall": wall, "cpu": cpu}

    def op_release_control(self, reps: int) -> dict:
        wall, cpu = self.release_bench.time_rebuild(reps)
        return {"wall": wall, "cpu": cpu}

    # -- section 2 -------------------------------------------------------------------------

    def op_add_case(self, policy: str, max_prompt: int, length: int, match: str) -> dict:
        from .add_request import AddRequestBench

        key = (policy, max_prompt)
        if key not in self.add_benches:
            self.add_benches[key] = AddRequestBench(policy, max_prompt)
        self.add_bench = bench = self.add_benches[key]
        bench.setup(length, match)
        outcomes = {v: bench.probe_once(f["add_request"]) for v, f in self.functions.items()}
        self.install("unpatched")
        gc.collect()
        return {"outcomes": outcomes}

    def op_add_time(self, variant: str, reps: int) -> dict:
        wall, cpu = self.add_bench.time(self.functions[variant]["add_request"], reps)
        self.install("unpatched")
        return {"wall": wall, "cpu": cpu}

    # -- section 3 -------------------------------------------------------------------------

    def op_e2e_setup(self, case: str, short: bool) -> dict:
        from .e2e import EndToEndBench

        self.e2e_bench = bench = EndToEndBench(case, short)
        return {"case": bench.case.name, "requests": len(bench.planned),
                "policies": list(bench.case.prefix_caching_eviction_policies),
                "batch_invariant": list(bench.invariance), "setup_s": bench.setup_s}

    def op_e2e_run(self, variant: str, policy: str) -> dict:
        self.install(variant)
        try:
            return self.e2e_bench.run(policy)
        finally:
            self.install("unpatched")


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (megatron-core, gloo, torch) go to stderr

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        worker = Worker()
    except Exception:
        send({"ok": False, "error": traceback.format_exc()})
        return
    gc.collect()
    gc.freeze()  # imports and setup are permanent: later collections only scan new objects
    send({"ready": worker.info})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.pop("op")
        if op == "quit":
            send({"ok": True, "result": None})
            break
        try:
            result = getattr(worker, f"op_{op}")(**request)
        except Exception:
            send({"ok": False, "error": traceback.format_exc()})
        else:
            send({"ok": True, "result": result})
    if worker.e2e_bench is not None:
        worker.e2e_bench.close()


if __name__ == "__main__":
    main()
