"""The orchestrator of ``scripts/bench.py``: one worker process per release, sections run in turn.

Workers never run at the same time (the orchestrator waits for each answer), so on a small
machine they do not compete with each other. Variants are timed in short back-to-back batches
(every timed call is preceded by a call of the same function, for every variant alike), and the
batches of all variants are interleaved round by round, rotating their order, so that load drift
on a shared machine hits every variant alike. Per-round ratios give the spread of each ratio.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_ext.source_patches import patch_source

from .stats import paired_summary, ratio_summary, summarize
from .trees import DEFAULT_SEARCH, REPO, find_tree

#: The patch section 6 measures (benchmarks.weight_update.FAULT8; that module imports torch).
FAULT8 = "weight-update-invalidation"

PATCHED_RELEASE = "0.18.2"   # has both faults: the runtime patches apply in full
UPSTREAM_RELEASE = "0.19.2"  # carries upstream's fix 1 (release_memory_blocks)

#: The cost targets, stated as what a job pays (issue 33):
#: * ``engine_step``: the patches' added time per engine step, patched / unpatched, the median of
#:   the paired rounds (one run of each variant back to back) of the engine-step sections (3, 5
#:   and 6's e2e part), on every release and policy they cover;
#: * ``release``: ``release_memory_blocks`` of the patched release / the released code with the
#:   same fault set fixed (0.19.2 with the patches it still needs on that path: fault 9's
#:   ``deregister-own-hash``), ratio of medians, on every pool size; ``release_pool_growth``:
#:   "flat in pool size", how much more than the pool size's own effect (the baseline's growth or
#:   the state rebuild's) the patched call may grow from the smallest pool to the largest;
#: * ``wu_flush_ms``: the median of one ``invalidate_prefix_cache`` call (section 6c), in ms.
#: The admission path (sections 2 and 6a) has no target: it reports the µs an admission adds, and
#: what that costs a job is judged in the engine-step sections, whose steps include the admissions.
TARGETS = {"engine_step": 1.01, "release": 1.00, "release_pool_growth": 1.10, "wu_flush_ms": 5.0}

#: What each judged section's verdict measures (the "verdict" entry of its JSON).
MEASURES = {
    "release": "release_memory_blocks, patched release / released code with the same fault set fixed "
               "(ratio of medians) on every row, and the patched call flat in pool size (its growth "
               "from the smallest pool to the largest within 1.10x of the baseline's or the state "
               "rebuild's)",
    "engine_step": "the patches' added time per engine step, patched / unpatched: median of the paired "
                   "rounds (each round one run of each variant, back to back), every release and policy",
    "add_request": "none: µs added per admission (paired median and ~95% interval) are reported, not "
                   "judged; their cost to a job is judged per engine step (sections 3, 5, 6b)",
}


#: The timed sections, by the names ``--sections`` accepts.
SECTIONS = ("release", "add_request", "e2e", "lru", "weight_update")

#: Releases section 6 runs on, each in its own worker; its parts, in the order they run.
WU_RELEASES = ["0.19.2", "0.18.2", "0.17.1"]
WU_PARTS = ("add_request", "flush", "e2e")


@dataclass
class Settings:
    """What to measure and how often. :func:`settings` gives the full and the ``--short`` sets."""

    short: bool
    clock: str = "cpu"  # the clock verdicts are based on: "cpu" (thread CPU time) or "wall"
    # CPU every worker is pinned to once started (None: last CPU this process may use; -1: no
    # pinning). One CPU for all workers: cross-process comparisons then see the same core.
    cpu: Optional[int] = None
    policies: list[str] = field(default_factory=lambda: ["REF_ZERO", "LRU"])
    pools: list[int] = field(default_factory=lambda: [4096, 65536, 1048576])
    # 36 and 2,304: N-sample releases below and above release_refcount's linear-dedupe threshold
    ids: list[int] = field(default_factory=lambda: [1, 36, 64, 2304, 4096])
    group: int = 8
    prefix: int = 7
    release_rounds: int = 40
    release_batch: int = 15
    add_releases: list[str] = field(default_factory=lambda: [PATCHED_RELEASE, UPSTREAM_RELEASE])
    add_policies: list[str] = field(default_factory=lambda: ["REF_ZERO", "LRU"])
    add_lengths: list[int] = field(default_factory=lambda: [64, 512, 2048, 8192])
    add_matches: list[str] = field(default_factory=lambda: ["full", "partial", "none"])
    add_rounds: int = 48
    add_batch: int = 10
    # Also time each add_releases release with the source patches of patches/ applied (its own
    # worker, no runtime patch): what the same fixes cost with no wrapper on the path.
    add_source: bool = True
    e2e_case: str = "rl_rollouts"
    e2e_releases: list[str] = field(default_factory=lambda: [PATCHED_RELEASE, UPSTREAM_RELEASE])
    e2e_policies: Optional[list[str]] = None  # None: every policy the case lists
    e2e_runs: int = 12
    e2e_warmup: bool = True
    # Section 5: LRU under memory pressure (the LRU fixes' wrappers at work). A case whose
    # unpatched run survives on 0.19.2; on 0.17/0.18 megatron-core raises unpatched (n/a rows).
    lru_case: str = "memory_pressure"
    lru_releases: list[str] = field(default_factory=lambda: [PATCHED_RELEASE, UPSTREAM_RELEASE])
    lru_runs: int = 12
    # Section 6: the weight-update-invalidation patch (fault 8). add_request: only its wrappers vs
    # none; e2e: every patch vs every patch but it; flush: invalidate_prefix_cache on a pool of
    # wu_pool blocks holding wu_registered registered blocks, per scenario.
    wu_releases: list[str] = field(default_factory=lambda: list(WU_RELEASES))
    wu_add_policy: str = "REF_ZERO"
    wu_add_lengths: list[int] = field(default_factory=lambda: [64, 512, 2048, 8192])
    wu_add_rounds: int = 48
    wu_add_batch: int = 10
    wu_e2e_runs: int = 12
    wu_pool: int = 65536
    wu_registered: int = 10000
    wu_scenarios: list[str] = field(default_factory=lambda: ["lru_cached", "ref_zero_held", "lru_held",
                                                             "lru_mixed"])
    wu_parts: list[str] = field(default_factory=lambda: list(WU_PARTS))
    wu_flush_rounds: int = 10
    wu_flush_batch: int = 5
    # Sections to run, in this order; scaling (section 4) comes with "release".
    sections: list[str] = field(default_factory=lambda: list(SECTIONS))


def settings(short: bool) -> Settings:
    if not short:
        return Settings(short=False)
    return Settings(
        short=True, pools=[1024, 4096], ids=[1, 64], release_rounds=3, release_batch=4,
        add_releases=[UPSTREAM_RELEASE], add_lengths=[64, 128], add_rounds=2, add_batch=2,
        e2e_releases=[PATCHED_RELEASE], e2e_policies=["ref_zero"], e2e_runs=1, e2e_warmup=False,
        lru_releases=[UPSTREAM_RELEASE], lru_runs=1,
        wu_releases=[UPSTREAM_RELEASE], wu_add_lengths=[64, 128], wu_add_rounds=2, wu_add_batch=2,
        wu_e2e_runs=1, wu_pool=1024, wu_registered=100, wu_flush_rounds=2, wu_flush_batch=2,
    )


class WorkerError(RuntimeError):
    """A worker failed to start or raised; the message carries its traceback and log tail."""


class WorkerProcess:
    """``python -m benchmarks.worker`` with ``tree`` first on ``PYTHONPATH``."""

    def __init__(self, version: str, tree: Path, log_dir: Path, label: str = "") -> None:
        self.version = version
        self.log_path = log_dir / f"worker-{label or version}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")}
        env["PYTHONPATH"] = os.pathsep.join([str(tree), str(REPO)])
        env["NO_VCS_VERSION"] = "1"  # megatron-core's package_info would append a git hash
        env["PYTHONWARNINGS"] = "ignore"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.worker"], cwd=REPO, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, bufsize=1,
        )
        self.info: dict[str, Any] = {}

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerError(f"worker for megatron-core {self.version} exited "
                              f"(code {self.proc.poll()}); log tail:\n{self.log_tail()}")
        return json.loads(line)

    def wait_ready(self) -> dict[str, Any]:
        message = self._read()
        if "ready" not in message:
            raise WorkerError(f"worker for megatron-core {self.version} failed to start:\n"
                              f"{message.get('error')}\nlog tail:\n{self.log_tail()}")
        self.info = message["ready"]
        found = self.info["megatron_core_version"]
        if found != self.version:
            raise WorkerError(f"worker meant for megatron-core {self.version} imported {found} "
                              f"from {self.info['megatron_core_path']}")
        return self.info

    def pin(self, cpus: set[int]) -> None:
        """Restrict every thread of the worker to ``cpus`` (Linux; threads started later inherit it)."""
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            os.sched_setaffinity(int(tid), cpus)

    def call(self, op: str, **arguments: Any) -> Any:
        self.proc.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.proc.stdin.flush()
        message = self._read()
        if not message.get("ok"):
            raise WorkerError(f"worker {self.version}, {op}({arguments}):\n{message.get('error')}")
        return message["result"]

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def machine_info() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {"nproc": usable, "cpu_count": os.cpu_count(), "cpu_model": model or "unknown",
            "platform": platform.platform(), "python": platform.python_version()}


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# -- section helpers ---------------------------------------------------------------------------


class Timed:
    """Samples of one variant in one row: all calls, plus each round's batch median."""

    def __init__(self) -> None:
        self.wall: list[int] = []
        self.cpu: list[int] = []
        self.round_wall: list[float] = []
        self.round_cpu: list[float] = []

    def add(self, batch: dict[str, list[int]]) -> None:
        self.wall.extend(batch["wall"])
        self.cpu.extend(batch["cpu"])
        self.round_wall.append(statistics.median(batch["wall"]))
        self.round_cpu.append(statistics.median(batch["cpu"]))

    def summary(self) -> dict[str, Any]:
        return {"wall_us": summarize(self.wall), "cpu_us": summarize(self.cpu)}


