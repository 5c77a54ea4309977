"""Run one case through megatron-core's dynamic inference engine and record what it produced.

A run builds the model and engine for the case (prefix caching on or off, one eviction policy),
feeds each planned request at its arrival step, steps the engine until every request finished,
and records per request the generated tokens, their log-probs and the step each token came from.
The context audits (:mod:`megatron_ext.harness.audits`) check every step and count prefix-cache hits.
An exception raised inside megatron-core ends the run and is recorded, not raised, so the report
still shows what happened up to that step.
"""

from __future__ import annotations

import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from .. import mcore
from .audits import AuditSummary, ContextAudit, PoolPressure, PrefixCacheCounters
from .cases.planning import PlannedRequest, validate_planned
from .cases.schema import Case
from .checkpoint import CheckpointError
from .compare import RequestOutput
from .rounds import make_update
from .weight_updates import WeightUpdateError, WeightUpdater

#: A run that has not drained after this many engine steps per request is declared stuck.
MAX_STEPS_PER_REQUEST = 200


class EngineStuckError(RuntimeError):
    """The engine stopped making progress (requests left, step budget spent)."""


@dataclass
class RunRecord:
    """One run of a case.

    Attributes:
        prefix_caching: whether prefix caching was on.
        eviction_policy: ``ref_zero`` / ``lru`` (None with prefix caching off).
        outputs: request ID -> :class:`RequestOutput`.
        steps: engine steps taken (idle steps waiting for an arrival included).
        counters: prefix-cache counters measured by the audit at each ``add_request``.
        audit: :meth:`ContextAudit.summary` of the run.
        pressure: KV pool pressure measured by the audit, with ``requests_evicted`` from
            megatron-core's ``evicted_request_count``.
        wall_s: wall-clock seconds for the run, build included.
        total_blocks: KV blocks in the context (dummy block included).
        error: the exception megatron-core raised during the run, as one line, or None.
        updates: the weight updates made during the run (:class:`~megatron_ext.harness.weight_updates.UpdateRecord`),
            empty for a case without ``weight_updates``.
    """

    prefix_caching: bool
    eviction_policy: Optional[str]
    outputs: dict[int, RequestOutput] = field(default_factory=dict)
    steps: int = 0
    counters: PrefixCacheCounters = field(default_factory=PrefixCacheCounters)
    audit: AuditSummary = field(default_factory=AuditSummary)
    pressure: PoolPressure = field(default_factory=PoolPressure)
    wall_s: float = 0.0
    total_blocks: int = 0
    error: Optional[str] = None
    updates: list = field(default_factory=list)

    @property
    def label(self) -> str:
        """The run as the report names it: ``A: caching off`` or ``B: caching on, <policy>``."""
        return f"B: caching on, {self.eviction_policy}" if self.prefix_caching else "A: caching off"


def sampling_params(case: Case, planned: PlannedRequest):
    """megatron-core ``SamplingParams`` for one request: the case's sampling, log-probs on."""
    module = mcore.import_module("megatron.core.inference.sampling_params")
    return module.SamplingParams(
        temperature=case.sampling.temperature,
        top_k=case.sampling.top_k,
        top_p=case.sampling.top_p,
        return_log_probs=True,
        skip_prompt_log_probs=True,  # prompt log-probs of skipped (cached) tokens do not exist
        num_tokens_to_generate=planned.num_tokens_to_generate,
        top_n_logprobs=case.sampling.top_n_logprobs,
    )


def _generated(engine: Any, request_id: int) -> int:
    """Tokens generated so far by a live request, over all its checkpoints (evictions)."""
    record = engine.requests[request_id].record
    return sum(len(r.generated_tokens) for r in record)


def taken_in(engine: Any, request_id: int) -> int:
    """Tokens of a live request whose KV the engine holds for it: its prompt (while it waits in the
    queue, the chunks prefilled so far and the rest of any block it obtained by a hash match, whose
    KV it reads rather than recomputes) plus the tokens it generated."""
    request = engine.requests[request_id].record[-1]
    if request_id in engine.waiting_request_ids:
        prompt = request.finished_chunk_token_count
        if prompt:
            prompt = max(prompt, min(_matched_end(request), len(request.prompt_tokens)))
    else:
        prompt = len(request.prompt_tokens)
    return prompt + _generated(engine, request_id)


