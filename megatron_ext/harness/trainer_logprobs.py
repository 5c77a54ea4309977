"""Trainer vs engine log-probs (``ab --trainer-logprobs``): are the rollouts on-policy, bit for bit?

In an RL job the rollout log-probs come from the inference engine, and the policy-gradient loss
uses the trainer's log-probs of the same tokens: the training forward of the same model (no KV
cache, full sequences). After each run of ``ab`` the same ``GPTModel`` runs that forward over every
request's prompt + generated tokens, and each generated token's log-prob is computed the way
Megatron-LM RL computes it (``megatron/rl/rl_utils.py``: ``get_logprobs`` ->
``selective_log_softmax``: log_softmax of the logits at position ``t - 1``, in float32, gathered at
token ``t``), then compared per token with the engine's log-prob of that token.

On the CPU backend (``--device cpu``, the default; ``matched`` runs only there) both sides run on
this machine: the engine with the reference paged attention in place of flash-attention and the
batch-invariant (row-wise) matrix products. The modes differ in the trainer forward only:

* ``matched``: the training forward computes with the engine's arithmetic: the batch-invariant
  products stay on and the core attention is the engine's own reference kernel
  (:func:`~megatron_ext.cpu_backend.attention.attend_sequence`, through
  :func:`~megatron_ext.cpu_backend.attention.matched_training_attention`). Any token whose log-prob
  bits differ fails the run. What it proves: the engine's path (paged KV blocks, prefix-cache
  matches, chunked prefill, decode steps, batches of other requests) computes, token by token, the
  same function as a cache-free full-sequence forward of the same weights with identical
  arithmetic; a stale or misplaced KV block, a wrong position or causal range, a prefill token
  skipped, or any arithmetic outside the shared kernels that differs shows as a bit difference.
  What it cannot show: a fault inside code both sides share (``attend_sequence``, the
  batch-invariant products, the layer code both paths run: norms, projections, MLP) is made
  identically on both sides and cancels (a 25% softmax-scale error inside ``attend_sequence``
  still passes); that kernel is checked on its own against float64 dense attention
  (``unit_tests/test_cpu_backend_attention.py``).
  Nor does it say anything of a GPU stack, where the engine's flash-attention decode and the
  trainer's attention kernel reduce in different orders (docs/ab.md: "Trainer vs engine log-probs").
* ``megatron``: megatron-core's training forward as released, with torch's CPU kernels
  (``DotProductAttention``, torch's matrix products) against the CPU backend's engine: what
  megatron-core's own training forward leaves against that engine's arithmetic; not what a user
  measures on a GPU stack, whose kernels differ on both sides. (With ``--device cuda`` both run on
  the GPU with the kernels installed there, the trainer with the local layer spec's
  ``DotProductAttention``, not Transformer Engine's; not measured here.) Information only: it
  never fails the verdict, except a run that compared no token or a trainer forward that raised
  (any mode).

A request in flight across a weight update is left out (two weight versions generated it), counted
in requests and tokens; a run that compared no token fails, as does an exception inside the trainer
comparison (named as the trainer's, never as the engine's).

The model is in eval mode (no dropout), as Megatron-LM RL's log-prob forward
(``logprobs_forward_step`` calls ``model.eval()``) runs it, and the forward runs under
``torch.no_grad()`` (the values do not depend on it).
"""

from __future__ import annotations

import contextlib
import math
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch

from ..errors import MegatronExtError
from .compare import RequestOutput
from .routing import replay_targets, replaying, router_replays
from .step_loop import describe_exception

#: ``ab --trainer-logprobs`` values; the first is the default of the bare flag.
MODES = ("matched", "megatron")


class TrainerLogProbsError(MegatronExtError):
    """``--trainer-logprobs`` asked for something it cannot do (bad mode, unsupported layout/case)."""


