"""Cases with weight updates between rounds, through megatron-core's engine on the CPU.

``rl_weight_update`` (shipped: ``test_ab_cases`` runs it patched on every release) must fail with
``MEGATRON_EXT_ON_WEIGHT_UPDATE=keep``: the stale-hit audit counts the matches of KV the old weights
computed and the requests admitted after an update differ from caching off. A perturbation without
suspend/resume passes through ``megatron_ext.invalidate_prefix_cache``; the same case with ``keep``
or unpatched fails. A ``checkpoint`` update loads a second checkpoint at the update.
"""

from __future__ import annotations

import json

import pytest

import megatron_ext
from megatron_ext.cpu_backend import cpu_backend
from megatron_ext.harness.ab import run_ab
from megatron_ext.harness.cases import load_case, parse_case
from megatron_ext.harness.checkpoint import save_checkpoint
from megatron_ext.harness.engine import build_model, ensure_model_parallel
from megatron_ext.harness.recorded import compare_recorded, pair_runs
from megatron_ext.harness.report import spanning_versions
from megatron_ext.harness.soak import soak_case, soak_lines, soak_summary
from megatron_ext.harness.weight_updates import weights_sha256

#: A perturbation at step 7 without suspend/resume: request r0 (alone at step 0) is still decoding
#: across it; r1's two samples finish before it; r2's two samples ask the same prompt afterwards.
PERTURB = """
name: perturb_invalidate
model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, params_dtype: bf16, seed: 1234, init_method_std: 0.1}
inference: {block_size_tokens: 16, buffer_size_gb: 0.002, max_requests: 16, max_tokens: 256, max_sequence_length: 256}
prefix_caching_eviction_policies: [ref_zero, lru]
weight_updates: {kind: perturb, update_at_steps: [7], perturb_scale: 0.02, seed: 3}
requests:
  - {prompt: "Summarize why the sky looks blue during the day.", num_tokens_to_generate: 12}
  - {prompt: "Summarize why the sky looks blue during the day.", samples: 2, arrival_step: 1, num_tokens_to_generate: 4}
  - {prompt: "Summarize why the sky looks blue during the day.", samples: 2, round: 1, num_tokens_to_generate: 4}
"""


#: Stale hits of ``rl_weight_update`` with ``keep``, per release series (measured).
RL_KEEP_STALE_HITS = {"0.17": {"ref_zero": 11, "lru": 28}, "0.18": {"ref_zero": 11, "lru": 28},
                      "0.19": {"ref_zero": 12, "lru": 30}}


@pytest.fixture
def keep(monkeypatch):
    """``MEGATRON_EXT_ON_WEIGHT_UPDATE=keep`` for one test: patches applied by an earlier test are
    reverted first (``apply()`` keeps what is applied), and again afterwards."""
    megatron_ext.revert()
    monkeypatch.setenv("MEGATRON_EXT_ON_WEIGHT_UPDATE", "keep")
    yield
    megatron_ext.revert()


def differing(result) -> dict[str, list[tuple[str, bool]]]:
    """Policy -> (label, tokens equal) of each request that differs from caching off."""
    return {p.policy: [(d.label, d.tokens_equal) for d in p.diffs if not d.identical] for p in result.policies}


@pytest.mark.slow
@pytest.mark.every_tree
def test_rl_weight_update_keep_has_stale_hits_and_differs(keep, mcore_series):
    result = run_ab(load_case("rl_weight_update"), patched=True)
    state = {p["patch"]: p["state"] for p in result.patches}
    assert state["weight-update-invalidation"] == "not applied"
    stale = {p.policy: p.run.audit.stale_hits for p in result.policies}
    # round 1's samples match the system prompt held by the rollout in flight (REF_ZERO and LRU);
    # under LRU round 2 also matches round 0's cached blocks
    assert stale == RL_KEEP_STALE_HITS[mcore_series]
    assert result.baseline.audit.stale_hits == 0
    round_1 = [(f"r2.s{i}", False) for i in range(4)]  # new tokens, not just log-prob bits
    assert differing(result)["ref_zero"][:4] == round_1
    assert differing(result)["lru"][:4] == round_1
    failures = result.failures()
    assert failures[0] == (f"fault 8 (weight-update-invalidation): {sum(stale.values())} stale hits: requests "
                           "admitted after a weight update matched KV blocks cached under older weights")
    assert result.exit_code() == 1
    for run in result.runs:  # same updates at the same steps, the in-flight rollout at the same token
        assert [(u.index, u.step, u.in_flight, u.invalidation) for u in run.updates] == [
            (1, 16, [0], "resume"), (2, 34, [], "resume")]
        assert run.updates[0].in_flight_tokens == {0: 76 + 15}  # its prompt + 15 generated tokens
        assert run.updates[0].trained_on == [1, 2, 3, 4] and run.updates[1].trained_on == [0, 5, 6, 7, 8]
        assert run.updates[0].weights_sha256 == result.baseline.updates[0].weights_sha256
    # the fresh engines on each version's weights: caching off agrees with them; the stale hits do not:
    # round 1's samples under both policies, under LRU round 2's requests that matched round 0's blocks too
    baseline, ref_zero, lru = result.post_update_reference.runs
    assert (len(baseline.compared), baseline.tokens_compared, baseline.differing, baseline.left_out) == (12, 72, [], [0])
    round_2 = [f"r2.s{i}" for i in range(4)]
    assert ref_zero.differing == round_2
    assert lru.differing[:4] == round_2 and lru.differing[4:] and set(lru.differing[4:]) <= {
        r.label for r in result.baseline.outputs.values() if r.label[:2] in ("r3", "r4")}
    for reference in (ref_zero, lru):
        first = reference.first_difference
        assert (first.version, first.request, first.token) == (1, "r2.s0", 0)


