"""The user's own inputs through the real engine: a prompts file, and ab files read back by compare."""

from __future__ import annotations

import json

import pytest

from megatron_ext import cli, mcore

MCORE = mcore.installed_version()


@pytest.mark.slow
def test_jsonl_prompts_under_lru_pressure_are_bit_identical(tmp_path, capfd):
    # lru_pressure's 12-block pool and LRU policy, the user's prompts: shared prefixes, samples,
    # arrivals; every admission evicts cached blocks
    prompts = tmp_path / "prompts.jsonl"
    system = "You are a careful assistant for Megatron users. Answer briefly. "
    prompts.write_text("\n".join(json.dumps(line) for line in [
        {"prompt": system + "What is a KV block?", "samples": 2},
        {"prompt": system + "What is a block table?", "arrival_step": 3},
        {"prompt": system + "What does LRU evict first?", "num_tokens_to_generate": 12, "arrival_step": 6},
    ]) + "\n")
    out = tmp_path / "ab.json"
    code = cli.main(["ab", "--case", "lru_pressure", "--prompts", str(prompts), "--samples", "3",
                     "--no-progress", "--json", str(out)])
    report = capfd.readouterr().out
    assert code == 0, report
    result = json.loads(out.read_text())
    assert result["case"] == "lru_pressure+prompts.jsonl"
    # prompt lengths in tokens: the byte tokenizer's BOS + one token per UTF-8 byte
    assert [(r["label"], r["prompt_length"]) for r in result["requests"]] == [
        ("r0.s0", 83), ("r0.s1", 83), ("r1.s0", 86), ("r1.s1", 86), ("r1.s2", 86),
        ("r2.s0", 90), ("r2.s1", 90), ("r2.s2", 90)]
    assert result["bit_identical"] and result["failures"] == []
    assert result["blocks_matched"] > 0
    assert result["policies"][0]["run"]["pressure"]["cached_blocks_evicted"] > 0
    assert report.splitlines()[-1].startswith("PASS: 8 requests bit-identical")


@pytest.mark.slow
def test_compare_reads_back_a_real_ab_file(tmp_path, capfd):
    result = tmp_path / "ab.json"
    assert cli.main(["ab", "--case", "shared_system_prompt", "--json", str(result), "--no-progress"]) == 0
    capfd.readouterr()
    # caching off vs LRU from the same file: what ab found, now from the file, bit for bit
    assert cli.main(["compare", f"{result}:off", f"{result}:lru"]) == 0
    lines = capfd.readouterr().out.splitlines()
    assert lines[:2] == [f"A: {result} (case shared_system_prompt, megatron-core {MCORE}, device cpu)",
                         f"B: {result} (case shared_system_prompt, megatron-core {MCORE}, device cpu)"]
    assert any("run off of A vs run lru of B" in line for line in lines)
    assert lines[-1] == "PASS: 5 requests bit-identical in 1 compared run pair(s)"


@pytest.mark.slow
def test_top_n_logprobs_are_recorded_and_bit_identical(tmp_path, capfd):
    out = tmp_path / "ab.json"
    assert cli.main(["ab", "--case", "shared_system_prompt", "--top-n-logprobs", "4", "--no-progress",
                     "--json", str(out)]) == 0
    assert "top-n log-probs equal" in capfd.readouterr().out
    result = json.loads(out.read_text())
    checked = 0
    for run in [result["baseline"]] + [p["run"] for p in result["policies"]]:
        for output in run["outputs"].values():
            top_n = output["top_n_logprobs"]
            assert len(top_n) == len(output["tokens"]) and all(1 <= len(entry) <= 4 for entry in top_n)
            for token, log_prob, entry in zip(output["tokens"], output["log_probs"], top_n):
                if token < 128:  # greedy: the sampled byte is the top entry, with its own log-prob bits
                    assert entry[0] == [chr(token), log_prob]
                    checked += 1
    assert checked > 20
    assert all(r["top_n_logprobs_equal"] is True for p in result["policies"] for r in p["requests"])


