"""Fault 7: top-n log-probs of prefill chunks are filed by a running count, not by what they belong to.

Every step, ``DynamicInferenceEngine.post_process_requests`` receives, per request, the top-n
log-probs the step computed (``top_n_logprobs``: request index -> one ``(values, indices)`` pair
per computed position, in order) and files each entry by a running count: into
``prompt_top_n_logprobs`` while ``skip_prompt_log_probs`` is False and fewer than
``len(prompt_tokens) - 1`` entries were filed, else into ``generated_top_n_logprobs``. Two things
break that count:

- chunked prefill: a non-final chunk computes the top-n of its positions (of its last position
  when ``skip_prompt_log_probs`` is True or only last-token logits are materialized) although it
  generates no token; with ``skip_prompt_log_probs=True`` every entry counts as generated, so a
  prompt prefilled in k chunks gets k-1 extra leading entries in ``generated_top_n_logprobs``
  and every later entry is shifted;
- prefix caching: positions of a matched prefix are never computed, so with
  ``skip_prompt_log_probs=False`` the count files the first generated token's entry (and up to
  k-1 decode entries after it, k skipped positions) as prompt entries.

Prefix caching changes how many chunks a prompt takes and how many positions it skips, so
caching on vs off differ in every top-n list while tokens and log-probs agree. Present in every
release 0.17 to 0.19 and on Megatron-LM main (checked up to 2026-08-22, including the open
PR #4604): there is no upstream change to mirror. The released code's plain log-probs are filed
by their own rule (a non-final chunk's are dropped with ``skip_prompt_log_probs=True``).

The fix keeps the released filing and corrects what it filed for each request in the step:
the step's entries belong, in order, to the prompt positions the step computed, then to the
tokens it appended to ``generated_tokens`` (none for a non-final chunk). In a decode step (the
request had generated tokens before it) every entry belongs to a generated token. Prompt
entries are kept in ``prompt_top_n_logprobs`` when ``skip_prompt_log_probs`` is False and
dropped when it is True, as the released code drops a non-final chunk's plain log-probs. So
``generated_top_n_logprobs[i]`` is the top-n of generated token i, and
``prompt_top_n_logprobs`` holds one entry per computed prompt position, in order (the position
predicting the first generated token is that token's entry).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from ..mcore import DYNAMIC_ENGINE_MODULE, TEXT_GENERATION_CONTROLLER_MODULE
from ..patching import Patch, Target

POST_PROCESS = Target(DYNAMIC_ENGINE_MODULE, "DynamicInferenceEngine.post_process_requests")
GET_REQUEST = Target(DYNAMIC_ENGINE_MODULE, "DynamicInferenceEngine.get_request")
#: Emits the entries in position order (all positions, or only the last of each request).
CALCULATE_TOP_N = Target(TEXT_GENERATION_CONTROLLER_MODULE,
                         "TextGenerationController._dynamic_step_calculate_top_n_logprobs")


@dataclass(frozen=True)
class TopNBooks:
    """A request's top-n lists before a step, to tell which entries the step filed.

    Attributes:
        request: the ``DynamicInferenceRequest`` (the object, kept even if the step finishes or
            evicts it).
        generated_tokens: ``len(request.generated_tokens)`` before the step.
        prompt_entries, generated_entries: lengths of ``prompt_top_n_logprobs`` and
            ``generated_top_n_logprobs`` before the step (0 for None).
    """

    request: Any
    generated_tokens: int
    prompt_entries: int
    generated_entries: int

    @classmethod
    def of(cls, request: Any) -> "TopNBooks":
        return cls(request, len(request.generated_tokens),
                   len(request.prompt_top_n_logprobs or ()),
                   len(request.generated_top_n_logprobs or ()))


def refile_step_entries(books: TopNBooks) -> int:
    """File again, by position, the top-n entries the released code filed for one request in a step.

    Args:
        books: the request's :class:`TopNBooks` taken right before ``post_process_requests``.

    The entries (dicts token text -> log-prob, float) the step appended to either list are taken
    out, in filing order (the count files a step's prompt entries before its generated ones),
    and appended again: the last g (g: tokens the step appended to ``generated_tokens``; all in
    a decode step) to ``generated_top_n_logprobs``, the ones before them to
    ``prompt_top_n_logprobs`` unless ``skip_prompt_log_probs`` (then dropped).

    Returns the number of prompt entries the step computed (kept or dropped).
    """
    request = books.request
    prompt, generated = request.prompt_top_n_logprobs, request.generated_top_n_logprobs
    if prompt is None or generated is None:  # the step filed nothing for this request
        return 0
    new = prompt[books.prompt_entries:] + generated[books.generated_entries:]
    del prompt[books.prompt_entries:], generated[books.generated_entries:]
    step_tokens = len(request.generated_tokens) - books.generated_tokens
    prompt_count = 0 if books.generated_tokens else max(0, len(new) - step_tokens)
    if not request.sampling_params.skip_prompt_log_probs:
        prompt.extend(new[:prompt_count])
    generated.extend(new[prompt_count:])
    return prompt_count


@functools.lru_cache(maxsize=16)
def _parameters(function: Callable) -> tuple[str, ...]:
    """Parameter names of a function, ``self`` included for a method."""
    return tuple(inspect.signature(function).parameters)


def _argument(wrapped: Callable, args: tuple, kwargs: dict, name: str) -> Any:
    """An argument of a call by name; its position differs between releases (0.19 inserted
    ``consumed_chunked_prefill_request_id`` before ``top_n_logprobs``). None if not passed.

    ``wrapped`` is the bound method (``args`` without ``self``), or, for a call through the
    class, whatever wrapt binds the instance with: its own signature then."""
    if name in kwargs:
        return kwargs[name]
    function = getattr(wrapped, "__func__", None)
    if function is not None:
        index = _parameters(function).index(name) - 1  # self is not in args
    else:
        index = tuple(inspect.signature(wrapped).parameters).index(name)
    return args[index] if index < len(args) else None


def _post_process_wrapper(wrapped: Callable, engine: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper around ``post_process_requests``; no work in steps without top-n."""
    top_n = _argument(wrapped, args, kwargs, "top_n_logprobs")
    if not top_n:
        return wrapped(*args, **kwargs)
    request_ids = _argument(wrapped, args, kwargs, "request_ids").tolist()
    books = [TopNBooks.of(engine.get_request(request_ids[i])) for i in top_n if i < len(request_ids)]
    result = wrapped(*args, **kwargs)
    for entry in books:
        refile_step_entries(entry)
    return result


class TopNPrefillChunksPatch(Patch):
    """Files each step's top-n log-probs by position (see module docstring)."""

    name = "top-n-prefill-chunks"
    fault = "7"
    source_patched_targets = (POST_PROCESS,)
    fault_evidence = ("no megatron-core release up to 0.19.2 (nor Megatron-LM main of 2026-08-22) "
                      "files top-n log-probs by position")
    waits_for_import = (POST_PROCESS, GET_REQUEST, CALCULATE_TOP_N)  # the engine and the controller

    def wrappers(self) -> dict[Target, Callable]:
        return {POST_PROCESS: _post_process_wrapper}

    def checked_functions(self) -> tuple[Target, ...]:
        return (POST_PROCESS, GET_REQUEST, CALCULATE_TOP_N)