@pytest.mark.slow
def test_perturb_with_invalidate_prefix_cache_is_bit_identical(tmp_path):
    result = run_ab(parse_case(PERTURB), patched=True)
    assert result.failures() == []
    assert result.total("stale_hits") == 0
    assert result.baseline.updates[0].invalidation == "caching off"
    for policy in result.policies:
        update = policy.run.updates[0]
        assert (update.step, update.in_flight, update.in_flight_tokens, update.invalidation) == (
            7, [0], {0: 48 + 7}, "invalidated")
        # r0 still holds the prompt's three blocks (r1's samples matched them): unhashed; no block
        # sits cached at ref count 0, so none is freed
        assert (update.blocks_unreachable, update.blocks_freed) == (3, 0)
    assert len({u.weights_sha256 for run in result.runs for u in run.updates}) == 1
    # r1's and r2's samples equal fresh engines on versions 0 and 1 bit for bit; r0 spans both
    assert result.post_update_reference.as_json() == {
        "checked": True, "why_not": None, "weight_versions": 2, "passed": True,
        "runs": [{"run": run.label, "requests_compared": 4, "tokens_compared": 16,
                  "left_out_in_flight_across_an_update": 1, "max_abs_diff": 0.0, "requests_differing": [],
                  "first_difference": None} for run in result.runs]}
    # per generated token, the weight version of its logits and the oldest of its KV prefix: r0 is
    # in flight across the update (7 tokens before it), r1 finished before it, r2 came after it
    for run in result.runs:
        versions = {o.label: o.weight_versions for o in run.outputs.values()}
        assert versions["r0.s0"] == {"logits": [0] * 7 + [1] * 5, "kv_prefix": [0] * 12}
        assert versions["r1.s0"] == versions["r1.s1"] == {"logits": [0] * 4, "kv_prefix": [0] * 4}
        assert versions["r2.s0"] == versions["r2.s1"] == {"logits": [1] * 4, "kv_prefix": [1] * 4}
    assert spanning_versions(result).splitlines()[0] == "A: caching off: tokens spanning weight versions: r0.s0 (v0-1)"
    # the JSON keeps what compare reads, plus rounds and stale hits
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(result.as_json()))
    data = json.loads(path.read_text())
    assert data["stale_hits"] == 0 and data["weight_updates"]["update_at_steps"] == [7]
    assert [r["round"] for r in data["requests"]] == [0, 0, 0, 1, 1]
    assert data["policies"][1]["run"]["updates"][0]["invalidation"] == "invalidated"
    assert data["policies"][1]["run"]["outputs"]["0"]["weight_versions"]["logits"] == [0] * 7 + [1] * 5
    comparison = compare_recorded(*pair_runs(f"{path}:off", f"{path}:lru")[0])
    assert comparison.bit_identical


@pytest.mark.slow
@pytest.mark.parametrize("how", ["keep", "unpatched"])
@pytest.mark.every_tree
def test_perturb_without_invalidation_has_stale_hits(how, request):
    if how == "keep":
        request.getfixturevalue("keep")
    result = run_ab(parse_case(PERTURB), patched=how == "keep")
    assert {p.policy: p.run.audit.stale_hits for p in result.policies} == {"ref_zero": 6, "lru": 6}
    after_update = [("r2.s0", False), ("r2.s1", False)]
    if how == "keep":
        assert differing(result) == {"ref_zero": after_update, "lru": after_update}
    else:  # unpatched, fault 2 also changes r0's log-prob bits (r1's samples rewrote its blocks)
        assert differing(result) == {"ref_zero": [("r0.s0", True), *after_update],
                                     "lru": [("r0.s0", True), *after_update]}
    expected = "kept" if how == "keep" else "patch not applied"
    assert [p.run.updates[0].invalidation for p in result.policies] == [expected, expected]
    assert result.exit_code() == 1


