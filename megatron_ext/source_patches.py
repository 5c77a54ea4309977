"""``megatron-ext patch-source``: apply the source patches in ``patches/`` to a megatron-core tree.

The tree is either an installed package (the directory holding ``megatron/core``, e.g.
``site-packages``) or a Megatron-LM checkout. Patches are applied with ``git apply`` (works
outside a git repository too), which checks every hunk before changing anything: a patch that
does not apply cleanly changes nothing. The release is read from the tree's own
``megatron/core/package_info.py``, and ``patches/index.yaml`` says which patches it takes: a
release's series (``releases:``), or for a Megatron-LM checkout, whose version names no release
("0.20.0" for every main commit since 0.19), the series of the known commit of that version
(``commits:``) whose first patch applies (:func:`series_for`).
"""

from __future__ import annotations

import enum
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from .errors import MegatronCoreNotFoundError, MegatronExtError

_REPO_PATCHES = Path(__file__).resolve().parent.parent / "patches"
_PACKAGED_PATCHES = Path(__file__).resolve().parent / "_source_patches"


class SourcePatchError(MegatronExtError):
    """A source patch cannot be applied or reverted; nothing was changed."""


class SourcePatchState(str, enum.Enum):
    APPLIED = "applied"
    REVERTED = "reverted"
    WOULD_APPLY = "would apply"
    WOULD_REVERT = "would revert"


@dataclass(frozen=True)
class SourcePatchResult:
    """One patch file and what happened to it."""

    patch: str
    state: SourcePatchState


def patches_dir() -> Path:
    """The ``patches/`` directory: the repository's, or the copy packaged in a wheel."""
    for candidate in (_REPO_PATCHES, _PACKAGED_PATCHES):
        if (candidate / "index.yaml").is_file():
            return candidate
    raise SourcePatchError("the source patches (patches/index.yaml) are missing from this install")


def default_tree() -> Path:
    """The directory holding the importable ``megatron/core`` package.

    Raises:
        MegatronCoreNotFoundError: megatron-core is not importable.
    """
    try:
        spec = importlib.util.find_spec("megatron.core")
    except ModuleNotFoundError:
        spec = None
    if spec is None or spec.origin is None:
        raise MegatronCoreNotFoundError(
            "megatron-core is not installed here; pass the path of a megatron-core tree, or "
            "install it: pip install --no-deps megatron-core==0.19.2")
    return Path(spec.origin).resolve().parent.parent.parent


