#!/usr/bin/env python3
"""Record the per-release fingerprints of the functions the runtime patches wrap or rely on.

Downloads each named megatron-core wheel (no dependencies), unpacks it into a temporary directory
and imports it there, in a subprocess per release, with this environment's torch. The digests of
each patch's ``checked_functions()`` go into ``megatron_ext/fingerprints.json`` under
``"released"``, merged into what is there: only the (patch, release) entries already recorded are
updated, and ``--add PATCH`` records the named releases for a patch that has no entry for them
(a new patch, or a new release a fix is written for). With ``--source-patched`` the unpacked trees
get the release's source patch series of ``patches/`` first, and the digests of each patch's
``source_patched_targets`` go under ``"source_patched"``: by those a runtime patch recognises code
that is already fixed. The whole series is applied, so a function that several fixes' source
patches edit is recorded with all of them. Prints each entry it changes.

    .venv/bin/python scripts/record_fingerprints.py [--source-patched] [--add PATCH ...] [RELEASE ...]

Releases default to every supported one.
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

from megatron_ext.fingerprints import FINGERPRINTS_FILE  # noqa: E402
from megatron_ext.mcore import SUPPORTED_RELEASES  # noqa: E402
from megatron_ext.source_patches import patch_source, unpack_release  # noqa: E402

CHILD = """
import json, sys
from megatron_ext.patches import ALL_PATCHES
from megatron_ext.fingerprints import fingerprint
source_patched = sys.argv[1] == "source_patched"
prints = {}
for p in ALL_PATCHES:
    if source_patched and not p.source_patched_targets:
        continue
    try:
        prints[p.name] = {t.qualname: fingerprint(t.original())
                          for t in (p.source_patched_targets if source_patched else p.checked_functions())}
    except (AttributeError, KeyError):  # a target this release does not have: a patch not written for it
        pass
print(json.dumps(prints))
"""


def write(recorded: dict) -> None:
    """Write ``recorded`` as :data:`FINGERPRINTS_FILE`: sorted keys, two-space indent, a final newline."""
    FINGERPRINTS_FILE.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="*", metavar="RELEASE", default=list(SUPPORTED_RELEASES))
    parser.add_argument("--source-patched", action="store_true",
                        help="record the trees after the source patches of patches/")
    parser.add_argument("--add", action="append", default=[], metavar="PATCH",
                        help="record the releases for this patch even where it has no entry yet")
    args = parser.parse_args()
    kind = "source_patched" if args.source_patched else "released"
    recorded = json.loads(FINGERPRINTS_FILE.read_text(encoding="utf-8"))
    section = recorded.setdefault(kind, {})
    with tempfile.TemporaryDirectory() as tmp:
        for version in args.releases:
            site = unpack_release(version, Path(tmp) / version, Path(tmp))
            if args.source_patched:
                patch_source(site)
            env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO}")
            child = subprocess.run([sys.executable, "-W", "ignore", "-c", CHILD, kind], env=env,
                                   capture_output=True, text=True)
            if child.returncode != 0:
                sys.exit(f"record_fingerprints: megatron-core {version}: the fingerprinting process failed:\n"
                         f"{child.stderr[-3000:]}")
            out = child.stdout
            for patch, prints in json.loads(out.strip().splitlines()[-1]).items():
                if version not in section.get(patch, {}) and patch not in args.add:
                    continue  # a release this patch is not written for
                if section.setdefault(patch, {}).get(version) != prints:
                    print(f"{kind} {patch} {version}: {json.dumps(prints, sort_keys=True)}")
                    section[patch][version] = prints
    write(recorded)


if __name__ == "__main__":
    main()
