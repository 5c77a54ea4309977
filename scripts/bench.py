#!/usr/bin/env python3
"""What megatron-ext's runtime patches cost: release path, admission path, end to end, scaling.

    .venv/bin/python scripts/bench.py                 # full run (a few minutes)
    .venv/bin/python scripts/bench.py --short         # CI: tiny sizes, few repetitions (~1 min)
    .venv/bin/python scripts/bench.py --json out.json

Each megatron-core release runs in its own worker process with that release's unpacked tree
first on PYTHONPATH: /tmp/mc/src/<version> if present (or --trees DIR), else the wheel from
.venv/mcore-wheels/ (downloaded with `pip download --no-deps` when missing), unzipped into a
temporary directory. The targets are stated as what a job pays: the patches' added time per
engine step, judged end to end; the admission path is reported in µs, not judged. Sections:

1. release path: KVBlockAllocator.release_memory_blocks of 0.18.2 + megatron-ext's patch vs
   0.18.2 unpatched vs 0.19.2 (upstream's fix 1) vs upstream+ext (0.19.2 with the same fault set
   fixed: the patches it still needs on this path, fault 9's deregister-own-hash), both eviction
   policies, pools of 4,096 / 65,536 / 1,048,576 blocks, 1 to 4,096 released IDs of N-sample
   sibling groups; allocator state rebuilt before every timed call. Target: patched/upstream+ext
   <= 1.00 (ratio of medians) on every row, and flat in pool size: from the smallest pool to the
   largest the patched call grows by at most 1.10x the growth of the baseline or of the state
   rebuild alone (cache and TLB misses), whichever is larger (table 1c).
2. admission path: DynamicInferenceContext.add_request (and what it calls) patched vs unpatched,
   prompts of 64 to 8,192 tokens, full / partial / no prefix match, both eviction policies
   (0.18.2 and 0.19.2; 0.18.2 LRU against upstream 0.19.2, which keeps the prefix forest 0.18.2
   gets backported); each release also with the source patches of patches/ applied (a copy of its
   tree, its own worker). Reports the µs an admission adds over the baseline: the paired estimate
   (median of the per-round differences) with its ~95% interval. No target: what admissions cost
   a job is judged per engine step (sections 3, 5, 6b), whose steps include them.
3. end to end: engine step time of the default `ab` case on the CPU backend, patched vs
   unpatched (0.18.2 and 0.19.2, every policy of the case); the variants alternate run by run,
   run r of each is a paired round. Target: the patches' added time per engine step <= 1%: the
   median over rounds of the difference of mean step times, <= 0.01 x the unpatched mean step
   (ratio <= 1.01), on every release and policy.
4. scaling: release cost vs pool size and vs released IDs (from section 1).
5. LRU under memory pressure: section 3 on the memory_pressure case with the LRU eviction policy
   (cached blocks evicted on admission, leaf-first eviction, resume into evictable blocks),
   patched vs unpatched (0.18.2 and 0.19.2; rows whose unpatched run raises, the LRU faults of
   0.17/0.18, are n/a). Target as section 3.
6. weight_update (fault 8, `weight-update-invalidation`; 0.19.2, 0.18.2, 0.17.1, each in its own
   worker): (a) add_request with only that patch's wrappers vs none, and vs a do-nothing wrapt
   wrapper on the same functions, prompts of 64 to 8,192 tokens, full / partial / no match: µs
   added per admission, reported as section 2; (b) engine step time of section 3's case, every
   patch vs every patch but this one: target as section 3 (this patch's added time per engine step
   <= 1%); (c) megatron_ext.invalidate_prefix_cache(context) on a 65,536-block pool holding 10,000
   registered blocks (LRU all cached at ref 0, REF_ZERO / LRU all held by live requests, LRU half
   and half) vs leaving ref-0 blocks unreachable to age out; ms per call, median and spread
   (target: median <= 5 ms).

Every timed call records both the wall clock (time.perf_counter_ns) and the calling thread's
CPU time (time.thread_time_ns; torch runs on one intra-op thread). Verdicts use --clock (default
cpu): on a shared machine the wall clock also counts time the process waited for a core. Workers
run one at a time, pinned to one CPU after start-up (--cpu), and variants are interleaved in
short batches, round by round, so that load on the machine hits every variant alike.

JSON (--json): {"meta": machine, settings, releases (tree, patch states and targets), stage_s,
total_s; "release" / "add_request" / "e2e" / "lru": {"verdict", "clock", "rows": [...], ...};
"scaling": {"rows"}; "weight_update": {"verdict", "targets", "add_request" / "e2e" / "flush":
{"rows", ...}, "rows": all three (key "part"), "load_average_start" / "load_average_end"}}.
"verdict" (per section): {"result": PASS / FAIL / n/a (no row could be judged) / none (section
2: not judged), "measure", "target", "rows": {"PASS", "FAIL", "n/a": counts}}; section 6's:
{"result", "parts": {"add_request", "e2e", "flush": the same}}.
Each row has "variants" (per variant: {"cpu_us"|"wall_us": {median, q1, q3, iqr, min, max, n}})
and "ratios" (e.g. "patched/unpatched": {"cpu", "wall": ratio of medians (engine sections: of the
floor run estimates), "rounds_cpu": spread of per-round ratios, "paired_cpu" / "paired_wall":
{diff, diff_lo, diff_hi (µs, ~95% interval), ratio, ratio_lo, ratio_hi, n}}; engine sections:
"per_step_cpu" / "per_step_wall", the same paired estimate of the mean step time). Judged rows
have "verdict" (PASS / FAIL; engine rows whose two runs did different work or raised: n/a);
engine rows also "added_us_per_step" ({diff, diff_lo, diff_hi, n}, µs). Section 1 adds
"flatness" (per policy and ID count: patched, baseline, control and allowed growth, verdict). Section 2 and
6a rows carry no verdict: "added_us" ({"patched"|"source"|"fault8"|"passthrough8": {diff,
diff_lo, diff_hi, n}}, µs per admission over "baseline"), "outcomes" (what each variant's
add_request did) and, in section 2, "source_check" (same work / DIFFERS / n/a); the sections add
"by_match" (per match kind: median row, least and most µs added).
Exit status: 0 when the run completed (whatever the verdicts; --strict: 1 if a section's verdict
is FAIL), 2 on error (bad arguments, a worker failed, the JSON could not be written).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import types
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
if "megatron_ext" not in sys.modules:
    # The orchestrator (benchmarks/ runner, report, trees, stats) needs no torch, but
    # megatron_ext/__init__ imports the patches and with them torch: ~10 s of CPU on a small
    # machine, taken from the workers starting up. A bare package object for megatron_ext lets its
    # submodules import normally without running that __init__ (the workers import it in full).
    _package = types.ModuleType("megatron_ext")
    _package.__path__ = [str(REPO / "megatron_ext")]
    sys.modules["megatron_ext"] = _package

from rich.console import Console  # noqa: E402

from benchmarks import report as bench_report  # noqa: E402
from benchmarks.runner import SECTIONS, WU_PARTS, run, settings  # noqa: E402
from benchmarks.trees import DEFAULT_SEARCH  # noqa: E402
from megatron_ext.mcore import SUPPORTED_RELEASES  # noqa: E402


def choice_list(kind: str, choices) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated, non-empty list of ``choices`` (else one error line
    naming the unknown ``kind`` and the choices)."""
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{kind} {unknown or text!r}: choose from {', '.join(choices)}")
        return names
    return parse