def _matched_end(request: Any) -> int:
    """End of the prompt positions a request got by hash match (fix 2's ranges: its KV writes
    there go to the dummy block, its reads to the matched blocks); 0 without fix 2."""
    from ..patches.matched_block_writes import MATCHED_RANGES

    ranges = MATCHED_RANGES.get(request) or getattr(request, "_matched_kv_token_ranges", None) or ()
    return max((stop for _, stop in ranges), default=0)


def merged_record(record: Any) -> Any:
    """A finished request's record as one request (0.18+ keep one entry per eviction: merged)."""
    return record.merge() if hasattr(record, "merge") else record


def _finish(output: RequestOutput, record: Any) -> None:
    output.weight_versions = _weight_versions(record)
    merged = merged_record(record)
    output.tokens = [int(t) for t in merged.generated_tokens]
    output.log_probs = [float(x) for x in (merged.generated_log_probs or [])]
    if merged.sampling_params.top_n_logprobs > 0:
        # dicts keyed by token text, in the engine's order (largest first)
        output.top_n_logprobs = [[(str(k), float(v)) for k, v in entry.items()]
                                 for entry in (merged.generated_top_n_logprobs or [])]
    routing = getattr(merged, "routing_indices", None)
    output.routing = None if routing is None else _as_int_lists(routing)


def _as_int_lists(routing: Any) -> list[list[list[int]]]:
    """megatron-core's ``routing_indices`` (a numpy array in 0.18+, a torch tensor in 0.17;
    ``[tokens, layers, topk]`` of int16/int32) as nested Python ints."""
    return [[[int(e) for e in layer] for layer in token] for token in routing.tolist()]


def _weight_versions(record: Any) -> Optional[dict[str, list[int]]]:
    """The finished request's per-token weight versions (the engine's record: one request per
    eviction), or None where the weight-update patch did not record them."""
    from ..patches.weight_versions import WeightVersionsNotRecorded, token_weight_versions

    try:
        versions = token_weight_versions(record)
    except WeightVersionsNotRecorded:
        return None
    return {"logits": list(versions.logits), "kv_prefix": list(versions.kv_prefix)}


def step_until_done(
    engine: Any,
    case: Case,
    planned: list[PlannedRequest],
    on_added: Callable[[PlannedRequest], None],
    on_stepped: Callable[[set[int], list[tuple[int, Any]]], None],
    on_tick: Callable[[int], None],
    step: Optional[Callable[[], Any]] = None,
    update_at_steps: Sequence[int] = (),
    on_update: Optional[Callable[[int], None]] = None,
) -> None:
    """The step loop: add each planned request at its arrival step, step the engine while any
    request is live, until every request finished.

    Args:
        engine: megatron-core's ``DynamicInferenceEngine``.
        case: the case (its sampling settings).
        planned: the requests, in arrival order.
        on_added: called with each request right after ``engine.add_request``.
        on_stepped: after each engine step: the requests still live and ``(request ID, record)``
            of each request that finished in that step.
        on_tick: after each loop iteration (an engine step, or an idle step waiting for an
            arrival) with the number of steps taken so far.
        step: what steps the engine (default ``engine.step_modern``), e.g. a timed call.
        update_at_steps: loop iterations (engine steps, idle ones included) at which
            ``on_update(k)`` is called with the update's index ``k`` (0-based), before that
            iteration's arrivals are added and before the engine steps; requests still live run on
            across it. An update whose step comes after the last request finished is not made.

    Raises:
        EngineStuckError: more than ``MAX_STEPS_PER_REQUEST * len(planned)`` steps.
    """
    step = step or engine.step_modern
    waiting = deque(planned)
    live: set[int] = set()
    steps = 0
    budget = MAX_STEPS_PER_REQUEST * len(planned)
    updates = deque(enumerate(update_at_steps))
    while waiting or live:
        while updates and updates[0][1] <= steps:
            on_update(updates.popleft()[0])
        while waiting and waiting[0].arrival_step <= steps:
            request = waiting.popleft()
            engine.add_request(request.request_id, list(request.prompt_tokens),
                               sampling_params(case, request))
            on_added(request)
            live.add(request.request_id)
        if live:
            result = step()
            finished_now = []
            for finished in (result or {}).get("finished_request_records", []):
                request_id = finished.request_id if hasattr(finished, "request_id") else finished[-1].request_id
                live.discard(request_id)
                finished_now.append((request_id, finished))
            on_stepped(live, finished_now)
        steps += 1
        on_tick(steps)
        if steps > budget:
            raise EngineStuckError(
                f"case '{case.name}': {len(live) + len(waiting)} requests unfinished after "
                f"{steps} steps; the engine made no progress"
            )


