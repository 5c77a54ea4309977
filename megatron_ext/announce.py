"""One-line-per-patch announcements on stderr, for the automatic entry points."""

from __future__ import annotations

import sys

from .env import flag
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
