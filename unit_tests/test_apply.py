"""apply / revert / status: idempotence, exact restoration, refusals, forcing, thread safety."""

from __future__ import annotations

import importlib.metadata
import json
import linecache
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

import megatron_ext
from megatron_ext import cli, mcore
from megatron_ext.errors import PatchRefusedError
from megatron_ext.patches import ALL_PATCHES
from megatron_ext.patches.matched_block_writes import ADD_REQUEST, COMPUTE_PREFIX_MATCH
from megatron_ext.patches.release_refcount import RELEASE
from megatron_ext.patches.weight_update_invalidation import FIND_MATCH
from megatron_ext.patches.lru_leaf_first_eviction import EVICT
from megatron_ext.patches.lru_register_once import REGISTER
from megatron_ext.patches.lru_resume_evictable import RESUME
from megatron_ext.patches.mamba_decode_no_dummy import KERNEL
from megatron_ext.patches.deregister_own_hash import DEREGISTER
from megatron_ext.fingerprints import recorded_fingerprints
from megatron_ext.patching import PatchState, installed_patches

from .allocator_factory import make_allocator, pin, ref_counts

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

_FAULTS_017_018 = {
    "release-refcount": "applicable", "lru-leaf-first-eviction": "applicable",
    "lru-register-once": "not needed", "lru-pin-before-allocate": "applicable",
    "matched-block-writes": "applicable", "lru-resume-evictable": "applicable",
    "weight-update-invalidation": "applicable",
    "top-n-prefill-chunks": "applicable",
    "deregister-own-hash": "applicable",
    "spec-block-ids-after-eviction": "applicable",
}
EXPECTED_STATUS = {
    "0.17": {**_FAULTS_017_018, "mamba-chunk-size": "applicable", "mamba-snapshot-offsets": "applicable",
             "mamba-slot-exhaustion": "applicable",
             "mamba-match-in-chunk": "applicable", "mamba-clamp-restore": "not needed",
             "mamba-conv-carry": "applicable",
             "mamba-continuation-skip": "applicable", "mamba-aligned-chunks": "applicable",
             "mamba-decode-no-dummy": "applicable", "mamba-decode-a-cache": "not needed",
             "routing-per-block": "applicable", "routing-finished-blocks": "not needed", "routing-evicted-requests": "applicable",
             "mla-decode-flag": "applicable", "mla-absorbed-weights": "applicable"},
    "0.18": {**_FAULTS_017_018, "mamba-chunk-size": "not needed", "mamba-snapshot-offsets": "applicable",
             "mamba-slot-exhaustion": "applicable",
             "mamba-match-in-chunk": "applicable", "mamba-clamp-restore": "applicable",
             "mamba-conv-carry": "applicable",
             "mamba-continuation-skip": "applicable", "mamba-aligned-chunks": "applicable",
             "mamba-decode-no-dummy": "applicable", "mamba-decode-a-cache": "applicable",
             "routing-per-block": "not needed", "routing-finished-blocks": "applicable", "routing-evicted-requests": "applicable",
             "mla-decode-flag": "applicable", "mla-absorbed-weights": "applicable"},
    "0.19": {
        "release-refcount": "not needed", "lru-leaf-first-eviction": "not needed",
        "lru-register-once": "applicable", "lru-pin-before-allocate": "not needed",
        "matched-block-writes": "applicable", "lru-resume-evictable": "applicable",
        "weight-update-invalidation": "applicable",
        "top-n-prefill-chunks": "applicable",
        "deregister-own-hash": "applicable",
        "mamba-chunk-size": "not needed",
        "mamba-snapshot-offsets": "not needed",
        "mamba-slot-exhaustion": "applicable",
        "mamba-match-in-chunk": "not needed",
        "mamba-clamp-restore": "applicable",
        "mamba-conv-carry": "applicable",
        "mamba-continuation-skip": "applicable",
        "mamba-aligned-chunks": "applicable",
        "mamba-decode-no-dummy": "applicable",
        "mamba-decode-a-cache": "applicable",
        "routing-per-block": "not needed",
        "routing-finished-blocks": "applicable",
        "routing-evicted-requests": "applicable",
        "mla-decode-flag": "applicable", "mla-absorbed-weights": "applicable",
        "spec-block-ids-after-eviction": "applicable",
    },
}
# Megatron-LM main (2a75ac12c5, "0.20.0"): 0.19's, less the faults main fixed (5, 6: #5995; H6: #6091;
# M2: #4902), decided by the fault tests run unpatched there
EXPECTED_STATUS["0.20"] = {**EXPECTED_STATUS["0.19"], "lru-register-once": "not needed",
                           "lru-resume-evictable": "not needed", "mamba-slot-exhaustion": "not needed",
                           "mla-decode-flag": "not needed"}
