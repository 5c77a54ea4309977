"""Source patches (patches/) are equivalent to the runtime patches, on pristine release trees.

For each release of the installed release's series (so CI's three runs cover all six supported
releases once), a pristine copy of the release's wheel gets the source patches; then, in a
subprocess importing that copy:
- ``megatron-ext status`` reports every runtime patch "not needed" (the fix is detected in
  the code: by a probe of the code's behaviour for fixes 1, 3 and 5, by the signature of
  ``is_memory_available`` for fix 4, by the recorded source-patched fingerprints for fixes 2,
  6, 7, 8, 9, H1, H7, H8, H10 and H11; by probes of the Mamba slot allocator for H4 and H6; by the context's own
  ``_find_mamba_match_count`` for H5);
- the unit tests that check the runtime patches pass there without them being applied (the
  consistency check between runtime and source patches) on the series' newest release; an older
  release's patched files are byte-identical to the newest's after patching, or their own fix tests
  run there too (``OLDER_RELEASE_DIFFERENCES``);
- the default ``ab`` case is bit-identical and audit-clean.

When the installed megatron-core is a known Megatron-LM commit with a series of its own
(``commits:`` in ``patches/index.yaml``; decided by :func:`megatron_ext.api.installed_tree`, not by
the version string, which is "0.20.0" on every main commit), that commit's tree is unpacked from its
archive (:func:`~megatron_ext.source_patches.unpack_tree`), gets its series, and is checked the same
way: ``status`` "not needed" for every patch, the fix tests, the default ``ab`` case.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import yaml

from functional_tests.conftest import REPO, SERIES
from megatron_ext import mcore
from megatron_ext.fingerprints import known_trees
from megatron_ext.patches import ALL_PATCHES
from megatron_ext.source_patches import (SourcePatchError, commit_patches, patch_source, patches_dir, patches_for,
                                         series_for, tree_version, unpack_release, unpack_tree)

WHEELS = REPO / ".venv" / "mcore-wheels"  # pip download cache, outside git
RELEASES = [r for r in mcore.SUPPORTED_RELEASES if mcore.release_series(r) == SERIES]
#: the release tests need a supported release installed (a Megatron-LM commit has the commit tests)
needs_release = pytest.mark.skipif(not RELEASES, reason=f"the installed megatron-core ({SERIES}) is no supported "
                                   "release: a Megatron-LM commit's series is checked by the *_commit_tree tests")


@pytest.fixture(scope="session")
def installed_commit() -> str:
    """The known Megatron-LM commit with a source patch series that the installed megatron-core is
    (:func:`megatron_ext.api.installed_tree`); the test is skipped on any other tree."""
    from megatron_ext.api import installed_tree

    series = yaml.safe_load((patches_dir() / "index.yaml").read_text()).get("commits") or {}
    commits = [name for name in installed_tree() if known_trees()[name].commit and name in series]
    if not commits:
        pytest.skip("the installed megatron-core is no known Megatron-LM commit with a source patch series")
    return commits[-1]


def pristine_tree(version: str, tmp_path: Path) -> Path:
    """Unpack megatron-core==version's wheel (downloaded once into .venv/mcore-wheels)."""
    return unpack_release(version, tmp_path / f"mcore-{version}", WHEELS)


