"""``megatron-ext`` command line. ``python -m megatron_ext`` is the same program."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Sequence

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


def cmd_ab(args: argparse.Namespace) -> int:
    """Run a case with prefix caching off and on; exit 0 only if bit-identical and audit-clean."""
    from tqdm import tqdm

    from .harness.ab import run_ab
    from .harness.report import print_report, write_plot
    from .harness.cases import load_case, shipped_cases
    from .harness.distributed import RankFailedError, describe_layout

    if args.list_cases:
        print("\n".join(shipped_cases()))
        return 0
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    rank, world_size = _world()
    if not _layout_fits(tp, pp, "ab"):
        return 2
    if world_size > 1 and args.device != "cpu":
        print("megatron-ext: error: multi-rank ab runs CPU ranks over gloo; --device cuda is "
              "single-rank only", file=sys.stderr)
        return 2
    if not _outputs_writable({"--json": args.json, "--plot": args.plot}):
        return 2
    case = load_case(args.case)
    checkpoint = None
    if args.load is not None:  # a bad path fails here, before the model or any engine is built
        from .harness.checkpoint import resolve_checkpoint

        checkpoint = resolve_checkpoint(args.load)
    try:
        with tqdm(desc=f"{case.name}: engine steps", unit="step", leave=False,
                  disable=args.no_progress or rank != 0) as bar:
            result = run_ab(case, patched=not args.unpatched, device=args.device,
                            on_step=lambda _step: bar.update(1),
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            load=checkpoint)
    except Exception as exc:  # noqa: BLE001 - multi-rank: name the rank, exit non-zero
        if world_size == 1 or isinstance(exc, MegatronExtError):
            raise
        if isinstance(exc, RankFailedError):  # names the rank already
            print(f"megatron-ext ab: {exc}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
            print(f"megatron-ext ab: rank {rank} of {world_size} failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
        return 1
    if rank == 0:
        console = Console(width=args.width)
        if world_size > 1:
            console.print(describe_layout(result.ranks))
        print_report(result, console)
        if args.json:
            Path(args.json).write_text(json.dumps(result.as_json(), indent=2))
        if args.plot:
            write_plot(result, Path(args.plot))
    return result.exit_code()


def _outputs_writable(outputs: dict[str, Any]) -> bool:
    """Whether every given output file's directory exists and is writable; prints the fix on
    stderr when not. Checked before a run, so a long run's results are not lost at the end."""
    for flag, path in outputs.items():
        if path is None:
            continue
        directory = Path(path).expanduser().resolve().parent
        if not directory.is_dir() or not os.access(directory, os.W_OK):
            print(f"megatron-ext: error: {flag} {path}: directory {directory} does not exist or is "
                  "not writable; create it or choose another path", file=sys.stderr)
            return False
    return True