def compare(numerator: Timed, denominator: Timed) -> dict[str, Any]:
    """Ratio of medians on both clocks, with the spread of the per-round ratios, and the paired
    estimate (``paired_cpu`` / ``paired_wall``: :func:`benchmarks.stats.paired_summary` of the
    rounds' batch medians, µs)."""
    def of(samples_n: list[int], samples_d: list[int]) -> float:
        return statistics.median(samples_n) / statistics.median(samples_d)
    return {
        "cpu": of(numerator.cpu, denominator.cpu),
        "wall": of(numerator.wall, denominator.wall),
        "rounds_cpu": ratio_summary(numerator.round_cpu, denominator.round_cpu),
        "rounds_wall": ratio_summary(numerator.round_wall, denominator.round_wall),
        "paired_cpu": paired_summary(numerator.round_cpu, denominator.round_cpu),
        "paired_wall": paired_summary(numerator.round_wall, denominator.round_wall),
    }


def source_key(version: str) -> str:
    """The worker key of ``version`` with the source patches applied."""
    return f"{version}+source"


def source_check(outcomes: dict[str, Any]) -> str:
    """Whether a section-2 row's source-patched ``add_request`` did the runtime-patched one's work
    (matched blocks, tokens added, dummy-block writes): "same work", "DIFFERS", or "n/a" (no
    source-patched worker)."""
    if "source" not in outcomes:
        return "n/a"
    return "same work" if outcomes["source"] == outcomes["patched"] else "DIFFERS"


def verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio <= target else "FAIL"


def added_us(ratio: dict[str, Any], clock: str) -> dict[str, float]:
    """The paired extra µs of a ratio from :func:`compare` (``diff``, its ~95% interval
    ``diff_lo`` / ``diff_hi``, and ``n`` rounds)."""
    paired = ratio[f"paired_{clock}"]
    return {k: paired[k] for k in ("diff", "diff_lo", "diff_hi", "n")}


def section_verdict(verdicts: list[str], measure: str, target: Any) -> dict[str, Any]:
    """A judged section's verdict: FAIL if any row fails, PASS if every judged row passes, n/a if
    no row could be judged (e.g. every unpatched run raised); with the row counts."""
    counts = {name: sum(v == name for v in verdicts) for name in ("PASS", "FAIL", "n/a")}
    result = "FAIL" if counts["FAIL"] else ("PASS" if counts["PASS"] else "n/a")
    return {"result": result, "measure": measure, "target": target, "rows": counts}


class Bench:
    """Runs the sections and collects the report (a JSON-able dict)."""

    def __init__(self, config: Settings, search: list[Path], progress: Callable[[str], None]) -> None:
        self.config = config
        self.search = search
        self.progress = progress
        self.workers: dict[str, WorkerProcess] = {}
        self.scratch = Path(tempfile.mkdtemp(prefix="megatron-ext-bench-"))
        self.trees: dict[str, dict[str, str]] = {}
        self.pinned_cpu: Optional[int] = None

    # -- workers -------------------------------------------------------------------------------

    def start_workers(self) -> None:
        c = self.config
        wanted = {"release": [PATCHED_RELEASE, UPSTREAM_RELEASE], "add_request": c.add_releases,
                  "e2e": c.e2e_releases, "lru": c.lru_releases, "weight_update": c.wu_releases}
        versions = sorted({v for name in c.sections for v in wanted[name]})
        for version in versions:
            tree, source = find_tree(version, self.search, self.scratch)
            self.trees[version] = {"path": str(tree), "source": source}
            self.progress(f"megatron-core {version}: {source}")
        keys = {version: (version, Path(self.trees[version]["path"])) for version in versions}
        if "add_request" in c.sections and c.add_source:
            for version in c.add_releases:
                keys[source_key(version)] = (version, self._source_tree(version))
        for key, (version, tree) in keys.items():  # start all, then wait: imports overlap
            self.workers[key] = WorkerProcess(version, tree, self.scratch, label=key)
        for key in keys:
            info = self.workers[key].wait_ready()
            self.trees.setdefault(key, {"path": str(keys[key][1]), "source": "source-patched copy"}).update(info)
            states = ", ".join(f"{p['patch']}: {p['state']}" for p in info["patches"])
            if key != version and all(p["state"] == "not needed" for p in info["patches"]):
                states = "the source patches are applied: no runtime patch is needed"
            self.progress(f"worker {key} ready ({states})")
        self.pinned_cpu = self._pin_workers()

    def _source_tree(self, version: str) -> Path:
        """A copy of ``version``'s tree in the scratch directory with ``patches/`` applied."""
        target = self.scratch / f"megatron-core-{version}-source"
        shutil.copytree(self.trees[version]["path"], target, ignore=shutil.ignore_patterns("__pycache__"))
        applied = patch_source(target)
        self.progress(f"megatron-core {version} + source patches: {len(applied)} applied in {target}")
        return target

    def _pin_workers(self) -> Optional[int]:
        """Pin all workers to one CPU (after start-up, so that their imports ran in parallel)."""
        if self.config.cpu == -1 or not hasattr(os, "sched_setaffinity"):
            return None
        cpu = self.config.cpu if self.config.cpu is not None else max(os.sched_getaffinity(0))
        try:
            for worker in self.workers.values():
                worker.pin({cpu})
        except OSError as exc:
            self.progress(f"could not pin the workers to CPU {cpu} ({exc}); running unpinned")
            return None
        self.progress(f"workers pinned to CPU {cpu}")
        return cpu

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        shutil.rmtree(self.scratch, ignore_errors=True)

    # -- section 1 -----------------------------------------------------------------------------

    def release_section(self) -> dict[str, Any]:
        c = self.config
        patched_w, upstream_w = self.workers[PATCHED_RELEASE], self.workers[UPSTREAM_RELEASE]
        # upstream+ext: upstream's fixed code with the runtime patches it still needs (fault 9's
        # deregister-own-hash is on this path in every release): what a job on it runs.
        tasks = [("patched", patched_w, "patched"), ("unpatched", patched_w, "unpatched"),
                 ("upstream", upstream_w, "unpatched"), ("upstream+ext", upstream_w, "patched")]
        rows = []
        for policy in c.policies:
            for pool in c.pools:
                for n_ids in c.ids:
                    self.progress(f"release: {policy} pool {pool:,} ids {n_ids:,}")
                    setup = dict(policy=policy, pool=pool, ids=n_ids, group=c.group, prefix=c.prefix)
                    here = patched_w.call("release_setup", **setup)
                    there = upstream_w.call("release_setup", **setup)
                    timed = {label: Timed() for label, _, _ in tasks}
                    for r in range(c.release_rounds):
                        shift = r % len(tasks)
                        for label, worker, variant in tasks[shift:] + tasks[:shift]:
                            timed[label].add(worker.call("release_time", variant=variant, reps=c.release_batch))
                    control = Timed()
                    control.add(patched_w.call("release_control", reps=4 * c.release_batch))
                    outcomes = {"patched": here["outcomes"]["patched"],
                                "unpatched": here["outcomes"]["unpatched"],
                                "upstream": there["outcomes"]["unpatched"],
                                "upstream+ext": there["outcomes"]["patched"]}
                    vs_upstream = compare(timed["patched"], timed["upstream"])
                    vs_upstream_ext = compare(timed["patched"], timed["upstream+ext"])
                    rows.append({
                        "policy": policy, "pool": pool, "ids": n_ids,
                        "workload": here["workload"],
                        "variants": {label: t.summary() for label, t in timed.items()},
                        "ratios": {"patched/upstream": vs_upstream,
                                   "patched/upstream+ext": vs_upstream_ext,
                                   "patched/unpatched": compare(timed["patched"], timed["unpatched"])},
                        "control_rebuild": control.summary(),
                        "outcomes": outcomes,
                        "same_result_as_upstream": (outcomes["patched"] == outcomes["upstream"]
                                                    == outcomes["upstream+ext"]),
                        "verdict": verdict(vs_upstream_ext[c.clock], TARGETS["release"]),
                    })
        flatness = _pool_flatness(rows, c.clock, c.pools, c.policies, c.ids)
        baseline_patches = self._release_path_patches(UPSTREAM_RELEASE)
        return {"target": TARGETS["release"], "target_pool_growth": TARGETS["release_pool_growth"],
                "clock": c.clock,
                "releases": {"patched": f"{PATCHED_RELEASE} + megatron-ext",
                             "unpatched": PATCHED_RELEASE, "upstream": UPSTREAM_RELEASE,
                             "upstream+ext": f"{UPSTREAM_RELEASE} + " + (", ".join(baseline_patches) or "no patch")},
                "baseline_patches": baseline_patches,
                "rounds": c.release_rounds, "batch": c.release_batch, "rows": rows,
                "flatness": flatness,
                "verdict": section_verdict([r["verdict"] for r in rows] + [f["verdict"] for f in flatness],
                                           MEASURES["release"],
                                           {"patched/upstream+ext": TARGETS["release"],
                                            "pool_growth_over_baseline_or_control":
                                                TARGETS["release_pool_growth"]})}

    def _release_path_patches(self, version: str) -> list[str]:
        """The patches ``apply()`` installs on ``version`` that wrap a function of the release path
        (``release_memory_blocks`` or the ``_deregister_blocks`` it calls)."""
        path = {"KVBlockAllocator.release_memory_blocks", "KVBlockAllocator._deregister_blocks"}
        return [p["patch"] for p in self.workers[version].info["patches"]
                if p["state"] == "applied" and path & set(p.get("targets", []))]

    # -- section 2 -----------------------------------------------------------------------------

    def add_request_section(self) -> dict[str, Any]:
        c = self.config
        rows = []
        max_prompt = max(c.add_lengths)
        for version, policy, length, match in itertools.product(
                c.add_releases, c.add_policies, c.add_lengths, c.add_matches):
            worker = self.workers[version]
            self.progress(f"add_request: {version} {policy} {length} tokens, {match} match")
            case = worker.call("add_case", policy=policy, max_prompt=max_prompt, length=length, match=match)
            # LRU on a release that gets upstream's LRU fixes backported: the backport (the prefix
            # forest kept on every registration) is judged against upstream's own code doing it.
            upstream = (self.workers.get(UPSTREAM_RELEASE)
                        if policy == "LRU" and version != UPSTREAM_RELEASE else None)
            if upstream is not None:
                upstream.call("add_case", policy=policy, max_prompt=max_prompt, length=length, match=match)
            runs = {"unpatched": (worker, "unpatched"), "patched": (worker, "patched")}
            if upstream is not None:
                runs["upstream"] = (upstream, "unpatched")
            source = self.workers.get(source_key(version))
            if source is not None:  # its runtime patches are "not needed": both variants are the tree's code
                case["outcomes"]["source"] = source.call(
                    "add_case", policy=policy, max_prompt=max_prompt, length=length, match=match,
                    variants=["unpatched"])["outcomes"]["unpatched"]
                runs["source"] = (source, "unpatched")
            timed = {variant: Timed() for variant in runs}
            for r in range(c.add_rounds):
                order = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]
                for variant in order:
                    who, installed = runs[variant]
                    timed[variant].add(who.call("add_time", variant=installed, reps=c.add_batch))
            ratios = {"patched/unpatched": compare(timed["patched"], timed["unpatched"])}
            if upstream is not None:
                ratios["patched/upstream"] = compare(timed["patched"], timed["upstream"])
            baseline = "upstream" if upstream is not None else "unpatched"
            judged = f"patched/{baseline}"
            if source is not None:
                ratios[f"source/{baseline}"] = compare(timed["source"], timed[baseline])
            rows.append({
                "release": version, "policy": policy, "prompt_tokens": length, "match": match,
                "outcomes": case["outcomes"],
                "variants": {v: t.summary() for v, t in timed.items()},
                "ratios": ratios, "baseline": baseline,
                # what an admission adds, µs (paired: the median of the per-round differences,
                # ~95% interval), against the baseline; reported, not judged
                "added_us": {"patched": added_us(ratios[judged], c.clock),
                             "source": (added_us(ratios[f"source/{baseline}"], c.clock)
                                        if source is not None else None)},
                "source_check": source_check(case["outcomes"]),
            })
        return {"clock": c.clock, "policies": c.add_policies, "source": c.add_source,
                "rounds": c.add_rounds, "batch": c.add_batch, "rows": rows,
                "by_match": _added_by_match(rows, "patched"), "by_match_source": _added_by_match(rows, "source"),
                "verdict": {"result": "none", "measure": MEASURES["add_request"], "target": None}}

    # -- section 3 -----------------------------------------------------------------------------

    def e2e_section(self) -> dict[str, Any]:
        c = self.config
        return self._engine_section("e2e", c.e2e_case, c.e2e_releases, c.e2e_policies, c.e2e_runs,
                                    c.e2e_warmup, shorten=c.short)

    # -- section 5 -----------------------------------------------------------------------------

    def lru_section(self) -> dict[str, Any]:
        """Section 3's measurement on an LRU workload under memory pressure, full size always
        (a shortened case would not evict)."""
        c = self.config
        return self._engine_section("lru", c.lru_case, c.lru_releases, ["lru"], c.lru_runs,
                                    c.e2e_warmup, shorten=False)

    def _engine_section(self, name: str, case: str, releases: list[str], policies: Optional[list[str]],
                        runs_per_variant: int, warmup: bool, shorten: bool,
                        worker_variants: Optional[dict[str, str]] = None) -> dict[str, Any]:
        """Engine step time of ``case``, patched vs unpatched, per release and policy (None: the
        case's policies); the two variants alternate run by run. ``worker_variants`` maps the
        row's "unpatched" / "patched" to the worker's variant names (default: the same names)."""
        names = worker_variants or {"unpatched": "unpatched", "patched": "patched"}
        target = TARGETS["engine_step"]
        rows = []
        setup_info = {}
        for version in releases:
            worker = self.workers[version]
            self.progress(f"{name}: {version}: building model ({case})")
            setup = worker.call("e2e_setup", case=case, short=shorten)
            setup_info[version] = setup
            for policy in policies or setup["policies"]:
                if warmup:
                    for variant in ("unpatched", "patched"):
                        worker.call("e2e_run", variant=names[variant], policy=policy)
                runs: dict[str, list[dict]] = {"unpatched": [], "patched": []}
                for r in range(runs_per_variant):
                    order = ["unpatched", "patched"] if r % 2 == 0 else ["patched", "unpatched"]
                    for variant in order:
                        self.progress(f"{name}: {version} {policy} run {r + 1}/{runs_per_variant} {variant}")
                        runs[variant].append(worker.call("e2e_run", variant=names[variant], policy=policy))
                rows.append(_e2e_row(version, policy, runs, self.config.clock, target))
        judged = section_verdict([r["verdict"] for r in rows], MEASURES["engine_step"], target)
        judged["unresolved"] = sum(r["verdict"] != "n/a" and not r["resolved"] for r in rows)
        return {"target": target, "clock": self.config.clock, "case": case, "short_case": shorten,
                "runs": runs_per_variant, "setup": setup_info, "rows": rows, "verdict": judged}

    # -- section 6 -----------------------------------------------------------------------------

    def weight_update_section(self) -> dict[str, Any]:
        """Fault 8's patch: add_request (its wrappers alone vs none), engine step time (every
        patch vs every patch but it) and the flush itself, on each release of ``wu_releases``."""
        c = self.config
        load_start = load_average()
        add_rows, flush_rows = [], []
        max_prompt = max(c.wu_add_lengths)
        key = f"{c.clock}_us"
        for version in c.wu_releases:
            worker = self.workers[version]
            for length in (c.wu_add_lengths if "add_request" in c.wu_parts else []):
                for match in c.add_matches:
                    self.progress(f"weight_update: add_request {version} {length} tokens, {match} match")
                    case = worker.call("wu_add_case", policy=c.wu_add_policy, max_prompt=max_prompt,
                                       length=length, match=match)
                    variants = ["unpatched", "passthrough8", "fault8"]
                    timed = {v: Timed() for v in variants}
                    for r in range(c.wu_add_rounds):
                        shift = r % len(variants)
                        for variant in variants[shift:] + variants[:shift]:
                            timed[variant].add(worker.call("add_time", variant=variant, reps=c.wu_add_batch))
                    ratio = compare(timed["fault8"], timed["unpatched"])
                    passthrough = compare(timed["passthrough8"], timed["unpatched"])
                    outcomes = case["outcomes"]
                    add_rows.append({
                        "release": version, "policy": c.wu_add_policy, "prompt_tokens": length, "match": match,
                        "outcomes": outcomes,
                        "same_outcome": outcomes["fault8"] == outcomes["unpatched"] == outcomes["passthrough8"],
                        "variants": {v: t.summary() for v, t in timed.items()},
                        "ratios": {"fault8/unpatched": ratio,
                                   "passthrough8/unpatched": passthrough},
                        # µs an admission adds, paired, against the release's own code (as
                        # section 2's added_us); reported, not judged
                        "baseline": "unpatched",
                        "added_us": {"fault8": added_us(ratio, c.clock),
                                     "passthrough8": added_us(passthrough, c.clock)},
                    })
            for scenario in (c.wu_scenarios if "flush" in c.wu_parts else []):
                self.progress(f"weight_update: flush {version} {scenario}, pool {c.wu_pool:,}, "
                              f"{c.wu_registered:,} registered")
                setup = worker.call("wu_flush_setup", scenario=scenario, pool=c.wu_pool,
                                    registered=c.wu_registered)
                timed = {"flush": Timed(), "age_out": Timed()}
                for r in range(c.wu_flush_rounds):
                    order = ["flush", "age_out"] if r % 2 == 0 else ["age_out", "flush"]
                    for variant in order:
                        timed[variant].add(worker.call("wu_flush_time", variant=variant, reps=c.wu_flush_batch))
                medians_ms = {v: t.summary()[key]["median"] / 1e3 for v, t in timed.items()}
                flush_rows.append({
                    "release": version, "scenario": scenario, "state": setup["state"],
                    "outcomes": setup["outcomes"],
                    "variants": {v: {"cpu_ms": summarize(t.cpu, 1e-6), "wall_ms": summarize(t.wall, 1e-6)}
                                 for v, t in timed.items()},
                    "median_ms": medians_ms,
                    "free_at_once_extra_ms": medians_ms["flush"] - medians_ms["age_out"],
                    "verdict": verdict(medians_ms["flush"], TARGETS["wu_flush_ms"]),
                })
        e2e = self._engine_section("weight_update", c.e2e_case, c.wu_releases if "e2e" in c.wu_parts else [],
                                   c.e2e_policies, c.wu_e2e_runs, c.e2e_warmup, shorten=c.short,
                                   worker_variants={"unpatched": "patched_no8", "patched": "patched"})
        rows = ([{"part": "add_request", **r} for r in add_rows] + [{"part": "e2e", **r} for r in e2e["rows"]]
                + [{"part": "flush", **r} for r in flush_rows])
        verdicts = {"add_request": {"result": "none", "measure": MEASURES["add_request"], "target": None},
                    "e2e": e2e["verdict"],
                    "flush": section_verdict([r["verdict"] for r in flush_rows], "median ms of one "
                                             "invalidate_prefix_cache call, per release and scenario",
                                             TARGETS["wu_flush_ms"])}
        judged = [v["result"] for part, v in verdicts.items() if part in c.wu_parts and v["result"] != "none"]
        result = "FAIL" if "FAIL" in judged else ("PASS" if "PASS" in judged else "n/a")
        return {
            "clock": c.clock, "targets": {"e2e_per_step": TARGETS["engine_step"], "flush_ms": TARGETS["wu_flush_ms"]},
            "verdict": {"result": result, "parts": {p: v for p, v in verdicts.items() if p in c.wu_parts}},
            "releases": c.wu_releases,
            "variants": {"add_request": {"fault8": "only weight-update-invalidation's wrappers",
                                         "passthrough8": "a do-nothing wrapt wrapper on each function "
                                                         "weight-update-invalidation wraps",
                                         "unpatched": "the release's own code (no patch)"},
                         "e2e": {"patched": "every runtime patch",
                                 "unpatched": "every runtime patch but weight-update-invalidation"},
                         "flush": {"flush": "megatron_ext.invalidate_prefix_cache (ref-0 blocks freed)",
                                   "age_out": "ref-0 blocks left hashed, unreachable; hash map cleared, "
                                              "held blocks unhashed"}},
            "add_request": {"policy": c.wu_add_policy, "rounds": c.wu_add_rounds, "batch": c.wu_add_batch,
                            "wrapped": next((p["targets"] for p in self.workers[c.wu_releases[0]].info["patches"]
                                             if p["patch"] == FAULT8), []) if c.wu_releases else [],
                            "rows": add_rows, "by_match": _added_by_match(add_rows, "fault8")},
            "e2e": e2e,
            "flush": {"pool": c.wu_pool, "registered": c.wu_registered, "rounds": c.wu_flush_rounds,
                      "batch": c.wu_flush_batch, "rows": flush_rows},
            "rows": rows,
            "load_average_start": load_start, "load_average_end": load_average(),
        }

    # -- section 4 -----------------------------------------------------------------------------

    def scaling_section(self, release: dict[str, Any]) -> dict[str, Any]:
        c = self.config
        key = f"{c.clock}_us"
        rows = []
        for policy in c.policies:
            cells = {(r["pool"], r["ids"]): r for r in release["rows"] if r["policy"] == policy}
            for variant in ("patched", "upstream", "unpatched", "control"):
                for n_ids in c.ids:
                    medians = {str(pool): (cells[(pool, n_ids)]["control_rebuild"] if variant == "control"
                                           else cells[(pool, n_ids)]["variants"][variant])[key]["median"]
                               for pool in c.pools}
                    small, large = medians[str(c.pools[0])], medians[str(c.pools[-1])]
                    rows.append({"policy": policy, "variant": variant, "ids": n_ids,
                                 "median_us_by_pool": medians, "pool_growth": large / small})
                if variant == "control":
                    continue
                for pool in c.pools:
                    few, many = cells[(pool, c.ids[0])], cells[(pool, c.ids[-1])]
                    per_id = ((many["variants"][variant][key]["median"] - few["variants"][variant][key]["median"])
                              / max(c.ids[-1] - c.ids[0], 1))
                    rows.append({"policy": policy, "variant": variant, "pool": pool,
                                 "us_per_released_id": per_id})
        return {"clock": c.clock, "pools": c.pools, "ids": c.ids, "rows": rows,
                "growth_limit": 1.5}