TARGETS = (RELEASE, ADD_REQUEST, EVICT, REGISTER, RESUME, DEREGISTER, COMPUTE_PREFIX_MATCH, KERNEL)
PATCHED_TARGETS = {"0.17": [RELEASE, ADD_REQUEST, EVICT, REGISTER, RESUME, DEREGISTER, COMPUTE_PREFIX_MATCH, KERNEL],
                   "0.18": [RELEASE, ADD_REQUEST, EVICT, REGISTER, RESUME, DEREGISTER, COMPUTE_PREFIX_MATCH, KERNEL],
                   "0.19": [ADD_REQUEST, REGISTER, RESUME, DEREGISTER, COMPUTE_PREFIX_MATCH, KERNEL],
                   "0.20": [ADD_REQUEST, DEREGISTER, COMPUTE_PREFIX_MATCH, KERNEL]}
#: The wrappers on add_request, outermost first (installed in ALL_PATCHES order).
ADD_REQUEST_STACK = {"0.17": ["weight-update-invalidation", "matched-block-writes", "lru-pin-before-allocate"],
                     "0.18": ["weight-update-invalidation", "matched-block-writes", "lru-pin-before-allocate"],
                     "0.19": ["weight-update-invalidation", "matched-block-writes"],
                     "0.20": ["weight-update-invalidation", "matched-block-writes"]}
#: The wrappers on _deregister_blocks, outermost first.
DEREGISTER_STACK = {"0.17": ["deregister-own-hash", "lru-leaf-first-eviction"],
                    "0.18": ["deregister-own-hash", "lru-leaf-first-eviction"],
                    "0.19": ["deregister-own-hash"],
                    "0.20": ["deregister-own-hash"]}
#: The wrappers on _compute_prefix_match (issue 22: H5, H1), outermost first.
PREFIX_MATCH_STACK = {"0.17": ["mamba-continuation-skip", "mamba-match-in-chunk"],
                      "0.18": ["mamba-continuation-skip", "mamba-clamp-restore", "mamba-match-in-chunk"],
                      "0.19": ["mamba-continuation-skip", "mamba-clamp-restore"],
                      "0.20": ["mamba-continuation-skip", "mamba-clamp-restore"]}


@pytest.fixture(autouse=True)
def always_revert():
    megatron_ext.revert()
    yield
    megatron_ext.revert()


def states(results) -> dict[str, str]:
    return {r.patch: r.state.value for r in results}


def by_name(results, name: str):
    return next(r for r in results if r.patch == name)


def test_status_per_release(mcore_series, mcore_version):
    results = megatron_ext.status()
    assert states(results) == EXPECTED_STATUS[mcore_series]
    installed = f"megatron-core {mcore_version}" if mcore_version in mcore.SUPPORTED_RELEASES else "Megatron-LM "
    for result in results:  # decided by the known tree the installed code is, not by a probe
        verdict = "has" if result.state is PatchState.APPLICABLE else "does not have"
        assert result.reason.startswith(f"the installed code {verdict} this fault: megatron-core {mcore_version}'s "
                                        "targets match "), result
        assert installed in result.reason, result
        assert result.evidence.startswith("fingerprints "), result


def test_probes_never_clear_faulty_code_and_see_each_release_as_it_is(mcore_series):
    """The probes decide code no known tree has (Patch.needed): on the installed code, a probe that
    runs never calls a fault absent where the installed tree is recorded faulty; on a release,
    each probe sees the fault where the release has it and the fix where it has that."""
    probes = {}
    for patch in ALL_PATCHES:
        try:
            probes[patch.name] = patch.needed()
        except Exception as exc:  # a probe main's code breaks: such code is refused, never cleared
            probes[patch.name] = (None, f"{type(exc).__name__}: {exc}")
    for name, state in EXPECTED_STATUS[mcore_series].items():
        assert probes[name][0] is not False or state != "applicable", (name, probes[name])
    if mcore_series not in ("0.17", "0.18", "0.19"):
        return  # a Megatron-LM main tree: recorded, so its probes' evidence is not asserted here
    assert {name: needed for name, (needed, _) in probes.items()} == {
        name: state == "applicable" for name, state in EXPECTED_STATUS[mcore_series].items()}
    series = mcore_series
    refcount, eviction, register, pin_first, offsets = (probes[name][1] for name in (
        "release-refcount", "lru-leaf-first-eviction", "lru-register-once", "lru-pin-before-allocate",
        "mamba-snapshot-offsets"))
    assert "took the free slot: free count 0 of 1" in probes["mamba-slot-exhaustion"][1]
    if series == "0.19":
        assert "ref count 0" in refcount
        assert "evicted [[1]] (leaf first, as Megatron-LM #5822)" in eviction
        assert "block 0 child count 2" in register  # the probe saw the double count
        assert "takes potential_matched_count" in pin_first
        assert "store_routing_per_block exists" in probes["routing-per-block"][1]
        assert "keeps the snapshot at token 32" in offsets
    else:
        assert "ref count 1" in refcount  # the probe saw the leak
        assert "evicted [[0]] (parent first)" in eviction
        assert "takes no parent_hashes" in register
        assert "has no potential_matched_count" in pin_first
        assert "keeps offsets [] of a 40-token prompt" in offsets


