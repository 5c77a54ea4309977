"""One weight update of a run, done the way a training-to-inference loop does it.

At each boundary of ``weight_updates.update_at_steps`` the step loop calls :func:`make_update`:

* with ``suspend_resume``: ``engine.suspend()``, the weight update, ``engine.resume()`` (megatron-ext's
  ``weight-update-invalidation`` patch invalidates the prefix cache inside ``resume()``);
* without it: the weight update, then ``megatron_ext.invalidate_prefix_cache(engine)`` (with prefix
  caching on; unpatched, megatron-core keeps the cache: upstream behaviour, recorded as
  ``patch not applied``).

Then the audits move to the next weight version (:meth:`ContextAudit.weights_updated`). Caching
off (A) and on (B) go through the same calls at the same step.
"""

from __future__ import annotations

from typing import Any

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
    """What a loop without suspend/resume calls after an update; fills ``record.invalidation``."""
    if not context.enable_prefix_caching:
        record.invalidation = "caching off"
        return
    from .. import invalidate_prefix_cache
    from ..errors import WeightUpdatePatchNotApplied

    try:
        result = invalidate_prefix_cache(engine)
    except WeightUpdatePatchNotApplied:
        record.invalidation = "patch not applied"
        return
    record.invalidation = "kept" if result.kept else "invalidated"
    record.blocks_unreachable, record.blocks_freed = result.blocks_unreachable, result.blocks_freed
