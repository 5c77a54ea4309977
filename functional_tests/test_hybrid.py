"""A tiny hybrid (Mamba + attention) model through megatron-core's own hybrid model and dynamic
engine on the CPU, prefix caching off vs on (REF_ZERO and LRU): bit-identical, with real matches.

megatron's Mamba Triton kernels run under Triton's interpreter, which Triton reads when it is first
imported; so the run happens in a fresh interpreter with ``TRITON_INTERPRET=1`` and
``MAMBA_DETERMINISTIC=1`` (the pytest process may have imported Triton already). That subprocess
also counts megatron-core's Mamba state restores (``MambaSlotAllocator.restore_to_live``, where the
release has it) by wrapping the class method, and its Mamba snapshot commits (snapshots wanted,
free slots, snapshots kept) and slot pools. About 100 s on 2 busy cores (0.19.2).

Two cases: ``hybrid_tiny`` (Mamba chunk 16, a restore at the block-aligned end of a 48-token prompt)
and ``hybrid_chunk256`` (fault H4: Mamba chunk 256; unpatched 0.17 / 0.18 snapshot r0's state at
token 128, off the chunk grid, and r1 restores it: 128 tokens skipped, r1's log-probs differ; with
the fix no snapshot there, nothing skipped, bit-identical). About 50 s of CPU time each (0.18.2).
And fault H1's trigger, ``hybrid_clamp`` (the >= 2-token clamp and the Mamba restore, below), and
fault H7's, ``hybrid_mid_restore`` (a mid-prompt snapshot restored 2 tokens before the prompt's end),
and fault H6's, ``hybrid_slot_exhaustion`` (a Mamba slot pool held by live requests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext import mcore

#: As in unit_tests/conftest.py: run against the released code, without the runtime patches.
UNPATCHED = os.environ.get("MEGATRON_EXT_TEST_UNPATCHED", "") == "1"

REPO = Path(__file__).resolve().parents[1]
CASES = REPO / "functional_tests" / "cases"

#: Runs in the subprocess: count restore_to_live results, run ab, print one JSON line.
_RUNNER = r"""
import functools, json, sys
from megatron_ext import mcore
from megatron_ext.harness.ab import run_ab
from megatron_ext.harness.cases import load_case

restores = {"ok": 0, "failed": 0, "observable": False}
try:
    allocator = mcore.import_module("megatron.core.inference.contexts.mamba_slot_allocator").MambaSlotAllocator
except (ImportError, AttributeError):
    allocator = None