def _world() -> tuple[int, int]:
    """``(RANK, WORLD_SIZE)`` as torchrun sets them; ``(0, 1)`` without torchrun."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _layout_fits(tp: int, pp: int, command: str) -> bool:
    """Whether TP x PP equals the number of ranks; prints the fix on stderr when it does not."""
    world_size = _world()[1]
    if tp < 1 or pp < 1 or tp * pp != world_size:
        print(f"megatron-ext: error: --tensor-model-parallel-size {tp} x --pipeline-model-parallel-size "
              f"{pp} needs {tp * pp} ranks, but WORLD_SIZE is {world_size}; launch with "
              f"'torchrun --nproc-per-node {max(tp * pp, 1)} -m megatron_ext {command} ...'", file=sys.stderr)
        return False
    return True


def cmd_save_checkpoint(args: argparse.Namespace) -> int:
    """Save the case's seeded model as a megatron-core distributed checkpoint (torch_dist).

    The model is built exactly as ``ab`` builds it (same case model section, same seed unless
    ``--seed``), on CPU ranks; under torchrun each rank writes its TP/PP shards.
    """
    from .harness.cases import load_case
    from .harness.checkpoint import save_checkpoint
    from .cpu_backend import cpu_backend
    from .harness.engine import build_model, ensure_model_parallel

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if not _layout_fits(tp, pp, "save-checkpoint"):
        return 2
    case = load_case(args.case)
    if args.seed is not None:
        case = case.model_copy(update={"model": case.model.model_copy(update={"seed": args.seed})})
    with cpu_backend():
        ensure_model_parallel(tp, pp)
        model = build_model(case)
        path = save_checkpoint(model, args.directory)
    if _world()[0] == 0:
        print(f"saved the model of case '{case.name}' (seed {case.model.seed}, "
              f"{case.model.params_dtype}, TP={tp} PP={pp}) to {path} (torch_dist); "
              f"use it with: megatron-ext ab --case {args.case} --load {path}")
    return 0


def cmd_soak(args: argparse.Namespace) -> int:
    """``ab`` on a generated workload of ``--requests`` requests (:func:`megatron_ext.harness.soak.soak_case`);
    exit codes as ``ab``."""
    from tqdm import tqdm

    from .harness.ab import run_ab
    from .harness.report import print_report
    from .harness.cases import dump_case
    from .harness.soak import soak_case, soak_summary

    if not _outputs_writable({"--json": args.json, "--dump-case": args.dump_case}):
        return 2
    policies = list(dict.fromkeys(args.policy or ("ref_zero", "lru")))  # a repeated --policy runs once
    case = soak_case(args.requests, args.seed, policies,
                     chunked_prefill=not args.no_chunked_prefill)
    if args.dump_case:
        Path(args.dump_case).write_text(dump_case(case))
    with tqdm(desc=f"{case.name}: engine steps", unit="step", leave=False, disable=args.no_progress) as bar:
        result = run_ab(case, patched=not args.unpatched, on_step=lambda _step: bar.update(1))
    console = Console(width=args.width)
    print_report(result, console, only_divergent=True)
    summary = soak_summary(result)
    for name, run in summary["runs"].items():
        console.print(f"soak {name}: {summary['requests']} requests, {run['engine_steps']} engine steps, "
                      f"{run['wall_s']} s, {run['blocks_matched']} blocks matched, peak pool use "
                      f"{run['peak_pool_use']} blocks, {run['requests_paused']} requests paused "
                      f"(peak {run['peak_paused_requests']} at once), {run['requests_evicted']} requests "
                      f"evicted, {run['cached_blocks_evicted']} cached blocks evicted"
                      + (f"; megatron-core raised: {run['error']}" if run["error"] else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"soak": summary, **result.as_json()}, indent=2))
    return result.exit_code()


def cmd_patch_source(args: argparse.Namespace) -> int:
    """Apply / check / revert the source patches on a megatron-core tree."""
    from .source_patches import default_tree, patch_source, tree_version

    tree = Path(args.path) if args.path else default_tree()
    results = patch_source(tree, check=args.check, revert=args.revert)
    print(f"megatron-core {tree_version(tree)} at {tree}:")
    for result in results:
        print(f"  {result.state.value:>15}  {result.patch}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron's model-parallel flags (launch T x P ranks with torchrun; CPU ranks over gloo)."""
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="T",
                        help="megatron-core tensor parallel size (launch T x P ranks with torchrun; "
                        "CPU ranks over gloo)")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="P",
                        help="megatron-core pipeline parallel size (T x P ranks)")


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

    p_ab = sub.add_parser(
        "ab", help="prefix caching off vs on through megatron-core's dynamic engine, bit for bit",
        description="Exit codes: 0 bit-identical and every audit holds; 1 divergence, audit "
        "violation or unmet expectation; 2 bad input (case file, --load checkpoint); 3 platform not batch-invariant. Multi-rank: "
        "'torchrun --nproc-per-node T*P -m megatron_ext ab --tensor-model-parallel-size T "
        "--pipeline-model-parallel-size P'; every rank runs the audits, rank 0 reports (and writes "
        "--json/--plot), every rank exits non-zero if any rank failed.")
    p_ab.add_argument("--case", default="rl_rollouts",
                      help="shipped case name or path to a case YAML file (default: rl_rollouts)")
    p_ab.add_argument("--unpatched", action="store_true",
                      help="run megatron-core as released, without megatron-ext's runtime patches")
    p_ab.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p_ab.add_argument("--plot", metavar="PNG", help="also plot |Δ log-prob| per step (matplotlib)")
    p_ab.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    _add_layout_arguments(p_ab)
    p_ab.add_argument("--load", metavar="DIR",
                      help="load the weights from a Megatron distributed checkpoint (torch_dist) or a "
                      "Megatron-LM save directory (latest_checkpointed_iteration.txt -> iter_NNNNNNN/) "
                      "after building the case's model; its model section must match the checkpoint. "
                      "Any TP/PP layout loads any other (dist-checkpointing reshards)")
    p_ab.add_argument("--list-cases", action="store_true", help="print the shipped case names")
    p_ab.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_ab.add_argument("--width", type=int, default=None, help="table width in columns")
    p_ab.set_defaults(func=cmd_ab)

    p_save = sub.add_parser(
        "save-checkpoint", help="save the case's seeded model as a Megatron distributed checkpoint",
        description="Builds the model exactly as 'ab' does (the case's model section and seed) and "
        "saves it with megatron-core's dist_checkpointing.save (torch_dist format) into DIR (new or "
        "empty), e.g. a fixture for 'ab --load DIR'. Multi-rank: 'torchrun --nproc-per-node T*P -m "
        "megatron_ext save-checkpoint DIR --tensor-model-parallel-size T "
        "--pipeline-model-parallel-size P'. Needs psutil (megatron-core's writer).")
    p_save.add_argument("directory", metavar="DIR", help="where to save (created; must be empty)")
    p_save.add_argument("--case", default="rl_rollouts",
                        help="shipped case name or case YAML whose model is saved (default: rl_rollouts)")
    p_save.add_argument("--seed", type=int, default=None, help="weights seed (default: the case's model.seed)")
    _add_layout_arguments(p_save)
    p_save.set_defaults(func=cmd_save_checkpoint)

    p_soak = sub.add_parser(
        "soak", help="ab on a generated workload of many requests sharing prefixes, under KV pressure",
        description="Generates a reproducible workload (megatron_ext/harness/soak.py: RL rollouts, multi-turn "
        "conversations, shared system prompts; Poisson arrivals; chunked prefill; a 48-block KV pool "
        "that pauses requests and makes LRU evict) and runs it as 'ab' does: caching off once, on "
        "once per policy. Exit codes as 'ab'. Cost on one CPU core: about 0.3 s per request for the "
        "caching-off run and 0.2 s per caching-on run (2000 requests, both policies: 15-20 minutes).")
    p_soak.add_argument("--requests", type=_positive_int, default=2000, metavar="N",
                        help="engine requests to generate (default: 2000)")
    p_soak.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p_soak.add_argument("--policy", action="append", choices=("ref_zero", "lru"),
                        help="eviction policy for B, repeatable (default: ref_zero and lru)")
    p_soak.add_argument("--no-chunked-prefill", action="store_true",
                        help="chunked prefill off (max_tokens raised to 256 so every prompt fits a step)")
    p_soak.add_argument("--unpatched", action="store_true",
                        help="run megatron-core as released, without megatron-ext's runtime patches")
    p_soak.add_argument("--json", metavar="PATH", help="also write the figures and results as JSON")
    p_soak.add_argument("--dump-case", metavar="PATH",
                        help="also write the generated case as YAML (runs with 'ab --case PATH')")
    p_soak.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_soak.add_argument("--width", type=int, default=None, help="table width in columns")
    p_soak.set_defaults(func=cmd_soak)

    p_src = sub.add_parser(
        "patch-source", help="apply the source patches (patches/) to a megatron-core tree",
        description="PATH is the directory holding megatron/core (site-packages or a Megatron-LM "
        "checkout); default: the importable megatron-core. Refuses, changing nothing, when a "
        "hunk does not apply or the tree is already patched.")
    p_src.add_argument("path", nargs="?", help="directory holding megatron/core")
    p_src.add_argument("--check", action="store_true", help="report what would be done; change nothing")
    p_src.add_argument("--revert", action="store_true", help="remove the patches")
    p_src.set_defaults(func=cmd_patch_source)
    return parser


def _quiet_imports() -> None:
    # megatron-core warns at import about optional packages (TE, Apex, absl) the CLI never needs.
    import logging
    import warnings

    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=SyntaxWarning)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Errors of megatron-ext print one line on stderr and exit 2."""
    args = build_parser().parse_args(argv)
    _quiet_imports()
    try:
        return args.func(args)
    except MegatronExtError as exc:
        print(f"megatron-ext: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if _world()[1] > 1:  # under torchrun: leave the process group together (not in-process callers)
            from .harness.distributed import shut_down

            shut_down()


if __name__ == "__main__":
    sys.exit(main())