def _pool_flatness(rows: list[dict[str, Any]], clock: str, pools: list[int], policies: list[str],
                   ids: list[int]) -> list[dict[str, Any]]:
    """Section 1's "flat in pool size", per policy and released-ID count: the patched call's
    growth from the smallest pool to the largest (median at the largest / at the smallest) against
    the growth the pool size causes anyway: that of the baseline (upstream+ext) or of the state
    rebuild alone (the control: the same entries of the same tables, no pool-dependent work; random
    IDs in larger tables cost cache and TLB misses), whichever is larger. PASS when the patched
    growth is at most ``TARGETS["release_pool_growth"]`` times that: work proportional to the
    pool (a scan of 1,048,576 entries) would grow a 100 µs call several-fold."""
    key = f"{clock}_us"
    out = []
    for policy in policies:
        for n_ids in ids:
            cells = {r["pool"]: r for r in rows if r["policy"] == policy and r["ids"] == n_ids}
            if len(pools) < 2 or pools[0] not in cells or pools[-1] not in cells:
                continue
            small, large = cells[pools[0]], cells[pools[-1]]

            def growth(variant: str) -> float:
                return large["variants"][variant][key]["median"] / small["variants"][variant][key]["median"]

            control = large["control_rebuild"][key]["median"] / small["control_rebuild"][key]["median"]
            patched, baseline = growth("patched"), growth("upstream+ext")
            allowed = TARGETS["release_pool_growth"] * max(baseline, control)
            out.append({"policy": policy, "ids": n_ids, "pools": [pools[0], pools[-1]],
                        "patched_growth": patched, "baseline_growth": baseline, "control_growth": control,
                        "allowed_growth": allowed, "verdict": "PASS" if patched <= allowed else "FAIL"})
    return out


