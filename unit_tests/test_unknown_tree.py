"""A tree nobody has seen: a copy of the installed megatron-core with one target's body changed and
another version string. Exactly the patches that check that function are refused (each naming it),
or decided by their probe; every other patch is decided as on the installed tree."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_ext
from megatron_ext.patches import ALL_PATCHES
from megatron_ext.patching import Patch, PatchState

from .conftest import UNPATCHED

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

REPO = Path(__file__).resolve().parents[1]
EDITED = "DynamicInferenceContext.add_request"
STATUS = "import json, megatron_ext; print(json.dumps([r.as_dict() for r in megatron_ext.status()]))"


def edit_function(path: Path, qualname: str) -> None:
    """Insert a statement at the top of ``Class.method``'s body (after its docstring) in ``path``."""
    source = path.read_text()
    class_name, method = qualname.split(".")
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    function = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method)
    first = function.body[1] if ast.get_docstring(function) else function.body[0]
    lines = source.splitlines(keepends=True)
    indent = lines[first.lineno - 1][:first.col_offset]
    lines.insert(first.lineno - 1, f"{indent}_locally_edited = True\n")
    path.write_text("".join(lines))


@pytest.fixture(scope="module")
def edited_tree(tmp_path_factory) -> Path:
    import megatron.core

    root = tmp_path_factory.mktemp("edited") / "site"
    shutil.copytree(Path(megatron.core.__file__).parents[1], root / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    edit_function(root / "megatron/core/inference/contexts/dynamic_context.py", EDITED)
    with open(root / "megatron/core/package_info.py", "a") as info:  # read last: the tree says 0.77.7
        info.write("MAJOR, MINOR, PATCH, PRE_RELEASE = 0, 77, 7, ''\n")
    return root


def status_of(tree: Path) -> dict[str, dict]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")},
           "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])}
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", STATUS], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["patch"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}


@pytest.mark.skipif(UNPATCHED, reason="status() is the same patched or not: the run with the patches covers it")
def test_an_edited_tree_refuses_exactly_the_patches_that_check_the_edited_function(edited_tree):
    installed = megatron_ext.mcore.installed_version()
    here = {r.patch: r for r in megatron_ext.status()}
    there = status_of(edited_tree)
    touching = {p.name for p in ALL_PATCHES if EDITED in {t.qualname for t in p.checked_functions()}}
    assert {"matched-block-writes", "weight-update-invalidation"} <= touching
    for patch in ALL_PATCHES:
        mine, theirs = here[patch.name], there[patch.name]
        if patch.name not in touching:  # decided as on the installed tree, by the same known trees
            assert (theirs["state"], theirs["reason"].replace("0.77.7", installed)) == (
                mine.state.value, mine.reason), patch.name
        elif theirs["state"] == PatchState.REFUSED.value:
            assert theirs["reason"].startswith(
                f"megatron.core.inference.contexts.dynamic_context.{EDITED} in megatron-core "
                "0.77.7: this code is not one megatron-ext has checked (nearest known tree: "), theirs
        else:  # only a probe may clear code nobody has seen
            assert type(patch).needed is not Patch.needed, theirs
            assert theirs["state"] == PatchState.NOT_NEEDED.value, theirs
    refused = {name for name, r in there.items() if r["state"] == PatchState.REFUSED.value}
    assert refused and refused <= touching
    assert {name for name, r in here.items() if r.state is PatchState.APPLICABLE} & touching <= refused