if allocator is not None and hasattr(allocator, "restore_to_live"):
    original = allocator.restore_to_live
    @functools.wraps(original)  # patches fingerprint restore_to_live: inspect reads the original
    def counted(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        restores["ok" if result else "failed"] += 1
        return result
    allocator.restore_to_live = counted
    restores["observable"] = True
# Mamba snapshot commits (H6): per commit the snapshots wanted, the free slots before, the kept
# ones (registered); and every slot allocator built, read at the end
commits, allocators = [], []
if allocator is not None:
    init, collect, register = allocator.__init__, allocator._collect_commit_data, allocator.register_block_hashes_batch
    @functools.wraps(init)
    def recorded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        allocators.append(self)
    @functools.wraps(collect)  # patches fingerprint it: inspect reads the original
    def counted_collect(self):
        data = collect(self)
        if data is not None:
            commits.append({"wanted": len(data[0]) + len(data[2]), "free": self.free_count, "kept": 0})
        return data
    @functools.wraps(register)
    def counted_register(self, block_ids, *args, **kwargs):
        commits[-1]["kept"] = len(block_ids)
        return register(self, block_ids, *args, **kwargs)
    allocator.__init__, allocator._collect_commit_data = recorded_init, counted_collect
    allocator.register_block_hashes_batch = counted_register
result = run_ab(load_case(sys.argv[1]), patched=sys.argv[2] == "patched")
out = result.as_json()
print("RESULT " + json.dumps({
    "failures": result.failures(), "bit_identical": result.bit_identical,
    "invariant": result.invariance[0], "self_check": out["batch_invariance_check"],
    "errors": [run.error for run in result.runs],
    "policies": {p.policy: {"blocks_matched": p.run.counters.blocks_matched,
                            "skipped": p.run.counters.prefill_tokens_skipped} for p in result.policies},
    "tokens": [[o["tokens"] for o in run["outputs"].values()] for run in [out["baseline"]] + [p["run"] for p in out["policies"]]],
    "restores": restores, "mamba_commits": commits,
    "mamba_slots": [{"max": a.max_slots, "free": a.free_count, "mapped": int((a.slot_to_block >= 0).sum())}
                    for a in allocators],
    "wall_s": result.wall_s}))
"""


@pytest.mark.slow
@pytest.mark.breadth  # the shipped hybrid cases (test_hybrid_cases) check restores under every release
@pytest.mark.parametrize("case, min_blocks, skipped, restores", [
    # r1 resumes r0's Mamba state at token 48: one restore per policy
    ("hybrid_tiny", 3, (48, None), (2, None)),
    # r1 matches r0's 8 complete blocks; no Mamba snapshot on the chunk-256 grid among them (H4)
    ("hybrid_chunk256", 8, (0, 0), (0, 0)),
])
def test_hybrid_prefix_caching_is_bit_identical_with_matches(case, min_blocks, skipped, restores):
    result = run_case(case)
    assert result["invariant"]
    # ab's JSON: the self-check covered megatron's Mamba kernels too, in the case's dtypes
    assert result["self_check"]["ok"] is True
    assert result["self_check"]["detail"].endswith(
        "float32 activations, float32 SSM states, float32 conv states) batch-invariant: 18 cases bit-identical")
    assert result["errors"] == [None, None, None]
    assert result["failures"] == []
    assert result["bit_identical"]
    baseline, *with_caching = result["tokens"]
    assert all(len(tokens) > 0 for tokens in baseline)
    assert all(tokens == baseline for tokens in with_caching)
    assert set(result["policies"]) == {"ref_zero", "lru"}
    for policy, counts in result["policies"].items():
        assert counts["blocks_matched"] >= min_blocks, (policy, counts)
        assert within(counts["skipped"], skipped), (policy, counts)
    if result["restores"]["observable"]:
        assert within(result["restores"]["ok"], restores), result["restores"]
        assert result["restores"]["failed"] == 0, result["restores"]


def within(value: int, bounds: tuple[int, int | None]) -> bool:
    """``low <= value <= high``; ``high`` None: no upper bound."""
    low, high = bounds
    return low <= value and (high is None or value <= high)


def run_case(case: str, patched: bool = True, env: dict[str, str] | None = None) -> dict:
    """Run ``cases/<case>.yaml`` through ``run_ab`` in a fresh interpreter (Triton's interpreter
    on); the subprocess's one JSON line. ``patched``: with megatron-ext's runtime patches (else
    none); ``env``: more environment variables (``MEGATRON_EXT_SKIP``)."""
    env = {**os.environ, **(env or {}), "TRITON_INTERPRET": "1", "MAMBA_DETERMINISTIC": "1"}
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(CASES / f"{case}.yaml"),
                           "patched" if patched else "unpatched"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def bit_identical_single_policy(result: dict, policy: str) -> tuple[dict, list]:
    """Assert a one-policy case ran without errors and caching on equals caching off bit for bit;
    returns ``(that policy's counters, the caching-off tokens per request)``."""
    assert result["invariant"]
    assert result["errors"] == [None, None]
    counts = result["policies"][policy]
    assert result["bit_identical"] and result["failures"] == [], (result["restores"], counts, result["failures"])
    baseline, with_caching = result["tokens"]
    assert with_caching == baseline
    return counts, baseline


#: hybrid_clamp, patched: r1's prefill tokens skipped per release series (0.17 has no clamp: the
#: 1-token chunk after the snapshot at 32; 0.18/0.19: no snapshot at or before the clamped 16).
CLAMP_SKIPPED = {"0.17": 32, "0.18": 0, "0.19": 0}

@pytest.mark.slow
def test_clamped_skip_keeps_the_mamba_restore_consistent():
    """Fault H1: r1 (r0's first 33 tokens) must not skip tokens whose Mamba state is not restored.
    With ``MEGATRON_EXT_TEST_UNPATCHED=1`` on 0.18.x and 0.19.x the restore fails while 16 tokens
    stay skipped and r1 differs from caching off. On 0.17 (no clamp) r1 restores r0's snapshot at
    token 32 and computes 1 token: exact only with fault H7 fixed (``mamba-conv-carry``).
    About 60 s on one core (0.19.2)."""
    result = run_case("hybrid_clamp", patched=not UNPATCHED)
    counts, baseline = bit_identical_single_policy(result, "ref_zero")
    assert all(len(tokens) == 4 for tokens in baseline)
    assert counts["blocks_matched"] == 2, counts  # r1 matches r0's first two blocks
    if result["restores"]["observable"]:
        # a failed restore means tokens were skipped whose Mamba state is not there
        assert result["restores"]["failed"] == 0, result["restores"]
    assert counts["skipped"] == CLAMP_SKIPPED[mcore.release_series(mcore.installed_version())], counts


@pytest.mark.slow
def test_restored_mid_prompt_snapshot_is_bit_identical():
    """Fault H7: r1 (r0's first 34 tokens) restores r0's Mamba snapshot at token 32, mid-prompt,
    and computes 2 tokens; its conv state must keep tokens 31-32. With
    ``MEGATRON_EXT_TEST_UNPATCHED=1``: 0.19.x restores and r1 differs from caching off; 0.17.x /
    0.18.x take no snapshot at 32 (fault H4), skip nothing and fail the skip count. About 60 s
    on one core (0.19.2)."""
    result = run_case("hybrid_mid_restore", patched=not UNPATCHED)
    counts, baseline = bit_identical_single_policy(result, "ref_zero")
    assert all(len(tokens) == 4 for tokens in baseline)
    assert counts["blocks_matched"] == 2, counts  # r0's first two blocks
    assert counts["skipped"] == 32, counts  # restored at the snapshot of token 32
    if result["restores"]["observable"]:
        assert result["restores"] == {"ok": 1, "failed": 0, "observable": True}, result["restores"]


@pytest.mark.slow
def test_continuation_chunk_skip_is_bit_identical():
    """Fault H8: with chunked prefill, r1's second chunk starts inside r0's cached blocks; it must
    not skip them (no Mamba state is restored after the first chunk). With
    ``MEGATRON_EXT_TEST_UNPATCHED=1`` (or ``MEGATRON_EXT_SKIP=mamba-continuation-skip``) r1
    differs from caching off on every release. About 70 s on one core (0.19.2)."""
    result = run_case("hybrid_chunked_skip", patched=not UNPATCHED)
    counts, baseline = bit_identical_single_policy(result, "lru")
    assert [len(tokens) for tokens in baseline] == [2, 1, 4]
    assert counts["blocks_matched"] >= 5, counts  # r1 matches r0's first blocks over two chunks
    if result["restores"]["observable"]:
        assert result["restores"]["failed"] == 0, result["restores"]


#: hybrid_slot_exhaustion (fault H6): Mamba cache slots (0.19 reserves 4 of the budget's 5 for
#: its per-step scratch), and per commit (step 0, 1, 2) the snapshots wanted, free slots, kept.
SLOT_EXHAUSTION = {
    "0.17": (5, [(4, 5, 4), (2, 1, 1), (1, 0, 0)]),
    "0.18": (5, [(4, 5, 4), (2, 1, 1), (1, 0, 0)]),
    "0.19": (1, [(4, 1, 1), (2, 0, 0), (1, 0, 0)]),
}
#: ... and released (MEGATRON_EXT_SKIP=mamba-slot-exhaustion): the step that raises, the commits
#: up to it, and (free, mapped) slots after it: one slot taken from the free pool, mapped to no block.
SLOT_EXHAUSTION_RELEASED = {
    "0.17": (1, [(4, 5, 4), (2, 1, 0)], (0, 4)),
    "0.18": (1, [(4, 5, 4), (2, 1, 0)], (0, 4)),
    "0.19": (0, [(4, 1, 0)], (0, 0)),
}


def commit_counts(result: dict) -> list[tuple[int, int, int]]:
    return [(c["wanted"], c["free"], c["kept"]) for c in result["mamba_commits"]]


@pytest.mark.slow
def test_exhausted_mamba_slot_pool_drops_snapshots_and_leaks_nothing():
    """Fault H6: one-block prompts want more Mamba snapshots than the slots not held by live
    requests (step 0 on 0.19, step 1 on 0.17 / 0.18). Patched, the commit keeps what fits, r6
    restores the kept snapshot of r0 and caching on vs off is bit-identical; at the end every slot
    is free again (REF_ZERO released each block). With ``MEGATRON_EXT_TEST_UNPATCHED=1`` the step
    raises "No evictable Mamba cache slots available" on 0.17.x-0.19.x. About 50-70 s on one
    core."""
    result = run_case("hybrid_slot_exhaustion", patched=not UNPATCHED)
    counts, baseline = bit_identical_single_policy(result, "ref_zero")
    assert [len(tokens) for tokens in baseline] == [4, 4, 4, 4, 4, 4, 2]
    assert counts == {"blocks_matched": 1, "skipped": 16}, counts  # r6 on r0's block
    if result["restores"]["observable"]:
        assert result["restores"] == {"ok": 1, "failed": 0, "observable": True}, result["restores"]
    slots, commits = SLOT_EXHAUSTION[mcore.release_series(mcore.installed_version())]
    assert commit_counts(result) == commits
    assert result["mamba_slots"] == [{"max": slots, "free": slots, "mapped": 0}]  # none leaked


@pytest.mark.slow
def test_exhausted_mamba_slot_pool_fails_the_step_without_the_fix():
    """The same case with ``MEGATRON_EXT_SKIP=mamba-slot-exhaustion`` (or unpatched): the released
    ``allocate_slots_batch`` takes the one free slot, ``_evict_lru_slots_batch`` finds nothing
    evictable and raises out of the engine step; that slot is neither free nor mapped. Shows the
    fault on the installed release; passes patched and unpatched. About 30-40 s on one core."""
    result = run_case("hybrid_slot_exhaustion", patched=not UNPATCHED,
                      env={"MEGATRON_EXT_SKIP": "mamba-slot-exhaustion"})
    step, commits, (free, mapped) = SLOT_EXHAUSTION_RELEASED[mcore.release_series(mcore.installed_version())]
    baseline_error, error = result["errors"]
    assert baseline_error is None
    assert error.startswith(f"step {step}: RuntimeError: No evictable Mamba cache slots available "
                            "(in _evict_lru_slots_batch, "), error
    assert commit_counts(result) == commits
    slots = SLOT_EXHAUSTION[mcore.release_series(mcore.installed_version())][0]
    assert result["mamba_slots"] == [{"max": slots, "free": free, "mapped": mapped}]
    assert free + mapped == slots - 1  # the leaked slot
