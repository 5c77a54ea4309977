"""A Llama-style checkpoint (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied embeddings, no
biases; 2 layers, hidden 64) saved with megatron-core by ``megatron-ext save-checkpoint`` and run
by ``ab --load`` with a case that has no model section: the model is built from the checkpoint's
Megatron-LM args.

* ``save-checkpoint``: Megatron-LM's layout (``iter_0000003`` + tracker) and common state (args,
  iteration, checkpoint_version), args under Megatron-LM's names with the exact values.
* ``ab --load`` without a model section: exit 0, bit-identical, audit-clean; the built model's
  megatron-core config and modules are the Llama architecture; its weights are the saved ones
  bit for bit (saved with seed 4321, built with 1234 before loading).
* Refusals: a checkpoint whose args name an unsupported architecture (grouped-GEMM experts, L2
  norm) exits 2 with one line naming the argument, before any engine is built.
* Cross-release (slow): the same checkpoint saved under megatron-core 0.19.2 (its wheel unpacked,
  in a subprocess; the common state lives in the .distcp files) loads under the installed release.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from functional_tests.conftest import REPO
from megatron_ext import cli, mcore
from megatron_ext.cpu_backend import cpu_backend
from megatron_ext.harness.cases import parse_case
from megatron_ext.harness.checkpoint import read_common_state, save_megatron_lm_checkpoint
from megatron_ext.harness.checkpoint_args import megatron_lm_args
from megatron_ext.harness.engine import build_model, ensure_model_parallel

LLAMA_MODEL = ("{num_layers: 2, hidden_size: 64, num_attention_heads: 8, num_query_groups: 2, "
               "ffn_hidden_size: 176, normalization: RMSNorm, swiglu: true, position_embedding_type: rope, "
               "rotary_base: 500000, add_bias_linear: false, untie_embeddings_and_output_weights: true, "
               "vocab_size: 512, params_dtype: bf16, init_method_std: 0.1, seed: 4321}")
REQUESTS = """
requests:
  - {prompt: "The quick brown fox jumps over the lazy dog.", samples: 3, num_tokens_to_generate: 6}
  - {prompt: "The quick brown fox jumps over the fence", samples: 2, num_tokens_to_generate: 6, arrival_step: 2}
