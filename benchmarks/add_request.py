"""Section 2 (worker side): time ``DynamicInferenceContext.add_request`` of one request.

A real ``DynamicInferenceContext`` on the CPU (2 layers, 4 heads of 16, fp32, block size 16,
prefix caching and chunked prefill on), large enough for two 8,192-token prompts in one step.
Before every timed call the context is reset and a *primer* request is added (untimed); then the
*probe* request is added, and only that call is timed. The primer decides the match:

* ``full``: the probe's prompt equals the primer's (every block matched; the release recomputes
  the last matched block, so its tokens are the ones the patch redirects to the dummy block);
* ``partial``: the probe shares the first half of its blocks with the primer;
* ``none``: the primer's prompt shares nothing with the probe.

The context is built inside megatron-ext's CUDA stand-ins (``cuda_on_cpu``) but timed outside
them: their ``TorchFunctionMode`` intercepts every torch call in Python and would inflate both
variants alike. ``add_request`` touches only CPU tensors, so it needs no stand-in.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from megatron_ext.cpu_backend import cuda_on_cpu
from megatron_ext.harness.factories import prefix_caching_request, small_prefix_caching_context
from .stats import time_calls

BLOCK = 16
MATCHES = ("full", "partial", "none")


def build_context(policy: str, max_prompt: int) -> Any:
    """A prefix-caching DynamicInferenceContext with room for two ``max_prompt``-token prompts in one step."""
    blocks_needed = 2 * (max_prompt // BLOCK + 2) + 64
    # KV bytes per block: K and V x 2 layers x 16 tokens x 4 heads x 16 dims x 4 bytes (fp32).
    buffer_gb = blocks_needed * 2 * 2 * BLOCK * 64 * 4 * 1.5 / 1024**3
    with cuda_on_cpu():
        return small_prefix_caching_context(
            policy, block_size_tokens=BLOCK, buffer_size_gb=buffer_gb, max_requests=8,
            max_tokens=2 * max_prompt + 2 * BLOCK, max_sequence_length=max_prompt + 2 * BLOCK,
        )


def make_request(request_id: int, tokens: list[int]) -> Any:
    return prefix_caching_request(request_id, tokens, BLOCK)


def prompts(length: int, match: str) -> tuple[list[int], list[int]]:
    """``(primer, probe)`` token lists for a probe of ``length`` tokens (a multiple of 16)."""
    probe = [(7 * i + 3) % 251 + 1000 for i in range(length)]
    if match == "full":
        primer = list(probe)
    elif match == "partial":
        half = (length // BLOCK // 2) * BLOCK
        primer = probe[:half] + [5000 + i for i in range(length - half)]
    elif match == "none":
        primer = [9000 + i for i in range(length)]
    else:
        raise ValueError(f"match must be one of {MATCHES}")
    return primer, probe


class AddRequestBench:
    """One context, reused for every (length, match) case of one eviction policy."""

    def __init__(self, policy: str, max_prompt: int) -> None:
        self.policy = policy
        self.max_prompt = max_prompt
        self.context = build_context(policy, max_prompt)
        self.cls = type(self.context)
        self.primer = self.probe = None

    def setup(self, length: int, match: str) -> None:
        if length % BLOCK or length > self.max_prompt:
            raise ValueError(f"prompt length {length} must be a multiple of {BLOCK} and <= {self.max_prompt}")
        primer, probe = prompts(length, match)
        self.primer = make_request(1, primer)
        self.probe = make_request(2, probe)

    def _prepare(self) -> None:
        self.context.reset()
        self.context.add_request(self.primer)

    def probe_once(self, function: Any) -> dict[str, Any]:
        """Add the probe once with ``function`` installed; what it did (checked equal across variants)."""
        with cpu_current_device():
            return self._probe_once(function)

    def _probe_once(self, function: Any) -> dict[str, Any]:
        setattr(self.cls, "add_request", function)
        ctx = self.context
        self._prepare()
        first, matched_before = ctx.active_token_count, ctx.prefix_cache_blocks_matched
        ctx.add_request(self.probe)
        end = ctx.active_token_count
        written = ctx.token_to_block_idx[first:end]
        return {
            "blocks_matched": int(ctx.prefix_cache_blocks_matched - matched_before),
            "tokens_added": int(end - first),
            "tokens_to_dummy_block": int((written == ctx.kv_block_allocator.dummy_block_idx).sum()),
        }

    def time(self, function: Any, reps: int) -> tuple[list[int], list[int]]:
        """``reps`` back-to-back timed ``add_request`` calls of the probe; (wall ns, CPU ns)."""
        setattr(self.cls, "add_request", function)
        ctx, probe = self.context, self.probe
        with cpu_current_device():
            return time_calls(self._prepare, lambda: ctx.add_request(probe), reps)


@contextlib.contextmanager
def cpu_current_device() -> Iterator[None]:
    """Without CUDA, ``torch.cuda.current_device`` answers ``"cpu"`` meanwhile: 0.17's
    ``add_request`` and allocator ``reset`` ask it for the device of new tensors (0.18 and 0.19
    do not call it). A plain function, the same in every variant, instead of ``cuda_on_cpu``'s
    ``TorchFunctionMode`` (which intercepts every torch call)."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original
