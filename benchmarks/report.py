"""Rich tables for the bench report (the JSON written by ``--json`` has the same numbers and more)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

CLOCK_NAMES = {"cpu": "thread CPU time (time.thread_time_ns)", "wall": "wall clock (time.perf_counter_ns)"}


def _t(stats: dict[str, float], digits: int = 0) -> str:
    return f"{stats['median']:.{digits}f} [{stats['q1']:.{digits}f}–{stats['q3']:.{digits}f}]"


def _range(stats: dict[str, float], digits: int = 0) -> str:
    return f"{stats['min']:.{digits}f}–{stats['max']:.{digits}f}"


def _r(ratio: dict[str, Any], clock: str, spread_key: str) -> str:
    spread = ratio[spread_key]
    if spread["n"] > 1:
        return f"{ratio[clock]:.2f} ({spread['q1']:.2f}–{spread['q3']:.2f})"
    return f"{ratio[clock]:.2f}"


def _a(added: dict[str, float] | None, digits: int = 1) -> str:
    """Paired extra µs and its ~95% interval, from an ``added_us`` entry of the JSON."""
    if added is None:
        return "-"
    return f"{added['diff']:+.{digits}f} ({added['diff_lo']:+.{digits}f} to {added['diff_hi']:+.{digits}f})"


def paired_ratio(ratio: dict[str, Any], clock: str) -> float:
    """What the paired sections' verdicts use: ``1 + median per-round difference / median``."""
    return ratio[f"paired_{clock}"]["ratio"]


def _v(value: str) -> str:
    colour = {"PASS": "green", "FAIL": "red", "DIFFERS": "red", "same work": "green"}.get(value, "yellow")
    return f"[bold {colour}]{value}[/]"


def release_tables(section: dict[str, Any]) -> list[Table]:
    clock = section["clock"]
    key = f"{clock}_us"
    releases = section["releases"]
    main = Table(title=f"1. Release path: KVBlockAllocator.release_memory_blocks, µs per call "
                       f"({CLOCK_NAMES[clock]}), median [IQR]",
                 caption=f"patched = {releases['patched']}; unpatched = {releases['unpatched']}; "
                         f"upstream = {releases['upstream']} (upstream's fix 1); upstream+ext = "
                         f"{releases['upstream+ext']} (the released code with the same fault set fixed: "
                         "the patches it still needs on this path), each release in its own process; "
                         f"every patch on every function it wraps. Ratios: ratio of medians (IQR of "
                         f"{section['rounds']} per-round ratios). Target: patched/upstream+ext <= "
                         f"{section['target']:.2f} on every row, and flat in pool size (table 1c).",
                 caption_justify="left")
    for name in ("policy", "pool", "IDs (unique)", "patched", "unpatched", "upstream", "upstream+ext",
                 "patched/upstream+ext", "patched/upstream", "patched/unpatched", "wall p/up+ext",
                 "same result", "verdict"):
        main.add_column(name, justify="left" if name in ("policy",) else "right")
    wall = Table(title="1b. Release path, wall clock µs per call: median [IQR] (min–max)",
                 caption=f"{section['rounds']} rounds x {section['batch']} calls per variant and row",
                 caption_justify="left")
    variants = ("patched", "unpatched", "upstream", "upstream+ext")
    for name in ("policy", "pool", "IDs", *variants):
        wall.add_column(name, justify="left" if name == "policy" else "right")
    for row in section["rows"]:
        v = row["variants"]
        w = row["workload"]
        ratios = row["ratios"]
        main.add_row(
            row["policy"], f"{row['pool']:,}", f"{row['ids']:,} ({w['unique']:,})",
            *(_t(v[x][key]) for x in variants),
            _r(ratios["patched/upstream+ext"], clock, f"rounds_{clock}"),
            _r(ratios["patched/upstream"], clock, f"rounds_{clock}"),
            _r(ratios["patched/unpatched"], clock, f"rounds_{clock}"),
            f"{ratios['patched/upstream+ext']['wall' if clock == 'cpu' else 'cpu']:.2f}",
            "yes" if row["same_result_as_upstream"] else "[red]NO[/]",
            _v(row["verdict"]),
        )
        wall.add_row(row["policy"], f"{row['pool']:,}", f"{row['ids']:,}",
                     *(f"{_t(v[x]['wall_us'])} ({_range(v[x]['wall_us'])})" for x in variants))
    if clock == "wall":
        main.columns[10].header = "cpu p/up+ext"
    flat = Table(title=f"1c. Release path, flat in pool size: growth from the smallest to the largest pool "
                       f"({clock})",
                 caption="growth = median at the largest pool / median at the smallest. Random IDs in "
                         "larger tables cost every variant cache and TLB misses: the baseline's growth, "
                         "or the state rebuild's (control: the same entries of the same tables, no "
                         "pool-dependent work), whichever is larger, is the pool size's own effect. "
                         f"Target: patched growth <= {section['target_pool_growth']:.2f} x that (allowed).",
                 caption_justify="left")
    for name in ("policy", "IDs", "pools", "patched growth", "upstream+ext growth", "control growth",
                 "allowed", "verdict"):
        flat.add_column(name, justify="left" if name == "policy" else "right")
    for row in section["flatness"]:
        flat.add_row(row["policy"], f"{row['ids']:,}", " -> ".join(f"{p:,}" for p in row["pools"]),
                     f"{row['patched_growth']:.2f}", f"{row['baseline_growth']:.2f}",
                     f"{row['control_growth']:.2f}", f"{row['allowed_growth']:.2f}", _v(row["verdict"]))
    return [main, wall, flat]