def test_apply_wraps_exactly_the_needed_targets_and_revert_restores_them(mcore_series):
    originals = {t: t.current() for t in TARGETS}
    results = megatron_ext.apply()
    expected = {k: ("applied" if v == "applicable" else v) for k, v in EXPECTED_STATUS[mcore_series].items()}
    assert states(results) == expected
    for target, original in originals.items():
        patched = target in PATCHED_TARGETS[mcore_series]
        assert (target.current() is not original) == patched
        assert target.original() is original
    assert installed_patches(ADD_REQUEST) == ADD_REQUEST_STACK[mcore_series]
    assert installed_patches(DEREGISTER) == DEREGISTER_STACK[mcore_series]
    assert installed_patches(COMPUTE_PREFIX_MATCH) == PREFIX_MATCH_STACK[mcore_series]
    reverted = states(megatron_ext.revert())
    assert reverted == {k: ("reverted" if v == "applicable" else "not applied")
                        for k, v in EXPECTED_STATUS[mcore_series].items()}
    for target, original in originals.items():
        assert target.current() is original


def test_apply_twice_changes_nothing(mcore_series):
    megatron_ext.apply()
    wrapper = ADD_REQUEST.current()
    again = megatron_ext.apply()
    assert ADD_REQUEST.current() is wrapper
    assert states(again)["matched-block-writes"] == "applied"
    assert by_name(again, "matched-block-writes").reason == "already applied by megatron-ext"
    assert installed_patches(ADD_REQUEST) == ADD_REQUEST_STACK[mcore_series]  # no layer twice


def test_stacked_wrappers_unwind_only_from_the_outside():
    """Two patches on add_request, installed directly (on 0.19 one of them is not needed)."""
    inner, outer = (next(p for p in ALL_PATCHES if p.name == name)
                    for name in ("lru-pin-before-allocate", "matched-block-writes"))
    original = ADD_REQUEST.current()
    inner.install()
    outer.install()
    try:
        stack = ADD_REQUEST.current()
        assert installed_patches(ADD_REQUEST) == ["matched-block-writes", "lru-pin-before-allocate"]
        assert inner.is_applied() and outer.is_applied()
        with pytest.raises(RuntimeError, match="cannot revert lru-pin-before-allocate: "
                           "DynamicInferenceContext.add_request is wrapped again by"):
            inner.uninstall()
        assert ADD_REQUEST.current() is stack  # the refusal changed nothing
    finally:
        assert outer.uninstall() and inner.uninstall()
    assert ADD_REQUEST.current() is original


def test_apply_revert_apply_round_trip(mcore_series):
    original = ADD_REQUEST.current()
    megatron_ext.apply()
    megatron_ext.revert()
    megatron_ext.apply()
    assert installed_patches(ADD_REQUEST) == ADD_REQUEST_STACK[mcore_series]
    function = ADD_REQUEST.current()
    for _ in ADD_REQUEST_STACK[mcore_series]:
        function = function.__wrapped__
    assert function is original
    megatron_ext.revert()
    assert ADD_REQUEST.current() is original


def test_instances_created_before_apply_are_covered(mcore_series):
    allocator = make_allocator("REF_ZERO")
    blocks = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes([int(blocks[0])], [77])
    pin(allocator, [int(blocks[0])])
    megatron_ext.apply()
    allocator.release_memory_blocks(torch.cat([blocks, blocks]))
    assert ref_counts(allocator, [int(blocks[0])]) == [0]  # on every release, patched or fixed
    assert allocator.kv_hash_to_block_id == {}


def test_apply_from_many_threads_installs_one_wrapper(mcore_series):
    barrier = threading.Barrier(8)
    outcomes: list[list] = []

    def worker():
        barrier.wait()
        outcomes.append(megatron_ext.apply())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outcomes) == 8
    assert all(states(o)["matched-block-writes"] == "applied" for o in outcomes)
    assert installed_patches(ADD_REQUEST) == ADD_REQUEST_STACK[mcore_series]


