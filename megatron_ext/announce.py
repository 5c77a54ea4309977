"""One-line-per-patch announcements on stderr, for the automatic entry points."""

from __future__ import annotations

import sys

from .env import flag
from .errors import UnsupportedReleaseError
from .patching import PatchResult, PatchState

QUIET_ENV = "MEGATRON_EXT_QUIET"


def announce(results: list[PatchResult]) -> None:
    """Print ``megatron-ext: <patch>: <state> (<reason>)`` per patch; refusals even when quiet."""
    quiet = flag(QUIET_ENV)
    for result in results:
        if quiet and result.state is not PatchState.REFUSED:
            continue
        detail = result.reason + (f"; {result.evidence}" if result.evidence else "")
        print(f"megatron-ext: {result.patch}: {result.state.value} ({detail})", file=sys.stderr)


#: The unsupported-release lines printed so far (the start-up hook applies up to three times).
_REFUSED_RELEASES: set[str] = set()


def apply_announced() -> list[PatchResult]:
    """:func:`megatron_ext.apply` for the automatic entry points: an unsupported release is
    refused in one line (printed once, even when quiet) and nothing is applied; like a refused
    patch, it does not stop the job. Returns the results (none for an unsupported release).

    Raises:
        MegatronExtError: as :func:`megatron_ext.apply` (a bad ``MEGATRON_EXT_SKIP``).
    """
    from .api import apply

    try:
        return apply()
    except UnsupportedReleaseError as exc:
        if str(exc) not in _REFUSED_RELEASES:
            _REFUSED_RELEASES.add(str(exc))
            print(f"megatron-ext: {exc}; no patch applied", file=sys.stderr)
        return []
