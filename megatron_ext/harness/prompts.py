"""Prompts from a file (``ab --prompts FILE``): the user's own prompts in place of a case's requests.

Two formats, by the file's suffix:

- ``.jsonl``: JSON Lines, one object per line: ``{"prompt": "...", "samples": 4,
  "num_tokens_to_generate": 32, "arrival_step": 0}``; only ``prompt`` is required.
- anything else: plain text, one prompt per line (the line break is not part of the prompt).

Lines end at ``\n`` or ``\r\n`` only: a form feed, ``\x1c``-``\x1e``, ``\x85``, U+2028 or
U+2029 (which :meth:`str.splitlines` would also break at) is part of the prompt, as it is part of a
JSON string. A UTF-8 byte-order mark at the start of the file is dropped (editors on Windows write
one); it is not part of the first prompt. Blank lines are skipped in both. ``samples`` (Megatron's ``--inference-repeat-n``) and
``num_tokens_to_generate`` default to the command line's ``--samples`` / ``--num-tokens-to-generate``.
The rest of the case (model, inference config, eviction policies, sampling) comes from ``--case``.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from ..errors import MegatronExtError
from .cases.planning import sequence_too_long
from .cases.schema import Case, Expectations, RequestSpec, describe_validation_error
from .tokenizer import Tokenizer, default_tokenizer

#: The keys a JSON Lines prompt may have.
PROMPT_KEYS = ("prompt", "samples", "num_tokens_to_generate", "arrival_step")


class PromptFileError(MegatronExtError, ValueError):
    """A prompts file is missing, unreadable, or has a bad line (the message names the line)."""


def read_prompts(path: Path, samples: int = 1, num_tokens_to_generate: Optional[int] = None
                 ) -> list[tuple[int, RequestSpec]]:
    """The prompts of ``path`` as ``(line number, request)`` pairs, in file order.

    Args:
        path: a ``.jsonl`` file or a plain text file (see the module docstring).
        samples: copies of each prompt where a line does not say (>= 1).
        num_tokens_to_generate: tokens to generate where a line does not say; None: the case
            file default (8).

    Raises:
        PromptFileError: the file is missing, a directory, not UTF-8, holds no prompt, or a line is
            not a JSON object, lacks ``prompt``, has an unknown key or a bad value (line named).
    """
    text = _read(path)
    defaults: dict[str, Any] = {"samples": samples}
    if num_tokens_to_generate is not None:
        defaults["num_tokens_to_generate"] = num_tokens_to_generate
    jsonl = path.suffix == ".jsonl"
    prompts = []
    for number, line in enumerate(_lines(text), start=1):
        if not line.strip():
            continue
        fields = _jsonl_fields(path, number, line) if jsonl else {"prompt": line}
        try:
            prompts.append((number, RequestSpec(**{**defaults, **fields})))
        except ValidationError as exc:
            raise PromptFileError(f"{path}: line {number}: {describe_validation_error(exc)}") from None
    if not prompts:
        raise PromptFileError(f"{path} holds no prompt; write one prompt per line")
    return prompts


def prompts_case(case: Case, path: Path, samples: int = 1,
                 num_tokens_to_generate: Optional[int] = None,
                 tokenizer: Optional[Tokenizer] = None) -> Case:
    """``case`` with its requests replaced by the prompts of ``path``.

    Prompt lengths are counted in ``tokenizer``'s tokens (None: the default byte-level tokenizer).

    Its expectations go back to the defaults (bit-identical only): a shipped case's minimum of
    matched blocks says nothing about the user's prompts.

    Raises:
        PromptFileError: as :func:`read_prompts`, or a prompt plus its generated tokens exceeds the
            case's ``inference.max_sequence_length`` (line named).
    """
    prompts = read_prompts(path, samples, num_tokens_to_generate)
    tokenizer = tokenizer or default_tokenizer()
    for number, spec in prompts:
        problem = sequence_too_long(case.inference, len(tokenizer.tokenize(spec.prompt)),
                                    spec.num_tokens_to_generate)
        if problem:
            raise PromptFileError(f"{path}: line {number}: {problem} (in --case {case.name})")
    return case.model_copy(update={"name": f"{case.name}+{path.name}",
                                   "requests": [spec for _, spec in prompts],
                                   "expectations": Expectations()})


def _lines(text: str) -> list[str]:
    """``text`` split at ``\n`` and ``\r\n`` only, without the line breaks.

    Not :meth:`str.splitlines`: it also breaks at ``\f``, ``\x1c``, U+2028 and others, which cut
    a prompt in two (and a JSON line holding U+2028 unescaped, which JSON allows, into two bad lines).
    A lone ``\r`` is kept: it ends no line here, so it belongs to the prompt.
    """
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def _read(path: Path) -> str:
    """The file's text, its line breaks untouched (no universal-newline translation: a lone ``\r``
    stays in its prompt) and a leading UTF-8 byte-order mark dropped."""
    if path.is_dir():
        raise PromptFileError(f"--prompts {path} is a directory; pass a .jsonl or text file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PromptFileError(f"--prompts {path}: no such file") from None
    except OSError as exc:
        raise PromptFileError(f"--prompts {path}: cannot read it: {exc.strerror}") from None
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"--prompts {path}: not UTF-8 text (byte {start + exc.start}); save it as UTF-8") from None


def _jsonl_fields(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        fields = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{path}: line {number}: not JSON ({exc.msg}); write one JSON object per "
                              "line, e.g. {\"prompt\": \"...\"}") from None
    if not isinstance(fields, dict):
        raise PromptFileError(f"{path}: line {number}: expected a JSON object with a \"prompt\"")
    unknown = sorted(set(fields) - set(PROMPT_KEYS))
    if unknown:
        raise PromptFileError(f"{path}: line {number}: unknown key(s) {', '.join(unknown)}; a line may "
                              f"have {', '.join(PROMPT_KEYS)}")
    if "prompt" not in fields:
        raise PromptFileError(f"{path}: line {number}: expected a JSON object with a \"prompt\"")
    return fields
