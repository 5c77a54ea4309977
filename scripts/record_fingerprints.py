#!/usr/bin/env python3
"""Record the fingerprints of the functions the runtime patches wrap or rely on, per known tree.

A known tree is a megatron-core release (its wheel, downloaded with no dependencies) or a
Megatron-LM commit listed under ``"trees"`` in ``megatron_ext/fingerprints.json`` (its archive in
``../shared/upstream``, or ``MEGATRON_EXT_UPSTREAM``). Each tree is unpacked into a temporary
directory and imported there, in a subprocess per tree, with this environment's torch. The digests
of each patch's ``checked_functions()`` (``"absent"`` for one the tree lacks) go into
``fingerprints.json``, under ``"faulty"`` where the tree has the patch's fault and ``"fixed"`` where
it does not: an entry already recorded is updated where it is; ``--add PATCH`` records it as faulty
and ``--fixed PATCH`` as fixed (decide by running the fault's test on that tree, unpatched);
``--fixed-by-probe`` records as fixed every unrecorded patch whose probe (``needed()``) finds no
fault. Anything else is listed as unrecorded. With ``--source-patched`` the unpacked trees get
their source patch series of ``patches/`` first, and the digests of each patch's
``source_patched_targets`` go under ``"source_patched"``: by those a runtime patch recognises code
that is already fixed. The whole series is applied, so a function that several fixes' source
patches edit is recorded with all of them. Prints each entry it changes.

    .venv/bin/python scripts/record_fingerprints.py [--source-patched] [--add PATCH ...]
        [--fixed PATCH ...] [--fixed-by-probe] [TREE ...]

Trees default to every known one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_ext.fingerprints import FINGERPRINTS_FILE, known_trees  # noqa: E402
from megatron_ext.source_patches import patch_source, unpack_tree  # noqa: E402

CHILD = """
import json, sys
from megatron_ext.patches import ALL_PATCHES
source_patched = sys.argv[1] == "source_patched"
prints = {}
for p in ALL_PATCHES:
    if source_patched and not p.source_patched_targets:
        continue
    targets = p.source_patched_targets if source_patched else p.checked_functions()
    entry = {t.qualname: p.found_fingerprint(t) for t in targets}
    try:
        needed = p.needed()[0]
    except Exception:  # a probe that cannot run finds nothing
        needed = None
    prints[p.name] = {"prints": entry, "probe_finds_fault": needed}
print(json.dumps(prints))
"""


def write(recorded: dict) -> None:
    """Write ``recorded`` as :data:`FINGERPRINTS_FILE`: sorted keys, two-space indent, a final newline."""
    FINGERPRINTS_FILE.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def fingerprint_tree(name: str, source_patched: bool, tmp: Path) -> dict:
    """``{patch: {"prints": {...}, "probe_finds_fault": bool | None}}`` of tree ``name``."""
    site = unpack_tree(name, tmp / name, tmp)
    if source_patched:
        patch_source(site)
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO}")
    child = subprocess.run([sys.executable, "-W", "ignore", "-c", CHILD,
                            "source_patched" if source_patched else "released"],
                           env=env, capture_output=True, text=True)
    if child.returncode != 0:
        sys.exit(f"record_fingerprints: {name}: the fingerprinting process failed:\n{child.stderr[-3000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def section_for(recorded: dict, patch: str, tree: str, args: argparse.Namespace, probe_finds_fault) -> str | None:
    """Where ``patch``'s entry for ``tree`` goes: ``faulty``, ``fixed`` or None (left unrecorded)."""
    for kind in ("faulty", "fixed"):
        if tree in recorded[kind].get(patch, {}):
            return kind
    if patch in args.add:
        return "faulty"
    if patch in args.fixed or (args.fixed_by_probe and probe_finds_fault is False):
        return "fixed"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("trees", nargs="*", metavar="TREE", default=list(known_trees()))
    parser.add_argument("--source-patched", action="store_true",
                        help="record the trees after the source patches of patches/")
    parser.add_argument("--add", action="append", default=[], metavar="PATCH",
                        help="record the trees as having this patch's fault, where it has no entry yet")
    parser.add_argument("--fixed", action="append", default=[], metavar="PATCH",
                        help="record the trees as free of this patch's fault, where it has no entry yet")
    parser.add_argument("--fixed-by-probe", action="store_true",
                        help="record as fixed every unrecorded patch whose probe finds no fault")
    args = parser.parse_args()
    recorded = json.loads(FINGERPRINTS_FILE.read_text(encoding="utf-8"))
    unknown = sorted(set(args.trees) - set(known_trees()))
    if unknown:
        sys.exit(f"record_fingerprints: {', '.join(unknown)} is not a known tree; add it under \"trees\" in "
                 f"{FINGERPRINTS_FILE} first (version, commit, date, source)")
    with tempfile.TemporaryDirectory() as tmp:
        for tree in args.trees:
            for patch, found in fingerprint_tree(tree, args.source_patched, Path(tmp)).items():
                if args.source_patched:
                    kind = "source_patched" if tree in recorded["source_patched"].get(patch, {}) or \
                        patch in args.add else None
                else:
                    kind = section_for(recorded, patch, tree, args, found["probe_finds_fault"])
                if kind is None:
                    print(f"unrecorded {patch} {tree} (probe finds the fault: {found['probe_finds_fault']}); "
                          "run its fault test there, then --add or --fixed")
                    continue
                if recorded[kind].setdefault(patch, {}).get(tree) != found["prints"]:
                    print(f"{kind} {patch} {tree}: {json.dumps(found['prints'], sort_keys=True)}")
                    recorded[kind][patch][tree] = found["prints"]
    write(recorded)


if __name__ == "__main__":
    main()
