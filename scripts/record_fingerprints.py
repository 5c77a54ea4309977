#!/usr/bin/env python3
"""Print the per-release fingerprints of every function the runtime patches wrap or rely on.

Downloads each supported megatron-core wheel (no dependencies), unpacks it into a temporary
directory and imports it there, in a subprocess per release, with this environment's torch.
Paste the printed dictionaries into the FINGERPRINTS tables of megatron_ext/patches/. With
--source-patched the unpacked trees get the source patches of patches/ first: those are the
SOURCE_PATCHED fingerprints, by which a runtime patch recognises code that is already fixed.

    .venv/bin/python scripts/record_fingerprints.py [--source-patched] [RELEASE ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_ext.mcore import SUPPORTED_RELEASES  # noqa: E402
from megatron_ext.source_patches import patch_source, unpack_release  # noqa: E402

CHILD = """
import json
from megatron_ext.patches import ALL_PATCHES
from megatron_ext.patching import fingerprint
print(json.dumps({p.name: {t.qualname: fingerprint(t.original()) for t in p.checked_functions()}
                  for p in ALL_PATCHES}))
"""


def main() -> None:
    args = sys.argv[1:]
    source_patched = "--source-patched" in args
    releases = [a for a in args if a != "--source-patched"] or list(SUPPORTED_RELEASES)
    table: dict[str, dict[str, dict[str, str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for version in releases:
            site = unpack_release(version, Path(tmp) / version, Path(tmp))
            if source_patched:
                patch_source(site)
            env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO}")
            out = subprocess.run([sys.executable, "-W", "ignore", "-c", CHILD], env=env,
                                 check=True, capture_output=True, text=True).stdout
            for patch, prints in json.loads(out.strip().splitlines()[-1]).items():
                table.setdefault(patch, {})[version] = prints
    for patch, by_release in table.items():
        print(f"# {patch}")
        print(json.dumps(by_release, indent=4))


if __name__ == "__main__":
    main()
