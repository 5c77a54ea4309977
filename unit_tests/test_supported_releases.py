"""One list of supported megatron-core releases: ``megatron_ext.mcore.SUPPORTED_RELEASES``.

Every other place that names the releases must agree with it: the known trees of the runtime
patches' recorded fingerprints (with the Megatron-LM commits), the source patches' ``patches/index.yaml`` (``releases:``; its
``commits:`` are the Megatron-LM commits with a series of their own), ``scripts/bootstrap.sh``
(``SUPPORTED=``), the optional dependency in ``pyproject.toml``, the releases ``.ci/run`` tests
(the newest of each series) and the README's list.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from megatron_ext import mcore
from megatron_ext.patches import ALL_PATCHES
from megatron_ext.fingerprints import FINGERPRINTS_FILE, known_trees

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

REPO = Path(__file__).resolve().parents[1]
SUPPORTED = mcore.SUPPORTED_RELEASES
SERIES = sorted({mcore.release_series(r) for r in SUPPORTED}, key=Version)


def test_supported_releases_are_sorted_and_unique():
    assert list(SUPPORTED) == sorted(set(SUPPORTED), key=Version)


def test_known_trees_are_the_supported_releases_and_the_megatron_lm_commits():
    trees = known_trees()
    assert [name for name, tree in trees.items() if not tree.commit] == list(SUPPORTED)
    assert {name: (tree.version, tree.commit[:len(name)]) for name, tree in trees.items() if tree.commit} == {
        "2a75ac12c5": ("0.20.0", "2a75ac12c5"), "d98e8a64": ("0.20.0", "d98e8a64")}
    for name, tree in trees.items():
        assert tree.version == (name if not tree.commit else tree.version) and tree.date, name


def test_every_patch_is_decided_on_every_known_tree_one_way():
    # each known tree is recorded faulty or fixed for each patch, never both; code recorded as
    # faulty somewhere is never recorded as fixed elsewhere (plan() would have to guess)
    for patch in ALL_PATCHES:
        faulty, fixed = patch.faulty_fingerprints, patch.fixed_fingerprints
        assert set(faulty) | set(fixed) == set(known_trees()), patch.name
        assert not set(faulty) & set(fixed), patch.name
        assert not [tree for tree, prints in fixed.items() if prints in faulty.values()], patch.name
        for prints in [*faulty.values(), *fixed.values()]:
            assert set(prints) == {t.qualname for t in patch.checked_functions()}, patch.name


#: Megatron-LM commits with a source patch series of their own (``commits:`` in patches/index.yaml)
COMMIT_SERIES = ("2a75ac12c5",)


def test_source_patch_index_lists_the_supported_releases_and_the_commit_series():
    index = yaml.safe_load((REPO / "patches" / "index.yaml").read_text())
    assert tuple(index["releases"]) == SUPPORTED
    assert tuple(index["commits"]) == COMMIT_SERIES
    trees = known_trees()
    for commit, patches in index["commits"].items():
        assert trees[commit].commit, commit  # a known Megatron-LM commit
        assert [p.split("/")[0] for p in patches] == [commit] * len(patches)
        # one patch per fault the commit has, each named after its runtime patch, in numbered order
        names = [re.fullmatch(rf"{commit}/(\d{{4}})-([a-z0-9-]+)\.patch", p).groups() for p in patches]
        assert [int(n) for n, _ in names] == list(range(1, len(patches) + 1))
        assert {name for _, name in names} == {p.name for p in ALL_PATCHES if commit in p.faulty_fingerprints}
    listed = {p for series in (*index["releases"].values(), *index["commits"].values()) for p in series}
    assert listed == {str(p.relative_to(REPO / "patches")) for p in (REPO / "patches").glob("*/*.patch")}


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
    # needed() answers "not needed" only for a tree listed here: a tree missing from one table
    # would get that runtime patch refused on its source-patched tree. A patch faulty on some
    # trees only is recorded fixed on the others.
    patches = {patch.name: patch for patch in ALL_PATCHES if patch.source_patched_fingerprints}
    assert {"matched-block-writes", "lru-resume-evictable", "weight-update-invalidation"} <= set(patches)
    assert set(patches["routing-per-block"].source_patched_fingerprints) == {"0.17.0", "0.17.1"}
    assert set(patches["routing-evicted-requests"].source_patched_fingerprints) == {*SUPPORTED, *COMMIT_SERIES}
    for commit in COMMIT_SERIES:  # each fault of a commit with a series is recorded source-patched there
        assert {name for name, patch in patches.items() if commit in patch.source_patched_fingerprints} == {
            patch.name for patch in ALL_PATCHES if commit in patch.faulty_fingerprints}, commit
    with_series = {*SUPPORTED, *COMMIT_SERIES}  # d98e8a64 is known (fingerprints) but has no series
    for name, patch in patches.items():
        assert set(patch.faulty_fingerprints) & with_series <= set(patch.source_patched_fingerprints), name
        assert set(patch.source_patched_fingerprints) <= with_series, name


def test_fingerprints_file_records_the_shipped_patches_only():
    # a table under a name no patch has would be dead data
    recorded = json.loads(FINGERPRINTS_FILE.read_text())
    names = {patch.name for patch in ALL_PATCHES}
    assert set(recorded) == {"trees", "faulty", "fixed", "source_patched"}
    assert set(recorded["faulty"]) | set(recorded["fixed"]) == names
    assert set(recorded["source_patched"]) == {p.name for p in ALL_PATCHES if p.source_patched_targets}
    assert FINGERPRINTS_FILE.read_text() == json.dumps(recorded, indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize("source, problem", [
    ("{tmp}/missing", "does not exist"),
    ("{tmp}/notes.txt", "is a file but not a .tar.gz archive"),
    ("{tmp}", "has no megatron/core/package_info.py"),
    ("{tmp}/broken.tar.gz", "is not a readable .tar.gz archive (tar failed)"),
])
def test_bootstrap_refuses_a_bad_megatron_core_source_in_one_line(tmp_path, source, problem):
    """Bad ``MEGATRON_CORE_SOURCE`` values are refused (exit 2, one line naming the value, the
    problem and the fix) before anything is installed."""
    (tmp_path / "notes.txt").write_text("not a tree\n")
    (tmp_path / "broken.tar.gz").write_bytes(b"not gzip")
    value = source.format(tmp=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_CORE_VERSION", "MEGATRON_CORE_SOURCE")}
    done = subprocess.run([str(REPO / "scripts" / "bootstrap.sh")], env={**env, "MEGATRON_CORE_SOURCE": value},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith(f"bootstrap: MEGATRON_CORE_SOURCE={value} {problem}")
    assert "megatron-lm-2a75ac12c5.tar.gz" in done.stderr or "Megatron-LM checkout" in done.stderr


def test_bootstrap_refuses_both_megatron_core_variables():
    env = {**os.environ, "MEGATRON_CORE_VERSION": "0.19.2", "MEGATRON_CORE_SOURCE": str(REPO)}
    done = subprocess.run([str(REPO / "scripts" / "bootstrap.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stderr) == (2, "bootstrap: MEGATRON_CORE_VERSION and MEGATRON_CORE_SOURCE are "
                                              "both set; unset one (the release's wheel, or the tree)\n")
