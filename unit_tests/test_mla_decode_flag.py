"""Fault M2: MLA's dynamic-batching forward calls ``flash_decode_and_prefill`` without ``is_decode_only``.

``mla_tiny``'s model (2 MLA layers) runs one request through megatron-core's engine on the CPU: a
prefill step, then two decode-only steps. Every attention call must get the context's
``is_decode_only()``: False in the prefill step, True after. With ``MEGATRON_EXT_TEST_UNPATCHED=1``
the first step raises ``TypeError`` (missing ``is_decode_only``) on every release.
"""

from __future__ import annotations

import pytest

from megatron_ext import mcore
from megatron_ext.cpu_backend import cpu_backend
from megatron_ext.harness.cases import load_case
from megatron_ext.harness.engine import build_engine, build_model, ensure_model_parallel
from megatron_ext.harness.tokenizer import default_tokenizer

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run


def test_every_mla_attention_call_gets_the_steps_decode_flag(runtime_patches, monkeypatch):
    attention = mcore.import_module(mcore.ATTENTION_MODULE).Attention
    released, flags = attention.flash_decode_and_prefill, []

    def recording(self, *args, **kwargs):
        flags.append(kwargs.get("is_decode_only", args[9] if len(args) > 9 else "missing"))
        return released(self, *args, **kwargs)

    monkeypatch.setattr(attention, "flash_decode_and_prefill", recording)
    sampling = mcore.import_module("megatron.core.inference.sampling_params")
    case = load_case("mla_tiny")
    with cpu_backend():
        ensure_model_parallel()
        engine, _ = build_engine(build_model(case), case, False, "ref_zero")
        engine.add_request(0, default_tokenizer().tokenize("Decode-only steps absorb the queries."),
                           sampling.SamplingParams(top_k=1, num_tokens_to_generate=3))
        for _ in range(3):
            engine.step_modern()
    assert flags == [False, False, True, True, True, True]  # 2 layers x (prefill, decode, decode)