@pytest.mark.slow
def test_checkpoint_update_loads_the_second_checkpoint(tmp_path):
    case = parse_case(PERTURB.replace("{kind: perturb, update_at_steps: [7], perturb_scale: 0.02, seed: 3}",
                                      "{kind: checkpoint, update_at_steps: [7]}"))
    other = case.model_copy(update={"model": case.model.model_copy(update={"seed": 4321})})
    with cpu_backend():
        ensure_model_parallel()
        model = build_model(other)
        save_checkpoint(model, tmp_path / "b")
        digest = weights_sha256(model)
    result = run_ab(case, patched=True, update_from=[tmp_path / "b"])
    assert result.failures() == []
    assert [u.weights_sha256 for run in result.runs for u in run.updates] == [digest] * 3
    assert result.as_json()["weight_updates"]["checkpoints"] == [str(tmp_path / "b")]


#: ``soak --requests 40 --seed 0 --update-every 10 --policy lru`` per release series (measured):
#: requests left out (updated at another token with caching on), (unreachable, freed) blocks per
#: invalidation; with keep: stale hits and requests that differ.
SOAK_COUNTS = {"0.17": {"left_out": 10, "invalidations": [(3, 12), (6, 4)], "keep_stale": 25, "keep_differ": 16},
               "0.18": {"left_out": 10, "invalidations": [(3, 12), (6, 4)], "keep_stale": 25, "keep_differ": 16},
               "0.19": {"left_out": 14, "invalidations": [(3, 12), (14, 6)], "keep_stale": 6, "keep_differ": 18}}


@pytest.mark.slow
def test_soak_update_every_passes_patched_leaving_out_requests_updated_at_other_tokens(mcore_series):
    expected = SOAK_COUNTS[mcore_series]
    result = run_ab(soak_case(40, seed=0, policies=("lru",), update_every=10), patched=True)
    assert result.failures() == []
    run = result.policies[0].run
    assert [(u.index, u.step, u.invalidation) for u in run.updates] == [(1, 10, "invalidated"), (2, 20, "invalidated")]
    assert [(u.blocks_unreachable, u.blocks_freed) for u in run.updates] == expected["invalidations"]
    assert result.total("stale_hits") == 0
    left_out = result.left_out(result.policies[0])
    differ = [d.request_id for d in result.policies[0].diffs if not d.identical]
    assert len(left_out) == expected["left_out"] and set(differ) <= set(left_out)  # the other 30: bit-identical
    # every request not in flight across an update equals fresh engines on its weights (3 versions)
    summary = soak_summary(result)
    reference = summary["post_update_reference"]
    assert (reference["passed"], reference["weight_versions"]) == (True, 3)
    assert all(r["requests_compared"] + r["left_out_in_flight_across_an_update"] == 40 for r in reference["runs"])
    assert soak_lines(summary)[-1].startswith("soak post-update reference: ")
    assert soak_lines(summary)[-1].endswith(" weight versions, 0 differing, max |Δ log-prob| 0")


@pytest.mark.slow
def test_soak_update_every_with_keep_has_stale_hits(keep, mcore_series):
    expected = SOAK_COUNTS[mcore_series]
    result = run_ab(soak_case(40, seed=0, policies=("lru",), update_every=10), patched=True)
    policy = result.policies[0]
    assert policy.run.audit.stale_hits == expected["keep_stale"]
    assert sum(not d.identical for d in policy.diffs) == expected["keep_differ"]
    assert [u.invalidation for u in policy.run.updates] == ["kept", "kept"]
    assert result.exit_code() == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["offload", "recompute"])
def test_rl_weight_update_runs_with_each_cpu_kv_cache_management_mode(mode):
    """suspend()/resume() with the other modes on the CPU backend (persist: the shipped case)."""
    case = load_case("rl_weight_update")
    updates = case.weight_updates.model_copy(update={"kv_cache_management_mode": mode})
    result = run_ab(case.model_copy(update={"weight_updates": updates, "prefix_caching_eviction_policies": ["lru"]}),
                    patched=True)
    assert result.failures() == []
    assert result.total("stale_hits") == 0
    assert [(u.step, u.in_flight, u.invalidation) for u in result.policies[0].run.updates] == [
        (16, [0], "resume"), (34, [], "resume")]