@dataclass(frozen=True)
class TrainerForward:
    """How the trainer forward computes: each piece either as the engine computes it on the CPU
    backend, or as megatron-core / torch ship it. ``matched`` is both matched, ``megatron`` both
    as shipped; the mixed ones show what one op alone leaves (docs/ab.md: "Trainer vs engine log-probs").

    Attributes:
        attention: ``matched`` (per-query reference attention) or ``megatron`` (``DotProductAttention``).
        matmuls: ``batch_invariant`` (the CPU backend's row-wise products) or ``torch`` (torch's own).
    """

    attention: str = "matched"
    matmuls: str = "batch_invariant"

    @classmethod
    def of_mode(cls, mode: str) -> "TrainerForward":
        """The forward of ``--trainer-logprobs MODE``.

        Raises:
            TrainerLogProbsError: ``mode`` is not one of :data:`MODES`.
        """
        check_mode(mode)
        return cls() if mode == "matched" else cls("megatron", "torch")

    @property
    def mode(self) -> str:
        """``matched``, ``megatron``, or for a mixed forward ``attention X, matmuls Y``."""
        if self == TrainerForward():
            return "matched"
        if self == TrainerForward("megatron", "torch"):
            return "megatron"
        return f"attention {self.attention}, matmuls {self.matmuls}"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block the model's training forward computes as this says (CPU backend)."""
        from ..cpu_backend.attention import matched_training_attention
        from ..cpu_backend.batch_invariant import batch_invariant_mode

        with contextlib.ExitStack() as stack:
            if self.attention == "matched":
                stack.enter_context(matched_training_attention())
            stack.enter_context(batch_invariant_mode(self.matmuls == "batch_invariant"))
            yield


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`MODES`.

    Raises:
        TrainerLogProbsError: any other value (one line naming the choices).
    """
    if mode not in MODES:
        raise TrainerLogProbsError(f"--trainer-logprobs {mode!r}: choose one of {', '.join(MODES)} "
                                   "(or give the flag alone for matched)")
    return mode


def check_supported(forward: TrainerForward, case: Any, device: str, tensor_model_parallel_size: int,
                    pipeline_model_parallel_size: int) -> None:
    """Refuse, before anything is built, what the trainer comparison does not do yet.

    Raises:
        TrainerLogProbsError: a hybrid model; ``matched`` on ``cuda`` (the
            matched attention is the CPU backend's).
    """
    why = None
    if case.model.is_hybrid and forward.attention == "matched":
        why = ("matched is for GPT models: a hybrid model's training forward scans each Mamba layer in chunks "
               "where the engine's decode steps run the recurrence token by token (other float arithmetic); "
               "use --trainer-logprobs megatron (for information)")
    elif forward.attention == "matched" and device != "cpu":
        why = "matched needs the CPU backend (--device cpu); use --trainer-logprobs megatron on cuda"
    if why:
        raise TrainerLogProbsError(f"--trainer-logprobs {why}")


def batch_sequences(sequences: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token and position IDs of the full sequences (prompt + generated).

    Returns:
        ``(tokens, position_ids)``, both ``[B, L]`` int64 on the CPU, ``L`` the longest sequence;
        positions are ``0..L-1`` in every row. Padding (``pad_id``) only follows real tokens, so
        with causal attention no real token sees it.
    """
    longest = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = torch.tensor(list(sequence), dtype=torch.long)
    return tokens, torch.arange(longest, dtype=torch.long).expand(len(sequences), longest).contiguous()


def trainer_log_probs(model: Any, requests: Sequence[tuple[Sequence[int], Sequence[int]]],
                      forward: TrainerForward = TrainerForward(),
                      routing: Optional[Sequence[Sequence]] = None) -> list[torch.Tensor]:
    """Log-probs of every generated token under the model's training forward.

    One ``GPTModel.forward(tokens, position_ids, attention_mask=None)`` over all requests, batched
    (``[B, L]``, right-padded); megatron-core returns logits ``[B, L, V]`` (``V`` the padded
    vocabulary, in the model's dtype). For request ``i`` with prompt length ``p`` and ``g``
    generated tokens, token ``k`` gets ``log_softmax(float32(logits[i, p - 1 + k]))[token]``.

    Args:
        model: the ``GPTModel`` (this rank's stage and shard) the engine ran, in eval mode. With TP or
            PP every rank calls this (collectives): TP gathers the logits' vocabulary shards
            (``runtime_gather_output``); PP runs megatron-core's pipeline schedule forward only and
            broadcasts the last stage's log-probs to every stage.
        requests: per request ``(prompt_tokens, generated_tokens)``; a prompt has at least one token.
        forward: how attention and matrix products compute (:class:`TrainerForward`).
        routing: an MoE model with routing replay: per request the engine's ``routing_indices``
            (``[prompt + generated - 1][layers][topk]``), replayed by every router
            (:func:`~megatron_ext.harness.routing.replaying`), as rollout routing replay trains;
            None: the routers compute their own top-k.

    Returns:
        Per request a float32 tensor ``[g]`` of natural-log probabilities (``[0]`` for none).
    """
    sequences = [list(p) + list(g) for p, g in requests]
    tokens, positions = batch_sequences(sequences)
    device = next(model.parameters()).device
    replay = contextlib.nullcontext() if routing is None else replaying(
        model, replay_targets(routing, tokens.shape[1], len(router_replays(model)), model.config.moe_router_topk))
    with forward.active(), _not_inferring(), torch.no_grad(), replay:
        logits = _logits(model, tokens.to(device), positions.to(device))  # [B, L, V]; None off the last stage
        result = []
        for row, (prompt, generated) in enumerate(requests):
            if logits is None or not generated:
                result.append(torch.zeros(len(generated) if logits is None else 0, dtype=torch.float32))
                continue
            start = len(prompt) - 1
            rows = logits[row, start: start + len(generated)].float()  # [g, V]
            index = torch.tensor(list(generated), dtype=torch.long, device=rows.device).unsqueeze(-1)
            result.append(torch.log_softmax(rows, dim=-1).gather(-1, index).squeeze(-1).cpu())
    return _from_last_stage(result)


def _logits(model: Any, tokens: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
    """The training forward's logits ``[B, L, V]`` (model dtype); with PP > 1 run by megatron-core's
    pipeline schedule (forward only, one micro-batch), and None on every stage but the last.
    ``runtime_gather_output``: with TP the vocabulary shards are gathered, as Megatron-LM RL asks."""
    from .engine import model_parallel_sizes

    if model_parallel_sizes()[1] == 1:
        return model(tokens, positions, None, runtime_gather_output=True)
    from .. import mcore

    schedules = mcore.import_module("megatron.core.pipeline_parallel.schedules")

    def step(batches: Iterator, chunk: Any) -> tuple[torch.Tensor, Any]:
        batch_tokens, batch_positions = next(batches)
        return (chunk(batch_tokens, batch_positions, None, runtime_gather_output=True),
                lambda output, non_loss_data=False: output)  # the last stage's logits, collected as they are

    collected = schedules.get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([(tokens, positions)]), model=[model], num_microbatches=1,
        seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True, collect_non_loss_data=True)
    return collected[0] if collected else None


def _from_last_stage(log_probs: list[torch.Tensor]) -> list[torch.Tensor]:
    """With PP > 1: every stage gets the last stage's log-probs (a broadcast over the pipeline
    group; the other stages hold zeros of the right lengths); unchanged otherwise."""
    from .. import mcore
    from .engine import model_parallel_sizes

    if model_parallel_sizes()[1] == 1 or not log_probs:
        return log_probs
    parallel_state = mcore.import_module("megatron.core.parallel_state")
    flat = torch.cat(log_probs)
    torch.distributed.broadcast(flat, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                group=parallel_state.get_pipeline_model_parallel_group())
    return list(flat.split([len(x) for x in log_probs]))


@contextlib.contextmanager
def _not_inferring() -> Iterator[None]:
    """megatron-core's process-wide "an engine is using the model" flag off for the block (0.18+:
    ``InferenceMode``, which the engine sets when built and clears in ``suspend()``, as an RL job
    does before training), then back as it was; the model otherwise takes inference-only paths."""
    from .. import mcore

    mode = getattr(mcore.import_module("megatron.core.inference.utils"), "InferenceMode", None)
    was_active = mode is not None and mode.is_active()
    if was_active:
        mode.unset_active()
    try:
        yield
    finally:
        if was_active:
            mode.set_active()


def k3(engine: float, trainer: float) -> float:
    """Schulman's k3 estimate of KL(engine || trainer) from one token sampled by the engine:
    ``r - 1 - log r`` with ``log r = trainer - engine`` (natural-log probabilities); >= 0, and
    exactly 0.0 when the two are equal."""
    log_ratio = trainer - engine
    return math.expm1(log_ratio) - log_ratio


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


@dataclass
class RequestLogProbs:
    """One request of one run: the engine's log-probs vs the trainer's, per generated token.

    Attributes:
        engine, trainer: natural-log probabilities of the generated tokens (float32 values as
            Python floats), the same length.
        first_divergent_token: index of the first generated token whose bits differ, or None.
    """

    request_id: int
    label: str
    engine: list[float]
    trainer: list[float]
    first_divergent_token: Optional[int] = None

    def __post_init__(self) -> None:
        self.first_divergent_token = next(
            (k for k, (e, t) in enumerate(zip(self.engine, self.trainer)) if _bits(e) != _bits(t)), None)

    @property
    def tokens(self) -> int:
        return len(self.engine)

    @property
    def bit_identical_tokens(self) -> int:
        return sum(_bits(e) == _bits(t) for e, t in zip(self.engine, self.trainer))

    @property
    def abs_diffs(self) -> list[float]:
        return [abs(e - t) for e, t in zip(self.engine, self.trainer)]

    @property
    def k3s(self) -> list[float]:
        """:func:`k3` per token."""
        return list(map(k3, self.engine, self.trainer))

    @property
    def k3_kl(self) -> float:
        """Mean k3 over the request's tokens (0.0 without tokens)."""
        return sum(self.k3s) / self.tokens if self.tokens else 0.0

    def as_json(self) -> dict[str, Any]:
        diffs = self.abs_diffs
        return {"request_id": self.request_id, "label": self.label, "tokens": self.tokens,
                "bit_identical_tokens": self.bit_identical_tokens, "max_abs_diff": max(diffs, default=0.0),
                "k3_kl": self.k3_kl, "first_divergent_token": self.first_divergent_token,
                "engine": self.engine, "trainer": self.trainer}


@dataclass
class RunLogProbs:
    """Trainer vs engine over one run (``A: caching off``, ``B: caching on, lru`` ...).

    Attributes:
        label: the run as the report names it.
        requests: per request, in request ID order.
        seconds: wall-clock seconds of the trainer forward and comparison.
        left_out: request IDs not compared: in flight across a weight update (two weight versions).
        left_out_tokens: the tokens those requests generated in this run.
        error: the exception the trainer comparison raised (one line, where it was raised); the
            requests it had not compared yet are in none of the figures. None: it ran through.
        routing_replayed: the trainer forward replayed the engine's MoE routing (every compared
            request had ``routing_indices``); False: its routers computed their own.
    """

    label: str
    requests: list[RequestLogProbs] = field(default_factory=list)
    seconds: float = 0.0
    left_out: list[int] = field(default_factory=list)
    left_out_tokens: int = 0
    error: Optional[str] = None
    routing_replayed: bool = False

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def bit_identical_tokens(self) -> int:
        return sum(r.bit_identical_tokens for r in self.requests)

    @property
    def first_divergent(self) -> Optional[RequestLogProbs]:
        """The first request (by ID) with a token that differs, or None."""
        return next((r for r in self.requests if r.first_divergent_token is not None), None)

    @property
    def max_abs_diff(self) -> float:
        """Max |Δ log-prob| (nats) over every compared token (0.0 without tokens)."""
        return max((d for r in self.requests for d in r.abs_diffs), default=0.0)

    def as_json(self) -> dict[str, Any]:
        """``{tokens, bit_identical_tokens, max_abs_diff, mean_abs_diff, k3_kl, left_out_requests,
        left_out_tokens}``: ``tokens`` the compared ones; |Δ| in nats over every compared token;
        ``k3_kl`` the mean k3 over them (0.0 without tokens); ``left_out_*`` the requests in flight
        across a weight update, not compared, and the tokens they generated."""
        diffs = [d for r in self.requests for d in r.abs_diffs]
        k3s = [value for r in self.requests for value in r.k3s]
        return {"tokens": self.tokens, "bit_identical_tokens": self.bit_identical_tokens,
                "max_abs_diff": self.max_abs_diff,
                "mean_abs_diff": sum(diffs) / len(diffs) if diffs else 0.0,
                "k3_kl": sum(k3s) / len(k3s) if k3s else 0.0,
                "left_out_requests": len(self.left_out), "left_out_tokens": self.left_out_tokens,
                "routing_replayed": self.routing_replayed}


def compare_run(label: str, outputs: dict[int, RequestOutput],
                trainer: dict[int, Sequence[float]]) -> RunLogProbs:
    """Per request and token, the engine's log-probs (``outputs``) vs the trainer's.

    Args:
        label: the run's name in the report.
        outputs: request ID -> what the engine produced.
        trainer: request ID -> the trainer's log-probs of that request's generated tokens.

    Raises:
        ValueError: a request's engine log-probs and trainer log-probs differ in count.
    """
    run = RunLogProbs(label)
    for request_id in sorted(outputs):
        engine = [float(x) for x in outputs[request_id].log_probs]
        theirs = [float(x) for x in trainer[request_id]]
        if len(engine) != len(theirs):
            raise ValueError(f"{label}: request {outputs[request_id].label}: {len(engine)} engine log-probs "
                             f"for {len(theirs)} trainer log-probs")
        run.requests.append(RequestLogProbs(request_id, outputs[request_id].label, engine, theirs))
    return run


def compare_with_trainer(model: Any, label: str, prompts: dict[int, Sequence[int]],
                         outputs: dict[int, RequestOutput], forward: TrainerForward) -> RunLogProbs:
    """The trainer forward over one run's requests (:func:`trainer_log_probs`), compared with the
    engine's log-probs (:func:`compare_run`); ``prompts``: request ID -> prompt token IDs. Requests
    that generated nothing (a run that ended early) count no tokens.

    Raises:
        ValueError: the engine returned another number of log-probs than tokens for a request.
    """
    started = time.perf_counter()
    ran = [rid for rid in sorted(outputs) if outputs[rid].tokens]
    routing = [outputs[rid].routing for rid in ran]
    replayed = bool(ran) and bool(router_replays(model)) and all(r is not None for r in routing)
    computed = trainer_log_probs(model, [(prompts[rid], outputs[rid].tokens) for rid in ran], forward,
                                 routing if replayed else None) if ran else []
    trainer = {rid: [] for rid in outputs}
    trainer.update({rid: values.tolist() for rid, values in zip(ran, computed)})
    run = compare_run(label, outputs, trainer)
    run.seconds, run.routing_replayed = time.perf_counter() - started, replayed
    return run


class TrainerComparison:
    """The trainer forward of every run of one ``ab``, collected in run order in :attr:`result`.

    Without weight updates each run is compared once, after it ends. With a ``WeightUpdater``
    (a case with ``weight_updates``), the requests generated wholly under one weight version are
    compared with those weights: before each update (the trainer's view of the round that just
    ran), and the last round after the run. A request in flight across an update saw two weight
    versions, so no single training forward is on-policy for it: it is left out and listed
    (:attr:`RunLogProbs.left_out`).

    An exception inside the trainer comparison (the training forward, or the comparison) is
    recorded in the run's :attr:`RunLogProbs.error` and the run's remaining requests are not
    compared; it never reaches the engine's step loop, which would report it as megatron-core's
    engine failing.
    """

    def __init__(self, model: Any, planned: Sequence[Any], forward: TrainerForward):
        self.model, self.forward = model, forward
        self.prompts = {r.request_id: r.prompt_tokens for r in planned}
        self.result = TrainerLogProbs(forward.mode)
        self.start()

    def start(self, updater: Any = None) -> None:
        """A run begins; ``updater`` (a ``WeightUpdater`` or None): compare before each of its updates."""
        self._requests: list[RequestLogProbs] = []
        self._done: set[int] = set()
        self._spanning: set[int] = set()
        self._seconds = 0.0
        self._error: Optional[str] = None
        self._replayed: Optional[bool] = None  # every comparison of the run replayed the engine's routing
        if updater is None:
            return
        update = updater.update

        def compare_then_update(record: Any, outputs: dict[int, RequestOutput], finished: set[int]) -> None:
            self._spanning |= set(outputs) - finished
            self._compare(outputs, finished - self._done - self._spanning,
                          f"before weight update {record.index} (engine step {record.step})")
            update(record, outputs, finished)

        updater.update = compare_then_update

    def after(self, run: Any) -> None:
        """A run (a ``RunRecord``: ``label``, ``outputs``) ended: compare what is left, record the run."""
        self._compare(run.outputs, set(run.outputs) - self._done - self._spanning, "after the run")
        ordered = sorted(self._requests, key=lambda r: r.request_id)
        spanning = sorted(self._spanning)
        self.result.runs.append(RunLogProbs(
            run.label, ordered, self._seconds, spanning,
            left_out_tokens=sum(len(run.outputs[rid].tokens) for rid in spanning), error=self._error,
            routing_replayed=bool(self._replayed)))

    def _compare(self, outputs: dict[int, RequestOutput], ids: set[int], when: str) -> None:
        if not ids or self._error is not None:
            return
        try:
            compared = compare_with_trainer(self.model, "", self.prompts, {rid: outputs[rid] for rid in ids},
                                            self.forward)
        except Exception as exc:  # noqa: BLE001 - the verdict names it as the trainer's, with where it was raised
            self._error = f"{when}: {describe_exception(exc)}"
            return
        self._requests.extend(compared.requests)
        self._seconds += compared.seconds
        self._done |= ids
        self._replayed = compared.routing_replayed and self._replayed is not False


@dataclass
class TrainerLogProbs:
    """``ab --trainer-logprobs``: the mode and one :class:`RunLogProbs` per run, in run order."""

    mode: str
    runs: list[RunLogProbs] = field(default_factory=list)

    def failures(self) -> list[str]:
        """One sentence per failing run, naming the run: in any mode, a trainer comparison that
        raised (named as the trainer's) or a run that compared no token; ``matched`` also, a token
        that differs (the first such request and token, and both values). A ``megatron`` (or mixed)
        forward's differences are information only."""
        problems = []
        for run in self.runs:
            where = f"trainer vs engine log-probs ({self.mode}): {run.label}"
            if run.error is not None:
                problems.append(
                    f"{where}: the trainer forward (the model's training forward that --trainer-logprobs runs, "
                    f"not the engine) raised {run.error}; {len(run.requests)} requests compared before it")
                continue
            if not run.tokens:
                why = (f"{len(run.left_out)} requests ({run.left_out_tokens} tokens) left out, in flight across a "
                       "weight update; a request that finishes before the next update is compared"
                       if run.left_out else "the engine generated no token")
                problems.append(f"{where}: 0 tokens compared, nothing was checked: {why}")
                continue
            first = run.first_divergent
            if self.mode != "matched" or first is None:
                continue
            k = first.first_divergent_token
            problems.append(
                f"{where}: {run.tokens - run.bit_identical_tokens} of {run.tokens} tokens differ; first: request "
                f"{first.label} (id {first.request_id}) generated token {k}: engine {first.engine[k]!r} vs "
                f"trainer {first.trainer[k]!r}")
        return problems

    def pass_clause(self) -> str:
        """What the PASS line says of the comparison (it passed): ``matched``: every compared token
        bit-identical; any other forward: identical tokens of all and the max |Δ log-prob| (nats),
        for information; then the requests and tokens left out (in flight across a weight update).
        Counts are summed over the runs (a request left out of two runs counts twice)."""
        tokens = sum(r.tokens for r in self.runs)
        left_out = (f"(left out, in flight across a weight update: {sum(len(r.left_out) for r in self.runs)} "
                    f"requests, {sum(r.left_out_tokens for r in self.runs)} tokens)")
        replayed = sum(r.routing_replayed for r in self.runs)
        left_out += f" with the engine's MoE routing replayed in {replayed} of {len(self.runs)} runs" if replayed else ""
        if self.mode == "matched":
            return (f"trainer log-probs (matched) bit-identical to the engine's in all {tokens} compared tokens of "
                    f"{len(self.runs)} runs {left_out}")
        identical = sum(r.bit_identical_tokens for r in self.runs)
        largest = max((r.max_abs_diff for r in self.runs), default=0.0)
        return (f"trainer ({self.mode}, for information): {identical}/{tokens} identical, max |Δ| {largest:.3g} nats "
                f"{left_out}")

    def as_json(self) -> dict[str, Any]:
        """Run label -> :meth:`RunLogProbs.as_json` (the ab JSON's ``trainer_logprobs``)."""
        return {run.label: run.as_json() for run in self.runs}

    def detail_json(self) -> dict[str, Any]:
        """The mode, seconds per run, the requests left out, the trainer comparison's error (None:
        none) and per-request figures (the ab JSON's ``trainer_logprobs_detail``)."""
        return {"mode": self.mode, "seconds": {run.label: round(run.seconds, 3) for run in self.runs},
                "left_out": {run.label: run.left_out for run in self.runs},
                "error": {run.label: run.error for run in self.runs},
                "requests": {run.label: [r.as_json() for r in run.requests] for run in self.runs}}