def add_request_table(section: dict[str, Any]) -> Table:
    clock = section["clock"]
    key = f"{clock}_us"
    other = "wall" if clock == "cpu" else "cpu"
    table = Table(title=f"2. Admission path: DynamicInferenceContext.add_request, µs per admission "
                        f"({CLOCK_NAMES[clock]}), median [IQR]",
                  caption=f"patched = every runtime patch the release needs, on every function they wrap "
                          f"(add_request and what it calls); {section['rounds']} rounds x "
                          f"{section['batch']} calls per variant; the context is reset and a primer "
                          "request added (untimed) before each call. KV writes to dummy: the probe's "
                          "tokens whose KV append goes to the dummy block (fix 2: recomputed tokens "
                          "inside hash-matched blocks). added µs: what an admission adds over the "
                          "baseline, paired (the median of the per-round differences of batch medians, "
                          "~95% interval, sign test; not the difference of the medians shown). Baseline: "
                          "unpatched, or upstream (0.19.2's own code, its own worker) for LRU on a release "
                          "that gets upstream's LRU fixes backported (the prefix forest kept on every "
                          "registration). source = the release with the source patches of patches/ "
                          "applied (its own worker, no runtime patch); source check: its matched blocks, "
                          "tokens and dummy-block writes equal patched's. No verdict: the cost of an "
                          "admission to a job is judged per engine step (sections 3, 5, 6b), whose steps "
                          "include the admissions.",
                  caption_justify="left")
    for name in ("release", "policy", "prompt", "match", "matched blocks", "tokens added",
                 "KV writes to dummy", "unpatched", "patched", "upstream", "baseline",
                 "added µs: patched (~95%)", "added µs: source (~95%)", "patched/unpatched",
                 f"{other} added µs", "source check"):
        table.add_column(name, justify="left" if name in ("release", "policy", "match", "baseline") else "right",
                         overflow="fold")  # in a narrow terminal a number wraps, never loses digits
    for row in section["rows"]:
        v = row["variants"]
        out = row["outcomes"]["patched"]
        judged = row["ratios"][f"patched/{row['baseline']}"]
        table.add_row(
            row["release"], row["policy"], f"{row['prompt_tokens']:,}", row["match"],
            f"{out['blocks_matched']:,}", f"{out['tokens_added']:,}", f"{out['tokens_to_dummy_block']:,}",
            _t(v["unpatched"][key]), _t(v["patched"][key]),
            _t(v["upstream"][key]) if "upstream" in v else "-", row["baseline"],
            _a(row["added_us"]["patched"]), _a(row["added_us"]["source"]),
            f"{paired_ratio(row['ratios']['patched/unpatched'], clock):.3f}",
            f"{judged[f'paired_{other}']['diff']:+.1f}", _v(row["source_check"]),
        )
    return table


#: Title of the engine-step-time tables, per section.
ENGINE_TABLE_TITLES = {"e2e": "3. End to end: engine step time",
                       "lru": "5. LRU under memory pressure: engine step time"}


#: What u and p stand for in the engine-step-time tables, per section.
ENGINE_VARIANTS = {"weight_update": "u = every runtime patch but weight-update-invalidation, "
                                    "p = every runtime patch"}


