"""``megatron-ext ab``: run a case with prefix caching off (A) and on (B) and compare bit for bit.

A runs once; B runs once per eviction policy the case lists. Same model weights, same seed, same
arrival schedule. The verdict is positive only if every B equals A bit for bit, every audit holds
and the case's expectations (e.g. that prefix caching really skipped prefill) are met.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from .. import mcore
from ..api import apply, revert
from ..errors import DeviceUnavailableError
from ..patches import (MlaAbsorbedWeightsPatch, RoutingEvictedRequestsPatch, RoutingPerBlockPatch,
                       TopNPrefillChunksPatch)
from ..patching import fault_label
from .audits import FAULT_OF_KIND, pool_blocks
from .audits.speculative import DraftCounts
from .speculative import check_supported as check_speculative, is_speculative
from .cases.planning import PlannedRequest, check_top_n_fits, plan_requests, validate_planned
from .cases.schema import Case, CaseFileError
from .checkpoint import CheckpointSource, PathLike, load_checkpoint, resolve_checkpoint
from .checkpoint_args import check_case_model_matches_args, checkpoint_model_spec
from .compare import RequestDiff, RequestOutput, compare_runs, routing_absent, routing_miscounted, top_n_miscounted
from .distributed import gather_ranks, is_multi_rank, rank_failed, rank_failures
from .rounds import left_out, update_mismatches
from .engine import build_engine, build_model, dist_timeout, ensure_model_parallel
from .hybrid import MAMBA_STATE_DTYPE_RULE, bf16_mamba_states, kernel_dtypes, mamba_state_dtype_warning
from .mla import check_mla_run, step_kind_warning
from .step_loop import RunRecord, drive
from .tokenizer import Tokenizer, check_vocab_fits, default_tokenizer
from .post_update import PostUpdateCheck, PostUpdateReference
from .trainer_logprobs import TrainerComparison, TrainerForward, TrainerLogProbs, check_supported
from .weight_updates import WeightSnapshot, WeightUpdateError, WeightUpdater

#: Audit violation kinds of the LRU faults 3-5, and what a count of them means in a verdict.
LRU_FAULT_VIOLATIONS = {
    "prefix_chain": "cached blocks outlived their parent (a lookup of their prefix raises KeyError)",
    "block_table": "block IDs held twice in one live block table (new KV overwrote matched KV)",
    "child_count": "child counts that disagree with the registered blocks (parents never evictable)",
}

#: Exit codes of ``megatron-ext ab``.
EXIT_OK, EXIT_DIVERGED, EXIT_NOT_INVARIANT = 0, 1, 3


@dataclass
class PolicyResult:
    """B under one eviction policy, compared with A."""

    policy: str
    run: RunRecord
    diffs: list[RequestDiff]

    @property
    def bit_identical(self) -> bool:
        return all(d.identical for d in self.diffs)


@dataclass
class ABResult:
    """Everything ``ab`` found; :meth:`as_json` is what ``--json`` writes."""

    case: Case
    megatron_core_version: str
    device: str
    patches: list[dict]
    invariance: tuple[bool, str]
    baseline: RunRecord
    policies: list[PolicyResult] = field(default_factory=list)
    wall_s: float = 0.0
    #: multi-rank runs: every rank's verdict (:func:`megatron_ext.harness.distributed.rank_verdict`)
    ranks: list[dict] = field(default_factory=list)
    #: the checkpoint both A and B ran with (``--load``); None: seeded random weights
    checkpoint: Optional[CheckpointSource] = None
    #: the requests as planned, for ``megatron-ext compare`` to refuse runs of other prompts:
    #: ``{"request_id", "label", "prompt_length", "prompt_sha256"}`` (SHA-256 of the prompt's
    #: token IDs as little-endian int64)
    requests: list[dict] = field(default_factory=list)
    #: the model was built from the checkpoint's Megatron-LM args (the case had no model section)
    model_from_checkpoint_args: bool = False
    #: the tokenizer that planned the prompts and detokenized outputs; None: not recorded
    tokenizer: Optional[Tokenizer] = None
    #: ``checkpoint`` weight updates: the checkpoints loaded at the updates (one for all, or one each)
    update_checkpoints: list[CheckpointSource] = field(default_factory=list)
    #: ``--trainer-logprobs``: the trainer forward's log-probs vs the engine's, per run; None: not asked
    trainer_logprobs: Optional[TrainerLogProbs] = None
    #: a case with weight updates: every run against fresh engines on the weights it ran under
    post_update_reference: Optional[PostUpdateReference] = None
    #: ``--allow-unknown-args``: the Megatron case's arguments not known to megatron-ext that the
    #: run went without (the verdict holds for the model built without them)
    unknown_args_allowed: list[str] = field(default_factory=list)

    def weights(self) -> dict[str, Any]:
        """Where the weights came from: ``{"source": "checkpoint", "requested", "path",
        "iteration", "backend"}`` (plus ``"model": "checkpoint args"`` when the model was built
        from them) or ``{"source": "seeded random", "seed"}``."""
        if self.checkpoint is not None:
            extra = {"model": "checkpoint args"} if self.model_from_checkpoint_args else {}
            return {"source": "checkpoint", **self.checkpoint.as_json(), **extra}
        return {"source": "seeded random", "seed": self.case.model.seed}

    def describe_weights(self) -> str:
        """One line for the report."""
        if self.checkpoint is not None:
            built = "; model built from its Megatron-LM args" if self.model_from_checkpoint_args else ""
            return f"weights: checkpoint {self.checkpoint.describe()}{built}"
        return f"weights: seeded random (seed {self.case.model.seed}; --load DIR to use a checkpoint)"

    @property
    def runs(self) -> list[RunRecord]:
        """A (caching off), then B per eviction policy, in the order they ran."""
        return [self.baseline] + [p.run for p in self.policies]

    @property
    def bit_identical(self) -> bool:
        return all(p.bit_identical for p in self.policies)

    def total(self, key: str) -> int:
        """Sum of the audit count ``key`` (an :class:`AuditSummary` field) over every run."""
        return sum(getattr(p.run.audit, key) for p in self.policies) + getattr(self.baseline.audit, key)

    def failures(self) -> list[str]:
        """Why the verdict is negative, one sentence each; empty when everything holds. Multi-rank:
        the failures of every rank, each naming its rank, and any disagreement between ranks."""
        if len(self.ranks) > 1:
            return rank_failures(self.ranks)
        return self.local_failures()

    def _routing_count_failures(self, run: RunRecord) -> list[str]:
        """What a run's per-request routing says on its own (caught where A and B are equally
        wrong): too few rows (fault R1), too many (fault R3 on 0.17), none (fault R3 on 0.18+)."""
        if "routing_replay" not in self.case.model.features:
            return []
        name, problems = run.eviction_policy or "caching off", []
        short, long = routing_miscounted(run.outputs)
        # a request the audit saw rebuilt to nothing is fault R2's, named by _routing_failures
        absent = [label for rid, label in routing_absent(run.outputs) if rid not in run.audit.routing_unrebuilt]
        for labels, label, what in (
                (short, fault_label(RoutingPerBlockPatch), "whose routing has fewer rows than tokens but the last"),
                (long, fault_label(RoutingEvictedRequestsPatch), "whose routing repeats rows (more than tokens but the last)"),
                (absent, fault_label(RoutingEvictedRequestsPatch), "that generated tokens but got no routing")):
            if labels:
                problems.append(f"{label}: run {name}: {len(labels)} requests {what}: {', '.join(labels[:6])}")
        return problems

    def _routing_failures(self) -> list[str]:
        """The routing-replay audit's findings: requests given no routing (fault R2), then replays
        of stale or wrong expert IDs (no patch), each with its first example."""
        problems = []
        for kind, label, what in (
                ("routing_missing", FAULT_OF_KIND["routing_missing"], "finished MoE requests given no routing"),
                ("routing_replay", "routing replay (no patch)", "replayed expert IDs stale, wrong or of other tokens")):
            count = sum(run.audit.violations_by_kind.get(kind, 0) for run in self.runs)
            if count:
                example = next((line for run in self.runs for line in run.audit.examples.get(kind, [])), "")
                problems.append(f"{label}: {count} {what}" + (f"; first: {example}" if example else ""))
        return problems

    def local_failures(self) -> list[str]:
        """This rank's own failures (the whole verdict with one rank)."""
        problems = []
        if not self.invariance[0]:
            problems.append(f"the platform is not batch-invariant: {self.invariance[1]}")
        for kind, what in (("kv_write", "KV writes into blocks obtained by a hash match"),
                           ("kv_write_foreign", "KV writes into blocks not in the writer's block table")):
            count = sum(run.audit.violations_by_kind.get(kind, 0) for run in self.runs)
            if count:
                problems.append(f"{FAULT_OF_KIND[kind]}: {count} {what}")
        if self.total("refcount_violations"):
            problems.append(
                f"{FAULT_OF_KIND['ref_count']}: {self.total('refcount_violations')} ref-count / "
                "free-pool / drain violations (shared blocks leaked)")
        for kind, what in LRU_FAULT_VIOLATIONS.items():
            count = sum(run.audit.violations_by_kind.get(kind, 0)
                        for run in self.runs)
            if count:
                problems.append(f"{FAULT_OF_KIND[kind]}: {count} {what}")
        if self.total("stale_hits"):
            problems.append(
                f"{FAULT_OF_KIND['stale_hit']}: {self.total('stale_hits')} stale hits: requests admitted after a "
                "weight update matched KV blocks cached under older weights")
        if self.total("mamba_restore_violations"):
            problems.append(
                f"{FAULT_OF_KIND['mamba_restore']}: {self.total('mamba_restore_violations')} hybrid requests "
                "skipped prefill tokens without their Mamba state restored")
        problems.extend(self._routing_failures())
        if self.total("speculative_violations"):
            problems.append(
                f"speculative decoding: {self.total('speculative_violations')} violations (hash-registered "
                "blocks holding drafts, or a rollback that left the KV bookkeeping broken)")
        problems.extend(self._update_mismatches())
        problems.extend(self._mla_update_failures())
        if self.trainer_logprobs is not None:
            problems.extend(self.trainer_logprobs.failures())
        if self.post_update_reference is not None:
            problems.extend(self.post_update_reference.failures())
        for run in self.runs:
            if run.error:
                problems.append(f"megatron-core raised in run {run.eviction_policy or 'caching off'} at {run.error}")
            problems.extend(self._routing_count_failures(run))
            miscounted = top_n_miscounted(run.outputs)  # caught even where A and B are equally wrong
            if miscounted:
                problems.append(f"{fault_label(TopNPrefillChunksPatch)}: run {run.eviction_policy or 'caching off'}: "
                                f"{len(miscounted)} requests whose top-n log-probs are not one entry per "
                                f"generated token: {', '.join(miscounted[:6])}")
        expect = self.case.expectations
        differing = False
        for p in self.policies:
            left_out = set(self.left_out(p))
            if expect.bit_identical and any(not d.identical and d.request_id not in left_out for d in p.diffs):
                bad = [d.label for d in p.diffs if not d.identical and d.request_id not in left_out]
                never_ran = sum(1 for d in p.diffs if not d.identical and not p.run.outputs[d.request_id].tokens)
                why = f" ({never_ran} never ran: the run ended early)" if p.run.error and never_ran else ""
                problems.append(f"{p.policy}: {len(bad)} requests differ with caching on vs off{why}: "
                                f"{', '.join(bad[:6])}")
                differing = True
            if p.run.counters.blocks_matched < expect.min_blocks_matched:
                problems.append(f"{p.policy}: only {p.run.counters.blocks_matched} blocks "
                                f"matched, case expects >= {expect.min_blocks_matched}")
            if p.run.counters.prefill_tokens_skipped < expect.min_prefill_tokens_skipped:
                problems.append(f"{p.policy}: only {p.run.counters.prefill_tokens_skipped} prefill "
                                f"tokens skipped, case expects >= {expect.min_prefill_tokens_skipped}")
        if differing and bf16_mamba_states(self.case.model):  # never a difference without its known cause
            problems.append("fault H2 (not patched): " + MAMBA_STATE_DTYPE_RULE)
        return problems

    def warnings(self) -> list[str]:
        """Lines the report prints before the tables: a case that breaks a rule under which a
        difference is known to occur (:func:`~megatron_ext.harness.hybrid.mamba_state_dtype_warning`,
        whatever the verdict), an MLA case that differs (:func:`~megatron_ext.harness.mla.step_kind_warning`)."""
        drafts = self.speculative_drafts()
        lines = [mamba_state_dtype_warning(self.case.model) if self.policies else None,
                 step_kind_warning(self.case, self.bit_identical) if self.policies else None,
                 drafts.none_accepted_warning() if drafts is not None else None]
        return [line for line in lines if line]

    def speculative_drafts(self) -> Optional[DraftCounts]:
        """Speculative decoding (``inference.num_speculative_tokens > 0``): the speculative audit's
        draft counts summed over every run (A and each B; each run's own are its ``audit.drafts``);
        None without speculative decoding."""
        if not is_speculative(self.case):
            return None
        return DraftCounts.total(run.audit.drafts for run in self.runs)

    def _mla_update_failures(self) -> list[str]:
        """Fault M1: a weight update that left an MLA layer's decode-only KV up-projection on old weights."""
        return [f"{fault_label(MlaAbsorbedWeightsPatch)}: run {run.eviction_policy or 'caching off'}: after weight "
                f"update {update.index} (step {update.step}) decode-only steps of MLA layers "
                f"{', '.join(map(str, update.mla_stale_layers))} keep the old KV up-projection (prefill steps have the new one)"
                for run in self.runs for update in run.updates if update.mla_stale_layers]

    def _update_mismatches(self) -> list[str]:
        return update_mismatches(self.case, self.baseline, [(p.policy, p.run) for p in self.policies])

    def left_out(self, policy: PolicyResult) -> list[int]:
        """Request IDs left out of ``policy``'s bit-identity check (:func:`~megatron_ext.harness.rounds.left_out`)."""
        return left_out(self.case, self.baseline, policy.run)

    def exit_code(self) -> int:
        if not self.invariance[0] or not all(r["batch_invariance_ok"] for r in self.ranks):
            return EXIT_NOT_INVARIANT
        return EXIT_OK if not self.failures() else EXIT_DIVERGED

    def as_json(self) -> dict[str, Any]:
        first = self.policies[0] if self.policies else None
        return {
            "case": self.case.name,
            "bit_identical": self.bit_identical,
            "verdict": "pass" if not self.failures() else "fail",
            "failures": self.failures(),
            "warnings": self.warnings(),
            "unknown_args_allowed": self.unknown_args_allowed,
            "num_requests": len(self.baseline.outputs),
            "kv_write_violations": self.total("kv_write_violations"),
            "refcount_violations": self.total("refcount_violations"),
            "lru_violations": self.total("lru_violations"),
            "stale_hits": self.total("stale_hits"),
            "model_features": self.case.model_features,
            **({} if not self.case.inference.num_speculative_tokens else {
                "speculative_violations": self.total("speculative_violations"),
                "speculative_drafts": self.speculative_drafts().as_json()}),
            **({} if not self.case.model.is_hybrid else {
                "mamba_restores": self.total("mamba_restores"),
                "mamba_restores_failed": self.total("mamba_restores_failed"),
                "mamba_restore_violations": self.total("mamba_restore_violations")}),
            **({} if "routing_replay" not in self.case.model.features else {
                "routing_replay_violations": self.total("routing_replay_violations"),
                "routing_tokens_checked": self.total("routing_tokens_checked"),
                "block_routing_max_entries": max(
                    [r.audit.block_routing_max_entries for r in self.runs] or [0])}),
            "weight_updates": (None if self.case.weight_updates is None else
                               {**self.case.weight_updates.model_dump(), "rounds": self.case.weight_updates.rounds,
                                "checkpoints": [c.path for c in self.update_checkpoints]
                                or self.case.weight_updates.checkpoints}),
            "prefill_tokens_skipped": sum(p.run.counters.prefill_tokens_skipped for p in self.policies),
            "blocks_matched": sum(p.run.counters.blocks_matched for p in self.policies),
            "megatron_core_version": self.megatron_core_version,
            "device": self.device,
            "weights": self.weights(),
            **({"tokenizer": self.tokenizer.as_json()} if self.tokenizer is not None else {}),
            "patches": self.patches,
            "batch_invariance_check": {"ok": self.invariance[0], "detail": self.invariance[1]},
            "wall_s": round(self.wall_s, 3),
            "layout": {k: v for k, v in (self.ranks[0] if self.ranks else {}).items()
                       if k in ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size")},
            "ranks": self.ranks,
            "requests": self.requests,
            "baseline": _run_json(self.baseline),
            "policies": [
                {"eviction_policy": p.policy, "bit_identical": p.bit_identical, "run": _run_json(p.run),
                 "left_out_of_bit_identity": [self.baseline.outputs[rid].label for rid in self.left_out(p)],
                 "requests": [d.as_dict() for d in p.diffs]}
                for p in self.policies
            ],
            "example_divergence": next((d.as_dict() for d in first.diffs if not d.identical), None) if first else None,
            **({} if self.trainer_logprobs is None else {
                "trainer_logprobs": self.trainer_logprobs.as_json(),
                "trainer_logprobs_detail": self.trainer_logprobs.detail_json()}),
            **({} if self.post_update_reference is None else {
                "post_update_reference": self.post_update_reference.as_json()}),
        }


def _request_json(request: PlannedRequest) -> dict[str, Any]:
    tokens = struct.pack(f"<{len(request.prompt_tokens)}q", *request.prompt_tokens)
    return {"request_id": request.request_id, "label": request.label, "round": request.round,
            "arrival_step": request.arrival_step,
            "prompt_length": len(request.prompt_tokens), "prompt_sha256": hashlib.sha256(tokens).hexdigest()}


def _run_json(run: RunRecord) -> dict[str, Any]:
    return {
        "prefix_caching": run.prefix_caching,
        "error": run.error,
        "eviction_policy": run.eviction_policy,
        "steps": run.steps,
        "wall_s": round(run.wall_s, 3),
        "counters": asdict(run.counters),
        "pressure": asdict(run.pressure),
        "audit": asdict(run.audit),
        "updates": [asdict(u) for u in run.updates],
        "outputs": {rid: _output_json(o) for rid, o in run.outputs.items()},
    }


def _output_json(output: RequestOutput) -> dict[str, Any]:
    fields = {"label": output.label, "tokens": output.tokens, "log_probs": output.log_probs,
              "token_steps": output.token_steps}
    if output.top_n_logprobs is not None:  # only when asked for (--top-n-logprobs)
        fields["top_n_logprobs"] = output.top_n_logprobs
    if output.weight_versions is not None:  # recorded by the weight-update patch
        fields["weight_versions"] = output.weight_versions
    if output.routing is not None:  # routing replay: the request's expert IDs per token and layer
        fields["routing"] = output.routing
    return fields


def check_device(device: str) -> None:
    """Refuse a device this machine lacks, before anything is imported or built.

    Raises:
        DeviceUnavailableError: ``cuda`` asked for but no CUDA device is available.
    """
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise DeviceUnavailableError("--device cuda: no CUDA device is available here (torch "
                                     f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                                     "use --device cpu, or run on a machine with a GPU")


@contextlib.contextmanager
def backend(device: str, mamba: bool = False, mamba_dtypes: Any = None) -> Iterator[tuple[bool, str]]:
    """The compute backend for a run; yields the batch-invariance self-check result.

    ``cpu``: megatron-ext's CPU backend with batch-invariant matmuls and its self-check, on one
    intra-op thread (results may depend on the thread count, and the row-wise bf16 products
    stall for milliseconds per call with two threads on a busy 2-core machine).
    ``cuda``: the GPU as it is; bit-identity then relies on the kernels the user configured.
    ``mamba``: the case is a hybrid model; on the CPU megatron's Mamba kernels then run under
    Triton's interpreter (:func:`megatron_ext.cpu_backend.mamba_on_cpu`) and the self-check
    covers them too (:func:`megatron_ext.cpu_backend.mamba_check.mamba_self_check`, with
    ``mamba_dtypes``, a :class:`~megatron_ext.cpu_backend.mamba_check.MambaDtypes`; None: fp32).

    Yields:
        ``(ok, detail)``: ``ok`` iff every check passed; ``detail`` the matmul check's line, then
        (hybrid) the Mamba check's, joined by ``"; "``.

    Raises:
        DeviceUnavailableError: ``cuda`` asked for but no CUDA device is available.
    """
    check_device(device)
    if device == "cuda":
        yield True, "not checked on cuda (configure megatron-core's batch_invariant_mode yourself)"
        return
    import torch

    from ..cpu_backend import cpu_backend, self_check

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with cpu_backend(mamba=mamba):
            yield _combined_checks(self_check(), mamba, mamba_dtypes)
    finally:
        torch.set_num_threads(threads)


def _combined_checks(matmuls: tuple[bool, str], mamba: bool, mamba_dtypes: Any) -> tuple[bool, str]:
    """The matmul self-check's result, and for a hybrid model the Mamba kernels' with it (imported
    only then: GPT-only runs never load megatron's Mamba kernels for it)."""
    if not mamba:
        return matmuls
    from ..cpu_backend.mamba_check import MambaDtypes, mamba_self_check

    ok, detail = mamba_self_check(mamba_dtypes or MambaDtypes())
    return matmuls[0] and ok, f"{matmuls[1]}; {detail}"


def check_moe_biases(case: Case, tensor_model_parallel_size: int = 1) -> None:
    """Refuse what megatron-core cannot do with the expert biases of a mixture-of-experts model
    (``add_bias_linear``; MoE models are trained without them).

    Raises:
        WeightUpdateError: a ``train_step`` weight update: the expert MLP adds its bias in place into
            a view of ``linear_fc2``'s output, which autograd refuses (``RuntimeError``, 0.17-0.19).
        CaseFileError: tensor parallelism: ``TransformerConfig`` asserts expert biases need expert tensor
            parallel size 1, which defaults to the TP size.
    """
    if not (case.model.is_moe and case.model.add_bias_linear):
        return
    if case.weight_updates is not None and case.weight_updates.kind == "train_step":
        raise WeightUpdateError(f"case '{case.name}': weight_updates kind train_step on a mixture-of-experts model "
                                "with add_bias_linear: megatron-core's expert MLP cannot be trained with biases "
                                "(autograd refuses its in-place bias add); set model.add_bias_linear: false or use "
                                "kind perturb")
    if tensor_model_parallel_size > 1:
        raise CaseFileError(f"case '{case.name}': a mixture-of-experts model with add_bias_linear under tensor "
                            f"parallelism (TP={tensor_model_parallel_size}): megatron-core supports expert biases "
                            "with expert tensor parallel size 1 only; set model.add_bias_linear: false")


def run_ab(
    case: Case,
    patched: bool = True,
    device: str = "cpu",
    on_step: Optional[Callable[[int], None]] = None,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    load: Union[PathLike, CheckpointSource, None] = None,
    on_run: Optional[Callable[[RunRecord], None]] = None,
    tokenizer: Optional[Tokenizer] = None,
    update_from: Sequence[Union[PathLike, CheckpointSource]] = (),
    trainer_logprobs: Union[str, TrainerForward, None] = None,
) -> ABResult:
    """Run A (caching off) and B (caching on, per policy) and compare.

    Args:
        case: the test case.
        patched: apply megatron-ext's runtime patches first (else make sure none is applied).
        device: ``cpu`` or ``cuda``.
        on_step: called after every engine step of every run (progress bars).
        tensor_model_parallel_size, pipeline_model_parallel_size: megatron-core's model-parallel
            layout (under torchrun; every rank calls run_ab and gets every rank's verdict).
        load: a Megatron distributed checkpoint (or Megatron-LM save directory) loaded into the
            model after it is built from ``case.model`` and before any engine run; A and B both
            use these weights (:func:`megatron_ext.harness.checkpoint.load_checkpoint`). When the
            case has no ``model`` section (``"model" not in case.model_fields_set``) and the
            checkpoint stores Megatron-LM ``args``, the model is built from them instead
            (:func:`megatron_ext.harness.checkpoint_args.checkpoint_model_spec`; the result's
            ``case.model`` is that model).
        on_run: called with each run's :class:`RunRecord` when it ends (progress lines in logs).
        tokenizer: tokenizes the prompts and detokenizes the outputs
            (:func:`megatron_ext.harness.tokenizer.load_tokenizer`); None: megatron-core's byte-level
            tokenizer as the shipped cases use it.
        update_from: checkpoints loaded at the weight updates of a case whose ``weight_updates``
            kind is ``checkpoint`` (``ab --update-from DIR``; in place of the case's
            ``weight_updates.checkpoints``): one for every update, or one per update. Each is
            loaded once before any run, so a checkpoint that does not fit the model is refused
            before any engine runs.
        trainer_logprobs: ``matched`` or ``megatron`` (``ab --trainer-logprobs``): after each run the
            model's training forward computes the log-probs of every generated token and they are
            compared with the engine's (:mod:`megatron_ext.harness.trainer_logprobs`; a
            :class:`~megatron_ext.harness.trainer_logprobs.TrainerForward` picks attention and
            matrix products separately); with ``matched`` a token that differs fails the verdict; in
            any mode a run that compared no token, or a trainer forward that raised (recorded, named
            as the trainer's), fails it. None: no trainer forward.

    With ``weight_updates`` every run (A and each B) starts from the same weights (a copy taken
    before the first run is restored before each) and makes the same updates at the same steps.

    Raises:
        WeightUpdateError: ``update_from`` without a ``checkpoint`` update, a ``checkpoint`` update
            without checkpoints, or a count that fits neither; a ``train_step`` update with
            pipeline parallelism, or of a mixture-of-experts model with biases
            (:func:`check_moe_biases`; CaseFileError for them under TP > 1).
        MegatronCoreNotFoundError, CaseFileError (prompt too long or empty), TokenizerError (the
        tokenizer's vocabulary exceeds the model's ``vocab_size``), WorkloadError (see
        :func:`megatron_ext.harness.cases.validate_planned`), CheckpointError (``load``: missing, not a
        checkpoint, architecture mismatch, args the harness cannot build), EngineStuckError, RuntimeError;
        MLAUnsupportedError: a multi-latent attention case on a release or with options it cannot run
            with (:func:`megatron_ext.harness.mla.check_mla_run`);
        TrainerLogProbsError: ``trainer_logprobs`` is no mode, or asked for with a hybrid model, or
        ``matched`` on ``cuda``;
        multi-rank: RankFailedError when megatron-core raised mid-run on this rank (the ranks are
        out of lockstep then; single-rank runs record the error in the result instead).
    """
    started = time.perf_counter()
    from_args = False
    if load is not None:  # resolved (and a model from its args read) before anything is built
        load = load if isinstance(load, CheckpointSource) else resolve_checkpoint(load)
        built_for = _case_for_checkpoint(case, load)
        case, from_args = built_for, built_for is not case
    check_mla_run(case, mcore.installed_version(), tensor_model_parallel_size, pipeline_model_parallel_size,
                  trainer_logprobs)
    tokenizer = tokenizer or default_tokenizer()
    check_vocab_fits(tokenizer, case.model.vocab_size, f"case {case.name}")
    check_top_n_fits(case)
    planned = plan_requests(case, tokenizer)
    validate_planned(planned)  # bad input is refused before anything is built
    at_updates = update_checkpoints(case, update_from)
    if case.weight_updates is not None and case.weight_updates.kind == "train_step" and pipeline_model_parallel_size > 1:
        raise WeightUpdateError(f"case '{case.name}': weight_updates kind train_step under pipeline parallelism needs "
                                "megatron-core's pipeline schedule, which ab does not drive; use kind perturb or "
                                "checkpoint with --pipeline-model-parallel-size > 1")
    check_moe_biases(case, tensor_model_parallel_size)
    forward = None
    if trainer_logprobs is not None:
        forward = (trainer_logprobs if isinstance(trainer_logprobs, TrainerForward)
                   else TrainerForward.of_mode(trainer_logprobs))
        check_supported(forward, case, device, tensor_model_parallel_size, pipeline_model_parallel_size)
    check_device(device)
    check_speculative(case, device)
    dist_timeout()  # a bad MEGATRON_EXT_DIST_TIMEOUT_S is refused before megatron-core is imported
    patch_results = apply() if patched else revert()
    patches = [r.as_dict() for r in patch_results]
    with backend(device, mamba=case.model.is_hybrid, mamba_dtypes=kernel_dtypes(case.model)) as invariance:
        ensure_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)
        model = build_model(case)
        checkpoint = None if load is None else load_checkpoint(model, load, case.name)
        snapshot = _initial_weights(model, case, at_updates)
        trainer = TrainerComparison(model, planned, forward) if forward is not None else None
        reference = PostUpdateCheck(case, planned, tokenizer) if snapshot is not None else None
        runs = _Runs(model, case, planned, on_step, on_run, tokenizer, snapshot, at_updates, trainer, reference)
        baseline = runs.one(False, case.prefix_caching_eviction_policies[0])
        result = ABResult(case, mcore.installed_version(), device, patches, invariance, baseline,
                          checkpoint=checkpoint, requests=[_request_json(r) for r in planned],
                          model_from_checkpoint_args=from_args, tokenizer=tokenizer,
                          update_checkpoints=at_updates)
        for policy in case.prefix_caching_eviction_policies:
            run = runs.one(True, policy)
            result.policies.append(PolicyResult(policy, run, compare_runs(baseline.outputs, run.outputs)))
        result.trainer_logprobs = trainer.result if trainer is not None else None
        result.post_update_reference = reference.result() if reference is not None else None
    result.ranks = gather_ranks(result)
    result.wall_s = time.perf_counter() - started
    return result


