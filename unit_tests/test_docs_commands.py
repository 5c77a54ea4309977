"""Every command line in the README's and ``docs/``'s code blocks names a real command and real flags.

A line in a fenced code block that runs ``megatron-ext COMMAND`` (``scripts/megatron-ext``,
``.venv/bin/megatron-ext``), ``python -m megatron_ext COMMAND`` (``torchrun ... -m megatron_ext``),
``scripts/NAME.py`` or ``scripts/run_functional_tests.sh`` is checked against that command's
``--help``: the subcommand must exist and every ``--flag`` the line passes it must appear in its
help. ``--help`` runs once per subcommand or script (argparse only: no engine, no megatron-core
import), so the whole check takes a few seconds. ``scripts/test.sh`` and ``scripts/bootstrap.sh``
pass their arguments to pytest / take none, and are not checked.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.release_independent

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL_ENDS = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def command_lines(text: str):
    """(line, program, args) for each command line of interest in ``text``'s code blocks.

    program: ``("megatron_ext", SUBCOMMAND)`` or ``("script", "scripts/NAME")``."""
    for block in FENCE.findall(text):
        for line in block.splitlines():
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:  # a heredoc body or YAML, not a command
                continue
            for end, token in enumerate(tokens):
                if token in SHELL_ENDS or token.startswith(">"):
                    tokens = tokens[:end]
                    break
            for i, token in enumerate(tokens):
                if token == "megatron-ext" or token.endswith("/megatron-ext"):
                    if i + 1 < len(tokens):
                        yield line, ("megatron_ext", tokens[i + 1]), tokens[i + 2:]
                    break
                if token == "-m" and tokens[i + 1:i + 2] == ["megatron_ext"]:
                    if i + 2 < len(tokens):
                        yield line, ("megatron_ext", tokens[i + 2]), tokens[i + 3:]
                    break
                match = re.fullmatch(r"(?:.*/)?(scripts/(?:[\w-]+\.py|run_functional_tests\.sh))", token)
                if match:
                    yield line, ("script", match.group(1)), tokens[i + 1:]
                    break


@functools.lru_cache(maxsize=None)
def help_text(program: tuple[str, str]) -> tuple[int, str]:
    """(exit code, output) of the program's ``--help``."""
    kind, name = program
    if kind == "megatron_ext":
        argv = [sys.executable, "-m", "megatron_ext", name, "--help"]
    elif name.endswith(".py"):
        argv = [sys.executable, name, "--help"]
    else:
        argv = ["bash", name, "--help"]
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def problems(texts: dict[str, str]) -> list[str]:
    """One line per command line naming a subcommand or flag its program's --help does not know."""
    found = []
    for where, text in texts.items():
        for line, program, args in command_lines(text):
            code, helped = help_text(program)
            label = " ".join(program[1:]) if program[0] == "script" else f"megatron-ext {program[1]}"
            if code != 0:
                found.append(f"{where}: `{line.strip()}`: `{label} --help` exits {code}")
                continue
            for arg in args:
                flag = arg.strip("[]").split("=", 1)[0]
                if flag.startswith("--") and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helped):
                    found.append(f"{where}: `{line.strip()}`: {label} has no {flag}")
    return found


def test_every_documented_command_and_flag_exists():
    texts = {str(path.relative_to(REPO)): path.read_text() for path in doc_files()}
    checked = [program for text in texts.values() for _, program, _ in command_lines(text)]
    # the README's two commands and the docs' commands are all seen: the extraction works
    assert ("megatron_ext", "ab") in checked and ("megatron_ext", "compare") in checked
    assert {p for p in checked if p[0] == "megatron_ext"} >= {
        ("megatron_ext", c) for c in ("status", "ab", "soak", "compare", "save-checkpoint", "patch-source")}
    assert ("script", "scripts/run_functional_tests.sh") in checked
    assert problems(texts) == []


def test_a_made_up_flag_or_command_is_caught():
    fake = ("```bash\n"
            "scripts/megatron-ext ab --case rl_rollouts --no-such-flag 3   # a comment --ignored\n"
            ".venv/bin/torchrun --nproc-per-node 2 -m megatron_ext soak --requests 8 --bogus\n"
            "scripts/megatron-ext frobnicate --json x.json\n"
            "scripts/run_functional_tests.sh --workers 2 --not-an-option\n"
            "```\n")
    found = problems({"fake.md": fake})
    assert len(found) == 4, found
    assert "megatron-ext ab has no --no-such-flag" in found[0]
    assert "megatron-ext soak has no --bogus" in found[1]
    assert "`megatron-ext frobnicate --help` exits 2" in found[2]
    assert "scripts/run_functional_tests.sh has no --not-an-option" in found[3]
