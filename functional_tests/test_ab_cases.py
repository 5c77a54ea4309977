"""Every shipped case through megatron-core's own dynamic inference engine on the CPU.

Patched: prefix caching on vs off is bit-identical and every audit holds. Unpatched: the audits
must catch the faults each release has (they are only trustworthy if they fire).
"""

from __future__ import annotations

import pytest

import megatron_ext
from functional_tests.conftest import NEEDED_FIXES
from megatron_ext.harness.ab import run_ab
from megatron_ext.harness.cases import load_case, shipped_cases

#: The LRU fixes whose faults ``lru_pressure`` reaches, with what shows in the verdict when only
#: that fix is left out (MEGATRON_EXT_SKIP): all three on 0.17 / 0.18, fault 6's on 0.19; none
#: on Megatron-LM main 2a75ac12c5 (fault 6 fixed by #5995, 3 and 4 by #5822).
LRU_FIX_FAULTS = {"lru-leaf-first-eviction": "fault 3 (lru-leaf-first-eviction)",
                  "lru-pin-before-allocate": "fault 4 (lru-pin-before-allocate)",
                  "lru-resume-evictable": "active_request_count == 0 with no hidden chunked prefill"}
#: Those the installed code needs (decided by its code: ``status()``).
LRU_FIXES = sorted(fix for fix in LRU_FIX_FAULTS if fix in NEEDED_FIXES)


#: The shipped GPT cases. The hybrid ones (``hybrid_*``) need Triton's interpreter from process
#: start, which this process cannot promise (Triton may be imported already): they run in a fresh
#: interpreter in ``functional_tests/test_hybrid_cases.py``. The multi-latent attention cases
#: (``mla_tiny``, ``mla_yarn_tiny``) run on 0.18+ only: ``functional_tests/test_mla.py``.
#: The speculative-decoding ones run in a fresh interpreter too the speculative-decoding ones
#: (megatron-core's Triton MTP kernels), in ``functional_tests/test_mtp_speculative.py``.
GPT_CASES = [name for name in shipped_cases()
             if not load_case(name).model.is_hybrid and not load_case(name).model.multi_latent_attention
             and not load_case(name).inference.num_speculative_tokens]


#: The default case and the weight-update case also run under Megatron-LM 2a75ac12c5 in .ci/run.
EVERY_TREE_CASES = ("rl_rollouts", "rl_weight_update")


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.every_tree) if name in EVERY_TREE_CASES
                                  else name for name in GPT_CASES])
def test_case_patched_is_bit_identical_and_audit_clean(name):
    result = run_ab(load_case(name), patched=True)
    assert result.invariance[0], result.invariance[1]
    assert result.failures() == []
    assert result.bit_identical
    assert result.total("kv_write_violations") == 0
    assert result.total("refcount_violations") == 0
    assert result.total("lru_violations") == 0
    assert all(run.error is None for run in result.runs)
    assert all(p.run.counters.prefill_tokens_skipped > 0 for p in result.policies)
    for run in result.runs:  # chunked_prefill records top-n: one entry per generated token (fix 7)
        for output in run.outputs.values():
            assert output.top_n_logprobs is None or len(output.top_n_logprobs) == len(output.tokens)


@pytest.mark.slow
@pytest.mark.skipif(not LRU_FIXES, reason="the installed code needs no LRU fix; "
                    "test_lru_pressure_unpatched_fails_with_the_lru_faults_of_this_tree checks none shows")
@pytest.mark.parametrize("fix", LRU_FIXES)
@pytest.mark.every_tree
def test_lru_pressure_reaches_the_fault_of_each_lru_fix(fix, monkeypatch):
    """All runtime patches but ``fix``: the case must fail with that fix's fault."""
    megatron_ext.revert()
    monkeypatch.setenv("MEGATRON_EXT_SKIP", fix)
    try:
        result = run_ab(load_case("lru_pressure"), patched=True)
    finally:
        megatron_ext.revert()
    skipped = next(p for p in result.patches if p["patch"] == fix)
    assert skipped["state"] == "not applied"
    assert LRU_FIX_FAULTS[fix] in " ".join(result.failures())
    assert result.exit_code() == 1


@pytest.mark.slow
@pytest.mark.every_tree
def test_lru_pressure_unpatched_fails_with_the_lru_faults_of_this_tree():
    result = run_ab(load_case("lru_pressure"), patched=False)
    failures = " ".join(result.failures())
    # fault 6 (step 10) and fault 3 show exactly where the code needs their fix (fault 4 hides
    # behind them unpatched: its test is the one above)
    for fix in ("lru-resume-evictable", "lru-leaf-first-eviction"):
        assert (LRU_FIX_FAULTS[fix] in failures) == (fix in NEEDED_FIXES), (fix, failures)
    if not LRU_FIXES:  # Megatron-LM main: only fault 2 is left (one write into a matched block)
        assert [f.split(":")[0] for f in result.failures()] == ["fault 2 (matched-block-writes)"]
        assert result.bit_identical
    assert result.exit_code() == 1


@pytest.mark.slow
@pytest.mark.every_tree
def test_unpatched_audits_catch_the_faults_of_this_release(mcore_series):
    result = run_ab(load_case("rl_rollouts"), patched=False)
    assert result.total("kv_write_violations") > 0  # fix 2's fault: every release up to 0.19.2
    failures = " ".join(result.failures())
    assert "fault 2 (matched-block-writes)" in failures
    if "release-refcount" in NEEDED_FIXES:  # 0.17, 0.18
        assert result.total("refcount_violations") > 0  # fix 1's leak
        assert "fault 1 (release-refcount)" in failures
        leaked = [v for p in result.policies for v in p.run.audit.examples.get("drain", [])]
        assert leaked, "the leak must be visible at drain"
    else:
        assert result.total("refcount_violations") == 0
    assert result.exit_code() == 1


@pytest.mark.slow
@pytest.mark.every_tree
def test_chunked_prefill_top_n_fails_without_fix_7(monkeypatch, mcore_series):
    """All runtime patches but ``top-n-prefill-chunks`` (caching off vs REF_ZERO): tokens and
    log-probs stay bit-identical, but every top-n list carries one entry per non-final prefill
    chunk more than tokens. 0.19 takes fewer chunks for cached prompts, so caching on vs off
    differ there too; 0.17/0.18 count a skipped prefix into the first chunk (same chunks, both
    runs equally wrong): the top-n count check fails the verdict on every release."""
    megatron_ext.revert()
    monkeypatch.setenv("MEGATRON_EXT_SKIP", "top-n-prefill-chunks")
    case = load_case("chunked_prefill").model_copy(update={"prefix_caching_eviction_policies": ["ref_zero"]})
    try:
        result = run_ab(case, patched=True)
    finally:
        megatron_ext.revert()
    assert next(p for p in result.patches if p["patch"] == "top-n-prefill-chunks")["state"] == "not applied"
    (policy,) = result.policies
    assert all(d.tokens_equal and d.log_probs_equal for d in policy.diffs)
    assert any(d.top_n_logprobs_equal is False for d in policy.diffs) == (mcore_series == "0.19")
    for output in result.baseline.outputs.values():  # prompts of 92-230 bytes in chunks of <= 64
        assert len(output.top_n_logprobs) > len(output.tokens) == 6
    failures = " ".join(result.failures())
    assert "fault 7 (top-n-prefill-chunks): run caching off: 4 requests" in failures
    assert result.exit_code() == 1