@pytest.fixture
def changed_prefix_match(monkeypatch):
    """A locally edited ``_compute_prefix_match`` (fix 2 relies on it): same behaviour, other code,
    in megatron-core's own module (a function defined elsewhere is a foreign wrapper)."""
    owner = COMPUTE_PREFIX_MATCH.owner()
    namespace = {"original": owner.__dict__["_compute_prefix_match"], "__name__": COMPUTE_PREFIX_MATCH.module}
    source = ("def _compute_prefix_match(self, *args, **kwargs):\n"  # pragma: no cover - never called
              "    return original(self, *args, **kwargs)\n")
    filename = "<locally edited _compute_prefix_match>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # readable, as an edit is
    exec(compile(source, filename, "exec"), namespace)
    monkeypatch.setattr(owner, "_compute_prefix_match", namespace["_compute_prefix_match"])
    yield
    # the patches that wrap _compute_prefix_match (H5, H1) wrapped the stand-in: off first, then
    # monkeypatch puts the original back
    megatron_ext.revert()


def test_changed_target_is_refused_naming_function_and_versions(changed_prefix_match, mcore_version):
    before = ADD_REQUEST.current()
    results = megatron_ext.apply()
    refused = by_name(results, "matched-block-writes")
    assert refused.state is PatchState.REFUSED
    assert refused.reason.startswith(
        "megatron.core.inference.contexts.dynamic_context.DynamicInferenceContext._compute_prefix_match in "
        f"megatron-core {mcore_version}: this code is not one megatron-ext has checked (nearest known tree: ")
    assert ", where the others match); it was changed locally, by another patch or upstream." in refused.reason
    assert re.fullmatch(r"fingerprints DynamicInferenceContext._compute_prefix_match [0-9a-f]{16}", refused.evidence)
    assert "matched-block-writes" not in installed_patches(ADD_REQUEST)  # nothing installed
    assert by_name(results, "release-refcount").state is not PatchState.REFUSED  # independent
    with pytest.raises(PatchRefusedError, match="_compute_prefix_match"):
        megatron_ext.apply(strict=True)


#: The patches that rely on _compute_prefix_match (refused once it is changed), per release series.
RELY_ON_PREFIX_MATCH = {"0.17": ["lru-pin-before-allocate", "mamba-aligned-chunks", "mamba-continuation-skip",
                                 "mamba-match-in-chunk", "matched-block-writes"],
                        "0.18": ["lru-pin-before-allocate", "mamba-aligned-chunks", "mamba-clamp-restore",
                                 "mamba-continuation-skip", "mamba-match-in-chunk", "matched-block-writes"],
                        "0.19": ["mamba-aligned-chunks", "mamba-clamp-restore", "mamba-continuation-skip",
                                 "matched-block-writes"],
                        "0.20": ["mamba-aligned-chunks", "mamba-clamp-restore", "mamba-continuation-skip",
                                 "matched-block-writes"]}
#: The wrappers on _deregister_blocks, outermost first.
DEREGISTER_STACK = {"0.17": ["deregister-own-hash", "lru-leaf-first-eviction"],
                    "0.18": ["deregister-own-hash", "lru-leaf-first-eviction"],
                    "0.19": ["deregister-own-hash"],
                    "0.20": ["deregister-own-hash"]}


def test_strict_apply_does_not_raise_for_a_refused_patch_that_skip_leaves_out(changed_prefix_match, monkeypatch,
                                                                              mcore_series):
    refused = sorted(r.patch for r in megatron_ext.status() if r.state is PatchState.REFUSED)
    assert refused == RELY_ON_PREFIX_MATCH[mcore_series]
    monkeypatch.setenv("MEGATRON_EXT_SKIP", ",".join(refused))
    results = megatron_ext.apply(strict=True)
    for name in refused:
        assert (by_name(results, name).state, by_name(results, name).reason) == (
            PatchState.NOT_APPLIED, "skipped by MEGATRON_EXT_SKIP")
    assert PatchState.REFUSED not in {r.state for r in results}
    assert "matched-block-writes" not in installed_patches(ADD_REQUEST)
    assert "weight-update-invalidation" in installed_patches(FIND_MATCH)  # the others were applied
    monkeypatch.setenv("MEGATRON_EXT_SKIP", "lru-resume-evictable")  # skipping another one: still refused
    megatron_ext.revert()
    with pytest.raises(PatchRefusedError, match="_compute_prefix_match"):
        megatron_ext.apply(strict=True)


def test_forced_apply_installs_despite_changed_target(changed_prefix_match):
    forced = by_name(megatron_ext.apply(force=True), "matched-block-writes")
    assert forced.state is PatchState.APPLIED
    assert forced.reason.startswith("FORCED despite refusal")
    assert "matched-block-writes" in installed_patches(ADD_REQUEST)


