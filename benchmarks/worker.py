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


def _pass_through(wrapped: Any, _instance: Any, args: tuple, kwargs: dict) -> Any:
    return wrapped(*args, **kwargs)


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
        # Section 6: "fault8" = the weight-update-invalidation patch alone, "patched_no8" = every
        # patch but that one, each exactly as apply() installs it under MEGATRON_EXT_SKIP.
        from .weight_update import FAULT8, skip_env, with_env

        others = [p.name for p in ALL_PATCHES if p.name != FAULT8]
        for variant, skipped in (("fault8", others), ("patched_no8", [FAULT8])):
            with_env(skip_env(skipped), megatron_ext.apply)
            self.functions[variant] = {k: c.__dict__[a] for k, (c, a) in self.targets.items()}
            megatron_ext.revert()
        # "passthrough8": a do-nothing wrapt wrapper on each function fault 8 wraps (the dispatch
        # cost alone, to split fault8's cost into wrapping and the wrappers' own work).
        import wrapt

        fault8_targets = {t.qualname for p in ALL_PATCHES if p.name == FAULT8 for t in p.wrappers()}
        self.functions["passthrough8"] = {
            k: (wrapt.FunctionWrapper(f, _pass_through) if k in fault8_targets else f)
            for k, f in self.functions["unpatched"].items()}
        wrapped = {p.name: sorted(t.qualname for t in p.wrappers()) for p in ALL_PATCHES}
        self.patches = [{"patch": r.patch, "state": r.state.value, "reason": r.reason,
                         "targets": wrapped.get(r.patch, [])} for r in results]
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
        self.flush_bench = None

    def install(self, variant: str) -> None:
        for key, (cls, attribute) in self.targets.items():
            setattr(cls, attribute, self.functions[variant][key])

    # -- section 1 -------------------------------------------------------------------------

    def op_release_setup(self, policy: str, pool: int, ids: int, group: int = 8, prefix: int = 7) -> dict:
        from .release import ReleaseBench

        self.release_bench = None
        self.release_bench = bench = ReleaseBench(policy, pool, ids, group, prefix)
        outcomes = {}
        for variant, functions in self.functions.items():  # every target, as op_release_time
            self.install(variant)
            outcomes.update(bench.probe({variant: functions["release"]}))
        self.install("unpatched")
        gc.collect()
        return {"workload": bench.describe(), "outcomes": outcomes}

    def op_release_time(self, variant: str, reps: int) -> dict:
        """``variant``'s functions on every target: the release and what it calls
        (``_deregister_blocks`` carries patches of its own)."""
        self.install(variant)
        try:
            wall, cpu = self.release_bench.time(self.functions[variant]["release"], reps)
        finally:
            self.install("unpatched")
        return {"wall": wall, "cpu": cpu}

    def op_release_control(self, reps: int) -> dict:
        wall, cpu = self.release_bench.time_rebuild(reps)
        return {"wall": wall, "cpu": cpu}

    # -- section 2 -------------------------------------------------------------------------

    def op_add_case(self, policy: str, max_prompt: int, length: int, match: str,
                    variants: tuple[str, ...] = ("unpatched", "patched")) -> dict:
        """What the probe's ``add_request`` did under each of ``variants`` (each installed on every
        target), to be checked equal across them."""
        from .add_request import AddRequestBench

        key = (policy, max_prompt)
        if key not in self.add_benches:
            self.add_benches[key] = AddRequestBench(policy, max_prompt)
        self.add_bench = bench = self.add_benches[key]
        bench.setup(length, match)
        outcomes = {}
        for variant in variants:
            self.install(variant)
            outcomes[variant] = bench.probe_once(self.functions[variant]["add_request"])
        self.install("unpatched")
        gc.collect()
        return {"outcomes": outcomes}

    def op_add_time(self, variant: str, reps: int) -> dict:
        """``variant``'s functions on every target: the whole admission path (``add_request`` and
        what it calls: the prefix match, block registration, allocation, eviction)."""
        self.install(variant)
        try:
            wall, cpu = self.add_bench.time(self.functions[variant]["add_request"], reps)
        finally:
            self.install("unpatched")
        return {"wall": wall, "cpu": cpu}

    # -- section 3 -------------------------------------------------------------------------

    def op_e2e_setup(self, case: str, short: bool) -> dict:
        from .e2e import EndToEndBench

        if self.e2e_bench is not None:
            # A second engine section in this worker (e.g. e2e, then lru): leave the first one's
            # CPU backend first. Left to the garbage collector, its exit would restore the real
            # torch.cuda functions under the new backend (megatron-core then asks a GPU driver).
            self.e2e_bench.close()
            self.e2e_bench = None
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

    # -- section 6 -------------------------------------------------------------------------

    def op_wu_add_case(self, policy: str, max_prompt: int, length: int, match: str) -> dict:
        """Section 2's probe with variants ``unpatched``, ``passthrough8`` and ``fault8`` (only
        this patch's wrappers)."""
        return self.op_add_case(policy, max_prompt, length, match, ("unpatched", "passthrough8", "fault8"))

    def op_wu_flush_setup(self, scenario: str, pool: int, registered: int) -> dict:
        """A context in ``scenario``'s state, built and flushed with every patch applied by
        ``megatron_ext.apply()`` (a real job's setting; ``invalidate_prefix_cache`` needs it)."""
        import megatron_ext

        from .weight_update import FlushBench

        self.flush_bench = None
        gc.collect()
        megatron_ext.apply()
        try:
            self.flush_bench = bench = FlushBench(scenario, pool, registered)
            outcomes = bench.probe()
        finally:
            megatron_ext.revert()
        gc.collect()
        return {"state": bench.state, "outcomes": outcomes}

    def op_wu_flush_time(self, variant: str, reps: int) -> dict:
        import megatron_ext

        megatron_ext.apply()
        try:
            wall, cpu = self.flush_bench.time(variant, reps)
        finally:
            megatron_ext.revert()
        return {"wall": wall, "cpu": cpu}


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