def _added_by_match(rows: list[dict[str, Any]], variant: str) -> dict[str, dict[str, Any]]:
    """Per match kind (full / partial / none), over rows of every release, policy and prompt
    length: the median row's, least and most paired µs ``variant`` adds per admission."""
    out: dict[str, dict[str, Any]] = {}
    for match in ("none", "partial", "full"):
        diffs = sorted(r["added_us"][variant]["diff"] for r in rows
                       if r["match"] == match and r["added_us"][variant] is not None)
        if diffs:
            out[match] = {"rows": len(diffs), "median_row_us": statistics.median(diffs),
                          "min_us": diffs[0], "max_us": diffs[-1]}
    return out


def _per_step(records: list[dict], key: str, reduce: Callable[[list[int]], float]) -> Optional[list[float]]:
    """``reduce`` (median or min) over runs of each step index's time, or None if step counts differ."""
    if len({len(r[key]) for r in records}) != 1:
        return None
    return [float(reduce(step)) for step in zip(*(r[key] for r in records))]


def _run_estimates(records: list[dict], key: str) -> dict[str, float]:
    """Two estimates of a run's time (ms) from several runs of the same work.

    ``median``: the sum over step indexes of the per-step median over runs (robust to a burst of
    load hitting one step of one run). ``floor``: the sum of the per-step minimum over runs, the
    least-disturbed time of each step: interference from other processes only ever adds time, and
    the patches' own cost is deterministic code that is in every sample, minimum included.
    If step counts differ between runs, both fall back to the median / minimum run total.
    """
    medians = _per_step(records, key, statistics.median)
    floors = _per_step(records, key, min)
    totals = [sum(r[key]) for r in records]
    return {
        "median": (sum(medians) if medians else statistics.median(totals)) * 1e-6,
        "floor": (sum(floors) if floors else min(totals)) * 1e-6,
    }