#: Run in a fresh interpreter over a megatron-core tree of release 0.16.1: every command of the
#: command line, ``apply()`` / ``status()`` (unforced and forced) and ``import megatron_ext.auto``;
#: prints, as JSON, each command's exit code and stderr and each call's exception or results.
UNSUPPORTED_RELEASE_RUN = r"""
import argparse, contextlib, io, json, sys
import megatron_ext
from megatron_ext import cli

def stderr_of(action):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            outcome = action()
        except BaseException as exc:
            outcome = [type(exc).__name__, str(exc)]
    return [outcome, err.getvalue()]

parser = cli.build_parser()
commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
argvs = json.loads(sys.argv[1])
out = {"commands": sorted(commands)}
out.update({argv[0]: stderr_of(lambda: cli.main(argv)) for argv in argvs})
out["apply()"] = stderr_of(lambda: repr(megatron_ext.apply()))
out["status()"] = stderr_of(lambda: repr(megatron_ext.status()))
out["apply(force=True)"] = stderr_of(lambda: repr(megatron_ext.apply(force=True)))
out["import megatron_ext.auto"] = stderr_of(lambda: __import__("megatron_ext.auto").auto.RESULTS)
print(json.dumps(out))
"""


@pytest.mark.release_independent  # a 0.16.1 tree of its own, whatever is installed
def test_an_unsupported_release_is_refused_by_name_everywhere(tmp_path):
    """A megatron-core whose package_info says 0.16.1 (a tree with nothing else: 0.16.1 lacks the
    modules the patches import, and so does this one), older than the first release with prefix
    caching: each command that runs megatron-core, and apply() / status(), name it and the
    supported releases; the automatic entry point says so in one line and applies nothing."""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text('MAJOR = 0\nMINOR = 16\nPATCH = 1\nPRE_RELEASE = ""\n')
    argvs = [["status"], ["ab"], ["soak"], ["save-checkpoint", str(tmp_path / "ckpt")],
             ["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")], ["patch-source", "--check"]]
    root = os.path.dirname(os.path.dirname(megatron_ext.__file__))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", UNSUPPORTED_RELEASE_RUN, json.dumps(argvs)],
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")},
                               "PYTHONPATH": os.pathsep.join([str(tmp_path), root])},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out.pop("commands") == sorted(argv[0] for argv in argvs)  # a new command needs a line here

    supported = ", ".join(mcore.SUPPORTED_RELEASES)
    refusal = (f"megatron-core 0.16.1 is older than 0.17.0, the first release with prefix caching: megatron-ext has "
               f"nothing to patch there (supported: {supported}, and Megatron-LM checkouts judged by their code); "
               "install one of those, e.g. `pip install --no-deps megatron-core==0.19.2`")
    forcing = ", or force with MEGATRON_EXT_FORCE=1 / apply(force=True) after checking the target code yourself"
    assert out == {
        "status": [2, f"megatron-ext: error: {refusal}, or force with --force after checking the target code "
                      "yourself\n"],
        "ab": [2, f"megatron-ext: error: {refusal}\n"],
        "soak": [2, f"megatron-ext: error: {refusal}\n"],
        "save-checkpoint": [2, f"megatron-ext: error: {refusal}\n"],
        # reads recorded JSON files only: any megatron-core, or none, will do
        "compare": [2, f"megatron-ext: error: {tmp_path / 'a.json'}: no such file; pass the JSON file 'ab --json' "
                       "or 'soak --json' wrote\n"],
        # the release of the tree it patches (here the importable one), named by patches/index.yaml
        "patch-source": [2, f"megatron-ext: error: no source patches for megatron-core 0.16.1; supported: "
                            f"{supported}\n"],
        "apply()": [["UnsupportedReleaseError", refusal + forcing], ""],
        "status()": [["UnsupportedReleaseError", refusal + forcing], ""],
        "apply(force=True)": [["UnsupportedReleaseError", f"{refusal}; it has no megatron.core.inference"], ""],
        "import megatron_ext.auto": [[], f"megatron-ext: {refusal}{forcing}; no patch applied\n"],
    }