def _per_step(paired: dict[str, float] | None) -> str:
    """The paired per-step ratio and its ~95% interval ("-" when the runs could not be paired)."""
    if not paired:
        return "-"
    return f"{paired['ratio']:.4f} ({paired['ratio_lo']:.4f} to {paired['ratio_hi']:.4f})"


def e2e_table(section: dict[str, Any], name: str = "e2e") -> Table:
    """Sections 3, 5 and 6b (``name``): engine step time, patched vs unpatched."""
    clock = section["clock"]
    other = "wall" if clock == "cpu" else "cpu"
    step_key, estimate_key = f"step_{clock}_us", f"run_estimate_{clock}_ms"
    case = section["case"] + (" (shortened for --short)" if section["short_case"] else "")
    title = ENGINE_TABLE_TITLES.get(name) or WU_TITLES["e2e"]
    variants = ENGINE_VARIANTS.get(name, "u = unpatched, p = patched")
    target = section["target"]
    table = Table(title=f"{title}, case {case}, CPU backend, prefix caching on "
                        f"({CLOCK_NAMES[clock]})",
                  caption=f"{variants}; the variants alternate run by run, and run r of each is one "
                          "paired round. added µs per step: the median over rounds of the difference of "
                          "the two runs' mean step times, with its ~95% interval (sign test); p/u per "
                          "step = 1 + that / the median u mean step: the verdict. step µs: median over "
                          "every step of every run. run ms floor (information): sum over step indexes "
                          "of the per-step minimum over runs. in patched fns: CPU ms per run inside the "
                          "functions the patches wrap (outermost calls; median over runs); attributed = "
                          "1 + (p - u) / run floor u: the patches' cost inside the engine, free of "
                          "run-to-run noise. n/a: the unpatched run did different work (it leaks shared "
                          "blocks, which a later request then matches) or megatron-core raised in it "
                          "(LRU faults), so the ratio measures the fault. Target: the patches' added "
                          f"time per engine step <= {100 * (target - 1):.0f}% (p/u per step <= "
                          f"{target:.2f}) on every row; a verdict in yellow is unresolved (its ~95% "
                          "interval contains the target).",
                  caption_justify="left")
    for name in ("release", "policy", "rounds", "work: steps, blocks matched, prefill tokens",
                 "median step µs u / p", "added µs per step (~95%)", "p/u per step (~95%)",
                 f"p/u per step, {other}", "run ms floor u / p", "p/u floor", "in patched fns ms u / p",
                 "attributed", "same outputs", "verdict"):
        table.add_column(name, justify="left" if name in ("release", "policy") else "right")
    for row in section["rows"]:
        v = row["variants"]
        u, p = v["unpatched"], v["patched"]
        ratio = row["ratios"]["patched/unpatched"]

        def work(x: dict) -> str:
            return " ".join(",".join(map(str, x[k])) for k in ("engine_steps", "blocks_matched",
                                                              "prefill_tokens_computed"))
        work_cell = work(u) if work(u) == work(p) else f"[yellow]u {work(u)} / p {work(p)}[/]"
        other_paired = ratio[f"per_step_{other}"]
        table.add_row(
            row["release"], row["policy"], str(row["runs"]), work_cell,
            f"{u[step_key]['median']:.0f} / {p[step_key]['median']:.0f}",
            _a(row["added_us_per_step"], 0), _per_step(ratio[f"per_step_{clock}"]),
            f"{other_paired['ratio']:.4f}" if other_paired else "-",
            f"{u[estimate_key]['floor']:.1f} / {p[estimate_key]['floor']:.1f}",
            f"{ratio[clock]:.3f}",
            f"{sum(u['inside_ms'].values()):.1f} / {sum(p['inside_ms'].values()):.1f}",
            f"{ratio['attributed']:.4f}",
            "yes" if row["same_outputs"] else "[red]NO[/]",
            _v(row["verdict"]) if row.get("resolved", True) or row["verdict"] == "n/a"
            else f"[yellow]{row['verdict']}?[/]",
        )
    return table


#: Titles of section 6's tables.
WU_TITLES = {"add_request": "6a. Weight-update invalidation (fault 8): DynamicInferenceContext.add_request",
             "e2e": "6b. Weight-update invalidation (fault 8): engine step time",
             "flush": "6c. Weight-update invalidation (fault 8): the flush, invalidate_prefix_cache(context)"}


