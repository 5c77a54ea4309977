"""One list of supported megatron-core releases: ``megatron_ext.mcore.SUPPORTED_RELEASES``.

Every other place that names the releases must agree with it: the runtime patches' recorded
fingerprints, the source patches' ``patches/index.yaml``, ``scripts/bootstrap.sh``
(``SUPPORTED=``), the optional dependency in ``pyproject.toml``, the releases ``.ci/run`` tests
(the newest of each series) and the README's list.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from megatron_ext import mcore
from megatron_ext.patches import ALL_PATCHES
from megatron_ext.fingerprints import FINGERPRINTS_FILE

REPO = Path(__file__).resolve().parents[1]
SUPPORTED = mcore.SUPPORTED_RELEASES
SERIES = sorted({mcore.release_series(r) for r in SUPPORTED}, key=Version)


def test_supported_releases_are_sorted_and_unique():
    assert list(SUPPORTED) == sorted(set(SUPPORTED), key=Version)


def test_fingerprints_cover_exactly_the_supported_releases():
    recorded = {release for patch in ALL_PATCHES for release in patch.fingerprints}
    assert recorded == set(SUPPORTED)
    for patch in ALL_PATCHES:
        assert set(patch.supported_releases) <= set(SUPPORTED), patch.name


def test_source_patch_index_lists_the_supported_releases():
    index = yaml.safe_load((REPO / "patches" / "index.yaml").read_text())["releases"]
    assert tuple(index) == SUPPORTED


def test_bootstrap_accepts_the_supported_releases():
    text = (REPO / "scripts" / "bootstrap.sh").read_text()
    listed = re.search(r'^SUPPORTED="([^"]*)"', text, re.MULTILINE).group(1).split()
    assert tuple(listed) == SUPPORTED
    default = re.search(r'MEGATRON_CORE_VERSION:-([0-9.]+)\}', text).group(1)
    assert default == SUPPORTED[-1]


def test_pyproject_mcore_extra_admits_the_supported_series_only():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = [Requirement(r) for r in extras["mcore"]]
    assert requirement.name == "megatron-core"
    assert all(requirement.specifier.contains(r) for r in SUPPORTED)
    first, last = Version(SERIES[0]), Version(SERIES[-1])
    assert not requirement.specifier.contains(f"{first.major}.{first.minor - 1}.99")
    assert not requirement.specifier.contains(f"{last.major}.{last.minor + 1}.0")


def test_ci_runs_the_newest_release_of_each_series():
    text = (REPO / ".ci" / "run").read_text()
    listed = re.search(r"^for release in ([0-9. ]+); do", text, re.MULTILINE).group(1).split()
    newest = [max((r for r in SUPPORTED if mcore.release_series(r) == s), key=Version) for s in SERIES]
    assert listed == newest


def test_readme_names_the_supported_releases():
    text = (REPO / "README.md").read_text()
    listed = re.search(r"\(supported: ([0-9., ]+)\)", text).group(1)
    assert tuple(listed.split(", ")) == SUPPORTED


def test_source_patched_fingerprints_cover_exactly_the_releases_each_patch_is_written_for():
    # needed() answers "not needed" only for a release listed here: a release missing from one
    # table would get that runtime patch refused on its source-patched tree. A patch written for
    # some releases only (its released fingerprints) answers "not needed" elsewhere by itself.
    patches = {patch.name: patch for patch in ALL_PATCHES if patch.source_patched_fingerprints}
    assert {"matched-block-writes", "lru-resume-evictable", "weight-update-invalidation"} <= set(patches)
    assert set(patches["routing-per-block"].source_patched_fingerprints) == {"0.17.0", "0.17.1"}
    assert set(patches["routing-evicted-requests"].source_patched_fingerprints) == set(SUPPORTED)
    for name, patch in patches.items():
        assert set(patch.fingerprints) <= set(patch.source_patched_fingerprints) <= set(SUPPORTED), name


def test_fingerprints_file_records_the_shipped_patches_only():
    # a table under a name no patch has would be dead data; every patch has released fingerprints
    recorded = json.loads(FINGERPRINTS_FILE.read_text())
    names = {patch.name for patch in ALL_PATCHES}
    assert set(recorded) == {"released", "source_patched"}
    assert set(recorded["released"]) == names
    assert set(recorded["source_patched"]) == {p.name for p in ALL_PATCHES if p.source_patched_targets}
    assert FINGERPRINTS_FILE.read_text() == json.dumps(recorded, indent=2, sort_keys=True) + "\n"
