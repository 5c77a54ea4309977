"""Bit-for-bit comparison of two runs of the same requests (A: prefix caching off, B: on).

Works on plain records (:class:`RequestOutput`), so it also serves runs recorded elsewhere: the
``ab`` harness fills them from megatron-core's engine, tests fill them by hand.
"""

from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class RequestOutput:
    """What one request produced in one run.

    Attributes:
        request_id: engine request ID (the same in A and B).
        label: human name from the case, e.g. ``r0.s2`` (request 0, sample 2).
        prompt_length: prompt tokens.
        tokens: generated token IDs, in order.
        log_probs: log-probability (natural log, as returned by megatron-core, float32 values
            carried as Python floats) of each generated token; same length as ``tokens``.
        token_steps: engine step (0-based) at which each generated token was produced.
        top_n_logprobs: megatron-core's top-n log-probs of each generated token
            (``SamplingParams.top_n_logprobs``), per token its ``(token text, log-prob)`` pairs in
            the engine's order; None when not asked for.
        weight_versions: per generated token, the weight version of its logits (``"logits"``) and
            the oldest one of its KV prefix (``"kv_prefix"``)
            (:func:`megatron_ext.token_weight_versions`); None where not recorded.
        routing: a mixture-of-experts model with routing replay: megatron-core's
            ``routing_indices`` of the request, the expert IDs each token was routed to,
            ``[prompt + generated - 1][moe layers][topk]`` (ints); None where megatron-core returned
            none (routing replay off, or a request it evicted: it reconstructs routing only for a
            request never evicted).
    """

    request_id: int
    label: str
    prompt_length: int
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)
    top_n_logprobs: Optional[list[list[tuple[str, float]]]] = None
    weight_versions: Optional[dict[str, list[int]]] = None
    routing: Optional[list[list[list[int]]]] = None

    @property
    def versions(self) -> list[int]:
        """Every weight version the request's tokens depend on, ascending ([] if not recorded)."""
        return sorted({v for per_token in (self.weight_versions or {}).values() for v in per_token})


@dataclass
class RequestDiff:
    """A vs B for one request.

    Attributes:
        tokens_equal: same generated tokens.
        log_probs_equal: same log-prob bits for every generated token (and same count).
        top_n_logprobs_equal: same top-n entries (text and log-prob bits, in order) for every
            generated token, or None when top-n log-probs were not recorded.
        routing_equal: same expert IDs for every token and MoE layer (routing replay), or None
            when neither run recorded routing (one run recording it and the other not differs).
        first_divergent_position: index of the first generated token whose token or log-prob
            bits differ, or None.
        first_divergent_step: B's engine step of that token, or None.
        max_abs_delta_log_prob: max |A - B| over positions both runs produced (0.0 if identical).
        abs_delta_log_prob: |A - B| per position, for plots.
    """

    request_id: int
    label: str
    tokens_equal: bool
    log_probs_equal: bool
    top_n_logprobs_equal: Optional[bool]
    first_divergent_position: Optional[int]
    first_divergent_step: Optional[int]
    max_abs_delta_log_prob: float
    abs_delta_log_prob: list[float]
    routing_equal: Optional[bool] = None

    @property
    def identical(self) -> bool:
        return (self.tokens_equal and self.log_probs_equal and self.top_n_logprobs_equal is not False
                and self.routing_equal is not False)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["identical"] = self.identical
        return out


def same_bits(x: float, y: float) -> bool:
    """True if two floats have identical IEEE-754 double bits (NaN == NaN of the same payload)."""
    return struct.pack("<d", x) == struct.pack("<d", y)


