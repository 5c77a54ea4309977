"""``post_update_reference``: does the engine run the weights it was given, after every update?

A run of a case with ``weight_updates`` uses one model through several weight versions: version 0
(the initial weights, restored in place before each run) and version k after update k. A cache
derived from the weights that an update does not reach (Mamba's ``-exp(A_log)``, fault H11; MLA's
split KV up-projection, fault M1) is invisible to the caching on = off comparison: both runs carry
it. This check compares each run's requests with a *fresh* model given the weights of the version
they ran under (its own copy of every parameter and buffer, no cache of any older weights) and a
fresh engine with prefix caching off, bit for bit: tokens and log-probs.

Compared: every request whose whole life fell within one version (added after the update that
made it, finished before the next one). Not compared: requests in flight across an update (their
tokens mix two versions). One fresh engine per distinct weight version runs the whole workload at
the run's arrival steps without updates, so a compared request shares its engine steps with the
same requests as in the run while their lengths do not depend on the weights (no early end of
document); under ``kv_cache_management_mode: recompute`` a resume re-prefills the requests in
flight, which the fresh engine does not. The fresh engine generates its own tokens, so the check
needs greedy sampling (``top_k: 1``); otherwise it reports itself not run. Multi-rank runs are not checked (each
rank would build and step its own fresh engine in lockstep; not done yet).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .cases import Case
from .cases.planning import PlannedRequest
from .compare import RequestOutput
from .mla import pre_absorption_name
from .step_loop import RunRecord
from .weight_updates import named_tensors, weights_sha256


@dataclass
class Difference:
    """The first token where a run and the fresh engine differ."""

    run: str
    version: int
    request: str
    token: int
    engine: tuple[Optional[int], Optional[float]]
    reference: tuple[Optional[int], Optional[float]]

    def describe(self) -> str:
        after = "the initial weights (restored)" if self.version == 0 else f"weight update {self.version}"
        return (f"{self.run}: under {after}, request {self.request} generated token {self.token} is "
                f"{self.engine[0]} (log-prob {self.engine[1]!r}) in the engine but {self.reference[0]} "
                f"(log-prob {self.reference[1]!r}) in a fresh model and engine on the same weights")


@dataclass
class RunReference:
    """One run against the fresh engines of its weight versions.

    Attributes:
        label: the run (``A: caching off``, ``B: caching on, lru``).
        compared: request ID -> weight version it ran under, for the compared requests.
        left_out: request IDs in flight across an update (not compared).
        tokens_compared: generated tokens compared (up to each request's first difference).
        max_abs_diff: largest |engine log-prob - reference log-prob| (nats) over the compared tokens.
        first_difference: the first request (in ID order) whose tokens or log-probs differ; None.
    """

    label: str
    compared: dict[int, int] = field(default_factory=dict)
    left_out: list[int] = field(default_factory=list)
    tokens_compared: int = 0
    max_abs_diff: float = 0.0
    first_difference: Optional[Difference] = None
    differing: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"run": self.label, "requests_compared": len(self.compared), "tokens_compared": self.tokens_compared,
                "left_out_in_flight_across_an_update": len(self.left_out), "max_abs_diff": self.max_abs_diff,
                "requests_differing": self.differing,
                "first_difference": None if self.first_difference is None else dataclasses.asdict(self.first_difference)}


@dataclass
class PostUpdateReference:
    """``ab``'s ``post_update_reference``: every run against fresh engines, or why it was not run."""

    runs: list[RunReference] = field(default_factory=list)
    not_run: Optional[str] = None
    versions: int = 0

    def failures(self) -> list[str]:
        """One line naming the runs that differ from the fresh engines, the first update and token."""
        differing = [run for run in self.runs if run.first_difference is not None]
        if not differing:
            return []
        requests = sorted({label for run in differing for label in run.differing})
        return [f"post-update reference: {len(requests)} requests differ from a fresh model and engine on the weights "
                f"they ran under, in {len(differing)} of {len(self.runs)} runs (the engine ran something computed under "
                f"older weights, e.g. prefix-cached KV (fault 8), Mamba's decode cache (H11) or MLA's split KV "
                f"up-projection (M1)); first: "
                f"{differing[0].first_difference.describe()}; max |Δ log-prob| "
                f"{max(run.max_abs_diff for run in differing):.3g}"]

    def pass_clause(self) -> str:
        """What a pass proved, for the verdict line."""
        if self.not_run is not None:
            return f"post-update reference not run: {self.not_run}"
        requests = sum(len(run.compared) for run in self.runs)
        tokens = sum(run.tokens_compared for run in self.runs)
        left_out = sum(len(run.left_out) for run in self.runs)
        return (f"after every weight update the engine equals a fresh model and engine on the current weights "
                f"({self.versions} weight versions; {requests} requests, {tokens} tokens compared over the runs, "
                f"{left_out} in flight across an update not)")

    def as_json(self) -> dict[str, Any]:
        return {"checked": self.not_run is None, "why_not": self.not_run, "weight_versions": self.versions,
                "passed": None if self.not_run is not None else not self.failures(),
                "runs": [run.as_json() for run in self.runs]}


class PostUpdateCheck:
    """Keeps a copy of each distinct weight version during the runs, then runs the fresh engines.

    Args:
        case, planned, tokenizer: what ``run_ab`` runs (the fresh engines run the same requests).
    """

    def __init__(self, case: Case, planned: list[PlannedRequest], tokenizer: Any) -> None:
        self.case, self.planned, self.tokenizer = case, {p.request_id: p for p in planned}, tokenizer
        self._weights: dict[str, dict[str, torch.Tensor]] = {}  # sha256 -> name -> copy
        self._runs: list[tuple[RunRecord, list[str]]] = []  # each run and the sha256 of its versions
        self._current: list[str] = []

    def start(self, model: Any) -> None:
        """A run begins on ``model`` (version 0, just restored)."""
        self._current = [self._keep(model, weights_sha256(model))]

    def updated(self, model: Any, digest: str) -> None:
        """The run just made its next weight update; ``digest``: the updater's SHA-256 of the parameters."""
        self._current.append(self._keep(model, digest))

    def after(self, run: RunRecord) -> None:
        self._runs.append((run, self._current))

    def _keep(self, model: Any, digest: str) -> str:
        if digest not in self._weights:  # names as a freshly built model has them (before MLA's absorption)
            self._weights[digest] = {pre_absorption_name(n): t.detach().clone() for n, t in named_tensors(model)}
        return digest

    def result(self) -> PostUpdateReference:
        """Run one fresh model and engine per distinct weight version and compare every run."""
        why = self._why_not()
        if why:
            return PostUpdateReference(not_run=why)
        runs = [_split(run, len(shas)) for run, shas in self._runs]
        wanted: dict[str, set[int]] = {}
        for (run, shas), reference in zip(self._runs, runs):
            for request_id, version in reference.compared.items():
                wanted.setdefault(shas[version], set()).add(request_id)
        outputs = {sha: self._fresh_outputs(sha, sorted(ids)) for sha, ids in wanted.items()}
        for (run, shas), reference in zip(self._runs, runs):
            _compare(run, reference, {rid: outputs[shas[v]][rid] for rid, v in reference.compared.items()})
        return PostUpdateReference(runs=runs, versions=len(self._weights))

    def _why_not(self) -> Optional[str]:
        from .distributed import is_multi_rank

        if self.case.sampling.top_k != 1:
            return (f"sampling is not greedy (top_k {self.case.sampling.top_k}): a fresh engine draws other samples; "
                    "use top_k: 1 to compare the engine with the current weights")
        if is_multi_rank():
            return "multi-rank run: the fresh-engine reference runs single-rank only"
        return None

    def _fresh_outputs(self, digest: str, request_ids: list[int]) -> dict[int, RequestOutput]:
        """The requests on a fresh model holding the weights ``digest``: a fresh engine, prefix
        caching off, every planned request at its arrival step (the same steps as the run, so each
        compared request shares its steps with the same requests: an MLA step's arithmetic depends
        on whether it mixes prefill and decode), no update."""
        from .engine import build_engine, build_model
        from .step_loop import drive

        with torch.random.fork_rng(devices=[]):  # building a model draws from the RNG the runs use
            model = build_model(self.case)
        with torch.no_grad():
            for name, tensor in named_tensors(model):
                tensor.data.copy_(self._weights[digest][name])
        engine, context = build_engine(model, self.case, False, self.case.prefix_caching_eviction_policies[0],
                                       self.tokenizer)
        record = RunRecord(False, None)
        drive(engine, context, self.case, list(self.planned.values()), record)
        if record.error:
            raise RuntimeError(f"the fresh engine of the post-update reference failed: {record.error}")
        return {rid: record.outputs[rid] for rid in request_ids}


def _split(run: RunRecord, versions: int) -> RunReference:
    """Which weight version each request of ``run`` ran under; those in flight across an update
    are left out."""
    reference = RunReference(run.label)
    across = {rid for update in run.updates for rid in update.in_flight}
    steps = [update.step for update in run.updates]
    for request_id, output in sorted(run.outputs.items()):
        if request_id in across:
            reference.left_out.append(request_id)
        elif output.token_steps:
            reference.compared[request_id] = min(sum(1 for s in steps if s <= output.token_steps[0]), versions - 1)
    return reference


def _compare(run: RunRecord, reference: RunReference, fresh: dict[int, RequestOutput]) -> None:
    for request_id, version in reference.compared.items():
        mine, theirs = run.outputs[request_id], fresh[request_id]
        for i in range(max(len(mine.tokens), len(theirs.tokens))):
            ours = _at(mine, i)
            ref = _at(theirs, i)
            if ours[0] == ref[0] and ours[1] is not None and ref[1] is not None:
                reference.tokens_compared += 1
                reference.max_abs_diff = max(reference.max_abs_diff, abs(ours[1] - ref[1]))
            if ours != ref:
                reference.differing.append(mine.label)
                if reference.first_difference is None:
                    reference.first_difference = Difference(run.label, version, mine.label, i, ours, ref)
                break


def _at(output: RequestOutput, i: int) -> tuple[Optional[int], Optional[float]]:
    return (output.tokens[i] if i < len(output.tokens) else None,
            output.log_probs[i] if i < len(output.log_probs) else None)