def weight_update_tables(section: dict[str, Any]) -> list[Table]:
    """Section 6: add_request ratios, engine step time, and the flush's time in ms."""
    clock = section["clock"]
    key = f"{clock}_us"
    targets = section["targets"]
    add = section["add_request"]
    wrapped = ", ".join(name.split(".")[-1] for name in add.get("wrapped", [])) or "its functions"
    add_table = Table(
        title=f"{WU_TITLES['add_request']}, µs per admission ({CLOCK_NAMES[clock]}), median [IQR]",
        caption=f"fault8 = only weight-update-invalidation's wrappers ({wrapped}); unpatched = the "
                "release's own code (every other patch off in both); pass-through = a do-nothing wrapt "
                "wrapper on the same functions (what wrapping alone costs). Policy "
                f"{add['policy']}; {add['rounds']} rounds x {add['batch']} calls per variant, alternating; "
                "the context is reset and a primer request added (untimed) before each call. added µs: "
                "paired (median of the per-round differences, ~95% interval), over unpatched. No verdict "
                "(as section 2): the patch's cost to a job is judged per engine step (6b).",
        caption_justify="left")
    for name in ("release", "prompt", "match", "matched blocks", "same outcome", "unpatched", "fault8",
                 "added µs: fault8 (~95%)", "added µs: pass-through (~95%)", "fault8/unpatched",
                 f"{'wall' if clock == 'cpu' else 'cpu'} added µs"):
        add_table.add_column(name, justify="left" if name in ("release", "match") else "right")
    for row in add["rows"]:
        v = row["variants"]
        ratio = row["ratios"]["fault8/unpatched"]
        add_table.add_row(
            row["release"], f"{row['prompt_tokens']:,}", row["match"],
            str(row["outcomes"]["fault8"]["blocks_matched"]),
            "yes" if row["same_outcome"] else "[red]NO[/]",
            _t(v["unpatched"][key]), _t(v["fault8"][key]),
            _a(row["added_us"]["fault8"]), _a(row["added_us"]["passthrough8"]),
            f"{paired_ratio(ratio, clock):.3f}",
            f"{ratio['paired_wall' if clock == 'cpu' else 'paired_cpu']['diff']:+.1f}",
        )
    flush = section["flush"]
    flush_table = Table(
        title=f"{WU_TITLES['flush']}, ms per call ({CLOCK_NAMES[clock]}), median [IQR] (min–max)",
        caption=f"A real DynamicInferenceContext, {flush['pool']:,}-block pool, {flush['registered']:,} "
                "registered blocks in 16-block prompt chains, every patch applied. held: blocks "
                "live requests hold (unhashed by the flush); ref-0: cached blocks (LRU; freed by the "
                "flush). flush = megatron_ext.invalidate_prefix_cache; age out = the alternative "
                "(ref-0 blocks left hashed and unreachable, hash map cleared, held blocks unhashed; "
                "a cost model, not a drop-in). The state is rebuilt (untimed) before every call; "
                f"{flush['rounds']} rounds x {flush['batch']} calls per variant, alternating. "
                f"Target: flush median <= {targets['flush_ms']:.0f} ms.",
        caption_justify="left")
    for name in ("release", "scenario", "held", "ref-0", "did: unhashed / freed", "flush ms", "age out ms",
                 "free at once costs ms", "wall flush ms", "verdict"):
        flush_table.add_column(name, justify="left" if name in ("release", "scenario") else "right")
    clock_ms = f"{clock}_ms"
    other_ms = "wall_ms" if clock == "cpu" else "cpu_ms"
    for row in flush["rows"]:
        v = row["variants"]
        did = row["outcomes"]["flush"]
        flush_table.add_row(
            row["release"], row["scenario"], f"{row['state']['held']:,}", f"{row['state']['cached_ref0']:,}",
            f"{did['blocks_unreachable']:,} / {did['blocks_freed']:,}",
            f"{_t(v['flush'][clock_ms], 2)} ({_range(v['flush'][clock_ms], 2)})",
            f"{_t(v['age_out'][clock_ms], 2)} ({_range(v['age_out'][clock_ms], 2)})",
            f"{row['free_at_once_extra_ms']:+.2f}",
            f"{_t(v['flush'][other_ms], 2)}" if clock == "cpu" else f"cpu {_t(v['flush'][other_ms], 2)}",
            _v(row["verdict"]),
        )
    if clock == "wall":
        flush_table.columns[8].header = "cpu flush ms"
    parts = {"add_request": add_table, "e2e": e2e_table(section["e2e"], "weight_update"), "flush": flush_table}
    return [table for name, table in parts.items() if section[name]["rows"]]


