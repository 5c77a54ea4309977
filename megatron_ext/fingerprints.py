"""Fingerprints of megatron-core functions: what a patch checks before it wraps anything.

A fingerprint is the SHA-256 of a function's source (:func:`fingerprint`). The recorded ones live
in :data:`FINGERPRINTS_FILE` (``fingerprints.json`` beside this module), written by
``scripts/record_fingerprints.py`` and read by each :class:`~megatron_ext.patching.Patch` through
:class:`RecordedFingerprints`.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import textwrap
from pathlib import Path
from typing import Any, Callable


def fingerprint(function: Callable) -> str:
    """SHA-256 (first 16 hex digits) of a function's dedented source, trailing blanks stripped.

    Source, not bytecode: megatron-core ships ``.py`` files, and bytecode changes with the Python
    patch release while the code we rely on does not. A Triton kernel is fingerprinted by the
    Python function it compiles, decorators (its ``triton.heuristics``) included.

    Raises:
        OSError: the source is not available (a ``.pyc``-only install); callers report it as a refusal.
        TypeError: ``function`` has no source (not a function, nor a Triton kernel).
    """
    # Triton's jit, heuristics and autotune layers each keep what they wrap in ``fn``
    while type(function).__module__.split(".")[0] == "triton" and hasattr(function, "fn"):
        function = function.fn
    source = textwrap.dedent(inspect.getsource(function))
    normalized = "\n".join(line.rstrip() for line in source.splitlines()).strip() + "\n"
    return hashlib.sha256(normalized.encode()).hexdigest()[:16]


#: The recorded fingerprints, shipped in the wheel and written by ``scripts/record_fingerprints.py``:
#: ``{"released": {patch: {release: {"Class.method": digest}}}, "source_patched": {...}}``.
FINGERPRINTS_FILE = Path(__file__).with_name("fingerprints.json")


@functools.cache
def recorded_fingerprints() -> dict[str, dict[str, dict[str, dict[str, str]]]]:
    """:data:`FINGERPRINTS_FILE`, read once (at the first patch check, not at import).

    Raises:
        OSError, ValueError: the file is missing or not JSON (a broken install).
    """
    import json  # not at import: ``import megatron_ext`` at start-up loads as little as it can

    with open(FINGERPRINTS_FILE, encoding="utf-8") as file:
        return json.load(file)


class RecordedFingerprints:
    """A :class:`Patch` class attribute: the patch's table in :data:`FINGERPRINTS_FILE` under
    ``kind`` (``"released"`` or ``"source_patched"``), looked up by the class's ``name``; ``{}``
    when none is recorded. A non-data descriptor, so a subclass or instance attribute of the same
    name takes its place."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __get__(self, instance: Any, owner: type) -> dict[str, dict[str, str]]:
        return recorded_fingerprints()[self.kind].get(owner.name, {})