def _e2e_row(version: str, policy: str, runs: dict[str, list[dict]], clock: str,
             target: float) -> dict[str, Any]:
    """One row of an engine-step section from the runs of each variant (``runs[v][r]``: run ``r``
    of variant ``v``; run ``r`` of both variants ran back to back). Judged by the added time per
    step, paired by round, against ``target`` (patched / unpatched); n/a when the variants did
    different work or one raised."""
    variants = {}
    for variant, records in runs.items():
        variants[variant] = {
            "step_cpu_us": summarize([s for r in records for s in r["step_cpu_ns"]]),
            "step_wall_us": summarize([s for r in records for s in r["step_wall_ns"]]),
            "run_cpu_ms": summarize([sum(r["step_cpu_ns"]) for r in records], 1e-6),
            "run_wall_ms": summarize([sum(r["step_wall_ns"]) for r in records], 1e-6),
            "run_estimate_cpu_ms": _run_estimates(records, "step_cpu_ns"),
            "run_estimate_wall_ms": _run_estimates(records, "step_wall_ns"),
            "run_totals_cpu_ms": [sum(r["step_cpu_ns"]) * 1e-6 for r in records],
            "step_median_cpu_us": [x * 1e-3 for x in (_per_step(records, "step_cpu_ns", statistics.median) or [])],
            "step_min_cpu_us": [x * 1e-3 for x in (_per_step(records, "step_cpu_ns", min) or [])],
            "engine_steps": sorted({r["engine_steps"] for r in records}),
            "blocks_matched": sorted({r["blocks_matched"] for r in records}),
            "prefill_tokens_computed": sorted({r["prefill_tokens_computed"] for r in records}),
            "outputs_digest": sorted({r["outputs_digest"] for r in records}),
        }
    patched, unpatched = variants["patched"], variants["unpatched"]
    # Kept for information: the floor and median run estimates' ratios (keys "cpu" / "wall", and
    # "<clock>_median"), and the spread of the per-pair run-total ratios.
    ratio: dict[str, Any] = {}
    for name in ("cpu", "wall"):
        p_est, u_est = patched[f"run_estimate_{name}_ms"], unpatched[f"run_estimate_{name}_ms"]
        ratio[name] = p_est["floor"] / u_est["floor"]
        ratio[f"{name}_median"] = p_est["median"] / u_est["median"]
    for name in ("cpu", "wall"):
        key = f"step_{name}_ns"
        ratio[f"pairs_{name}"] = ratio_summary([sum(r[key]) for r in runs["patched"]],
                                               [sum(r[key]) for r in runs["unpatched"]])
    # The verdict: the added time per engine step, paired by round (run r of each variant ran
    # back to back): the median over rounds of (patched - unpatched) mean step time, µs, with its
    # ~95% interval; ratio = 1 + that / the median unpatched mean step time.
    for name in ("cpu", "wall"):
        key = f"step_{name}_ns"
        means = {v: [sum(r[key]) / len(r[key]) for r in records if r[key]] for v, records in runs.items()}
        paired = (paired_summary(means["patched"], means["unpatched"])
                  if len(means["patched"]) == len(means["unpatched"]) == len(runs["patched"]) else None)
        ratio[f"per_step_{name}"] = paired
    # What the patches cost inside the engine: extra CPU time in the patched functions per run
    # (median over runs), relative to the unpatched run's floor estimate.
    inside = {}
    for variant, records in runs.items():
        inside[variant] = {
            name: statistics.median(r["inside_cpu_ns"][name] for r in records) * 1e-6
            for name in records[0]["inside_cpu_ns"]
        }
        variants[variant]["inside_ms"] = inside[variant]
        variants[variant]["inside_calls"] = records[0]["inside_calls"]
    extra_ms = sum(inside["patched"].values()) - sum(inside["unpatched"].values())
    ratio["attributed"] = 1 + extra_ms / unpatched["run_estimate_cpu_ms"]["floor"]
    ratio["attributed_extra_ms"] = extra_ms
    same_work = all(patched[k] == unpatched[k]
                    for k in ("engine_steps", "blocks_matched", "prefill_tokens_computed"))
    errors = {variant: next((r["error"] for r in records if r.get("error")), None)
              for variant, records in runs.items()}
    return {
        "release": version, "policy": policy, "runs": len(runs["patched"]),
        "variants": variants,
        "ratios": {"patched/unpatched": ratio},
        "same_work": same_work,
        "same_outputs": patched["outputs_digest"] == unpatched["outputs_digest"],
        "errors": errors,
        # Unpatched 0.17/0.18 leak shared blocks (fix 1), which a later request can then match,
        # or raise under LRU (faults 3-6): the two runs do different work and the ratio measures
        # the fault, not the patch.
        "added_us_per_step": ({k: ratio[f"per_step_{clock}"][k] for k in ("diff", "diff_lo", "diff_hi", "n")}
                              if ratio[f"per_step_{clock}"] else None),
        "verdict": (verdict(ratio[f"per_step_{clock}"]["ratio"], target)
                    if same_work and not any(errors.values()) and ratio[f"per_step_{clock}"] else "n/a"),
        # whether the ~95% interval lies on one side of the target: if not, the verdict is the
        # noise's (more rounds, or a quieter machine, would be needed to decide it)
        "resolved": bool(ratio[f"per_step_{clock}"])
        and not (ratio[f"per_step_{clock}"]["ratio_lo"] <= target < ratio[f"per_step_{clock}"]["ratio_hi"]),
    }