section_list = choice_list("unknown section(s)", SECTIONS)
wu_part_list = choice_list("unknown part(s)", WU_PARTS)
release_list = choice_list("unsupported release(s)", SUPPORTED_RELEASES)


def json_path(text: str) -> Path:
    """A file path the report can be written to (its directory is made if missing)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file path, e.g. {path / 'bench.json'}")
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {ancestor} is not a writable directory")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    summary, _, details = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="tiny sizes, few repetitions (CI smoke run)")
    parser.add_argument("--json", type=json_path, metavar="PATH", help="also write the full report as JSON")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="clock the PASS/FAIL verdicts use (default: cpu)")
    parser.add_argument("--trees", type=Path, action="append", metavar="DIR",
                        help="directory of unpacked releases as DIR/<version>/megatron "
                             f"(repeatable; default {DEFAULT_SEARCH[0]})")
    parser.add_argument("--cpu", type=int, metavar="N",
                        help="CPU every worker is pinned to after start-up (default: the last usable "
                             "CPU; -1: no pinning)")
    parser.add_argument("--release-rounds", type=int, help="override section 1's rounds")
    parser.add_argument("--e2e-runs", type=int,
                        help="override section 3's runs per variant (= paired rounds; default 12)")
    parser.add_argument("--lru-runs", type=int,
                        help="override section 5's runs per variant (= paired rounds; default 12)")
    parser.add_argument("--wu-releases", type=release_list,
                        metavar="VERSIONS", help="section 6's releases, comma-separated (default: "
                        "0.19.2,0.18.2,0.17.1; --short: 0.19.2)")
    parser.add_argument("--wu-parts", type=wu_part_list, metavar="PARTS",
                        help=f"section 6's parts, comma-separated (default: all: {','.join(WU_PARTS)})")
    parser.add_argument("--wu-e2e-runs", type=int,
                        help="override section 6b's engine runs per variant (= paired rounds; default 12)")
    parser.add_argument("--sections", type=section_list, default=list(SECTIONS), metavar="NAMES",
                        help=f"comma-separated sections to run (default: all: {','.join(SECTIONS)}; "
                             "scaling comes with release)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a section's verdict is FAIL")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = settings(args.short)
    config.clock = args.clock
    config.cpu = args.cpu
    config.sections = args.sections
    if args.release_rounds:
        config.release_rounds = args.release_rounds
    if args.e2e_runs:
        config.e2e_runs = args.e2e_runs
    if args.lru_runs:
        config.lru_runs = args.lru_runs
    if args.wu_releases:
        config.wu_releases = args.wu_releases
    if args.wu_parts:
        config.wu_parts = args.wu_parts
    if args.wu_e2e_runs:
        config.wu_e2e_runs = args.wu_e2e_runs
    # In a log (not a terminal) the tables get the width they need: section 2's has 17 columns.
    console = Console(width=max(Console().width, 320) if not sys.stdout.isatty() else None)
    err = Console(stderr=True, soft_wrap=True)
    progress = (lambda message: None) if args.quiet else (lambda message: err.print(f"[dim]{message}[/]"))
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    try:
        report = run(config, args.trees, progress, command=command)
    except Exception as exc:  # a worker failed, no tree could be found, ...
        err.print(f"[bold red]bench failed:[/] {type(exc).__name__}: {exc}")
        return 2
    bench_report.print_report(report, console)  # first: a JSON that cannot be written loses nothing shown
    if args.json:
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1))
        except OSError as exc:
            err.print(f"[bold red]bench failed:[/] cannot write the JSON report to {args.json}: "
                      f"{exc.strerror or exc} (choose a writable file path; the tables above are complete)")
            return 2
        console.print(f"JSON report: {args.json}")
    failed = any(report[s]["verdict"]["result"] == "FAIL" for s in args.sections)
    return 1 if (args.strict and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
