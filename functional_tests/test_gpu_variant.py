"""The GPU variant of the A/B check: prefix caching off vs on, bit for bit, on a CUDA device with
the kernels production jobs use instead of megatron-ext's CPU backend.

* ``GPTModel`` with the Transformer Engine layer spec, bf16 weights;
* megatron-core's own batch-invariant mode (``TransformerConfig.batch_invariant_mode``, which
  requires the flash attention backend, FlashAttention 3 on 0.19, plus the ``torch.library``
  overrides of ``set_batch_invariant_mode``);
* CUDA graphs off and on (``cuda_graph_impl="local"`` + ``InferenceConfig.num_cuda_graphs``);
* the Triton KV append on (megatron-core uses it whenever Triton imports).

Skipped, with the reason, where CUDA, Transformer Engine or flash-attn is missing (on a CPU-only
machine: no CUDA). NOT RUN YET ANYWHERE: written against the 0.17.1 / 0.18.2 / 0.19.2 sources, never
executed on a GPU; expect to adjust config details on the first GPU run. Limits known in advance:
with CUDA graphs on, KV appends inside replayed graphs bypass the Python-level KV-write audit, so
that audit only sees eagerly run steps (the ref-count audit is unaffected).
``scripts/run_functional_tests.sh --gpus 1`` runs this file.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from megatron_ext import mcore
from megatron_ext.api import apply
from megatron_ext.harness.cases import load_case, plan_requests
from megatron_ext.harness.compare import compare_runs
from megatron_ext.harness.engine import engine_tokenizer, ensure_model_parallel
from megatron_ext.harness.step_loop import RunRecord, drive
from megatron_ext.harness.tokenizer import default_tokenizer


def _missing() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine (transformer_engine) is not installed"
    if importlib.util.find_spec("flash_attn") is None and importlib.util.find_spec("flash_attn_interface") is None:
        return "flash-attn (flash_attn / flash_attn_interface) is not installed"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(_missing() is not None, reason=f"GPU variant: {_missing()}")]


def _config(case, cuda_graphs: bool):
    module = mcore.import_module("megatron.core.transformer.transformer_config")
    enums = mcore.import_module("megatron.core.transformer.enums")
    fields = {f.name for f in dataclasses.fields(module.TransformerConfig)}
    spec = case.model
    kwargs = dict(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                  num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
                  ffn_hidden_size=spec.ffn_hidden_size, params_dtype=torch.bfloat16, bf16=True,
                  batch_invariant_mode=True, attention_backend=enums.AttnBackend.flash,
                  cuda_graph_impl="local" if cuda_graphs else "none")
    if "flash_attention_version" in fields:  # 0.19: batch-invariant mode needs FA3 or FA4
        kwargs["flash_attention_version"] = 3
    if spec.init_method_std is not None:
        kwargs["init_method_std"] = spec.init_method_std
    return module.TransformerConfig(**kwargs)


def _model(case, cuda_graphs: bool):
    gpt_model = mcore.import_module("megatron.core.models.gpt.gpt_model")
    layer_specs = mcore.import_module("megatron.core.models.gpt.gpt_layer_specs")
    random = mcore.import_module("megatron.core.tensor_parallel.random")
    config = _config(case, cuda_graphs)
    torch.manual_seed(case.model.seed)
    random.model_parallel_cuda_manual_seed(case.model.seed)
    model = gpt_model.GPTModel(config=config,
                               transformer_layer_spec=layer_specs.get_gpt_layer_with_transformer_engine_spec(),
                               vocab_size=case.model.vocab_size,
                               max_sequence_length=case.model.max_position_embeddings)
    return model.cuda().to(torch.bfloat16).eval()


def _run(model, case, planned, prefix_caching: bool, policy: str, cuda_graphs: bool) -> RunRecord:
    config = mcore.import_module("megatron.core.inference.config")
    dynamic_context = mcore.import_module(mcore.DYNAMIC_CONTEXT_MODULE)
    wrapper = mcore.import_module("megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper")
    controller = mcore.import_module("megatron.core.inference.text_generation_controllers.text_generation_controller")
    engines = mcore.import_module("megatron.core.inference.engines.dynamic_engine")
    inference = config.InferenceConfig(
        **case.inference.model_dump(), enable_prefix_caching=prefix_caching,
        prefix_caching_eviction_policy=getattr(config.PrefixCachingEvictionPolicy, policy.upper()),
        num_cuda_graphs=8 if cuda_graphs else None)
    context = dynamic_context.DynamicInferenceContext(model.config, inference)
    text = controller.TextGenerationController(wrapper.GPTInferenceWrapper(model, context),
                                               engine_tokenizer(default_tokenizer()))
    engine = engines.DynamicInferenceEngine(text, context)  # captures the CUDA graphs, if any
    record = RunRecord(prefix_caching, policy if prefix_caching else None)
    drive(engine, context, case, planned, record)
    assert record.error is None, record.error
    return record


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["cuda-graphs-off", "cuda-graphs-on"])
def test_gpu_prefix_caching_is_bit_identical(cuda_graphs):
    bik = mcore.import_module("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    dynamic_context = mcore.import_module(mcore.DYNAMIC_CONTEXT_MODULE)
    assert dynamic_context.triton_append_key_value_cache is not None, "the Triton KV append must be on"
    # head dim 64: flash-attn's kernels do not take the CPU case's head dim of 16
    case = load_case("rl_rollouts")
    case = case.model_copy(update={"model": case.model.model_copy(update={"hidden_size": 256})})
    assert case.model.params_dtype == "bf16"
    planned = plan_requests(case, default_tokenizer())
    assert all(result.state.value != "refused" for result in apply())
    ensure_model_parallel()
    with bik.set_batch_invariant_mode(True):
        model = _model(case, cuda_graphs)
        baseline = _run(model, case, planned, False, case.prefix_caching_eviction_policies[0], cuda_graphs)
        for policy in case.prefix_caching_eviction_policies:
            run = _run(model, case, planned, True, policy, cuda_graphs)
            diffs = compare_runs(baseline.outputs, run.outputs)
            assert [d.label for d in diffs if not d.identical] == [], f"{policy}: caching on != off"
            assert run.audit.kv_write_violations == 0, run.audit.examples
            assert run.audit.refcount_violations == 0, run.audit.examples
            assert run.counters.prefill_tokens_skipped > 0
            if not cuda_graphs:
                assert run.audit.kv_writes_checked > 0