def engine_summary(section: dict[str, Any], label: str) -> str:
    """The verdict line of an engine-step section (3, 5 or 6b): rows passing, the worst row's
    added time per step with its interval, and the cost inside the patched functions."""
    clock = section["clock"]
    rows = section["rows"]
    judged = [r for r in rows if r["verdict"] in ("PASS", "FAIL")]
    verdict = section["verdict"]
    line = (f"{label}: {_v(verdict['result'])}: the patches' added time per engine step <= "
            f"{100 * (section['target'] - 1):.0f}%: {verdict['rows']['PASS']}/{len(judged)} rows")
    if judged:
        worst = max(judged, key=lambda r: r["ratios"]["patched/unpatched"][f"per_step_{clock}"]["ratio"])
        paired = worst["ratios"]["patched/unpatched"][f"per_step_{clock}"]
        line += (f", worst {worst['release']} {worst['policy']} {100 * (paired['ratio'] - 1):+.2f}% "
                 f"(~95% {100 * (paired['ratio_lo'] - 1):+.2f}% to {100 * (paired['ratio_hi'] - 1):+.2f}%; "
                 f"{paired['diff']:+.0f} µs per step)")
    if len(judged) < len(rows):
        line += f", {len(rows) - len(judged)} n/a"
    if verdict.get("unresolved"):
        line += (f"; {verdict['unresolved']}/{len(judged)} rows unresolved (their ~95% interval contains "
                 "the target: the verdict is the noise's)")
    if judged:
        attributed = max(r["ratios"]["patched/unpatched"]["attributed"] for r in judged)
        line += f"; inside the patched functions: worst {100 * (attributed - 1):+.2f}% of a run"
    return line


def _by_match(by_match: dict[str, Any]) -> str:
    """``none +1.0 µs (-2.0 to +3.0), ...``: the median row and the range over rows, per match kind."""
    return ", ".join(f"{match} {m['median_row_us']:+.1f} µs ({m['min_us']:+.1f} to {m['max_us']:+.1f}, "
                     f"{m['rows']} rows)" for match, m in by_match.items())


