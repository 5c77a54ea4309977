"""One weight update of a run, done the way a training-to-inference loop does it.

At each boundary of ``weight_updates.update_at_steps`` the step loop calls :func:`make_update`:

* with ``suspend_resume``: ``engine.suspend()``, the weight update, ``engine.resume()`` (megatron-ext's
  ``weight-update-invalidation`` patch invalidates the prefix cache inside ``resume()``);
* without it: the weight update, then ``megatron_ext.invalidate_prefix_cache(engine)`` (with prefix
  caching on; unpatched, megatron-core keeps the cache: upstream behaviour, recorded as
  ``patch not applied``).

Then the audits move to the next weight version (:meth:`ContextAudit.weights_updated`). Caching
off (A) and on (B) go through the same calls at the same step. :func:`update_mismatches` and
:func:`left_out` judge afterwards whether A and B met each update at the same point.
"""

from __future__ import annotations

from typing import Any, Sequence

from .audits import ContextAudit
from .weight_updates import UpdateRecord, WeightUpdater


def make_update(engine: Any, context: Any, updater: WeightUpdater, audit: ContextAudit, index: int, step: int,
                outputs: dict, finished: set[int], generated: dict[int, int]) -> UpdateRecord:
    """Update the weights (update ``index`` + 1) at engine step ``step``, with the engine calls
    the case asks for; returns what was done.

    Args:
        engine, context: megatron-core's ``DynamicInferenceEngine`` and its context.
        updater: the run's :class:`WeightUpdater`.
        audit: the run's :class:`ContextAudit`.
        index: 0-based index of the update in ``update_at_steps``.
        step: the engine step (loop iteration) of the update.
        outputs: the run's outputs so far (request ID -> ``RequestOutput``).
        finished: request IDs finished so far; the others in ``outputs`` are in flight.
        generated: request ID -> tokens generated so far, for the requests in flight.

    Raises:
        WeightUpdateError, CheckpointError: see :meth:`WeightUpdater.update`.
    """
    spec = updater.spec
    record = UpdateRecord(index=index + 1, step=step, kind=spec.kind, suspend_resume=spec.suspend_resume,
                          in_flight=sorted(set(outputs) - finished), in_flight_tokens=dict(sorted(generated.items())))
    if spec.suspend_resume:
        engine.suspend()
        updater.update(record, outputs, finished)
        engine.resume()
        record.invalidation = "resume"
    else:
        updater.update(record, outputs, finished)
        _invalidate(engine, context, record)
    audit.weights_updated()
    return record


def _invalidate(engine: Any, context: Any, record: UpdateRecord) -> None:
    """What a loop without suspend/resume calls after an update; fills ``record.invalidation``.
    Called with caching off too: the flush moves the weight version the tokens are recorded under."""
    from .. import invalidate_prefix_cache
    from ..errors import WeightUpdatePatchNotApplied

    try:
        result = invalidate_prefix_cache(engine)
    except WeightUpdatePatchNotApplied:
        result = None
    if not context.enable_prefix_caching:
        record.invalidation = "caching off"
        return
    if result is None:
        record.invalidation = "patch not applied"
        return
    record.invalidation = "kept" if result.kept else "invalidated"
    record.blocks_unreachable, record.blocks_freed = result.blocks_unreachable, result.blocks_freed


def updated_at_other_tokens(baseline: Any, run: Any) -> dict[int, list[str]]:
    """Update index -> ``"<label> at token N vs M"`` for each request in flight at that update of
    ``run`` whose computed tokens (prompt prefilled + generated) differ from ``baseline``'s (caching
    off), or that finished in one run only; updates where both agree are left out.

    Args:
        baseline, run: :class:`~megatron_ext.harness.step_loop.RunRecord` of caching off and on.
    """
    labels = {rid: o.label for rid, o in baseline.outputs.items()}
    out = {}
    for a, b in zip(baseline.updates, run.updates):
        moved = [f"{labels[rid]} at token {n} vs {a.in_flight_tokens[rid]}" if rid in a.in_flight_tokens
                 else f"{labels[rid]} at token {n} vs finished"
                 for rid, n in b.in_flight_tokens.items() if n != a.in_flight_tokens.get(rid)]
        moved += [f"{labels[rid]} finished vs at token {n}" for rid, n in a.in_flight_tokens.items()
                  if rid not in b.in_flight_tokens]
        if moved:
            out[b.index] = moved
    return out


def left_out(case: Any, baseline: Any, run: Any) -> list[int]:
    """Request IDs left out of ``run``'s bit-identity check: with the case's
    ``expectations.update_timing: exclude``, those a weight update reached at another token than in
    ``baseline`` (caching off); otherwise none."""
    if case.expectations.update_timing != "exclude":
        return []
    moved: set[int] = set()
    for a, b in zip(baseline.updates, run.updates):
        ids = set(a.in_flight_tokens) | set(b.in_flight_tokens)
        moved |= {rid for rid in ids if a.in_flight_tokens.get(rid) != b.in_flight_tokens.get(rid)}
    return sorted(moved)


def update_mismatches(case: Any, baseline: Any, runs: Sequence[tuple[str, Any]]) -> list[str]:
    """One sentence per caching-on run (``(policy, RunRecord)``) whose weight updates were not made
    at the same steps as ``baseline``'s, or (with ``expectations.update_timing: fail``) reached a
    request in flight at another token; runs megatron-core ended early are skipped."""
    expected = [u.step for u in baseline.updates]
    problems = []
    for policy, run in runs:
        if run.error:
            continue
        if [u.step for u in run.updates] != expected:
            problems.append(f"{policy}: weight updates at steps {[u.step for u in run.updates]}, caching off at {expected}")
            continue
        if case.expectations.update_timing == "exclude":
            continue
        for index, moved in updated_at_other_tokens(baseline, run).items():
            problems.append(
                f"{policy}: update {index} (step {run.updates[index - 1].step}) came at another token than with "
                f"caching off for {', '.join(moved[:4])}; the new weights start at different tokens, so those "
                "requests differ for that reason (megatron-core schedules caching on differently, e.g. it defers "
                "a request whose prefix a same-step sibling is computing); move the update or the arrivals")
    return problems