def _case_for_checkpoint(case: Case, source: CheckpointSource) -> Case:
    """``case`` with the model the checkpoint's Megatron-LM args describe, when the case has no
    ``model`` section and the checkpoint has args; otherwise ``case`` unchanged.

    Raises:
        CheckpointError: the case's model section disagrees with the checkpoint's args on a value
            the weights' shapes cannot show (``norm_epsilon``, ``rotary_base``, ...; see
            :func:`megatron_ext.harness.checkpoint_args.check_case_model_matches_args`).
    """
    if "model" in case.model_fields_set:
        check_case_model_matches_args(source, case.model)
        return case
    spec = checkpoint_model_spec(source, case.model)
    if spec is None:
        return case
    return case.model_copy(update={"model": spec})


def update_checkpoints(case: Case, update_from: Sequence[Union[PathLike, CheckpointSource]]) -> list[CheckpointSource]:
    """The checkpoints of ``checkpoint`` weight updates (``update_from``, else the case's), resolved.

    Raises:
        WeightUpdateError: checkpoints given but the case makes no ``checkpoint`` update, or a
            ``checkpoint`` update has none.
        CheckpointError: a path that is no checkpoint.
    """
    spec = case.weight_updates
    if spec is None or spec.kind != "checkpoint":
        if update_from:
            raise WeightUpdateError(
                f"--update-from loads a checkpoint at each weight update, but case '{case.name}' has "
                + ("no weight_updates section" if spec is None else f"weight_updates of kind {spec.kind}")
                + "; use a case with weight_updates: {kind: checkpoint, ...}")
        return []
    paths = list(update_from) or list(spec.checkpoints)
    if not paths:
        raise WeightUpdateError(f"case '{case.name}': weight_updates kind checkpoint needs the checkpoints to load; "
                                "pass --update-from DIR or list them under weight_updates.checkpoints")
    if len(paths) not in (1, len(spec.update_at_steps)):
        raise WeightUpdateError(f"case '{case.name}': {len(paths)} update checkpoints for "
                                f"{len(spec.update_at_steps)} weight updates; give one (loaded at every update) "
                                "or one per update")
    return [p if isinstance(p, CheckpointSource) else resolve_checkpoint(p) for p in paths]


