"""``ab`` / ``soak`` set Triton's environment for a hybrid case on the CPU themselves
(``megatron_ext.harness.triton_env.ensure_hybrid_cpu_environment``), and the bf16 Mamba-state rule (fault H2) is named
where a case breaks it (``megatron_ext.harness.hybrid``). The end-to-end runs are in
``functional_tests/test_hybrid_cli.py``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from megatron_ext.errors import MegatronExtError
from megatron_ext.harness.cases import load_case, parse_case
from megatron_ext.harness import triton_env
from megatron_ext.harness.hybrid import bf16_mamba_states, mamba_state_dtype_warning

HYBRID_TINY = Path(__file__).resolve().parents[1] / "functional_tests" / "cases" / "hybrid_tiny.yaml"
VARIABLES = ("TRITON_INTERPRET", "MAMBA_DETERMINISTIC", triton_env.TRITON_REEXEC_ENV)


class Execed(Exception):
    """Raised by the stand-in for ``os.execv``."""


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    calls = []

    def execv(path, argv):
        calls.append((path, argv, {k: os.environ.get(k) for k in VARIABLES}))
        raise Execed

    monkeypatch.setattr(triton_env.os, "execv", execv)
    return calls


def hybrid_case():
    return load_case(str(HYBRID_TINY))


def test_set_in_process_when_nothing_read_them(clean_env, monkeypatch):
    monkeypatch.setattr(triton_env, "triton_env_read", lambda: False)
    triton_env.ensure_hybrid_cpu_environment(hybrid_case(), "cpu", program=True)
    assert {k: os.environ.get(k) for k in VARIABLES} == {
        "TRITON_INTERPRET": "1", "MAMBA_DETERMINISTIC": "1", triton_env.TRITON_REEXEC_ENV: None}
    assert clean_env == []


def test_reexecutes_once_when_triton_is_imported(clean_env, monkeypatch):
    monkeypatch.setattr(triton_env, "triton_env_read", lambda: True)
    with pytest.raises(Execed):
        triton_env.ensure_hybrid_cpu_environment(hybrid_case(), "cpu", program=True)
    assert clean_env == [(sys.executable, [sys.executable, *sys.orig_argv[1:]],
                          {"TRITON_INTERPRET": "1", "MAMBA_DETERMINISTIC": "1", triton_env.TRITON_REEXEC_ENV: "1"})]


def test_refuses_after_reexecuting_once(clean_env, monkeypatch):
    monkeypatch.setattr(triton_env, "triton_env_read", lambda: True)
    monkeypatch.setenv(triton_env.TRITON_REEXEC_ENV, "1")
    with pytest.raises(MegatronExtError, match="Triton was imported before megatron-ext could set "
                       "TRITON_INTERPRET=1 MAMBA_DETERMINISTIC=1; set them in the environment"):
        triton_env.ensure_hybrid_cpu_environment(hybrid_case(), "cpu", program=True)
    assert clean_env == []


@pytest.mark.parametrize("why", ["in-process", "cuda", "gpt case", "already set"])
def test_leaves_the_environment_alone(clean_env, monkeypatch, why):
    monkeypatch.setattr(triton_env, "triton_env_read", lambda: True)
    case, device, program = hybrid_case(), "cpu", True
    if why == "in-process":
        program = False
    elif why == "cuda":
        device = "cuda"
    elif why == "gpt case":
        case = load_case("shared_system_prompt")
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("MAMBA_DETERMINISTIC", "1")
    before = {k: os.environ.get(k) for k in VARIABLES}
    triton_env.ensure_hybrid_cpu_environment(case, device, program)
    assert {k: os.environ.get(k) for k in VARIABLES} == before
    assert clean_env == []


def _model(**fields):
    base = {"hybrid_layer_pattern": "M*M", "hidden_size": 32, "num_attention_heads": 2, **fields}
    text = "name: t\nmodel: {" + ", ".join(f"{k}: {v}" for k, v in base.items()) + "}\nrequests: [{prompt: hi}]\n"
    return parse_case(text.replace("M*M", '"M*M"')).model


@pytest.mark.parametrize("fields, rule_broken", [
    ({"params_dtype": "bf16"}, True),                                    # default states: the model's bf16
    ({"params_dtype": "bf16", "mamba_ssm_states_dtype": "bf16"}, True),
    ({"params_dtype": "bf16", "mamba_ssm_states_dtype": "fp32"}, False),
    ({"params_dtype": "fp32"}, False),
    ({"params_dtype": "fp32", "mamba_ssm_states_dtype": "bf16"}, True),
])
def test_bf16_mamba_states_rule(fields, rule_broken):
    model = _model(**fields)
    assert bf16_mamba_states(model) is rule_broken
    warning = mamba_state_dtype_warning(model)
    assert (warning is not None) is rule_broken
    if rule_broken:
        assert warning.endswith("(fault H2, not patched); set mamba_ssm_states_dtype: fp32")


def test_gpt_model_has_no_mamba_rule():
    model = load_case("shared_system_prompt").model
    assert model.params_dtype == "bf16"
    assert not bf16_mamba_states(model) and mamba_state_dtype_warning(model) is None