prefix_caching_eviction_policies: [ref_zero, lru]
expectations: {bit_identical: true, min_prefill_tokens_skipped: 1}
"""
SAVED_SEED = 4321


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> tuple[Path, Path]:
    """(the Llama case with a model section, the same requests without one)."""
    root = tmp_path_factory.mktemp("cases")
    llama, no_model = root / "llama.yaml", root / "no_model.yaml"
    llama.write_text(f"name: llama-tiny\nmodel: {LLAMA_MODEL}\n{REQUESTS}")
    no_model.write_text(f"name: from-checkpoint\n{REQUESTS}")
    return llama, no_model


@pytest.fixture(scope="module")
def saved(cases, tmp_path_factory) -> Path:
    """``save-checkpoint DIR --case llama.yaml --iteration 3`` (in this process)."""
    path = tmp_path_factory.mktemp("llama") / "ckpt"
    assert cli.main(["save-checkpoint", str(path), "--case", str(cases[0]), "--iteration", "3"]) == 0
    return path


def test_save_checkpoint_writes_megatron_lm_layout_and_args(saved):
    assert sorted(p.name for p in saved.iterdir()) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    assert (saved / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    common = read_common_state(saved / "iter_0000003")
    assert (common["iteration"], common["checkpoint_version"]) == (3, 3.0)
    args = vars(common["args"])
    expected = dict(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=8,
                    group_query_attention=True, num_query_groups=2, kv_channels=8,
                    normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, qk_layernorm=False,
                    position_embedding_type="rope", rotary_base=500000, rotary_percent=1.0,
                    add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True,
                    padded_vocab_size=512, max_position_embeddings=1024, seq_length=1024,
                    params_dtype=torch.bfloat16, bf16=True, fp16=False, seed=SAVED_SEED,
                    tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    assert {k: args[k] for k in expected} == expected


@pytest.fixture
def built_models(monkeypatch) -> list:
    """Every model ab builds, captured."""
    import megatron_ext.harness.ab

    models = []

    def capture(case):
        models.append(build_model(case))
        return models[-1]

    monkeypatch.setattr(megatron_ext.harness.ab, "build_model", capture)
    return models


@pytest.mark.slow
def test_ab_load_without_model_section_builds_llama_from_args(saved, cases, built_models, tmp_path, capfd):
    out = tmp_path / "ab.json"
    code = cli.main(["ab", "--case", str(cases[1]), "--load", str(saved), "--no-progress", "--width", "400",
                     "--json", str(out)])
    printed = capfd.readouterr().out
    assert code == 0, printed[-3000:]
    result = json.loads(out.read_text())
    assert result["verdict"] == "pass" and result["bit_identical"] is True
    assert (result["kv_write_violations"], result["refcount_violations"], result["lru_violations"]) == (0, 0, 0)
    assert result["prefill_tokens_skipped"] > 0
    assert result["weights"] == {"source": "checkpoint", "requested": str(saved),
                                 "path": str(saved / "iter_0000003"), "iteration": 3,
                                 "backend": "torch_dist", "model": "checkpoint args"}
    assert "torch_dist; model built from its Megatron-LM args" in printed

    (model,) = built_models
    config = model.config
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.num_query_groups,
            config.kv_channels, config.ffn_hidden_size) == (2, 64, 8, 2, 8, 176)
    assert (config.normalization, config.layernorm_epsilon, config.gated_linear_unit,
            config.activation_func, config.add_bias_linear, config.add_qkv_bias, config.qk_layernorm) == \
        ("RMSNorm", 1e-5, True, torch.nn.functional.silu, False, False, False)
    assert (config.apply_rope_fusion, config.bias_activation_fusion) == (False, False)
    assert config.params_dtype is torch.bfloat16 and config.bf16 is True
    assert model.position_embedding_type == "rope" and not hasattr(model.embedding, "position_embeddings")
    assert model.rotary_pos_emb.inv_freq[1].item() == pytest.approx(500000 ** (-2 / 8))
    assert model.share_embeddings_and_output_weights is False
    layer = model.decoder.layers[0]
    assert type(layer.input_layernorm).__name__ == "RMSNorm"
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if "_extra_state" not in k}
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == (64 + 2 * 2 * 8, 64)
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 176, 64)
    assert shapes["output_layer.weight"] == (512, 64)
    assert not any(k.endswith(".bias") for k in shapes)

    # the weights are the saved model's (seed 4321), not the seed-1234 model ab built first
    saved_case = parse_case(cases[0].read_text())
    with cpu_backend():
        ensure_model_parallel()
        reference = build_model(saved_case)
    loaded = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        assert torch.equal(loaded[name].view(torch.int16), param.view(torch.int16)), name


@pytest.mark.slow
def test_ab_load_with_model_section_uses_it(saved, cases, built_models, capfd):
    """A model section wins over the args (today's behaviour): the Llama case loads; the default
    GPT case is refused by the architecture check."""
    assert cli.main(["ab", "--case", str(cases[0]), "--load", str(saved), "--no-progress"]) == 0
    assert "model built from its Megatron-LM args" not in capfd.readouterr().out
    code = cli.main(["ab", "--case", "rl_rollouts", "--load", str(saved), "--no-progress"])
    err = capfd.readouterr().err
    assert code == 2
    assert "architecture mismatch: checkpoint" in err and "has no tensor 'embedding.position_embeddings.weight'" in err


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if ab gets as far as building an engine."""
    import megatron_ext.harness.ab

    def refuse(*args, **kwargs):
        raise AssertionError("an engine was built despite the refused checkpoint")

    monkeypatch.setattr(megatron_ext.harness.ab, "build_engine", refuse)


@pytest.mark.parametrize("changes, named", [
    ({"num_experts": 8, "moe_grouped_gemm": True},
     "moe_grouped_gemm=True (grouped-GEMM experts (the harness builds SequentialMLP experts))"),
    ({"normalization": "L2Norm"}, "normalization='L2Norm' (the harness builds LayerNorm or RMSNorm)"),
])
def test_unsupported_checkpoint_args_exit_2_by_name(cases, tmp_path, capfd, no_engine, changes, named):
    case = parse_case(f"name: gpt\n{REQUESTS}")
    with cpu_backend():
        ensure_model_parallel()
        model = build_model(case)
        args = megatron_lm_args(case.model, 257)
        for name, value in changes.items():
            setattr(args, name, value)
        save_megatron_lm_checkpoint(model, tmp_path / "ckpt", args, 5)
    code = cli.main(["ab", "--case", str(cases[1]), "--load", str(tmp_path / "ckpt"), "--no-progress"])
    err = capfd.readouterr().err
    assert code == 2
    assert err == (f"megatron-ext: error: --load {tmp_path / 'ckpt'}: the checkpoint's model has arguments "
                   f"the harness cannot build: {named}\n")


@pytest.mark.parametrize("field, value, case_value", [("norm_epsilon", 1e-6, 1e-5), ("rotary_base", 10000, 500000),
                                                      ("rotary_percent", 0.5, 1.0)])
def test_model_section_disagreeing_on_a_value_shapes_cannot_show_exits_2(cases, tmp_path, capfd, no_engine,
                                                                         field, value, case_value):
    """The Llama weights saved with args that differ from the case's model section in one value no
    tensor shape shows: before, ab ran silently with the case's value; now it refuses by name."""
    llama = parse_case(cases[0].read_text())
    with cpu_backend():
        ensure_model_parallel()
        model = build_model(llama)
        args = megatron_lm_args(llama.model, 512)
        setattr(args, field, value)
        save_megatron_lm_checkpoint(model, tmp_path / "ckpt", args, 5)
    code = cli.main(["ab", "--case", str(cases[0]), "--load", str(tmp_path / "ckpt"), "--no-progress"])
    err = capfd.readouterr().err
    assert code == 2
    assert err == (f"megatron-ext: error: --load {tmp_path / 'ckpt'}: the case's model section has {field}={case_value!r} "
                   f"but the checkpoint's Megatron-LM args have {field}={value!r} (the weights' shapes cannot show "
                   f"it, so the run would use the wrong one); set {field}: {value!r} in the case's model section, "
                   "or leave the model section out to build the model from the checkpoint's args\n")


CROSS_RELEASE = "0.19.2"  # writes the common state into the .distcp files (0.17/0.18 write common.pt)


@pytest.mark.slow
@pytest.mark.every_tree
def test_checkpoint_saved_by_another_release_loads(cases, tmp_path, capfd):
    """Saved under megatron-core 0.19.2 (wheel unpacked, subprocess), run here without a model
    section: before megatron-ext's common-state reader, 0.17/0.18 failed with 'common.pt does not
    exist'."""
    from megatron_ext.source_patches import unpack_release

    tree = unpack_release(CROSS_RELEASE, tmp_path / f"mcore-{CROSS_RELEASE}", REPO / ".venv" / "mcore-wheels")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_EXT_")}
    env["PYTHONPATH"] = f"{tree}{os.pathsep}{REPO}"
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-m", "megatron_ext", "save-checkpoint", str(ckpt), "--case",
                           str(cases[0])], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    saved_files = sorted(p.name for p in (ckpt / "iter_0000001").iterdir())
    assert "common.pt" not in saved_files and "__0_0.distcp" in saved_files
    assert read_common_state(ckpt / "iter_0000001")["args"].swiglu is True
    out = tmp_path / "ab.json"
    code = cli.main(["ab", "--case", str(cases[1]), "--load", str(ckpt), "--no-progress", "--json", str(out)])
    assert code == 0, capfd.readouterr().out[-3000:]
    result = json.loads(out.read_text())
    assert result["bit_identical"] is True and result["verdict"] == "pass"
    assert result["weights"]["model"] == "checkpoint args"
    assert result["megatron_core_version"] == mcore.installed_version()
