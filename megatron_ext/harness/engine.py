"""Build megatron-core's GPT model and dynamic inference engine for a case.

Only megatron-core's own classes are used: ``GPTModel`` with the local layer spec (no Transformer
Engine), ``DynamicInferenceContext``, ``GPTInferenceWrapper``, ``TextGenerationController`` and
``DynamicInferenceEngine``. The constructors are the same in 0.17, 0.18 and 0.19.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import types
from typing import Any, Optional

import torch

from .. import env, mcore
from .cases.schema import Case
from .dtypes import TORCH_DTYPES
from .hybrid import build_hybrid_model, mamba_inference_state_config
from .mla import mla_config_fields, mla_layer_spec, mla_mtp_layer_spec
from .routing import use_router_replays
from .speculative import inference_options as speculative_options
from .tokenizer import Tokenizer, default_tokenizer


def dist_timeout() -> datetime.timedelta:
    """The collectives' timeout, ``MEGATRON_EXT_DIST_TIMEOUT_S`` seconds (default 300).

    Raises:
        MegatronExtError: ``MEGATRON_EXT_DIST_TIMEOUT_S`` is not a number of seconds in (0, 604800].
    """
    return datetime.timedelta(seconds=env.seconds("MEGATRON_EXT_DIST_TIMEOUT_S", 300.0))


def ensure_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> None:
    """Initialize torch.distributed (gloo; one rank unless launched by torchrun) and megatron-core's
    parallel state, once per process.

    Collectives time out after ``MEGATRON_EXT_DIST_TIMEOUT_S`` seconds (default 300) instead of
    torch's 30 minutes, so a rank that died or left the lockstep ends the run with an error.

    Raises:
        RuntimeError: the world size does not fit the requested TP x PP layout, or the parallel
            state was already initialized with another layout.
        MegatronExtError: ``MEGATRON_EXT_DIST_TIMEOUT_S`` is not a positive number.
    """
    dist = torch.distributed
    timeout = dist_timeout()
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
            dist.init_process_group("gloo", timeout=timeout)
        else:
            init = f"file://{tempfile.mktemp(prefix='megatron-ext-pg-')}"
            dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    parallel_state = mcore.import_module("megatron.core.parallel_state")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size, pipeline_model_parallel_size,
            distributed_timeout_minutes=timeout.total_seconds() / 60)
    have = model_parallel_sizes()
    if have != (tensor_model_parallel_size, pipeline_model_parallel_size):
        raise RuntimeError(f"megatron-core's parallel state is already TP={have[0]} PP={have[1]}; "
                           f"asked for TP={tensor_model_parallel_size} PP={pipeline_model_parallel_size}")


def model_parallel_sizes() -> tuple[int, int]:
    """``(tensor, pipeline)`` model-parallel sizes of megatron-core's parallel state; ``(1, 1)``
    before :func:`ensure_model_parallel`."""
    parallel_state = mcore.import_module("megatron.core.parallel_state")
    if not parallel_state.model_parallel_is_initialized():
        return 1, 1
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size())


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of the TP size (megatron-core splits the embedding
    and output layer evenly over TP ranks); unchanged with TP=1. The extra IDs are model-only
    tokens that :meth:`Tokenizer.detokenize` drops."""
    return -(-vocab_size // tensor_model_parallel_size) * tensor_model_parallel_size


def transformer_config(case: Case) -> Any:
    """megatron-core ``TransformerConfig`` for the case's model (CPU initialization, no TE).

    ``params_dtype`` is ``torch.float32`` or ``torch.bfloat16`` (``bf16=True`` with the latter);
    ``init_method_std`` is passed only when the case sets it (else megatron-core's 0.02). The
    Megatron-LM architecture fields of :class:`~megatron_ext.harness.cases.ModelSpec` map as
    Megatron-LM maps them (``swiglu``: ``gated_linear_unit`` + SiLU; ``norm_epsilon``:
    ``layernorm_epsilon``); the RoPE and bias-activation fusions are always off (they need
    Transformer Engine or a GPU compiler). A hybrid model (``hybrid_layer_pattern``) also gets
    the case's Mamba sizes (``mamba_state_dim``, ``mamba_head_dim``, ``mamba_num_groups``,
    ``mamba_num_heads``). A mixture-of-experts model (``num_experts``) gets megatron-core's
    ``num_moe_experts``, ``moe_router_topk``, ``moe_ffn_hidden_size`` (the case's, else the dense
    MLP's width), ``moe_enable_routing_replay`` and load balancing ``none`` (no auxiliary loss:
    inference only).
    A multi-latent attention model gets an ``MLATransformerConfig`` with
    its MLA sizes (:func:`megatron_ext.harness.mla.mla_config_fields`).
    """
    module = mcore.import_module("megatron.core.transformer.transformer_config")
    spec = case.model
    dtype = TORCH_DTYPES[spec.params_dtype]
    optional = {} if spec.init_method_std is None else {"init_method_std": spec.init_method_std}
    tp, pp = model_parallel_sizes()
    if pp > 1:
        optional["pipeline_dtype"] = dtype  # megatron-core requires it with pipeline parallelism
    if spec.swiglu:
        optional.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    if spec.mtp_num_layers:
        optional.update(mtp_num_layers=spec.mtp_num_layers, mtp_use_repeated_layer=spec.mtp_use_repeated_layer)
    if spec.is_hybrid:
        optional.update(mamba_state_dim=spec.mamba_state_dim, mamba_head_dim=spec.mamba_head_dim,
                        mamba_num_groups=spec.mamba_num_groups, mamba_num_heads=spec.mamba_num_heads)
    if spec.is_moe:
        optional.update(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_router_topk,
                        moe_ffn_hidden_size=spec.effective_moe_ffn_hidden_size(),
                        moe_enable_routing_replay=spec.moe_enable_routing_replay,
                        moe_router_load_balancing_type="none")
    config_class = module.TransformerConfig
    if spec.multi_latent_attention:
        config_class = module.MLATransformerConfig
        optional.update(mla_config_fields(spec))
    return config_class(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.effective_ffn_hidden_size(),
        normalization=spec.normalization,
        layernorm_epsilon=spec.norm_epsilon,
        qk_layernorm=spec.qk_layernorm,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        **optional,
    )


def build_model(case: Case) -> Any:
    """GPTModel with seeded random weights (``case.model.seed``), in eval mode, of the
    architecture ``case.model`` describes (see :class:`~megatron_ext.harness.cases.ModelSpec`).

    Returns a ``megatron.core.models.gpt.GPTModel`` (a hybrid model's ``HybridModel``, 0.17/0.18
    ``MambaModel``, with megatron-ext's local layer spec: :mod:`megatron_ext.harness.hybrid`)
    whose parameters have dtype ``case.model.params_dtype``. Calling twice with the same case gives
    identical weights.
    """
    gpt_model = mcore.import_module("megatron.core.models.gpt.gpt_model")
    layer_specs = mcore.import_module("megatron.core.models.gpt.gpt_layer_specs")
    random = mcore.import_module("megatron.core.tensor_parallel.random")
    config = transformer_config(case)
    torch.manual_seed(case.model.seed)
    random.model_parallel_cuda_manual_seed(case.model.seed)
    tp, pp = model_parallel_sizes()
    parallel_state = mcore.import_module("megatron.core.parallel_state")
    spec = case.model
    # the constructor arguments GPTModel and the hybrid model share
    shared = dict(
        config=config,
        vocab_size=padded_vocab_size(spec.vocab_size, tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pp == 1 or parallel_state.is_pipeline_first_stage(),
        post_process=pp == 1 or parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not spec.untie_embeddings_and_output_weights,
        position_embedding_type=spec.position_embedding_type,
        rotary_base=spec.rotary_base,
        rotary_percent=spec.rotary_percent,
    )
    if spec.is_hybrid:
        model = build_hybrid_model(spec, **shared)
    else:
        if spec.multi_latent_attention:
            layer_spec = mla_layer_spec(spec)
        else:
            layer_options = {} if spec.normalization == "LayerNorm" else {"normalization": spec.normalization}
            if spec.is_moe:
                layer_options["num_experts"] = spec.num_experts
            layer_spec = layer_specs.get_gpt_layer_local_spec(qk_layernorm=spec.qk_layernorm, **layer_options)
        if spec.mtp_num_layers:  # megatron-core's MTP block over the same layer spec (MLA: no latent cache)
            mtp_layer_spec = mla_mtp_layer_spec(spec) if spec.multi_latent_attention else layer_spec
            shared["mtp_block_spec"] = layer_specs.get_gpt_mtp_block_spec(
                config, mtp_layer_spec, use_transformer_engine=False)
        model = gpt_model.GPTModel(transformer_layer_spec=layer_spec, **shared)
    use_router_replays(model)
    return model.to(TORCH_DTYPES[case.model.params_dtype]).eval()


def inference_config(case: Case, prefix_caching: bool, eviction_policy: str,
                     mamba_inference_state_config: Any = None) -> Any:
    """megatron-core ``InferenceConfig`` from the case's ``inference`` section (and, for weight
    updates wrapped in ``suspend()`` / ``resume()``, its ``kv_cache_management_mode``).

    ``mamba_inference_state_config``: a hybrid model's Mamba state shapes and dtypes
    (:func:`megatron_ext.harness.hybrid.mamba_inference_state_config`); None for a GPT model.
    ``inference.prefix_caching_mamba_gb`` is passed only when the case sets it."""
    module = mcore.import_module("megatron.core.inference.config")
    updates = case.weight_updates
    optional = speculative_options(case)
    if mamba_inference_state_config is not None:
        optional["mamba_inference_state_config"] = mamba_inference_state_config
    if updates is not None and updates.suspend_resume:
        optional["kv_cache_management_mode"] = getattr(module.KVCacheManagementMode,
                                                       updates.kv_cache_management_mode.upper())
    return module.InferenceConfig(
        **case.inference.model_dump(exclude_none=True), **optional,
        enable_prefix_caching=prefix_caching,
        prefix_caching_eviction_policy=getattr(module.PrefixCachingEvictionPolicy, eviction_policy.upper()),
    )


def engine_tokenizer(tokenizer: Tokenizer) -> Any:
    """The tokenizer object megatron-core's controller expects (``eod``, ``detokenize`` ...):
    ``tokenizer``'s, with a ``detokenize`` that drops IDs the tokenizer does not know and takes
    (and ignores) megatron-core's keyword arguments, the same on every release."""
    return types.SimpleNamespace(
        eod=tokenizer.eod,
        vocab_size=tokenizer.vocab_size,
        tokenize=tokenizer.tokenize,
        detokenize=lambda ids, **_: tokenizer.detokenize(list(ids)),
    )


def build_engine(model: Any, case: Case, prefix_caching: bool, eviction_policy: str,
                 tokenizer: Optional[Tokenizer] = None) -> tuple[Any, Any]:
    """A fresh ``DynamicInferenceContext`` and ``DynamicInferenceEngine`` around ``model``.

    ``tokenizer``: what the controller detokenizes with and stops at (its ``eod``); None: the
    default byte-level tokenizer.

    Returns:
        ``(engine, context)``.
    """
    dynamic_context = mcore.import_module(mcore.DYNAMIC_CONTEXT_MODULE)
    wrapper = mcore.import_module("megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper")
    controller = mcore.import_module(
        "megatron.core.inference.text_generation_controllers.text_generation_controller")
    engines = mcore.import_module("megatron.core.inference.engines.dynamic_engine")
    mamba = None
    if case.model.is_hybrid:
        ssm, conv = case.model.mamba_ssm_states_dtype, case.model.mamba_conv_states_dtype
        mamba = mamba_inference_state_config(model, None if ssm is None else TORCH_DTYPES[ssm],
                                             None if conv is None else TORCH_DTYPES[conv])
    use_router_replays(model)
    context = dynamic_context.DynamicInferenceContext(
        model.config, inference_config(case, prefix_caching, eviction_policy, mamba))
    wrapped = wrapper.GPTInferenceWrapper(model, context)
    text_controller = controller.TextGenerationController(wrapped, engine_tokenizer(tokenizer or default_tokenizer()))
    return engines.DynamicInferenceEngine(text_controller, context), context