def weight_update_summary(section: dict[str, Any]) -> list[str]:
    """One line per part of section 6: what an admission adds, the engine-step verdict, the flush."""
    targets = section["targets"]
    lines = []
    add = section["add_request"]["rows"]
    if add:
        through = sorted(r["added_us"]["passthrough8"]["diff"] for r in add)[len(add) // 2]
        lines.append(f"weight-update add_request, µs fault 8's wrappers add per admission (paired, median "
                     f"row (least to most); not judged): {_by_match(section['add_request']['by_match'])}; "
                     f"a pass-through wrapper alone: median row {through:+.1f} µs")
    if section["e2e"]["rows"]:
        lines.append(engine_summary(section["e2e"], "weight-update engine step (all patches / all but fault 8)"))
    flush = section["flush"]["rows"]
    if flush:
        worst = max(r["median_ms"]["flush"] for r in flush)
        passed = sum(r["verdict"] == "PASS" for r in flush)
        lines.append(f"weight-update flush ({section['flush']['registered']:,} registered blocks, "
                     f"{section['flush']['pool']:,}-block pool): {passed}/{len(flush)} rows PASS "
                     f"(target <= {targets['flush_ms']:.0f} ms median, worst {worst:.2f} ms)")
    return lines


def scaling_tables(section: dict[str, Any]) -> list[Table]:
    clock = section["clock"]
    pools = section["pools"]
    by_pool = Table(title=f"4a. Release cost vs pool size: median µs ({clock}) per call",
                    caption=f"growth = median at {pools[-1]:,} blocks / median at {pools[0]:,} blocks "
                            f"(red above {section['growth_limit']}). control: the state rebuild alone, "
                            "which writes the same entries of the same tables with no pool-size-dependent "
                            "work: its growth is what random IDs in larger tables cost in cache and TLB "
                            "misses.",
                    caption_justify="left")
    for name in ["policy", "variant", "IDs", *[f"{p:,} blocks" for p in pools], "growth"]:
        by_pool.add_column(name, justify="left" if name in ("policy", "variant") else "right")
    per_id = Table(title=f"4b. Release cost vs released IDs: marginal µs per released ID ({clock})",
                   caption=f"(median at {section['ids'][-1]:,} IDs - median at {section['ids'][0]:,} ID) "
                           f"/ {section['ids'][-1] - section['ids'][0]:,}",
                   caption_justify="left")
    for name in ["policy", "variant", *[f"{p:,} blocks" for p in pools]]:
        per_id.add_column(name, justify="left" if name in ("policy", "variant") else "right")
    per_id_rows: dict[tuple[str, str], dict[int, float]] = {}
    for row in section["rows"]:
        if "pool_growth" in row:
            growth = row["pool_growth"]
            style = "" if growth <= section["growth_limit"] else "[red]"
            name = "control: rebuild only" if row["variant"] == "control" else row["variant"]
            by_pool.add_row(row["policy"], name, f"{row['ids']:,}",
                            *(f"{row['median_us_by_pool'][str(p)]:.0f}" for p in pools),
                            f"{style}{growth:.2f}")
        else:
            per_id_rows.setdefault((row["policy"], row["variant"]), {})[row["pool"]] = row["us_per_released_id"]
    for (policy, variant), cells in per_id_rows.items():
        per_id.add_row(policy, variant, *(f"{cells[p]:.3f}" for p in pools))
    return [by_pool, per_id]


def summary_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    if "release" in report:
        section = report["release"]
        clock = section["clock"]
        rows, flat = section["rows"], section["flatness"]
        worst = max((r["ratios"]["patched/upstream+ext"][clock] for r in rows), default=float("nan"))
        growth = max((f["patched_growth"] / f["allowed_growth"] for f in flat), default=float("nan"))
        lines.append(f"release path vs {section['releases']['upstream+ext']}: "
                     f"{_v(section['verdict']['result'])}: patched/upstream+ext <= {section['target']:.2f}x "
                     f"{sum(r['verdict'] == 'PASS' for r in rows)}/{len(rows)} rows (worst {worst:.3f}x); "
                     f"flat in pool size {sum(f['verdict'] == 'PASS' for f in flat)}/{len(flat)} "
                     f"(growth <= {section['target_pool_growth']:.2f} x the baseline's or the rebuild's; "
                     f"worst {growth * section['target_pool_growth']:.3f} x)")
    if "add_request" in report:
        section = report["add_request"]
        lines.append("add_request, µs the patches add per admission over the baseline (paired, median row "
                     f"(least to most); not judged): {_by_match(section['by_match'])}")
        sourced = [r for r in section["rows"] if r["added_us"]["source"] is not None]
        if sourced:
            differs = sum(r["source_check"] == "DIFFERS" for r in sourced)
            lines.append(f"add_request with the source patches instead: {_by_match(section['by_match_source'])}; "
                         + (f"[red]{differs} rows did other work[/]" if differs else "same work on every row"))
    for name, label in (("e2e", "end to end"), ("lru", "LRU under pressure")):
        if name in report:
            lines.append(engine_summary(report[name], label))
    if "weight_update" in report:
        lines += weight_update_summary(report["weight_update"])
    return lines


def print_report(report: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    meta = report["meta"]
    machine = meta["machine"]
    console.print(f"[bold]megatron-ext bench[/]: {machine['nproc']} CPUs ({machine['cpu_model']}), "
                  f"Python {machine['python']}, load average {meta['load_average_start']} -> "
                  f"{meta.get('load_average_end')}, total {meta.get('total_s', 0):.0f} s"
                  + ("  [yellow](--short: tiny sizes, few repetitions; verdicts not meaningful)[/]"
                     if meta["settings"]["short"] else ""))
    pinned = meta.get("workers_pinned_to_cpu")
    console.print("  one worker process per release (section 2: and per source-patched copy), "
                  + (f"all pinned to CPU {pinned}" if pinned is not None else "not pinned")
                  + "; torch on one intra-op thread")
    for version, tree in meta.get("releases", {}).items():
        states = ", ".join(f"{p['patch']} {p['state']}" for p in tree.get("patches", []))
        console.print(f"  megatron-core {version}: {tree.get('megatron_core_path', tree['path'])} "
                      f"(torch {tree.get('torch')}; {states})")
    tables = []
    if "release" in report:
        tables += release_tables(report["release"])
    if "add_request" in report:
        tables.append(add_request_table(report["add_request"]))
    for name in ENGINE_TABLE_TITLES:
        if name in report:
            tables.append(e2e_table(report[name], name))
    if "scaling" in report:
        tables += scaling_tables(report["scaling"])
    if "weight_update" in report:
        wu = report["weight_update"]
        console.print(f"  section 6 (weight_update): load average {wu.get('load_average_start')} -> "
                      f"{wu.get('load_average_end')}")
        tables += weight_update_tables(wu)
    for table in tables:
        console.print(table)
    for line in summary_lines(report):
        console.print(line)
