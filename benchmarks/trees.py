"""Unpacked megatron-core release trees, one per release, to put first on a worker's ``PYTHONPATH``.

Lookup order for release ``v``:

1. ``<search dir>/<v>`` for each search directory (default ``/tmp/mc/src``, where the team's
   machines keep unpacked wheels), if it holds ``megatron/core/package_info.py`` of release ``v``;
2. the wheel cached in ``.venv/mcore-wheels/`` (the same cache ``functional_tests`` uses), or,
   if absent, ``pip download --no-deps megatron-core==v`` into it; the wheel is unzipped into a
   temporary directory that the caller removes.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parents[1]
WHEEL_CACHE = REPO / ".venv" / "mcore-wheels"
DEFAULT_SEARCH = (Path("/tmp/mc/src"),)


class TreeError(RuntimeError):
    """No tree of the release could be found or fetched."""


def tree_release(tree: Path) -> str | None:
    """The ``__version__`` declared by ``tree/megatron/core/package_info.py`` (None if absent)."""
    info = tree / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        return None
    fields = dict(re.findall(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", info.read_text(), re.M))
    if len(fields) == 3:
        return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}"
    match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", info.read_text())
    return match.group(1) if match else None


def cached_wheel(version: str, cache: Path = WHEEL_CACHE) -> Path:
    """The cached ``megatron_core-<version>-*.whl``, downloaded with pip first if missing.

    Raises:
        TreeError: pip could not download it (no network, unknown release).
    """
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"megatron_core-{version}-*.whl"))
    if not wheels:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(cache),
             f"megatron-core=={version}"],
            capture_output=True, text=True,
        )
        wheels = sorted(cache.glob(f"megatron_core-{version}-*.whl"))
        if done.returncode != 0 or not wheels:
            raise TreeError(
                f"megatron-core {version}: no unpacked tree found and `pip download --no-deps "
                f"megatron-core=={version}` failed: {(done.stderr or done.stdout).strip()[-400:]}"
            )
    return wheels[-1]


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
    wheel = cached_wheel(version)
    target = scratch / f"megatron-core-{version}"
    if tree_release(target) != version:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    if tree_release(target) != version:
        raise TreeError(f"{wheel} does not contain megatron-core {version}")
    return target, f"wheel {wheel.name} unpacked into {target}"