@pytest.mark.slow
def test_megatron_model_config_runs_as_an_ab_case(tmp_path, capfd):
    # a Megatron functional-test case (the format of gpt_dynamic_inference_*_prefix_caching_lru),
    # small: model flags instead of --use-checkpoint-args, chunked prefill, LRU, arrivals per step
    directory = tmp_path / "gpt_dynamic_inference_tp1_pp1_tiny_prefix_caching_lru"
    directory.mkdir()
    (directory / "model_config.yaml").write_text(json.dumps({
        "ENV_VARS": {"CUDA_DEVICE_MAX_CONNECTIONS": 1}, "TEST_TYPE": "frozen-start", "MODE": "inference",
        "MODEL_ARGS": {
            "--use-mcore-models": True, "--attention-backend": "flash", "--transformer-impl": "transformer_engine",
            "--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1, "--bf16": True,
            "--seed": 4321, "--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--max-position-embeddings": 256,
            "--inference-max-seq-length": 256, "--top_k": 1, "--return-log-probs": True,
            "--num-tokens-to-generate": 12, "--inference-dynamic-batching-buffer-size-gb": 0.002,
            "--inference-dynamic-batching-block-size": 16, "--inference-dynamic-batching-max-tokens": 64,
            "--enable-chunked-prefill": True, "--inference-dynamic-batching-prefix-caching": True,
            "--inference-dynamic-batching-prefix-caching-eviction-policy": "lru",
            "--output-path": "${INFERENCE_OUTPUT_PATH}", "--incoming-requests-per-step": 1,
            "--prompts": ["Time travel to 2008, and go to a bar on the Lower East Side.",
                          "Time travel to 2008, and go to a disco-basement on the Lower East Side."],
            "--inference-repeat-n": 3, "--log-params-norm": True, "--wandb-project": "megatron",
            "--some-new-flag": 7},
        "METRICS": ["generated_tokens", "logprobs"]}))  # JSON is YAML
    out = tmp_path / "ab.json"
    ab = ["ab", "--case", str(directory / "model_config.yaml"), "--no-progress", "--json", str(out)]
    assert cli.main(ab) == 2  # an argument megatron-ext does not know stops the run before any engine
    refused = capfd.readouterr()
    assert refused.err.strip().endswith("not known to megatron-ext: --some-new-flag; ab cannot tell whether it "
                                        "changes the model or the engine, so it would report on a model it may "
                                        "not have built: remove it from a copy of the file, or run ab "
                                        "--allow-unknown-args (the verdict then names what it ran without)")
    assert len(refused.err.strip().splitlines()) == 1 and not out.exists()
    code = cli.main(ab + ["--allow-unknown-args"])
    lines = capfd.readouterr().out.splitlines()
    assert code == 0, "\n".join(lines)
    assert "megatron case: ran without --some-new-flag: not known to megatron-ext (--allow-unknown-args)" in lines
    assert "for the model built without --some-new-flag (not known to megatron-ext, --allow-unknown-args)" in lines[-1]
    ignored = [line for line in lines if line.startswith("megatron case: ignored ")]
    assert [line.split(":")[1].split()[-1] for line in ignored] == [
        "--use-mcore-models", "--attention-backend", "--transformer-impl", "--return-log-probs",
        "--inference-dynamic-batching-prefix-caching", "--output-path", "--log-params-norm", "--wandb-project"]
    assert "weights: seeded random (seed 4321; --load DIR to use a checkpoint)" in lines
    result = json.loads(out.read_text())
    assert result["weights"] == {"source": "seeded random", "seed": 4321}  # --seed: the model's seed
    assert result["case"] == "gpt_dynamic_inference_tp1_pp1_tiny_prefix_caching_lru"
    assert [p["eviction_policy"] for p in result["policies"]] == ["lru"]
    assert len(result["requests"]) == 6 and result["bit_identical"] and result["failures"] == []
    assert result["prefill_tokens_skipped"] > 0 and result["unknown_args_allowed"] == ["--some-new-flag"]