def test_missing_megatron_core_is_one_line_error(monkeypatch, capsys):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    monkeypatch.setitem(sys.modules, "megatron.core.package_info", None)
    assert cli.main(["status"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("megatron-ext: error: megatron-core is not installed")
    assert "pip install --no-deps megatron-core==0.19.2" in err[0]


#: Each patch's fault ID, as the README's table of faults numbers them (H2 is a rule, no patch).
FAULT_IDS = {
    "release-refcount": "1", "matched-block-writes": "2", "lru-leaf-first-eviction": "3",
    "lru-pin-before-allocate": "4", "lru-register-once": "5", "lru-resume-evictable": "6",
    "top-n-prefill-chunks": "7", "weight-update-invalidation": "8", "deregister-own-hash": "9",
    "mamba-clamp-restore": "H1", "mamba-chunk-size": "H3", "mamba-snapshot-offsets": "H4",
    "mamba-match-in-chunk": "H5", "mamba-slot-exhaustion": "H6", "mamba-conv-carry": "H7",
    "mamba-continuation-skip": "H8", "mamba-aligned-chunks": "H9", "mamba-decode-no-dummy": "H10",
    "mamba-decode-a-cache": "H11",
    "routing-per-block": "R1", "routing-finished-blocks": "R2",
    "routing-evicted-requests": "R3", "mla-decode-flag": "M2", "mla-absorbed-weights": "M1",
    "spec-block-ids-after-eviction": "S1",
}


def test_patches_carry_one_fault_id_and_a_class_named_after_them():
    assert {p.name: p.fault for p in ALL_PATCHES} == FAULT_IDS
    for patch in ALL_PATCHES:  # lru-leaf-first-eviction: LruLeafFirstEvictionPatch
        assert type(patch).__name__ == "".join(w.capitalize() for w in patch.name.split("-")) + "Patch"


def test_cli_status_json(capsys, mcore_series, mcore_version):
    assert cli.main(["status", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["megatron_core_version"] == mcore_version
    assert {p["patch"]: p["state"] for p in payload["patches"]} == EXPECTED_STATUS[mcore_series]
    assert {p["patch"]: p["fault"] for p in payload["patches"]} == FAULT_IDS
    installed = [mcore_version] if mcore_version in mcore.SUPPORTED_RELEASES else ["2a75ac12c5", "d98e8a64"]
    assert set(installed) & set(payload["known_tree"])  # the release itself, or a main commit CI installs
    assert payload["known_tree"] == list(megatron_ext.api.installed_tree())


def test_cli_status_trees_lists_every_known_tree_and_marks_the_installed_one(capsys, mcore_version):
    assert cli.main(["status", "--trees", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    trees = {tree["name"]: tree for tree in payload["known_trees"]}
    assert list(trees) == ["0.17.0", "0.17.1", "0.18.0", "0.18.2", "2a75ac12c5", "0.19.0", "d98e8a64", "0.19.2"]
    assert trees["2a75ac12c5"] == {"name": "2a75ac12c5", "version": "0.20.0", "date": "2026-08-13",
                                   "commit": "2a75ac12c54ba6a42b34024756820bf819a2e25f",
                                   "source": "megatron-lm-2a75ac12c5.tar.gz"}
    # 0.19.2's inference code is 0.19.0's: both are named; never a tree of another series
    assert payload["known_tree"] and all(mcore.release_series(trees[name]["version"]) == mcore.release_series(
        mcore_version) for name in payload["known_tree"])
    assert cli.main(["status", "--trees", "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert f"known trees; installed: megatron-core {mcore_version} (code of " in out
    assert re.search(r"^│ Megatron-LM 2a75ac12c5 │ 0\.20\.0 +│ 2026-08-13 │", out, re.MULTILINE)


def test_cli_status_table_names_each_patch_with_its_fault_id(capsys):
    cli.main(["status", "--width", "400"])
    out = capsys.readouterr().out
    assert re.search(r"^┃ fault ┃ patch\s+┃ target", out, re.MULTILINE)
    for name, fault in FAULT_IDS.items():
        assert re.search(rf"^│ {fault}\s+│ {name}\s+│", out, re.MULTILINE), name


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=full_env,
                          capture_output=True, text=True, timeout=300)


CHECK_WRAPPED = (  # the outermost wrapper of add_request (the last patch installed on it)
    "import megatron.core.inference.contexts.dynamic_context as d; "
    "print(getattr(d.DynamicInferenceContext.__dict__['add_request'], "
    "'_self_megatron_ext_patch', None))"
)


def test_environment_variable_applies_at_import_with_no_code_change():
    done = run_python(CHECK_WRAPPED, MEGATRON_EXT_AUTO="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "weight-update-invalidation"
    assert "megatron-ext: matched-block-writes: applied" in done.stderr
    untouched = run_python(CHECK_WRAPPED)
    assert untouched.stdout.strip() == "None"
    assert "megatron-ext" not in untouched.stderr


def test_environment_variable_applies_the_engine_patch_once_the_engine_is_imported(mcore_series):
    # The engine module imports the context half-way through its own import, so the context's
    # hook runs with the engine half-defined (importing it from there fails on megatron-core's
    # circular imports): the patches of the engine and its controller wait, a hook on the engine
    # module decides them.
    code = ("from megatron.core.inference.engines import DynamicInferenceEngine as E; " + CHECK_WRAPPED
            + "; print(getattr(E.__dict__['post_process_requests'], '_self_megatron_ext_patch', None))")
    done = run_python(code, MEGATRON_EXT_AUTO="1")
    assert done.returncode == 0, done.stderr
    # routing-evicted-requests goes on post_process_requests (0.18, 0.19; 0.17: on the record's merge)
    # after top-n-prefill-chunks
    outermost = "top-n-prefill-chunks" if mcore_series == "0.17" else "routing-evicted-requests"
    assert done.stdout.split() == ["weight-update-invalidation", outermost]
    lines = [line for line in done.stderr.splitlines() if line.startswith("megatron-ext: ")]
    waiting = ("top-n-prefill-chunks", "routing-per-block", "routing-evicted-requests", "mamba-aligned-chunks")
    assert len(lines) == len(ALL_PATCHES) + len(waiting)  # each patch once, the waiting ones twice
    for name in waiting:
        decided = EXPECTED_STATUS[mcore_series][name].replace("applicable", "applied")
        engine = [line for line in lines if line.startswith(f"megatron-ext: {name}: ")]
        assert len(engine) == 2
        assert engine[0].startswith(f"megatron-ext: {name}: not applied (megatron-core is being")
        assert engine[1].startswith(f"megatron-ext: {name}: {decided} (")
        assert engine[1] in lines[-len(waiting):]  # once the engine module is imported, after every other patch


HEAVY_MODULES_LOADED = (  # wrapt: its import alone was 0.09 s, 6x a bare Python start-up
    "import sys; print(sorted(m for m in ('torch', 'megatron', 'numpy', 'wrapt') if m in sys.modules))"
)


def test_environment_variable_imports_neither_torch_nor_megatron_at_start_up():
    # A job sets MEGATRON_EXT_AUTO=1 for every process (data-loader workers, launch scripts):
    # start-up must only register the import hook; the patches load with megatron-core.
    done = run_python(HEAVY_MODULES_LOADED, MEGATRON_EXT_AUTO="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert done.stderr == ""


APPLIED_LINE = "megatron-ext: matched-block-writes: applied"
DYNAMIC_CONTEXT = "megatron.core.inference.contexts.dynamic_context"


def test_environment_variable_applies_at_once_when_megatron_core_was_imported_first():
    # the start-up hook installed after the module was imported (a launcher importing megatron-core
    # before megatron_ext._startup runs): the patches apply at once
    done = run_python(f"import {DYNAMIC_CONTEXT}, os; os.environ['MEGATRON_EXT_AUTO'] = '1'; "
                      "import megatron_ext._startup; " + CHECK_WRAPPED)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "weight-update-invalidation"
    assert done.stderr.count(APPLIED_LINE) == 1


def test_environment_variable_applies_once_with_threads_importing_together():
    code = (
        "import threading, importlib, megatron.core, torch\n"  # the parents first: the race is on the hooked module
        "barrier = threading.Barrier(4)\n"
        "seen = []\n"
        "def importer():\n"
        "    barrier.wait()\n"
        f"    module = importlib.import_module('{DYNAMIC_CONTEXT}')\n"
        "    seen.append(getattr(module.DynamicInferenceContext.__dict__['add_request'], '_self_megatron_ext_patch', None))\n"
        "threads = [threading.Thread(target=importer) for _ in range(4)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(seen)\n"
    )
    done = run_python(code, MEGATRON_EXT_AUTO="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(["weight-update-invalidation"] * 4)  # each thread got it patched
    assert done.stderr.count(APPLIED_LINE) == 1  # applied once


def test_environment_variable_under_reload_applies_once_and_apply_covers_the_reloaded_classes():
    # a reload executes the module again: its classes are new objects, without the patches; the
    # hook ran once (it does not run again), and apply() patches the reloaded classes
    code = (f"import importlib, {DYNAMIC_CONTEXT} as d\n" + CHECK_WRAPPED + "\n"
            "importlib.reload(d)\n" + CHECK_WRAPPED + "\n"
            "import megatron_ext; megatron_ext.apply()\n" + CHECK_WRAPPED + "\n")
    done = run_python(code, MEGATRON_EXT_AUTO="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["weight-update-invalidation", "None", "weight-update-invalidation"]
    assert done.stderr.count(APPLIED_LINE) == 1


def test_package_and_cli_import_without_torch():
    done = run_python("import megatron_ext, megatron_ext.cli; " + HEAVY_MODULES_LOADED)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    help_run = subprocess.run([sys.executable, "-X", "importtime", "-m", "megatron_ext", "--help"],
                              capture_output=True, text=True, timeout=120)
    assert help_run.returncode == 0
    assert "usage: megatron-ext" in help_run.stdout
    imported = {line.split("|")[-1].strip() for line in help_run.stderr.splitlines()}
    assert "torch" not in imported and "megatron" not in imported


def test_lazy_attributes_are_the_real_objects():
    import megatron_ext
    from megatron_ext import api, errors, patching

    assert megatron_ext.apply is api.apply
    assert megatron_ext.status is api.status
    assert megatron_ext.PatchState is patching.PatchState
    assert megatron_ext.PatchRefusedError is errors.PatchRefusedError
    assert set(megatron_ext.__all__) <= set(dir(megatron_ext))
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        megatron_ext.nonexistent  # noqa: B018


def test_import_auto_applies():
    done = run_python("import megatron_ext.auto; " + CHECK_WRAPPED)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "weight-update-invalidation"
    assert "megatron-ext: matched-block-writes: applied" in done.stderr


#: The patches that require another: the Mamba skip fixes recompute tokens inside matched blocks,
#: whose KV writes fix 2 sends to the dummy block.
REQUIRES = {"mamba-clamp-restore": ("matched-block-writes",), "mamba-continuation-skip": ("matched-block-writes",)}
WITHOUT_FIX2 = "needs matched-block-writes, which MEGATRON_EXT_SKIP leaves out; leave out both or neither"


@pytest.mark.parametrize("order", ["in order", "reversed"])
def test_a_patch_whose_requirement_is_skipped_is_not_applied(order, monkeypatch, mcore_series):
    """``MEGATRON_EXT_SKIP=matched-block-writes``: the patches requiring it are not applied either
    (refused under strict=True, naming it), forced or not, in any order of ALL_PATCHES; everything
    else is as without the variable. 0.17 has no clamp: mamba-clamp-restore is not needed there."""
    from megatron_ext import api

    assert {p.name: p.requires for p in ALL_PATCHES if p.requires} == REQUIRES
    if order == "reversed":
        monkeypatch.setattr(api, "ALL_PATCHES", tuple(reversed(ALL_PATCHES)))
    without_skip = {r.patch: r.reason for r in megatron_ext.status()}
    monkeypatch.setenv("MEGATRON_EXT_SKIP", "matched-block-writes")
    expected = {name: (state, without_skip[name])
                for name, state in EXPECTED_STATUS[mcore_series].items() if state == "applicable"}
    expected.update({"matched-block-writes": ("not applied", "skipped by MEGATRON_EXT_SKIP"),
                     "mamba-continuation-skip": ("not applied", WITHOUT_FIX2)})
    if mcore_series != "0.17":
        expected["mamba-clamp-restore"] = ("not applied", WITHOUT_FIX2)

    def reasons(results):
        return {r.patch: (r.state.value, r.reason) for r in results if r.patch in expected}

    assert reasons(megatron_ext.status()) == expected
    applied = {name: ("applied", reason) if state == "applicable" else (state, reason)
               for name, (state, reason) in expected.items()}
    assert reasons(megatron_ext.apply(force=True)) == applied
    stack = PREFIX_MATCH_STACK[mcore_series][::1 if order == "in order" else -1]
    assert installed_patches(COMPUTE_PREFIX_MATCH) == [name for name in stack if name not in REQUIRES]
    megatron_ext.revert()
    dependents = [p.name for p in api.ALL_PATCHES if p.name in expected and p.name in REQUIRES]
    with pytest.raises(PatchRefusedError) as refused:
        megatron_ext.apply(strict=True)
    assert str(refused.value) == "; ".join(f"{name}: {WITHOUT_FIX2}" for name in dependents)
    assert installed_patches(ADD_REQUEST) == [] and installed_patches(COMPUTE_PREFIX_MATCH) == []
    monkeypatch.setenv("MEGATRON_EXT_SKIP", "matched-block-writes," + ",".join(REQUIRES))  # both: applies
    assert PatchState.REFUSED not in {r.state for r in megatron_ext.apply(strict=True)}


def test_a_patch_whose_requirement_is_refused_is_not_applied(monkeypatch, mcore_series, mcore_version):
    """matched-block-writes refused (its entry taken out of fingerprints.json): the patches
    requiring it are not applied; under strict=True they are refused with it."""
    monkeypatch.delitem(recorded_fingerprints()["faulty"], "matched-block-writes")
    dependents = [name for name in REQUIRES if EXPECTED_STATUS[mcore_series][name] == "applicable"]
    context = "megatron.core.inference.contexts.dynamic_context.DynamicInferenceContext"
    fix2_refusal = (f"{context}.add_request, {context}._compute_prefix_match in megatron-core {mcore_version}: this "
                    "code is not one megatron-ext has checked; it was changed locally, by another patch or upstream. "
                    "Use a known tree (`megatron-ext status --trees`), or force with MEGATRON_EXT_FORCE=1 / "
                    "apply(force=True) after checking the code yourself")
    results = {r.patch: (r.state.value, r.reason) for r in megatron_ext.apply()}
    assert {name: results[name] for name in ["matched-block-writes", *dependents]} == {
        "matched-block-writes": ("refused", fix2_refusal),
        **{name: ("not applied", "needs matched-block-writes, which is refused") for name in dependents}}
    assert not set(REQUIRES) & set(installed_patches(COMPUTE_PREFIX_MATCH))
    megatron_ext.revert()
    with pytest.raises(PatchRefusedError) as refused:
        megatron_ext.apply(strict=True)
    assert str(refused.value) == "; ".join([f"matched-block-writes: {fix2_refusal}", *(
        f"{name}: needs matched-block-writes, which is refused" for name in dependents)])

