"""``ab --trainer-logprobs`` through megatron-core's engine and training forward on the CPU backend.

``matched``: the training forward's log-probs equal the engine's bit for bit in every run (caching
off and on), bf16 and fp32, and across a weight update (requests in flight across it left out and
counted). One float32 ulp in the trainer forward (a weight) or in the engine (its decode attention's
softmax scale) fails the verdict, naming the request and token. An exception inside the trainer
forward is named as the trainer's. ``megatron``: megatron-core's own training forward (torch's
kernels) is reported, never failed.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from functional_tests.conftest import REPO
from megatron_ext import cli
from megatron_ext.cpu_backend import attention
from megatron_ext.harness import trainer_logprobs
from megatron_ext.harness.ab import run_ab
from megatron_ext.harness.cases import load_case
from megatron_ext.harness.report import print_report

TINY = Path(__file__).parent / "cases" / "trainer_tiny.yaml"
#: trainer_tiny in fp32 with a perturb update at step 3: r0.s0 and r1.s0 in flight across it
UPDATE_TINY = Path(__file__).parent / "cases" / "trainer_update_tiny.yaml"
RUNS = ("A: caching off", "B: caching on, ref_zero", "B: caching on, lru")


def _tiny(dtype: str = "bf16"):
    case = load_case(str(TINY))
    return case.model_copy(update={"model": case.model.model_copy(update={"params_dtype": dtype})})


def _report(result) -> str:
    console = Console(width=10_000, record=True, file=io.StringIO())
    print_report(result, console)
    return console.export_text()


def test_default_case_matched_is_bit_identical_caching_on_and_off(tmp_path, capfd):
    out = tmp_path / "ab.json"
    assert cli.main(["ab", "--trainer-logprobs", "--json", str(out), "--no-progress"]) == 0
    assert ("trainer log-probs (matched) bit-identical to the engine's in all 336 compared tokens of 3 runs (left "
            "out, in flight across a weight update: 0 requests, 0 tokens)") in capfd.readouterr().out
    written = json.loads(out.read_text())
    identical = {"tokens": 112, "bit_identical_tokens": 112, "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "k3_kl": 0.0,
                 "left_out_requests": 0, "left_out_tokens": 0, "routing_replayed": False}
    assert written["trainer_logprobs"] == {run: identical for run in RUNS}  # 14 requests x 8 tokens per run
    detail = written["trainer_logprobs_detail"]
    assert detail["mode"] == "matched" and list(detail["seconds"]) == list(RUNS)
    for run in RUNS:  # the trainer's values are the engine's, request by request
        engine = {rid: o["log_probs"] for rid, o in
                  (written["baseline"] if run == RUNS[0] else
                   next(p["run"] for p in written["policies"] if run.endswith(p["eviction_policy"])))["outputs"].items()}
        assert {str(r["request_id"]): r["trainer"] for r in detail["requests"][run]} == engine


def test_in_flight_across_an_update_left_out_and_counted_the_rest_matched_in_fp32():
    """Each run: r2.s0 (1 token, before the update) and r3.s0 (round 1, after it) compared with their
    own weights, bit for bit; r0.s0 (6 tokens) and r1.s0 (3: it generated the end-of-document token)
    decoding across the update are left out, in the JSON summary and the PASS line."""
    result = run_ab(load_case(str(UPDATE_TINY)), trainer_logprobs="matched")
    assert result.failures() == []
    figures = {"tokens": 7, "bit_identical_tokens": 7, "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "k3_kl": 0.0,
               "left_out_requests": 2, "left_out_tokens": 9, "routing_replayed": False}
    assert result.as_json()["trainer_logprobs"] == {run: figures for run in RUNS[:2]}
    assert result.as_json()["trainer_logprobs_detail"]["left_out"] == {run: [0, 1] for run in RUNS[:2]}
    assert [r.label for r in result.trainer_logprobs.runs[0].requests] == ["r2.s0", "r3.s0"]
    assert ("trainer log-probs (matched) bit-identical to the engine's in all 14 compared tokens of 2 runs (left out, "
            "in flight across a weight update: 4 requests, 18 tokens); every audit holds") in _report(result)


def test_an_exception_in_the_trainer_forward_is_named_as_the_trainers(monkeypatch):
    """Raised inside megatron-core's training forward (its core attention), before the weight
    update, inside the engine's step loop: the verdict names the trainer forward, not megatron-core's
    engine, which ran on (the update made, the outputs of caching on and off equal)."""
    def broken(*args, **kwargs):
        raise RuntimeError("trainer attention broke")

    monkeypatch.setattr(attention, "full_sequence_attention", broken)
    result = run_ab(load_case(str(UPDATE_TINY)), trainer_logprobs="matched")
    assert result.exit_code() == 1 and all(run.error is None and len(run.updates) == 1 for run in result.runs)
    assert result.policies[0].bit_identical
    assert [f.split(" (in ")[0] for f in result.failures()] == [
        f"trainer vs engine log-probs (matched): {run}: the trainer forward (the model's training forward that "
        "--trainer-logprobs runs, not the engine) raised before weight update 1 (engine step 3): RuntimeError: "
        "trainer attention broke" for run in RUNS[:2]]
    assert all(f.endswith("; 0 requests compared before it") and "megatron/core/" in f for f in result.failures())


def _one_ulp_up(value: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(value, torch.tensor(math.inf, dtype=value.dtype))


def _same_bits(a: float, b: float) -> bool:
    return struct.pack("<d", a) == struct.pack("<d", b)


def _identical_per_request(run) -> list[int]:
    """Bit-identical tokens of each request of ``run``, counted here from its engine and trainer values."""
    return [sum(map(_same_bits, r.engine, r.trainer)) for r in run.requests]


def _first_difference(run) -> tuple[str, int]:
    """(request label, generated token) of the first engine/trainer pair of ``run`` whose bits differ."""
    return next((r.label, k) for r in run.requests for k, (e, t) in enumerate(zip(r.engine, r.trainer))
                if not _same_bits(e, t))


@pytest.mark.parametrize("where", ["trainer", "engine"])
def test_one_float32_ulp_in_the_trainer_or_the_engine_fails_naming_request_and_token(monkeypatch, where):
    """``trainer``: one fp32 weight (layer 0's input layernorm weight[0], 1.0) one ulp up, in the
    trainer forward only. ``engine``: every element of the engine's decode attention output
    (``flash_attn_with_kvcache``'s stand-in, decode steps only) one float32 ulp up, after the kernel:
    a one-ulp softmax scale rounded away in the float32 scores on some CPUs and releases. Both fail
    matched mode, naming the first differing request and token of each run."""
    if where == "trainer":
        logits = trainer_logprobs._logits

        def perturbed_trainer(model, tokens, positions):
            weight = model.decoder.layers[0].input_layernorm.weight.data.view(-1)
            was = weight[0].clone()
            weight[0] = _one_ulp_up(was)
            try:
                return logits(model, tokens, positions)
            finally:
                weight[0] = was

        monkeypatch.setattr(trainer_logprobs, "_logits", perturbed_trainer)
    else:
        decode = attention.kvcache_attention

        def perturbed_decode(*args, **kwargs):
            out = decode(*args, **kwargs)
            return (_one_ulp_up(out[0]), *out[1:]) if isinstance(out, tuple) else _one_ulp_up(out)

        monkeypatch.setattr(attention, "kvcache_attention", perturbed_decode)
    result = run_ab(_tiny("fp32"), trainer_logprobs="matched")
    assert result.exit_code() == 1
    for run in result.trainer_logprobs.runs:
        # Which tokens one ulp reaches (if any: it may round away in a run) depends on the CPU's
        # kernels (AVX2 and AVX-512 sum in different orders): counted here from the values.
        identical = sum(_identical_per_request(run))
        assert run.tokens == 18 and run.bit_identical_tokens == identical
        if identical == 18:
            assert run.first_divergent is None and not any(f"{run.label}:" in f for f in result.failures())
            continue
        label, token = _first_difference(run)
        first = run.first_divergent
        assert (first.label, first.first_divergent_token) == (label, token)
        engine, trainer = first.engine[token], first.trainer[token]
        assert engine != trainer and abs(engine - trainer) < 1e-5  # the last bits
        assert (f"trainer vs engine log-probs (matched): {run.label}: {18 - identical} of 18 tokens differ; first: "
                f"request {label} (id {first.request_id}) generated token {token}: engine {engine!r} vs trainer "
                f"{trainer!r}") in result.failures()
    if where == "engine":  # the decode kernel only: caching off, each request's first token (its prefill) holds
        assert all(_same_bits(r.engine[0], r.trainer[0]) for r in result.trainer_logprobs.runs[0].requests)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_megatron_mode_reports_the_mismatch_and_passes(dtype):
    result = run_ab(_tiny(dtype), trainer_logprobs="megatron")
    assert result.failures() == [] and result.exit_code() == 0
    runs = result.trainer_logprobs.runs
    identical = _identical_per_request(runs[0])  # fp32: how many hold depends on the CPU's kernels
    assert sum(identical) < 18 and (dtype == "fp32" or identical == [0, 0, 0])
    for run in runs:  # caching on and off: the same tokens, the same trainer figures
        assert [r.bit_identical_tokens for r in run.requests] == _identical_per_request(run) == identical
        assert run.as_json()["max_abs_diff"] > 0.0 and run.as_json()["k3_kl"] > 0.0
    largest = max(run.max_abs_diff for run in runs)
    assert (f"trainer (megatron, for information): {2 * sum(identical)}/36 identical, max |Δ| {largest:.3g} nats "
            "(left out, in flight across a weight update: 0 requests, 0 tokens); every audit holds") in _report(result)


@pytest.mark.slow
def test_megatron_mode_runs_a_hybrid_model(tmp_path):
    """hybrid_tiny through the CLI (it starts Triton's interpreter for the Mamba kernels): the training
    forward (each Mamba layer's chunked scan, the CPU backend's causal conv1d) against the engine's
    prefill and decode steps, for information: every generated token compared in each run, the same
    figures caching off and on, the last bits apart."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_EXT_", "TRITON_", "MAMBA_"))}
    done = subprocess.run([sys.executable, "-m", "megatron_ext", "ab", "--case", "functional_tests/cases/hybrid_tiny.yaml",
                           "--trainer-logprobs", "megatron", "--no-progress", "--json", str(tmp_path / "ab.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = list(json.loads((tmp_path / "ab.json").read_text())["trainer_logprobs"].values())
    assert [f["tokens"] for f in figures] == [10, 10, 10] and all(f == figures[0] for f in figures)
    assert 0 < figures[0]["bit_identical_tokens"] < 10 and 0.0 < figures[0]["max_abs_diff"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [pytest.param(2, 1, id="tp2", marks=pytest.mark.multirank),
                                    pytest.param(1, 2, id="pp2", marks=(pytest.mark.multirank, pytest.mark.breadth))])
def test_tiny_case_matched_multi_rank(tmp_path, torchrun, tp, pp):
    """TP=2 or PP=2 (torchrun, gloo): the training forward (TP: vocabulary shards gathered; PP:
    megatron-core's pipeline schedule, the last stage's log-probs broadcast) matches the engine bit
    for bit on every rank, caching off and on."""
    relative = TINY.relative_to(REPO)  # the fixture writes its JSON under tmp_path by the case's name
    (tmp_path / relative.parent).mkdir(parents=True)
    code, output, result = torchrun.ab(tmp_path, tp=tp, pp=pp, case=str(relative), extra=("--trainer-logprobs",))
    torchrun.assert_clean(tp, pp, code, output, result)
    identical = {"tokens": 18, "bit_identical_tokens": 18, "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "k3_kl": 0.0,
                 "left_out_requests": 0, "left_out_tokens": 0, "routing_replayed": False}
    assert result["trainer_logprobs"] == {run: identical for run in RUNS[:2]}


@pytest.mark.slow
@pytest.mark.breadth
def test_weight_update_rounds_compare_each_round_with_its_own_weights(monkeypatch):
    """rl_weight_update (2 SGD steps between 3 rounds; REF_ZERO only, to keep it short): each round's
    requests match the trainer forward with the weights that generated them, bit for bit; r0.s0, in
    flight across update 1, is left out. Compared after the run instead (the final weights for every
    round), rounds 0 and 1 differ in every token, round 2 matches."""
    from megatron_ext.harness import trainer_logprobs

    case = load_case("rl_weight_update").model_copy(update={"prefix_caching_eviction_policies": ["ref_zero"]})
    result = run_ab(case, trainer_logprobs="matched")
    assert result.failures() == []
    assert [run.label for run in result.trainer_logprobs.runs] == list(RUNS[:2])
    for run in result.trainer_logprobs.runs:
        assert (run.tokens, run.bit_identical_tokens, run.left_out) == (72, 72, [0])
        assert (run.as_json()["left_out_requests"], run.as_json()["left_out_tokens"]) == (1, 24)
    start = trainer_logprobs.TrainerComparison.start
    monkeypatch.setattr(trainer_logprobs.TrainerComparison, "start", lambda self, updater=None: start(self, None))
    stale = run_ab(case, trainer_logprobs="matched")
    round_of = {r["request_id"]: r["round"] for r in stale.requests}
    for run in stale.trainer_logprobs.runs:
        identical = {}  # round -> identical tokens / tokens
        for r in run.requests:
            have = identical.get(round_of[r.request_id], (0, 0))
            identical[round_of[r.request_id]] = (have[0] + r.bit_identical_tokens, have[1] + r.tokens)
        assert run.left_out == [] and identical == STALE_ROUNDS, (run.label, identical)
    assert stale.exit_code() == 1


#: rl_weight_update's rounds compared with the final weights: round -> (identical tokens, tokens)
STALE_ROUNDS = {0: (0, 48), 1: (0, 24), 2: (24, 24)}