def tree_version(tree: Path) -> str:
    """The release in ``tree/megatron/core/package_info.py`` (read as text, not imported).

    Raises:
        SourcePatchError: the file is missing or has no version.
    """
    info = tree / "megatron" / "core" / "package_info.py"
    try:
        text = info.read_text()
    except OSError:
        raise SourcePatchError(f"{tree} is not a megatron-core tree: {info} is missing") from None
    fields = dict(re.findall(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", text, re.MULTILINE))
    if len(fields) != 3:
        raise SourcePatchError(f"cannot read MAJOR/MINOR/PATCH from {info}")
    return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}"


def release_wheel(version: str, cache: Path) -> Path:
    """The wheel ``megatron_core-<version>-*.whl`` in ``cache``, downloaded there first if missing
    (``pip download --no-deps megatron-core==<version>``).

    Raises:
        SourcePatchError: pip could not download it (no network, unknown release).
    """
    cache = Path(cache)
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
            raise SourcePatchError(
                f"`pip download --no-deps megatron-core=={version}` failed: "
                f"{(done.stderr or done.stdout).strip()[-400:]}")
    return wheels[-1]


def unpack_release(version: str, target: Path, cache: Path) -> Path:
    """Unpack megatron-core ``version``'s wheel (:func:`release_wheel`) into ``target``; return ``target``,
    the directory holding ``megatron/core`` (a pristine tree to patch or to put on ``PYTHONPATH``).

    Raises:
        SourcePatchError: the wheel could not be downloaded.
    """
    with zipfile.ZipFile(release_wheel(version, cache)) as archive:
        archive.extractall(target)
    return Path(target)


#: Where the archives of known Megatron-LM commits (:class:`~megatron_ext.fingerprints.KnownTree`
#: ``source``) are: ``MEGATRON_EXT_UPSTREAM``, or ``../shared/upstream`` beside this checkout.
UPSTREAM_ENV = "MEGATRON_EXT_UPSTREAM"


def upstream_dir() -> Path:
    """The folder holding the known commits' archives (:data:`UPSTREAM_ENV`)."""
    return Path(os.environ.get(UPSTREAM_ENV) or _REPO_PATCHES.parent.parent / "shared" / "upstream")


def unpack_tree(name: str, target: Path, cache: Path) -> Path:
    """Unpack a known tree (a release's wheel, or a Megatron-LM commit's archive from
    :func:`upstream_dir`) under ``target``; return the directory holding ``megatron/core``.

    Raises:
        SourcePatchError: the wheel could not be downloaded, or the archive is missing.
    """
    import tarfile

    from .fingerprints import known_trees

    tree = known_trees().get(name)
    if tree is None or not tree.commit:
        return unpack_release(name, target, cache)
    archive = upstream_dir() / tree.source
    if not archive.is_file():
        raise SourcePatchError(f"{archive} is missing: {tree.label}'s code comes from that archive; set "
                               f"{UPSTREAM_ENV} to the folder holding it")
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    (info,) = Path(target).glob("*/megatron/core/package_info.py")
    return info.parents[2]


def _index() -> dict:
    return yaml.safe_load((patches_dir() / "index.yaml").read_text())


def patches_for(version: str) -> list[Path]:
    """Patch files for a release, in order.

    Raises:
        SourcePatchError: the release has no entry in ``index.yaml``.
    """
    index = _index()["releases"]
    if version not in index:
        raise SourcePatchError(
            f"no source patches for megatron-core {version}; supported: {', '.join(index)}")
    return [patches_dir() / name for name in index[version]]


def commit_patches(name: str) -> list[Path]:
    """Patch files for a known Megatron-LM commit (its short name in ``index.yaml``'s ``commits:``,
    e.g. ``"2a75ac12c5"``), in order.

    Raises:
        SourcePatchError: the commit has no entry in ``index.yaml``.
    """
    index = _index().get("commits") or {}
    if name not in index:
        raise SourcePatchError(f"no source patches for Megatron-LM {name}; commits with a series: "
                               f"{', '.join(index) or 'none'}")
    return [patches_dir() / patch for patch in index[name]]


def series_for(tree: Path) -> tuple[str, list[Path]]:
    """The series for a megatron-core tree: ``(name, patches)``, ``name`` the release or the commit.

    A release of ``index.yaml``'s ``releases:`` gets its series. Any other version (a Megatron-LM
    checkout: main says "0.20.0" at every commit since 0.19) gets the series of the known commit
    tree of that version (:func:`megatron_ext.fingerprints.known_trees`, oldest first) whose first
    patch applies to ``tree`` (``git apply --check``); failing that, the one whose last patch is
    already applied (so that an already patched tree is refused by name, and ``--revert`` works).

    Raises:
        SourcePatchError: no series for the version, or none of its commits' series applies.
    """
    from .fingerprints import known_trees

    version = tree_version(tree)
    index = _index()
    if version in index["releases"]:
        return version, patches_for(version)
    commits = index.get("commits") or {}
    candidates = [name for name, known in known_trees().items()
                  if known.commit and known.version == version and name in commits]
    if not candidates:
        patches_for(version)  # raises: no source patches for that version
    for name in candidates:
        if _applies(tree, commit_patches(name)[0]):
            return name, commit_patches(name)
    for name in candidates:
        if _applies(tree, commit_patches(name)[-1], reverse=True):
            return name, commit_patches(name)
    tried = ", ".join(f"Megatron-LM {name}" for name in candidates)
    raise SourcePatchError(
        f"megatron-core {version} at {tree} is no release with source patches, and the series of no known "
        f"Megatron-LM commit of {version} applies to it (tried {tried}: its first patch does not apply): it is "
        f"not a tree megatron-ext has a source patch series for; nothing was changed. Series exist for the "
        f"releases {', '.join(index['releases'])} and the commits {', '.join(commits)}")


def _git_apply(tree: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    git = shutil.which("git")
    if git is None:
        raise SourcePatchError("`git` is needed to apply source patches (git apply); install git")
    # git apply inside a git work tree applies paths relative to that repository's root and skips
    # the rest silently (exit 0): a .venv inside a checkout would be "patched" with nothing
    # changed. A ceiling at the tree's parent keeps git from finding an enclosing repository.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.resolve().parent)}
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    return subprocess.run([git, "apply", *flags, str(patch.resolve())], cwd=tree, env=env,
                          capture_output=True, text=True)


def _applies(tree: Path, patch: Path, reverse: bool = False) -> bool:
    return _git_apply(tree, patch, "--check", *(["-R"] if reverse else [])).returncode == 0


def patch_source(tree: Path | None = None, check: bool = False, revert: bool = False) -> list[SourcePatchResult]:
    """Apply (or with ``revert`` remove) the tree's source patches (:func:`series_for`) to ``tree``.

    All patches are checked before any is applied, so a refusal changes nothing.

    Args:
        tree: directory holding ``megatron/core``; default: the importable megatron-core.
        check: report what would happen, change nothing.
        revert: remove the patches instead of applying them.

    Raises:
        SourcePatchError: no series for the tree (:func:`series_for`), a patch already applied (apply) or not applied
            (revert), or a hunk that does not apply; the message names the patch file.
        MegatronCoreNotFoundError: no tree given and megatron-core is not importable.
    """
    tree = Path(tree) if tree is not None else default_tree()
    _, patches = series_for(tree)
    if revert:
        patches = list(reversed(patches))
    for patch in patches:
        _refuse_if_not_applicable(tree, patch, revert)
    results = []
    for patch in patches:
        if check:
            state = SourcePatchState.WOULD_REVERT if revert else SourcePatchState.WOULD_APPLY
        else:
            done = _git_apply(tree, patch, *(["-R"] if revert else []))
            if done.returncode != 0:  # checked above; only a concurrent change gets here
                raise SourcePatchError(f"git apply {patch.name} failed in {tree}: {done.stderr.strip()}")
            state = SourcePatchState.REVERTED if revert else SourcePatchState.APPLIED
        results.append(SourcePatchResult(f"{patch.parent.name}/{patch.name}", state))
    return results


def _refuse_if_not_applicable(tree: Path, patch: Path, revert: bool) -> None:
    name = f"{patch.parent.name}/{patch.name}"
    if _applies(tree, patch, reverse=revert):
        return
    if not revert and _applies(tree, patch, reverse=True):
        raise SourcePatchError(f"{name} is already applied to {tree}; nothing was changed "
                               "(use --revert to remove it)")
    if revert and _applies(tree, patch):
        raise SourcePatchError(f"{name} is not applied to {tree}; nothing to revert")
    detail = _git_apply(tree, patch, "--check", *(["-R"] if revert else [])).stderr.strip()
    raise SourcePatchError(f"{name} does not apply to {tree} (the target code differs from the "
                           f"tree it was made for); nothing was changed. git apply: {detail}")