def drive(
    engine: Any,
    context: Any,
    case: Case,
    planned: list[PlannedRequest],
    record: RunRecord,
    on_step: Optional[Callable[[int], None]] = None,
    updater: Optional[WeightUpdater] = None,
) -> None:
    """Feed requests at their arrival steps and step the engine until all are finished.

    An exception raised by megatron-core is caught and recorded in ``record.error`` (one line
    with the innermost megatron-core frame); the audit results up to that step are kept.

    With ``updater`` (a case with ``weight_updates``), the weights are updated at each of the
    case's ``update_at_steps`` (:func:`megatron_ext.harness.rounds.make_update`), recorded in
    ``record.updates``.

    Raises:
        WorkloadError: a zero-token prompt or a repeated request ID in ``planned`` (checked before
            the engine or context is touched).
        EngineStuckError: more than ``MAX_STEPS_PER_REQUEST * len(planned)`` steps.
        WeightUpdateError, CheckpointError: a weight update the harness cannot make. Any other
            exception raised while stepping (megatron-core's, or a patch's inside it, such as
            ``PrefixForestError``) is recorded in ``record.error``.
    """
    validate_planned(planned)
    audit = ContextAudit(context, check_ref_counts=context.enable_prefix_caching).attach()
    finished: set[int] = set()

    def added(request: PlannedRequest) -> None:
        record.outputs[request.request_id] = RequestOutput(
            request.request_id, request.label, len(request.prompt_tokens))

    def stepped(live: set[int], finished_now: list[tuple[int, Any]]) -> None:
        for request_id, finished_record in finished_now:
            _finish(record.outputs[request_id], finished_record)
            finished.add(request_id)
        _note_token_steps(engine, record, live, [request_id for request_id, _ in finished_now])
        audit.end_step()

    def ticked(steps: int) -> None:
        record.steps = steps
        if on_step:
            on_step(steps)

    def update(index: int) -> None:
        generated = {rid: taken_in(engine, rid) for rid in record.outputs if rid not in finished}
        record.updates.append(make_update(engine, context, updater, audit, index, record.steps,
                                          record.outputs, finished, generated))

    at_steps = updater.spec.update_at_steps if updater is not None else ()
    try:
        step_until_done(engine, case, planned, added, stepped, ticked, update_at_steps=at_steps, on_update=update)
        if context.enable_prefix_caching:
            audit.drain()
    except (EngineStuckError, WeightUpdateError, CheckpointError):
        raise  # the harness cannot go on (bad input for an update): not a megatron-core failure
    except Exception as exc:  # megatron-core (or a patch inside it) failed mid-run: report it with the step
        record.error = f"step {record.steps}: {describe_exception(exc)}"
        audit.end_failed_step()
    finally:
        audit.detach()
    record.audit = audit.summary()
    record.counters = audit.counters
    record.pressure = audit.pressure
    record.pressure.requests_evicted = int(engine.evicted_request_count)  # every release 0.17-0.19 has it


def describe_exception(exc: BaseException) -> str:
    """``KeyError: 123 (in _find_kv_match_count, megatron/core/.../dynamic_context.py:1922)``."""
    frames = traceback.extract_tb(exc.__traceback__)
    inner = next((f for f in reversed(frames) if "megatron/core" in f.filename), frames[-1] if frames else None)
    where = ""
    if inner is not None:
        path = inner.filename[inner.filename.find("megatron/core"):] if "megatron/core" in inner.filename else inner.filename
        where = f" (in {inner.name}, {path}:{inner.lineno})"
    return f"{type(exc).__name__}: {exc}{where}"


def _note_token_steps(engine: Any, record: RunRecord, live: set[int], finished_now: list[int]) -> None:
    """Extend the ``token_steps`` of live requests and of those that finished in this step with
    the current step for tokens new this step (requests finished earlier have all theirs)."""
    for request_id in [*live, *finished_now]:
        output = record.outputs[request_id]
        produced = len(output.tokens) if request_id not in live else _generated(engine, request_id)
        output.token_steps.extend([record.steps] * (produced - len(output.token_steps)))