def compare_request(a: RequestOutput, b: RequestOutput) -> RequestDiff:
    """Compare one request's outputs. Raises ValueError if the IDs differ."""
    if a.request_id != b.request_id:
        raise ValueError(f"comparing different requests: {a.request_id} vs {b.request_id}")
    common = min(len(a.tokens), len(b.tokens), len(a.log_probs), len(b.log_probs))
    deltas = [abs(a.log_probs[i] - b.log_probs[i]) for i in range(min(len(a.log_probs), len(b.log_probs)))]
    top_n = a.top_n_logprobs is not None and b.top_n_logprobs is not None
    first = next(
        (i for i in range(common)
         if a.tokens[i] != b.tokens[i] or not same_bits(a.log_probs[i], b.log_probs[i])
         or (top_n and not _same_top_n(a.top_n_logprobs, b.top_n_logprobs, i))),
        None,
    )
    lengths_differ = len(a.tokens) != len(b.tokens) or len(a.log_probs) != len(b.log_probs)
    if first is None and lengths_differ:
        first = common
    top_n_equal = None
    if top_n:
        top_n_equal = len(a.top_n_logprobs) == len(b.top_n_logprobs) and all(
            _same_top_n(a.top_n_logprobs, b.top_n_logprobs, i) for i in range(len(a.top_n_logprobs)))
        if first is None and not top_n_equal:  # they differ only past the tokens both produced
            first = min(len(a.top_n_logprobs), len(b.top_n_logprobs), common)
    finite = [d for d in deltas if not math.isnan(d)]
    return RequestDiff(
        request_id=a.request_id,
        label=a.label,
        tokens_equal=a.tokens == b.tokens,
        log_probs_equal=len(a.log_probs) == len(b.log_probs)
        and all(same_bits(x, y) for x, y in zip(a.log_probs, b.log_probs)),
        top_n_logprobs_equal=top_n_equal,
        first_divergent_position=first,
        first_divergent_step=(b.token_steps[first] if first is not None and first < len(b.token_steps) else None),
        max_abs_delta_log_prob=max(finite, default=0.0),
        abs_delta_log_prob=deltas,
        routing_equal=None if a.routing is None and b.routing is None else a.routing == b.routing,
    )


def top_n_miscounted(outputs: dict[int, RequestOutput]) -> list[str]:
    """Labels of the requests of one run whose top-n log-probs are not one entry per generated
    token (fault 7: top-n of non-final prefill chunks filed as generated); requests without
    top-n or without tokens (a run that ended early) are not counted."""
    return [o.label for o in outputs.values()
            if o.top_n_logprobs is not None and o.tokens and len(o.top_n_logprobs) != len(o.tokens)]


def routing_miscounted(outputs: dict[int, RequestOutput]) -> tuple[list[str], list[str]]:
    """Labels of the requests of one run whose routing (routing replay) is not one row per token
    but the last (``prompt + generated - 1``): ``(short, long)``. Short: fault R1 (a prefix-cached
    request's matched prefix left out); long: fault R3 on 0.17 (the merge of an evicted and
    re-run request repeats the rows before its eviction). Requests without routing or without tokens are not counted."""
    counted = [(o.label, len(o.routing) - (o.prompt_length + len(o.tokens) - 1)) for o in outputs.values()
               if o.routing is not None and o.tokens]
    return [label for label, extra in counted if extra < 0], [label for label, extra in counted if extra > 0]


def routing_absent(outputs: dict[int, RequestOutput]) -> list[tuple[int, str]]:
    """``(request ID, label)`` of the requests of one run of a routing-replay model that generated
    tokens but came back without routing (fault R3 for a request the engine evicted and re-ran;
    R2 when its blocks' routing was dropped, which the routing-replay audit sees)."""
    return [(rid, o.label) for rid, o in outputs.items() if o.routing is None and o.tokens]


def _same_top_n(a: list[list[tuple[str, float]]], b: list[list[tuple[str, float]]], i: int) -> bool:
    """Whether generated token ``i`` has the same top-n entries in both (a missing one differs)."""
    if i >= len(a) or i >= len(b):
        return len(a) == len(b)
    return len(a[i]) == len(b[i]) and all(
        ka == kb and same_bits(va, vb) for (ka, va), (kb, vb) in zip(a[i], b[i]))


def compare_runs(a: dict[int, RequestOutput], b: dict[int, RequestOutput]) -> list[RequestDiff]:
    """Compare every request of two runs, by request ID.

    Raises:
        ValueError: the runs do not hold the same request IDs.
    """
    if a.keys() != b.keys():
        raise ValueError(
            f"runs hold different requests: only in A {sorted(a.keys() - b.keys())}, "
            f"only in B {sorted(b.keys() - a.keys())}"
        )
    return [compare_request(a[rid], b[rid]) for rid in sorted(a)]