def _initial_weights(model: Any, case: Case, update_checkpoints: list[CheckpointSource]) -> Optional[WeightSnapshot]:
    """A copy of the weights every run starts from (None without weight updates). Each update
    checkpoint is loaded once first (and the weights restored), so one that does not fit the
    model is refused (CheckpointError) before any engine runs."""
    if case.weight_updates is None:
        return None
    snapshot = WeightSnapshot(model)
    for source in update_checkpoints:
        load_checkpoint(model, source, case.name)
        snapshot.restore(model)
    return snapshot


@dataclass
class _Runs:
    """What every run of one ``run_ab`` shares; :meth:`one` makes one run."""

    model: Any
    case: Case
    planned: list[PlannedRequest]
    on_step: Optional[Callable[[int], None]]
    on_run: Optional[Callable[[RunRecord], None]]
    tokenizer: Tokenizer
    snapshot: Optional[WeightSnapshot]
    update_checkpoints: list[CheckpointSource]
    #: ``--trainer-logprobs``: the trainer forward of each run's requests (before each weight update
    #: for the requests generated under the weights it replaces, and after the run); None: off
    trainer: Optional[TrainerComparison] = None
    #: a case with weight updates: keeps each weight version, compared with fresh engines after the runs
    reference: Optional[PostUpdateCheck] = None

    def one(self, prefix_caching: bool, policy: str) -> RunRecord:
        """One run (caching on with ``policy``, or off), from the initial weights."""
        updater = None
        if self.snapshot is not None:
            self.snapshot.restore(self.model)
            if self.reference is not None:
                self.reference.start(self.model)
            updater = WeightUpdater(self.model, self.case.weight_updates, self.planned, self.update_checkpoints,
                                    self.reference.updated if self.reference is not None else None)
        if self.trainer is not None:
            self.trainer.start(updater)
        run = _one_run(self.model, self.case, self.planned, prefix_caching, policy, self.on_step, self.on_run,
                       self.tokenizer, updater)
        if self.trainer is not None:
            self.trainer.after(run)
        if self.reference is not None:
            self.reference.after(run)
        return run


def _one_run(model, case, planned, prefix_caching, policy, on_step, on_run, tokenizer, updater=None) -> RunRecord:
    started = time.perf_counter()
    engine, context = build_engine(model, case, prefix_caching, policy, tokenizer)
    record = RunRecord(prefix_caching, policy if prefix_caching else None)
    record.total_blocks = pool_blocks(context.kv_block_allocator)
    drive(engine, context, case, planned, record, on_step, updater)
    if record.error and is_multi_rank():  # this rank left the lockstep: it cannot go on
        raise rank_failed(policy if prefix_caching else "caching off", record.error)
    for request in planned:  # a run that megatron-core ended early: requests never added produced nothing
        record.outputs.setdefault(request.request_id, RequestOutput(
            request.request_id, request.label, len(request.prompt_tokens)))
    record.wall_s = time.perf_counter() - started
    if on_run is not None:
        on_run(record)
    return record
