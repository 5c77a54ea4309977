"""Shared fixtures: the installed megatron-core release and the runtime patches under test.

``MEGATRON_EXT_TEST_SOURCE_PATCHED=1`` says the imported megatron-core carries the source
patches of ``patches/`` (the released code is then fixed already). Set ``MEGATRON_EXT_TEST_UNPATCHED=1`` to run the same tests against the released code without the
runtime patches: the fault tests then fail on the releases that have the faults, which is how the
issue notes count "fails unpatched, passes patched".
"""

from __future__ import annotations

import os
import warnings

import pytest

import megatron_ext
from megatron_ext import mcore

warnings.filterwarnings("ignore", module="megatron")

UNPATCHED = os.environ.get("MEGATRON_EXT_TEST_UNPATCHED", "") == "1"
# Set by functional_tests/test_source_patches.py when the imported tree carries patches/.
SOURCE_PATCHED = os.environ.get("MEGATRON_EXT_TEST_SOURCE_PATCHED", "") == "1"


@pytest.fixture(scope="session")
def mcore_version() -> str:
    return mcore.installed_version()


@pytest.fixture(scope="session")
def mcore_series(mcore_version: str) -> str:
    return mcore.release_series(mcore_version)


@pytest.fixture
def runtime_patches():
    """Apply megatron-ext's runtime patches for one test (unless running unpatched), then revert."""
    results = [] if UNPATCHED else megatron_ext.apply()
    yield results
    megatron_ext.revert()
