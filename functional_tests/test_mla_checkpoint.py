"""``mla_tiny`` (multi-latent attention) through ``save-checkpoint`` and ``ab --load`` (0.18, 0.19).

The checkpoint is saved before any inference forward, under megatron-core's own parameter names
(``prepare_for_absorption`` renames ``linear_kv_up_proj`` only at the engine's first forward), with
the MLA sizes, ``rope_type`` and YaRN parameters in its Megatron-LM args. Saved with seed 4321 and loaded into a
model built from its args (a case without a model section, seeded 1234 before loading), ``ab``
passes and generates exactly the tokens of ``mla_tiny`` seeded 4321 without a checkpoint. 0.17
cannot run MLA: ``ab --load`` is refused by name, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from functional_tests.conftest import SERIES
from megatron_ext import cli
from megatron_ext.harness.checkpoint import read_common_state
from megatron_ext.harness.mla import MLA_SERIES

RUNS_MLA = SERIES in MLA_SERIES
#: greedy tokens of mla_tiny's four requests with seed 4321 (bf16), caching on and off
TOKENS_4321 = [[105, 155, 201, 150, 233, 172], [105, 169, 105, 169, 105, 169], [172, 98, 96, 14, 108, 148],
               [105, 192, 114, 94, 44, 127]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mla") / "ckpt"
    assert cli.main(["save-checkpoint", str(path), "--case", "mla_tiny", "--seed", "4321"]) == 0
    return path


@pytest.fixture(scope="module")
def no_model_case(tmp_path_factory) -> Path:
    """mla_tiny's requests and inference section without its model section."""
    from megatron_ext.harness.cases import load_case

    import yaml

    data = load_case("mla_tiny").model_dump(mode="json", exclude_defaults=True)
    data.pop("model")
    data["name"] = "mla-from-checkpoint"
    path = tmp_path_factory.mktemp("cases") / "no_model.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_save_checkpoint_writes_the_mla_args(saved):
    args = vars(read_common_state(saved / "iter_0000001")["args"])
    assert {k: args[k] for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                 "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "cache_mla_latents",
                                 "qk_layernorm", "normalization", "seed")} == dict(
        multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
        v_head_dim=16, rope_type="rope", cache_mla_latents=True, qk_layernorm=True, normalization="RMSNorm",
        seed=4321)


@pytest.mark.slow
def test_ab_load_builds_mla_from_args_and_generates_the_saved_models_tokens(saved, no_model_case, tmp_path, capfd):
    out = tmp_path / "ab.json"
    code = cli.main(["ab", "--case", str(no_model_case), "--load", str(saved), "--no-progress", "--json", str(out)])
    captured = capfd.readouterr()
    printed = captured.out
    if not RUNS_MLA:  # 0.17: refused by name before anything is built
        assert code == 2 and "multi-latent attention with prefix caching does not run on megatron-core" in captured.err
        return
    assert code == 0, printed[-3000:]
    result = json.loads(out.read_text())
    assert (result["verdict"], result["bit_identical"], result["model_features"]) == ("pass", True, ["mla"])
    assert (result["weights"]["model"], result["weights"]["iteration"]) == ("checkpoint args", 1)
    assert (result["kv_write_violations"], result["refcount_violations"], result["lru_violations"]) == (0, 0, 0)
    assert [output["tokens"] for output in result["baseline"]["outputs"].values()] == TOKENS_4321


#: ``MLATransformerConfig`` fields of MLA's RoPE that ``save-checkpoint`` / ``ab --load`` carry
YARN_CONFIG_FIELDS = ("rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
                      "beta_slow", "mscale", "mscale_all_dim", "rotary_base")


@pytest.mark.slow
def test_yarn_mla_round_trips_rope_type_and_yarn_parameters(tmp_path, monkeypatch, capfd):
    """``mla_yarn_tiny`` (rope_type yarn, megatron-core's YaRN defaults but mscale_all_dim 1.0) saved
    and loaded from its args: the args carry rope_type and every YaRN parameter, and the model
    ``ab --load`` builds has the saved model's config fields and YaRN embedding, and passes."""
    import yaml

    from megatron_ext import mcore
    from megatron_ext.cpu_backend import cpu_backend
    from megatron_ext.harness import ab
    from megatron_ext.harness.cases import load_case
    from megatron_ext.harness.engine import build_model, ensure_model_parallel

    path = tmp_path / "ckpt"
    assert cli.main(["save-checkpoint", str(path), "--case", "mla_yarn_tiny", "--seed", "4321"]) == 0
    args = vars(read_common_state(path / "iter_0000001")["args"])
    assert {k: args[k] for k in YARN_CONFIG_FIELDS} == dict(
        rope_type="yarn", rotary_scaling_factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, rotary_base=10000)
    case = load_case("mla_yarn_tiny")
    with cpu_backend():
        ensure_model_parallel()
        expected = {k: getattr(build_model(case).config, k) for k in YARN_CONFIG_FIELDS}
    data = case.model_dump(mode="json", exclude_defaults=True)
    data.pop("model")
    data["name"] = "mla-yarn-from-checkpoint"
    no_model = tmp_path / "no_model.yaml"
    no_model.write_text(yaml.safe_dump(data))
    built = []

    def recording_build_model(*a, **k):
        built.append(build_model(*a, **k))
        return built[-1]

    monkeypatch.setattr(ab, "build_model", recording_build_model)
    code = cli.main(["ab", "--case", str(no_model), "--load", str(path), "--no-progress",
                     "--json", str(tmp_path / "ab.json")])
    captured = capfd.readouterr()
    if not RUNS_MLA:
        assert code == 2 and "multi-latent attention with prefix caching does not run on megatron-core" in captured.err
        return
    assert code == 0, captured.out[-3000:]
    assert built and all({k: getattr(m.config, k) for k in YARN_CONFIG_FIELDS} == expected for m in built)
    yarn = mcore.import_module("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")
    assert type(built[0].decoder.layers[0].self_attention.rotary_pos_emb) is yarn.YarnRotaryEmbedding
    result = json.loads((tmp_path / "ab.json").read_text())
    assert (result["verdict"], result["bit_identical"], result["model_features"]) == ("pass", True, ["mla"])
    assert result["weights"]["model"] == "checkpoint args" and result["blocks_matched"] > 0
