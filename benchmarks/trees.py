"""Unpacked megatron-core release trees, one per release, to put first on a worker's ``PYTHONPATH``.

Lookup order for release ``v``:

1. ``<search dir>/<v>`` for each search directory (default ``/tmp/mc/src``, where the team's
   machines keep unpacked wheels), if it holds ``megatron/core/package_info.py`` of release ``v``;
2. the wheel cached in ``.venv/mcore-wheels/`` (the same cache ``functional_tests`` uses), or,
   if absent, ``pip download --no-deps megatron-core==v`` into it; the wheel is unzipped into a
   temporary directory that the caller removes (both by
   :func:`megatron_ext.source_patches.unpack_release`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from megatron_ext.source_patches import SourcePatchError, release_wheel, tree_version, unpack_release

REPO = Path(__file__).resolve().parents[1]
WHEEL_CACHE = REPO / ".venv" / "mcore-wheels"
DEFAULT_SEARCH = (Path("/tmp/mc/src"),)


class TreeError(RuntimeError):
    """No tree of the release could be found or fetched."""


def tree_release(tree: Path) -> str | None:
    """The release declared by ``tree/megatron/core/package_info.py`` (None if absent or unreadable)."""
    try:
        return tree_version(tree)
    except SourcePatchError:
        return None


def find_tree(version: str, search: Iterable[Path], scratch: Path) -> tuple[Path, str]:
    """A directory to put on ``PYTHONPATH`` for ``megatron-core==version``, and where it came from.

    Args:
        version: e.g. ``"0.18.2"``.
        search: directories holding unpacked releases as ``<dir>/<version>/megatron/...``.
        scratch: a temporary directory the wheel is unzipped into when no tree is found.

    Raises:
        TreeError: not found and not downloadable.
    """
    for base in search:
        candidate = Path(base) / version
        if tree_release(candidate) == version:
            return candidate, f"unpacked tree {candidate}"
    try:
        wheel = release_wheel(version, WHEEL_CACHE)
        target = scratch / f"megatron-core-{version}"
        if tree_release(target) != version:
            unpack_release(version, target, WHEEL_CACHE)
    except SourcePatchError as exc:
        raise TreeError(f"megatron-core {version}: no unpacked tree found and {exc}") from None
    if tree_release(target) != version:
        raise TreeError(f"{wheel} does not contain megatron-core {version}")
    return target, f"wheel {wheel.name} unpacked into {target}"
