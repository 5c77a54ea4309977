"""``megatron-ext`` command line. ``python -m megatron_ext`` is the same program."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from rich.console import Console
from rich.table import Table

from . import mcore
from .api import status
from .errors import MegatronExtError
from .patching import PatchResult

_STATE_STYLE = {
    "applied": "green",
    "applicable": "yellow",
    "not needed": "cyan",
    "refused": "bold red",
}


def _status_table(version: str, results: list[PatchResult]) -> Table:
    table = Table(title=f"megatron-ext patches for megatron-core {version}", show_lines=True)
    for column in ("patch", "target", "state", "reason", "evidence"):
        table.add_column(column, overflow="fold")
    for result in results:
        style = _STATE_STYLE.get(result.state.value, "")
        table.add_row(
            result.patch,
            "\n".join(result.targets),
            f"[{style}]{result.state.value}[/]" if style else result.state.value,
            result.reason,
            result.evidence,
        )
    return table


def cmd_status(args: argparse.Namespace) -> int:
    """Print installed megatron-core version and each patch's state. Exit 1 if any is refused."""
    version = mcore.installed_version()
    results = status(force=args.force or None)
    if args.json:
        payload = {"megatron_core_version": version, "patches": [r.as_dict() for r in results]}
        print(json.dumps(payload, indent=2))
    else:
        Console(width=args.width).print(_status_table(version, results))
    return 1 if any(r.state.value == "refused" for r in results) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-ext",
        description="Prefix-caching fixes and bit-identity checks for megatron-core's dynamic inference.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_status = sub.add_parser("status", help="show what each runtime patch would do here")
    p_status.add_argument("--json", action="store_true", help="machine-readable output")
    p_status.add_argument("--force", action="store_true", help="as MEGATRON_EXT_FORCE=1")
    p_status.add_argument("--width", type=int, default=None, help="table width in columns")
    p_status.set_defaults(func=cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Errors of megatron-ext print one line on stderr and exit 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MegatronExtError as exc:
        print(f"megatron-ext: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
