"""Fingerprints of megatron-core functions: what a patch checks before it wraps anything.

A fingerprint is the SHA-256 of a function's source (:func:`fingerprint`). The recorded ones live
in :data:`FINGERPRINTS_FILE` (``fingerprints.json`` beside this module), written by
``scripts/record_fingerprints.py`` and read by each :class:`~megatron_ext.patching.Patch` through
:class:`RecordedFingerprints`: per patch and per known tree (:class:`KnownTree`: a PyPI release or
a Megatron-LM commit), the fingerprints of the functions it checks where that tree has the fault
(``faulty``) and where it does not (``fixed``). :func:`match_trees` says which known trees a
tree's functions are.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import textwrap
from dataclasses import dataclass
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


#: The fingerprint recorded for a function a tree does not have (its class or attribute is missing).
ABSENT = "absent"

#: The recorded fingerprints, shipped in the wheel and written by ``scripts/record_fingerprints.py``:
#: ``{"trees": {tree: {...}}, "faulty": {patch: {tree: {"Class.method": digest}}}, "fixed": {...},
#: "source_patched": {...}}``.
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
    ``kind`` (``"faulty"``, ``"fixed"`` or ``"source_patched"``), looked up by the class's
    ``name``; ``{}`` when none is recorded. A non-data descriptor, so a subclass or instance
    attribute of the same name takes its place."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __get__(self, instance: Any, owner: type) -> dict[str, dict[str, str]]:
        return recorded_fingerprints()[self.kind].get(owner.name, {})


@dataclass(frozen=True)
class KnownTree:
    """A megatron-core tree whose fingerprints are recorded: a PyPI release or a Megatron-LM commit.

    Attributes:
        name: its key in :data:`FINGERPRINTS_FILE`: the release (``"0.19.2"``) or the short commit
            (``"2a75ac12c5"``).
        version: what its ``package_info`` says (``"0.20.0"`` for every main commit since 0.19).
        commit: the full Megatron-LM commit, ``""`` for a PyPI release.
        date: the release's or the commit's date, ``YYYY-MM-DD``.
        source: where the recorded code came from (``PyPI`` or an archive of ``../shared/upstream``).
    """

    name: str
    version: str
    commit: str = ""
    date: str = ""
    source: str = "PyPI"

    @property
    def label(self) -> str:
        """How messages name it: ``megatron-core 0.19.2`` or ``Megatron-LM 2a75ac12c5``."""
        return f"Megatron-LM {self.name}" if self.commit else f"megatron-core {self.name}"


def known_trees() -> dict[str, KnownTree]:
    """Every tree with recorded fingerprints, by name, oldest first (releases, then commits by date)."""
    trees = [KnownTree(name, **fields) for name, fields in recorded_fingerprints()["trees"].items()]
    return {tree.name: tree for tree in sorted(trees, key=lambda t: (t.date, t.name))}


def tree_labels(names: tuple[str, ...] | list[str]) -> str:
    """``megatron-core 0.19.0, megatron-core 0.19.2 and Megatron-LM 2a75ac12c5``: known trees in words."""
    trees = known_trees()
    labels = [trees[name].label if name in trees else name for name in names]
    return labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} and {labels[-1]}"


@dataclass(frozen=True)
class TreeMatch:
    """Which known trees a patch's checked functions are (:func:`match_trees`).

    Attributes:
        found: ``Class.method`` -> fingerprint in the installed tree (:data:`ABSENT` if missing).
        faulty: known trees whose faulty code this is, exactly (every checked function equal).
        fixed: known trees without the fault whose code this is, exactly.
        nearest: the known tree sharing the most checked functions with this one (``""`` if none).
        differing: ``Class.method`` of the functions that differ from ``nearest`` (all of them if
            there is no nearest tree).
    """

    found: dict[str, str]
    faulty: tuple[str, ...]
    fixed: tuple[str, ...]
    nearest: str
    differing: tuple[str, ...]

    @property
    def absent(self) -> tuple[str, ...]:
        """``Class.method`` of the checked functions the installed tree does not have."""
        return tuple(name for name, digest in self.found.items() if digest == ABSENT)


def match_trees(found: dict[str, str], faulty: dict[str, dict[str, str]],
                fixed: dict[str, dict[str, str]]) -> TreeMatch:
    """Compare a tree's fingerprints with the recorded ones of every known tree.

    Args:
        found: ``Class.method`` -> fingerprint of each function a patch checks, in the installed tree.
        faulty, fixed: tree -> ``{Class.method: fingerprint}`` recorded where the fault is present
            and where it is not (:attr:`~megatron_ext.patching.Patch.faulty_fingerprints`,
            :attr:`~megatron_ext.patching.Patch.fixed_fingerprints`).
    """
    order = list(known_trees())
    ranked = sorted({**fixed, **faulty}.items(), key=lambda item: order.index(item[0]) if item[0] in order else -1)
    nearest, shared = "", 0
    for tree, prints in ranked:  # the newest of the trees sharing the most functions
        same = sum(prints.get(name) == digest for name, digest in found.items())
        if same and same >= shared:
            nearest, shared = tree, same
    reference = {**fixed, **faulty}.get(nearest, {})
    return TreeMatch(found=found,
                     faulty=tuple(tree for tree, prints in ranked if tree in faulty and faulty[tree] == found),
                     fixed=tuple(tree for tree, prints in ranked if tree in fixed and fixed[tree] == found),
                     nearest=nearest,
                     differing=tuple(name for name, digest in found.items() if reference.get(name) != digest))
