"""Planning a case's requests: samples and conversation turns expanded into engine requests,
checked before anything is built or run."""

from __future__ import annotations

from typing import Optional

from ...errors import MegatronExtError
from ..tokenizer import Tokenizer
from .schema import Case, CaseFileError, InferenceSpec, StrictModel, turn_prompts


class WorkloadError(MegatronExtError, ValueError):
    """A list of planned requests the engine must not be given: a zero-token prompt or a request
    ID used twice (the message names the list index and the request ID)."""


class PlannedRequest(StrictModel):
    """One engine request after expanding samples and conversations."""

    request_id: int
    arrival_step: int
    prompt_tokens: list[int]
    num_tokens_to_generate: int
    label: str
    #: the round (weight version) of the request; ``arrival_step`` is absolute (round start added)
    round: int = 0


def plan_requests(case: Case, tokenizer: Tokenizer) -> list[PlannedRequest]:
    """Expand a case's requests into engine requests, ordered by arrival step then ID.

    Request IDs are assigned here (0, 1, ... in case order), so a case cannot repeat one. With
    ``weight_updates`` a request's arrival step is made absolute: its round's start step is added.

    Raises:
        CaseFileError: a prompt plus its generated tokens exceeds ``max_sequence_length``, or a
            prompt has 0 tokens (a case built without validation; case files are refused when
            loaded). Raised before anything is built or run.
    """
    planned: list[PlannedRequest] = []
    for index, spec in enumerate(case.requests):
        for turn, text in enumerate(turn_prompts(spec)):
            tokens = tokenizer.tokenize(spec.prefix + text)
            if not tokens:
                where = f"turn {turn} of 'conversation'" if spec.conversation else "'prompt' (with 'prefix')"
                raise CaseFileError(
                    f"case '{case.name}': field 'requests.{index}': {where} has 0 tokens; megatron-core "
                    "cannot prefill an empty prompt; write at least one character"
                )
            problem = sequence_too_long(case.inference, len(tokens), spec.num_tokens_to_generate)
            if problem:
                raise CaseFileError(f"case '{case.name}': field 'requests.{index}': {problem}")
            start = 0 if case.weight_updates is None else case.weight_updates.round_start(spec.round)
            for sample in range(spec.samples):
                planned.append(PlannedRequest(
                    request_id=len(planned),
                    round=spec.round,
                    arrival_step=start + spec.arrival_step + turn * spec.turn_interval,
                    prompt_tokens=tokens,
                    num_tokens_to_generate=spec.num_tokens_to_generate,
                    label=f"r{index}" + (f".t{turn}" if spec.conversation else "") + f".s{sample}",
                ))
    return sorted(planned, key=lambda p: (p.arrival_step, p.request_id))


def sequence_too_long(inference: InferenceSpec, prompt_tokens: int, generated: int) -> Optional[str]:
    """Why a prompt of ``prompt_tokens`` tokens plus ``generated`` tokens cannot run, or None."""
    total = prompt_tokens + generated
    if total <= inference.max_sequence_length:
        return None
    return (f"prompt of {prompt_tokens} tokens + {generated} generated = {total} exceeds "
            f"inference.max_sequence_length={inference.max_sequence_length}; "
            "shorten the prompt or raise max_sequence_length")


def check_top_n_fits(case: Case) -> None:
    """Refuse top-n log-probs wider than the model's vocabulary (megatron-core's top-k then raises
    at the first step). Call once the model is settled (a checkpoint's args may change it).

    Raises:
        CaseFileError: ``sampling.top_n_logprobs`` exceeds ``model.vocab_size`` (both named).
    """
    if case.sampling.top_n_logprobs > case.model.vocab_size:
        raise CaseFileError(f"case '{case.name}': top-n log-probs {case.sampling.top_n_logprobs} exceed the "
                            f"model's vocabulary of {case.model.vocab_size} tokens; ask for at most that many")


def validate_planned(planned: list[PlannedRequest]) -> None:
    """Refuse requests the engine must not be given; call before building or stepping anything.

    megatron-core itself accepts both in ``DynamicInferenceEngine.add_request`` and fails later
    (seen on 0.19.2, chunked prefill on): a zero-token prompt raises ``AssertionError: Chunk length
    is 0`` in the context's ``add_request`` at the next step; a repeated ``request_id`` keeps the
    first request's record (the second prompt is dropped), queues the ID twice, and the next step
    raises the same assertion when it schedules the ID again.

    Args:
        planned: the requests, as :func:`plan_requests` returns them (or built by hand).

    Raises:
        WorkloadError: a prompt has 0 tokens, or two requests share a ``request_id`` (the message
            names the list indices, the ID and the fix).
    """
    first_index: dict[int, int] = {}
    for index, request in enumerate(planned):
        if len(request.prompt_tokens) == 0:
            raise WorkloadError(
                f"planned request {index} (request_id {request.request_id}, '{request.label}') has an "
                "empty prompt (0 tokens); megatron-core cannot prefill it: give it at least one token")
        if request.request_id in first_index:
            raise WorkloadError(
                f"planned requests {first_index[request.request_id]} and {index} share request_id "
                f"{request.request_id}; megatron-core would keep only the first: give every request "
                "its own request_id")
        first_index[request.request_id] = index
