"""Multi-rank ``ab``: every rank runs the same case and audits; rank 0 reports for all.

Under ``torchrun`` each rank runs :func:`megatron_ext.harness.ab.run_ab` itself (its own CPU backend, its
own batch-invariance self-check, its own KV-write and ref-count audits on its own context). At the
end :func:`gather_ranks` collects every rank's verdict with ``all_gather_object`` over the gloo
world group, so every rank knows whether any rank failed (and exits non-zero if one did), and rank
0 names the failing ranks in its report. Ranks of one model-parallel layout must also agree with
each other: the generated tokens and log-probs of every run are hashed per rank and compared (TP
ranks sample from the same gathered logits; PP stages receive them from the last stage).

A rank that raises mid-run cannot take part in the next collective; :class:`RankFailedError` ends
that rank (the CLI prints it with the rank named), and its peers' pending collectives fail when
its connections close, or after ``MEGATRON_EXT_DIST_TIMEOUT_S`` (see
:func:`megatron_ext.harness.engine.ensure_model_parallel`).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Iterable

import torch

from .. import mcore


class RankFailedError(RuntimeError):
    """This rank cannot continue in lockstep with the others (megatron-core raised mid-run)."""


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of torch.distributed; ``(0, 1)`` when it is not initialized."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_multi_rank() -> bool:
    return world()[1] > 1


def layout() -> dict[str, int]:
    """This rank's place: ``rank``, ``world_size``, ``tensor_model_parallel_size`` / ``_rank``,
    ``pipeline_model_parallel_size`` / ``_rank`` (1 / 0 without megatron-core's parallel state)."""
    rank, size = world()
    info = {"rank": rank, "world_size": size, "tensor_model_parallel_size": 1,
            "tensor_model_parallel_rank": 0, "pipeline_model_parallel_size": 1,
            "pipeline_model_parallel_rank": 0}
    parallel_state = mcore.import_module("megatron.core.parallel_state")
    if parallel_state.model_parallel_is_initialized():
        info.update(
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            tensor_model_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            pipeline_model_parallel_rank=parallel_state.get_pipeline_model_parallel_rank())
    return info


def outputs_digest(runs: Iterable[Any]) -> str:
    """SHA-256 over every run's per-request tokens, log-prob bits and top-n log-probs (texts and
    bits; when recorded) (``RunRecord`` objects)."""
    digest = hashlib.sha256()
    for run in runs:
        digest.update(f"run {run.prefix_caching} {run.eviction_policy} {run.error}\n".encode())
        for request_id in sorted(run.outputs):
            output = run.outputs[request_id]
            digest.update(f"{request_id}:{output.tokens}:".encode())
            digest.update(b"".join(struct.pack("<d", x) for x in output.log_probs))
            for entry in output.top_n_logprobs or ():
                digest.update(repr([(text, struct.pack("<d", value)) for text, value in entry]).encode())
    return digest.hexdigest()


def rank_verdict(result: Any) -> dict[str, Any]:
    """What this rank contributes to the gather: its layout, local verdict and output digest."""
    failures = result.local_failures()
    return {
        **layout(),
        "verdict": "pass" if not failures else "fail",
        "failures": failures,
        "batch_invariance_ok": bool(result.invariance[0]),
        "bit_identical": result.bit_identical,
        "kv_write_violations": result.total("kv_write_violations"),
        "refcount_violations": result.total("refcount_violations"),
        "lru_violations": result.total("lru_violations"),
        "outputs_sha256": outputs_digest(result.runs),
    }


def all_ranks(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank; ``[value]`` on one rank.

    A collective (``all_gather_object``): every rank must call it.
    """
    if not is_multi_rank():
        return [value]
    gathered: list[Any] = [None] * world()[1]
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def gather_ranks(result: Any) -> list[dict[str, Any]]:
    """Every rank's :func:`rank_verdict`, in rank order, on every rank (a collective: all ranks
    must call it)."""
    return all_ranks(rank_verdict(result))


def _who(entry: dict[str, Any]) -> str:
    return (f"rank {entry['rank']} (tp {entry['tensor_model_parallel_rank']}, "
            f"pp {entry['pipeline_model_parallel_rank']})")


def rank_failures(ranks: list[dict[str, Any]]) -> list[str]:
    """The failures of all ranks, each naming the rank(s), plus a disagreement between ranks.

    The same sentence from several ranks is reported once, with all their names.
    """
    by_text: dict[str, list[str]] = {}
    for entry in ranks:
        for failure in entry["failures"]:
            by_text.setdefault(failure, []).append(_who(entry))
    problems = [f"{', '.join(names)}: {text}" for text, names in by_text.items()]
    reference = ranks[0]["outputs_sha256"]
    differ = [_who(e) for e in ranks if e["outputs_sha256"] != reference]
    if differ:
        problems.append(f"{', '.join(differ)}: generated tokens / log-probs differ from rank 0's "
                        "(model-parallel ranks must agree bit for bit)")
    return problems


def describe_layout(ranks: list[dict[str, Any]]) -> str:
    """One line for the report: layout, ranks, whether they agree."""
    first = ranks[0]
    agree = len({e["outputs_sha256"] for e in ranks}) == 1
    failed = [str(e["rank"]) for e in ranks if e["verdict"] != "pass"]
    return (f"layout: TP={first['tensor_model_parallel_size']} PP={first['pipeline_model_parallel_size']} "
            f"on {first['world_size']} ranks (gloo); outputs identical on all ranks: "
            f"{'yes' if agree else 'NO'}; ranks failing: {', '.join(failed) or 'none'}")


#: Known reasons a rank fails, matched in megatron-core's error line; the first match is shown.
_HINTS = (
    ("in _is_cuda, megatron/core/inference/communication_utils.py",
     "megatron-core's pipeline-parallel inference communication (communication_utils."
     "broadcast_from_last_pipeline_stage / send_to_next_pipeline_rank) asserts tensor.is_cuda, "
     "so PP > 1 cannot run on the CPU backend"),
    ("Timed out", "a peer rank stopped taking part in collectives (hung, died or left the lockstep)"),
    ("gloo/transport", "a peer rank probably died or failed first; see its message and torchrun's root cause"),
)


def rank_failed(run_name: str, error: str) -> RankFailedError:
    """The error that ends this rank after megatron-core raised in run ``run_name``."""
    info = layout()
    hint = next((hint for needle, hint in _HINTS if needle in error), None)
    return RankFailedError(
        f"rank {info['rank']} of {info['world_size']} (tp {info['tensor_model_parallel_rank']}, "
        f"pp {info['pipeline_model_parallel_rank']}): megatron-core raised in run {run_name} at {error}"
        + (f" [{hint}]" if hint else ""))


def shut_down() -> None:
    """Leave the torch.distributed world together: a barrier, then ``destroy_process_group``.

    Without it each rank tears its gloo process group down during interpreter finalization, and a
    rank whose peer has already exited can abort there (SIGABRT with no Python frame: seen once
    in CI, on a TP=2 ``ab`` run that had passed), which torchrun reports as a failed run. A no-op
    when no process group exists.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()