def run_with(tree: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")}
    env.update(PYTHONPATH=str(tree), MEGATRON_EXT_TEST_SOURCE_PATCHED="1")
    return subprocess.run([sys.executable, "-W", "ignore", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def patched_tree(version: str, tmp_path: Path) -> Path:
    tree = pristine_tree(version, tmp_path)
    assert tree_version(tree) == version
    results = patch_source(tree)
    assert [r.state.value for r in results] == ["applied"] * len(results)
    return tree


#: Unit-test files of the runtime patches' fixes: run on a source-patched tree, without the runtime patches.
FIX_TESTS = ("unit_tests/test_release_refcount.py", "unit_tests/test_matched_block_writes.py",
             "unit_tests/test_faults.py", "unit_tests/test_lru_faults.py",
             "unit_tests/test_weight_update_invalidation.py", "unit_tests/test_top_n_prefill_chunks.py",
             "unit_tests/test_deregister_own_hash.py", "unit_tests/test_mamba_chunk_size.py",
             "unit_tests/test_mamba_snapshot_offsets.py", "unit_tests/test_mamba_slot_exhaustion.py",
             "unit_tests/test_mamba_match_in_chunk.py", "unit_tests/test_mamba_clamp_restore.py",
             "unit_tests/test_mamba_conv_carry.py", "unit_tests/test_mamba_continuation_skip.py",
             "unit_tests/test_mamba_aligned_chunks.py", "unit_tests/test_mamba_decode_no_dummy.py",
             "unit_tests/test_mamba_decode_a_cache.py",
             "unit_tests/test_routing_per_block.py", "unit_tests/test_routing_evicted_requests.py",
             "unit_tests/test_mla_decode_flag.py", "unit_tests/test_mla_absorbed_weights.py",
             "unit_tests/test_spec_block_ids_after_eviction.py")

#: Files the source patches change that differ between an older release of a series and the newest
#: one after patching, with the fix tests of that code (run on the older tree too); every other
#: patched file is byte-identical, so the newest release's fix tests ran its code.
OLDER_RELEASE_DIFFERENCES = {
    "0.17.0": {"megatron/core/inference/inference_request.py": ("unit_tests/test_routing_evicted_requests.py",)},
    "0.18.0": {}, "0.19.0": {},
}


def run_fix_tests(tree: Path, *tests: str) -> None:
    """The fix tests on ``tree`` without the runtime patches; those marked ``slow`` (an engine run end
    to end) are left to their own tests below."""
    done = run_with(tree, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *tests)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and not re.search(r"\d+ failed", done.stdout)  # "2 xfailed" is no failure


def patched_files(version: str) -> list[str]:
    """The files (``megatron/core/...``) the release's source patches change."""
    return sorted({line[len("+++ b/"):].strip() for patch in patches_for(version)
                   for line in patch.read_text().splitlines() if line.startswith("+++ b/")})


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.every_tree
def test_source_patched_tree_needs_no_runtime_patch(version, tmp_path):
    tree = patched_tree(version, tmp_path)
    status = run_with(tree, "-m", "megatron_ext", "status", "--json")
    assert status.returncode == 0, status.stderr
    payload = json.loads(status.stdout)
    assert payload["megatron_core_version"] == version
    assert {p["patch"]: p["state"] for p in payload["patches"]} == {
        name: "not needed" for name in (
            "release-refcount", "lru-leaf-first-eviction", "lru-register-once",
            "lru-pin-before-allocate", "matched-block-writes", "lru-resume-evictable",
            "weight-update-invalidation", "top-n-prefill-chunks", "deregister-own-hash",
            "mamba-chunk-size", "mamba-snapshot-offsets", "mamba-slot-exhaustion",
            "mamba-match-in-chunk", "mamba-clamp-restore", "mamba-conv-carry",
            "mamba-continuation-skip", "mamba-aligned-chunks", "mamba-decode-no-dummy",
            "mamba-decode-a-cache",
            "routing-per-block", "routing-finished-blocks", "routing-evicted-requests",
            "mla-decode-flag", "mla-absorbed-weights", "spec-block-ids-after-eviction")}


@pytest.mark.slow
@needs_release
@pytest.mark.every_tree
def test_source_patched_newest_release_passes_the_fix_tests(tmp_path):
    run_fix_tests(patched_tree(RELEASES[-1], tmp_path), *FIX_TESTS)


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES[:-1])
@pytest.mark.every_tree
def test_older_release_is_patched_to_the_newest_releases_code(version, tmp_path):
    """The patched files of an older release equal the newest release's after patching, except
    those of :data:`OLDER_RELEASE_DIFFERENCES`, whose fix tests then pass on the older tree."""
    older, newest = patched_tree(version, tmp_path / "older"), patched_tree(RELEASES[-1], tmp_path / "newest")
    files = patched_files(version)
    assert files == patched_files(RELEASES[-1])
    differing = [f for f in files if (older / f).read_bytes() != (newest / f).read_bytes()]
    assert differing == sorted(OLDER_RELEASE_DIFFERENCES[version])
    tests = sorted({t for f in differing for t in OLDER_RELEASE_DIFFERENCES[version][f]})
    if tests:
        run_fix_tests(older, *tests)


@pytest.mark.slow
@needs_release
def test_source_patched_mamba_decode_cache_follows_a_refit(tmp_path):
    """Fault H11 on the newest release's source-patched tree, without runtime patches: after every
    weight is updated through ``.data`` inside suspend/resume, and after an in-place restore under a
    new engine, round 2 is a fresh engine's bits (0.17 has no such cache: the same holds)."""
    tree = patched_tree(RELEASES[-1], tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")}
    env.update(PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]), TRITON_INTERPRET="1", MAMBA_DETERMINISTIC="1")
    done = subprocess.run([sys.executable, "-W", "ignore", "scripts/probes/mamba_decode_a_cache.py", "unpatched",
                           "add", "new_engine"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    probe = json.loads(lines[-1][len("PROBE "):])
    for path in ("add", "new_engine"):
        assert (probe[path]["same"], probe[path]["max_abs_dlogprob"]) == (True, 0.0), path


@pytest.mark.slow
@needs_release
@pytest.mark.every_tree
def test_default_ab_case_passes_on_source_patched_tree(tmp_path):
    # The newest release of the series: its target files are identical to the older one's.
    assert_default_ab_case_passes(patched_tree(RELEASES[-1], tmp_path), tmp_path)


def assert_default_ab_case_passes(tree: Path, tmp_path: Path) -> None:
    """The default ``ab`` case on a source-patched ``tree``: bit-identical, audit-clean, every
    runtime patch "not needed"."""
    report = tmp_path / "ab.json"
    done = run_with(tree, "-m", "megatron_ext", "ab", "--no-progress", "--json", str(report))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    payload = json.loads(report.read_text())
    assert payload["bit_identical"] and payload["kv_write_violations"] == 0
    assert payload["refcount_violations"] == 0
    assert {p["state"] for p in payload["patches"]} == {"not needed"}


@pytest.mark.slow
@needs_release
@pytest.mark.every_tree
def test_resume_after_suspend_serves_no_cached_block_source_patched_as_runtime_patched(tmp_path):
    """Engine level, on the newest release of the series: ``engine.resume()`` after ``suspend()``
    flushes the prefix cache in the source-patched code exactly as the runtime patch does."""
    def rounds(tree, mode):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")}
        if tree is not None:
            env["PYTHONPATH"] = str(tree)
        done = subprocess.run([sys.executable, "-W", "ignore", "-m", "functional_tests.suspend_resume_rounds", mode],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    source = rounds(patched_tree(RELEASES[-1], tmp_path), "apply")
    runtime = rounds(pristine_tree(RELEASES[-1], tmp_path / "pristine"), "apply")
    assert (source["weight_update_patch"], runtime["weight_update_patch"]) == ("not needed", "applied")
    assert source["blocks_matched"] == runtime["blocks_matched"]
    lru, ref_zero = source["blocks_matched"]["lru"], source["blocks_matched"]["ref_zero"]
    # round 2 matches only within itself (as round 1); round 3 matches round 2's cached blocks
    assert lru[0] == lru[1] < lru[2] and ref_zero[0] == ref_zero[1] == ref_zero[2] > 0


@needs_release
def test_already_patched_and_foreign_trees_are_refused(tmp_path):
    tree = pristine_tree(RELEASES[-1], tmp_path)
    patch_source(tree)
    before = {p: p.read_text() for p in (tree / "megatron/core/inference/contexts").glob("*.py")}
    with pytest.raises(SourcePatchError, match="is already applied"):
        patch_source(tree)
    checked = patch_source(tree, check=True, revert=True)
    assert all(r.state.value == "would revert" for r in checked)
    assert before == {p: p.read_text() for p in before}  # --check changed nothing
    patch_source(tree, revert=True)
    with pytest.raises(SourcePatchError, match="is not applied"):
        patch_source(tree, revert=True)
    target = tree / "megatron/core/inference/contexts/dynamic_context.py"
    target.write_text(target.read_text().replace("token_offset_range", "offsets"))
    with pytest.raises(SourcePatchError, match="does not apply .* nothing was changed"):
        patch_source(tree)


@needs_release
def test_tree_inside_a_git_checkout_is_really_patched(tmp_path):
    # the README's default: .venv inside the repository's work tree. git apply run there once
    # skipped every path silently and reported success with nothing changed.
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    tree = pristine_tree(RELEASES[-1], tmp_path)
    targets = sorted((tree / "megatron/core").rglob("*.py"))
    before = {p: p.read_bytes() for p in targets}
    results = patch_source(tree)
    assert [r.state.value for r in results] == ["applied"] * len(results)
    changed = sorted(str(p.relative_to(tree)) for p in targets if p.read_bytes() != before[p])
    assert changed == ["megatron/core/inference/contexts/dynamic_context.py",
                       "megatron/core/inference/contexts/kv_block_allocator.py",
                       "megatron/core/inference/contexts/mamba_slot_allocator.py",
                       "megatron/core/inference/engines/dynamic_engine.py",
                       "megatron/core/inference/inference_request.py",
                       # routing-per-block (0.17 only): the controller's routing bookkeeping
                       *(["megatron/core/inference/text_generation_controllers/text_generation_controller.py"]
                         if SERIES == "0.17" else []),
                       # mamba-decode-a-cache (0.18+): refresh_mamba_decode_caches
                       *(["megatron/core/inference/utils.py"] if SERIES != "0.17" else []),
                       "megatron/core/resharding/refit.py",
                       "megatron/core/ssm/mamba_mixer.py",
                       "megatron/core/ssm/ops/mamba_ssm.py",
                       # mla-decode-flag and mla-absorbed-weights
                       "megatron/core/transformer/multi_latent_attention.py"]
    patch_source(tree, revert=True)  # byte for byte the release again, no file added
    assert sorted((tree / "megatron/core").rglob("*.py")) == targets
    assert all(p.read_bytes() == before[p] for p in targets)


# -- a known Megatron-LM commit (NeMo-RL's 2a75ac12c5): its own series, checked like a release's ----


def patched_commit_tree(commit: str, tmp_path: Path) -> Path:
    """The commit's tree unpacked from its archive (``../shared/upstream``), with its series applied."""
    tree = unpack_tree(commit, tmp_path / commit, WHEELS)
    assert series_for(tree) == (commit, commit_patches(commit))
    results = patch_source(tree)
    assert [r.state.value for r in results] == ["applied"] * len(results)
    assert [r.patch.split("/")[0] for r in results] == [commit] * len(results)
    return tree


#: The fix tests run on a source-patched commit tree: those of the faults its series fixes and of
#: the faults fixed there upstream.
COMMIT_FIX_TESTS = FIX_TESTS


@pytest.mark.slow
@pytest.mark.every_tree
def test_source_patched_commit_tree_needs_no_runtime_patch(installed_commit, tmp_path):
    tree = patched_commit_tree(installed_commit, tmp_path)
    status = run_with(tree, "-m", "megatron_ext", "status", "--json")
    assert status.returncode == 0, status.stderr
    payload = json.loads(status.stdout)
    assert payload["megatron_core_version"] == known_trees()[installed_commit].version
    states = {p["patch"]: p["state"] for p in payload["patches"]}
    assert states == {p.name: "not needed" for p in ALL_PATCHES}, {p: s for p, s in states.items() if s != "not needed"}


@pytest.mark.slow
@pytest.mark.every_tree
def test_source_patched_commit_tree_passes_the_fix_tests(installed_commit, tmp_path):
    run_fix_tests(patched_commit_tree(installed_commit, tmp_path), *COMMIT_FIX_TESTS)


@pytest.mark.slow
@pytest.mark.every_tree
def test_default_ab_case_passes_on_source_patched_commit_tree(installed_commit, tmp_path):
    assert_default_ab_case_passes(patched_commit_tree(installed_commit, tmp_path), tmp_path)