def run(config: Settings, search: list[Path] | None = None, progress: Callable[[str], None] = print,
        command: str = "") -> dict[str, Any]:
    """Run every section; return the report dict (see ``scripts/bench.py --help`` for the layout)."""
    started = time.perf_counter()
    report: dict[str, Any] = {
        "meta": {"command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                 "machine": machine_info(), "load_average_start": load_average(),
                 "settings": asdict(config)},
    }
    bench = Bench(config, list(search or DEFAULT_SEARCH), progress)
    stages: dict[str, float] = {}
    report["meta"]["stage_s"] = stages

    def stage(name: str, action: Callable[[], Any]) -> Any:
        begun = time.perf_counter()
        try:
            return action()
        finally:
            stages[name] = round(time.perf_counter() - begun, 2)

    try:
        stage("start_workers", bench.start_workers)
        report["meta"]["releases"] = bench.trees
        report["meta"]["workers_pinned_to_cpu"] = bench.pinned_cpu
        sections = {"release": bench.release_section, "add_request": bench.add_request_section,
                    "e2e": bench.e2e_section, "lru": bench.lru_section,
                    "weight_update": bench.weight_update_section}
        for name in config.sections:
            report[name] = stage(name, sections[name])
        if "release" in report:
            report["scaling"] = bench.scaling_section(report["release"])
    finally:
        bench.close()
    report["meta"]["load_average_end"] = load_average()
    report["meta"]["total_s"] = time.perf_counter() - started
    return report
