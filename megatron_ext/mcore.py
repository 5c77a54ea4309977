"""Finding the installed megatron-core and its release.

Every lookup goes through here so that "megatron-core is not installed" is reported the same way
everywhere: one line naming the fix, never an ImportError traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import sys
from types import ModuleType
from typing import Callable, ContextManager

from packaging.version import InvalidVersion, Version

from .errors import MegatronCoreNotFoundError, UnsupportedReleaseError

#: PyPI releases megatron-ext was written and tested against: the one list. The known trees of
#: the patches' fingerprints (with Megatron-LM commits beside them), patches/index.yaml,
#: scripts/bootstrap.sh, pyproject.toml, .ci/run and the README must agree with it
#: (unit_tests/test_supported_releases.py). Patches are decided by the installed code, not by
#: this list: a tree not in it is judged by its fingerprints (:meth:`megatron_ext.patching.Patch.plan`).
SUPPORTED_RELEASES: tuple[str, ...] = ("0.17.0", "0.17.1", "0.18.0", "0.18.2", "0.19.0", "0.19.2")

#: The first release with prefix caching: an older tree has nothing megatron-ext could patch.
FIRST_RELEASE = SUPPORTED_RELEASES[0]

KV_BLOCK_ALLOCATOR_MODULE = "megatron.core.inference.contexts.kv_block_allocator"
DYNAMIC_CONTEXT_MODULE = "megatron.core.inference.contexts.dynamic_context"
DYNAMIC_ENGINE_MODULE = "megatron.core.inference.engines.dynamic_engine"
TEXT_GENERATION_CONTROLLER_MODULE = (
    "megatron.core.inference.text_generation_controllers.text_generation_controller")
MAMBA_SLOT_ALLOCATOR_MODULE = "megatron.core.inference.contexts.mamba_slot_allocator"
MLA_MODULE = "megatron.core.transformer.multi_latent_attention"
ATTENTION_MODULE = "megatron.core.transformer.attention"
INFERENCE_REQUEST_MODULE = "megatron.core.inference.inference_request"

_INSTALL_HINT = (
    "install a supported release, e.g. `pip install --no-deps megatron-core==0.19.2` "
    f"(supported: {', '.join(SUPPORTED_RELEASES)})"
)


def installed_version() -> str:
    """Return the release of the importable megatron-core as a string, e.g. ``"0.19.2"``.

    Read from ``megatron.core.package_info`` (the code that is actually imported, also a source
    tree on ``PYTHONPATH``) as MAJOR.MINOR.PATCH + PRE_RELEASE, falling back to the distribution
    metadata. Not ``__version__``: megatron-core appends the git hash of whatever repository
    its directory sits in (a virtualenv inside a project checkout gives ``0.18.2+<project hash>``).

    Raises:
        MegatronCoreNotFoundError: megatron-core is not importable.
    """
    try:
        info = importlib.import_module("megatron.core.package_info")
        return f"{info.MAJOR}.{info.MINOR}.{info.PATCH}{getattr(info, 'PRE_RELEASE', '')}"
    except ImportError as exc:
        try:
            return importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:
            raise MegatronCoreNotFoundError(
                f"megatron-core is not installed in this Python ({exc}); {_INSTALL_HINT}"
            ) from None


def require_supported(version: str, fix: str = "") -> None:
    """Refuse a tree older than :data:`FIRST_RELEASE` (no prefix caching: nothing to fingerprint
    against), before any of its modules is looked at. Any newer tree, released or not, is judged
    patch by patch by its code; an unparsable version is not refused here.

    Args:
        version: the installed release (:func:`installed_version`).
        fix: appended to the message's install hint, e.g. how to force.

    Raises:
        UnsupportedReleaseError: naming ``version`` and the supported releases.
    """
    if too_old(version):
        raise UnsupportedReleaseError(version, SUPPORTED_RELEASES, fix)


def too_old(version: str) -> bool:
    """Whether ``version`` is older than :data:`FIRST_RELEASE` (False if it does not parse)."""
    try:
        return Version(version) < Version(FIRST_RELEASE)
    except InvalidVersion:
        return False


def base_release(version: str) -> str:
    """The public release of a version: ``"0.18.2+624d3fd"`` (a local build) -> ``"0.18.2"``.

    A local build of a release is patched like the release only if its target code still has
    the release's fingerprints; unparsable input is returned as is.
    """
    try:
        return Version(version).base_version
    except InvalidVersion:
        return version


def release_series(version: str) -> str:
    """Map a release to its series, e.g. ``"0.18.2"`` -> ``"0.18"``; unparsable input is returned as is."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return version
    return f"{parsed.major}.{parsed.minor}"


#: module name -> context entered around its first import through :func:`import_module`
_IMPORT_CONTEXTS: dict[str, Callable[[], ContextManager]] = {}


def register_import_context(name: str, context: Callable[[], ContextManager]) -> None:
    """Enter ``context()`` around the first import of megatron-core module ``name`` through
    :func:`import_module` (a runtime patch's target, say). For a backend that decides how a module
    binds its optional imports, which it does once, at import: the CPU backend registers the Mamba
    mixer (:mod:`megatron_ext.cpu_backend.mamba`), so a patch importing it need not know of backends.
    """
    _IMPORT_CONTEXTS[name] = context


def import_module(name: str) -> ModuleType:
    """Import a megatron-core module by dotted name (inside its registered import context, if any,
    when it is not imported yet: :func:`register_import_context`).

    Raises:
        UnsupportedReleaseError: the module is missing from a release older than
            :data:`FIRST_RELEASE` (reached when forced): named with the release, not as an import failure.
        MegatronCoreNotFoundError: megatron-core (or this module of it) cannot be imported.
    """
    context = _IMPORT_CONTEXTS.get(name) if name not in sys.modules else None
    try:
        with context() if context is not None else contextlib.nullcontext():
            return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == "megatron" or exc.name.startswith("megatron.")):
            try:
                version = installed_version()
            except MegatronCoreNotFoundError:
                version = None  # no megatron-core at all: said below
            if version is not None and too_old(version):
                raise UnsupportedReleaseError(version, SUPPORTED_RELEASES, f"; it has no {exc.name}") from None
            raise MegatronCoreNotFoundError(
                f"cannot import {name} ({exc}); {_INSTALL_HINT}"
            ) from None
        raise


def uses_lru_prefix_caching(allocator) -> bool:
    """Whether a ``KVBlockAllocator`` caches blocks under the LRU eviction policy.

    Under LRU, blocks of finished requests stay cached at ref count 0 until an allocation evicts
    them; under REF_ZERO (the default) they are dropped when their ref count reaches zero.
    """
    return bool(allocator.enable_prefix_caching) and allocator.prefix_caching_eviction_policy.name == "LRU"
