"""Section 3 (worker side): engine step time of a ``megatron-ext ab`` case, prefix caching on.

The model and engine are built exactly as ``megatron-ext ab`` builds them
(:mod:`megatron_ext.harness.engine`, inside :func:`megatron_ext.harness.ab.backend` ``("cpu")``: the CPU backend
with batch-invariant matmuls, one intra-op thread). The loop is the harness's own
(:func:`megatron_ext.harness.step_loop.step_until_done`, which :func:`~megatron_ext.harness.step_loop.drive`
runs too) without the context audits (they hook ``add_request`` and each step, and would be
timed too): requests are added at their arrival steps and each ``engine.step_modern()`` call is
timed alone.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import time
from typing import Any

from megatron_ext.harness.ab import backend
from megatron_ext.harness.cases import Case, load_case, plan_requests
from megatron_ext.harness.engine import build_engine, build_model, ensure_model_parallel
from megatron_ext.harness.step_loop import EngineStuckError, describe_exception, merged_record, step_until_done
from megatron_ext.harness.tokenizer import default_tokenizer


def shrink(case: Case) -> Case:
    """A few-second version of a case for ``--short``: its first two request groups, two samples
    each, four generated tokens, everything arriving by step 2."""
    requests = [r.model_copy(update={"samples": min(r.samples, 2), "num_tokens_to_generate": 4,
                                     "arrival_step": min(r.arrival_step, 2)})
                for r in case.requests[:2]]
    return case.model_copy(update={"requests": requests})


class _Counters:
    """Running totals of context counters that ``reset()`` sets back to zero (read after each step)."""

    NAMES = ("lifetime_prefill_token_count",)

    def __init__(self, context: Any) -> None:
        self.context = context
        self.last = {name: int(getattr(context, name)) for name in self.NAMES}
        self.totals = {name: 0 for name in self.NAMES}

    def update(self) -> None:
        for name in self.NAMES:
            now = int(getattr(self.context, name))
            self.totals[name] += now - self.last[name] if now >= self.last[name] else now
            self.last[name] = now


class _InsideTimer:
    """Thread CPU time spent inside the functions megatron-ext's runtime patches wrap, during a run.

    Installed on the instances (``context.add_request`` and the other wrapped context and
    allocator methods) as the audit does, around whatever the class holds (patched or not): the
    difference between the patched and the unpatched runs is what the patches cost inside the
    engine, measured on the calls alone instead of a whole run, so it resolves far below the
    run-to-run noise. Only outermost calls count (``add_request`` calls ``evict_lru_blocks``
    through allocation; that time is ``add_request``'s), so the totals add up. The timer's own
    cost (two clock reads per call) is the same in both variants.
    """

    CONTEXT = ("add_request", "check_availability", "resume_paused_requests", "_find_kv_match_count",
               "initialize_attention_state")
    ALLOCATOR = ("release_memory_blocks", "register_kv_block_hashes", "evict_lru_blocks",
                 "_deregister_blocks")

    def __init__(self, context: Any) -> None:
        names = self.CONTEXT + self.ALLOCATOR
        self.ns = dict.fromkeys(names, 0)
        self.calls = dict.fromkeys(names, 0)
        self._depth = 0
        for name in self.CONTEXT:
            self._wrap(context, name)
        for name in self.ALLOCATOR:
            self._wrap(context.kv_block_allocator, name)

    def _wrap(self, owner: Any, name: str) -> None:
        bound = getattr(owner, name)
        cpu_clock = time.thread_time_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start = cpu_clock()
            try:
                return bound(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.ns[name] += cpu_clock() - start
                    self.calls[name] += 1

        setattr(owner, name, timed)

    def totals(self) -> dict[str, dict[str, int]]:
        return {"inside_cpu_ns": dict(self.ns), "inside_calls": dict(self.calls)}


class EndToEndBench:
    """One model on the CPU backend; :meth:`run` builds a fresh engine and times every step."""

    def __init__(self, case_name: str, short: bool = False) -> None:
        case = load_case(case_name)
        self.case = shrink(case) if short else case
        self.planned = plan_requests(self.case, default_tokenizer())
        self._stack = contextlib.ExitStack()
        started = time.perf_counter()
        self.invariance = self._stack.enter_context(backend("cpu"))
        ensure_model_parallel()
        self.model = build_model(self.case)
        self.setup_s = time.perf_counter() - started

    def close(self) -> None:
        self._stack.close()

    def run(self, policy: str) -> dict[str, Any]:
        """One run with prefix caching on under ``policy``; per-step wall and CPU ns, and what it did."""
        engine, context = build_engine(self.model, self.case, True, policy)
        inside = _InsideTimer(context)
        wall: list[int] = []
        cpu: list[int] = []
        outputs: dict[int, list[int]] = {}
        counters = _Counters(context)
        error = None
        gc.collect()
        try:
            self._loop(engine, wall, cpu, outputs, counters)
        except EngineStuckError:
            raise
        except Exception as exc:  # the unpatched run of a faulty release: report, do not time
            error = describe_exception(exc)
        digest = hashlib.sha256(repr(sorted(outputs.items())).encode()).hexdigest()[:12]
        return {
            "step_wall_ns": wall,
            "step_cpu_ns": cpu,
            "engine_steps": len(wall),
            "requests": len(outputs),
            # 0.18+ engines drain the context's counter into their own every step; 0.17 does not.
            "blocks_matched": int(getattr(engine, "_prefix_cache_blocks_matched", 0))
            + int(context.prefix_cache_blocks_matched),
            "prefill_tokens_computed": counters.totals["lifetime_prefill_token_count"],
            "outputs_digest": digest,
            "error": error,
            **inside.totals(),
        }

    def _loop(self, engine: Any, wall: list[int], cpu: list[int], outputs: dict[int, list[int]],
              counters: _Counters) -> None:
        """The harness's step loop (:func:`~megatron_ext.harness.step_loop.step_until_done`) with
        each ``engine.step_modern()`` call timed alone (ns appended to ``wall`` / ``cpu``) and the
        generated tokens of finished requests collected in ``outputs``; no audits."""
        clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns

        def timed_step() -> Any:
            w0, c0 = clock(), cpu_clock()
            result = engine.step_modern()
            c1, w1 = cpu_clock(), clock()
            wall.append(w1 - w0)
            cpu.append(c1 - c0)
            counters.update()
            return result

        def stepped(live: set[int], finished_now: list[tuple[int, Any]]) -> None:
            for request_id, finished in finished_now:
                outputs[request_id] = [int(t) for t in merged_record(finished).generated_tokens]

        step_until_done(engine, self.case, self.planned, on_added=lambda request: None,
                        on_stepped=stepped, on_tick=lambda steps: None, step=timed_step)
