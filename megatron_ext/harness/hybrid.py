"""Build megatron-core's hybrid (Mamba + attention) model with a local layer spec (no Transformer Engine).

megatron-core ships hybrid stack specs built from Transformer Engine modules only
(``hybrid_stack_spec`` / ``mamba_stack_spec``), and its stack builds the final norm with ``TENorm``
unconditionally. megatron-ext builds the same layer classes (``MambaLayer`` + ``MambaMixer``,
``TransformerLayer`` + ``SelfAttention``, ``MLPLayer``) from the pieces of megatron-core's own
local GPT spec (``get_gpt_layer_local_spec``: its norm, attention and MLP submodules) and lets the
stack's final norm be that local norm while the model is built (:func:`local_final_norm`).

Class and argument names by release:

* 0.18, 0.19: ``megatron.core.models.hybrid``: ``HybridModel(hybrid_stack_spec=..., hybrid_layer_pattern=...)``
  around ``HybridStack`` / ``HybridStackSubmodules`` (``hybrid_block``);
* 0.17: ``megatron.core.models.mamba.MambaModel(mamba_stack_spec=..., hybrid_override_pattern=...)``
  around ``MambaStack`` / ``MambaStackSubmodules`` (``megatron.core.ssm.mamba_block``).
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Iterator, Optional

from .. import mcore
from ..cpu_backend._swap import AttributeSwap
from .cases.schema import ModelSpec
from .dtypes import TORCH_DTYPES


def _has_hybrid_package() -> bool:
    """Whether this release has ``megatron.core.models.hybrid`` (``HybridModel``)."""
    mcore.import_module("megatron.core.models")
    return importlib.util.find_spec("megatron.core.models.hybrid") is not None


def _stack_module() -> tuple[Any, str, str]:
    """``(module, stack class name, submodules class name)`` of this release's hybrid stack."""
    if _has_hybrid_package():
        return mcore.import_module("megatron.core.models.hybrid.hybrid_block"), "HybridStack", "HybridStackSubmodules"
    return mcore.import_module("megatron.core.ssm.mamba_block"), "MambaStack", "MambaStackSubmodules"


def model_class() -> tuple[Any, str, str]:
    """``(model class, stack-spec keyword, pattern keyword)`` of this release's hybrid model."""
    if _has_hybrid_package():
        module = mcore.import_module("megatron.core.models.hybrid.hybrid_model")
        return module.HybridModel, "hybrid_stack_spec", "hybrid_layer_pattern"
    module = mcore.import_module("megatron.core.models.mamba.mamba_model")
    return module.MambaModel, "mamba_stack_spec", "hybrid_override_pattern"


def _local_norm(spec: ModelSpec) -> Any:
    """The norm class of megatron-core's local GPT spec for ``spec.normalization`` (``WrappedTorchNorm``
    without Apex; it takes ``config, hidden_size, eps`` like ``TENorm``)."""
    return _local_gpt_layer(spec).submodules.input_layernorm


def _local_gpt_layer(spec: ModelSpec) -> Any:
    layer_specs = mcore.import_module("megatron.core.models.gpt.gpt_layer_specs")
    options = {} if spec.normalization == "LayerNorm" else {"normalization": spec.normalization}
    return layer_specs.get_gpt_layer_local_spec(qk_layernorm=spec.qk_layernorm, **options)


#: Checkpoint key of each layer's norm in megatron-core's Transformer Engine hybrid spec
#: (``hybrid_stack_spec`` / 0.17 ``mamba_stack_spec``), which fuses the norm into the next linear
#: layer (``TELayerNormColumnParallelLinear``): the local layers' norms are saved and loaded under
#: these names, so checkpoints of Megatron-LM hybrid models load (as megatron-core's local GPT
#: spec does for GPT layers).
MAMBA_NORM_KEYS = {"norm.": "mixer.in_proj.layer_norm_"}
ATTENTION_NORM_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
MLP_NORM_KEYS = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def hybrid_stack_spec(spec: ModelSpec) -> Any:
    """The ``ModuleSpec`` of a hybrid stack made of megatron-core's local (non-TE) modules.

    * ``M``: ``MambaLayer`` (``norm``: the local norm) around ``MambaMixer`` with
      ``ColumnParallelLinear`` in / ``RowParallelLinear`` out projections and
      ``chunk_size=spec.mamba_chunk_size``;
    * ``*``: ``TransformerLayer`` with the local GPT spec's input norm and self-attention, no MLP;
    * ``-``: ``MLPLayer`` with the local GPT spec's pre-MLP norm and MLP.

    Each layer's norm is checkpointed under the Transformer Engine spec's name
    (:data:`MAMBA_NORM_KEYS`, :data:`ATTENTION_NORM_KEYS`, :data:`MLP_NORM_KEYS`).
    """
    spec_utils = mcore.import_module("megatron.core.transformer.spec_utils")
    mamba_layer = mcore.import_module("megatron.core.ssm.mamba_layer")
    mamba_mixer = mcore.import_module("megatron.core.ssm.mamba_mixer")
    mlp_layer = mcore.import_module("megatron.core.ssm.mlp_layer")
    transformer_layer = mcore.import_module("megatron.core.transformer.transformer_layer")
    tensor_parallel = mcore.import_module("megatron.core.tensor_parallel")
    bda = mcore.import_module("megatron.core.fusions.fused_bias_dropout")
    module, stack, submodules = _stack_module()
    ModuleSpec = spec_utils.ModuleSpec
    gpt = _local_gpt_layer(spec).submodules
    mamba = ModuleSpec(
        module=mamba_layer.MambaLayer,
        submodules=mamba_layer.MambaLayerSubmodules(
            norm=gpt.input_layernorm,
            mixer=ModuleSpec(
                module=mamba_mixer.MambaMixer,
                params={"chunk_size": spec.mamba_chunk_size},
                submodules=mamba_mixer.MambaMixerSubmodules(
                    in_proj=tensor_parallel.ColumnParallelLinear,
                    out_proj=tensor_parallel.RowParallelLinear),
            ),
            mamba_bda=bda.get_bias_dropout_add,
            sharded_state_dict_keys_map=dict(MAMBA_NORM_KEYS),
        ),
    )
    attention = ModuleSpec(
        module=transformer_layer.TransformerLayer,
        submodules=transformer_layer.TransformerLayerSubmodules(
            input_layernorm=gpt.input_layernorm,
            self_attention=gpt.self_attention,
            self_attn_bda=bda.get_bias_dropout_add,
            sharded_state_dict_keys_map=dict(ATTENTION_NORM_KEYS),
        ),
    )
    mlp = ModuleSpec(
        module=mlp_layer.MLPLayer,
        submodules=transformer_layer.TransformerLayerSubmodules(
            pre_mlp_layernorm=gpt.pre_mlp_layernorm,
            mlp=gpt.mlp,
            mlp_bda=bda.get_bias_dropout_add,
            sharded_state_dict_keys_map=dict(MLP_NORM_KEYS),
        ),
    )
    return ModuleSpec(
        module=getattr(module, stack),
        submodules=getattr(module, submodules)(mamba_layer=mamba, attention_layer=attention, mlp_layer=mlp),
    )


@contextlib.contextmanager
def local_final_norm(spec: ModelSpec) -> Iterator[None]:
    """While the block runs, the hybrid stack module's ``TENorm`` (its final norm, built
    unconditionally, and Transformer Engine is not installed) is the local spec's norm.

    The name is only looked up while the stack is constructed: build the model inside the block.
    """
    module, _, _ = _stack_module()
    swap = AttributeSwap()
    try:
        swap.set(module, "TENorm", _local_norm(spec))
        yield
    finally:
        swap.restore()


def build_hybrid_model(spec: ModelSpec, **model_kwargs: Any) -> Any:
    """megatron-core's hybrid model (``HybridModel``, 0.17/0.18 ``MambaModel``) for ``spec`` with
    the local stack spec; ``model_kwargs`` are the constructor arguments it shares with
    ``GPTModel`` (``config`` with the Mamba sizes, vocabulary, sequence length, stages, embeddings,
    rotary settings; see :func:`megatron_ext.harness.engine.build_model`)."""
    cls, stack_keyword, pattern_keyword = model_class()
    with local_final_norm(spec):
        return cls(**{stack_keyword: hybrid_stack_spec(spec), pattern_keyword: spec.hybrid_layer_pattern},
                   **model_kwargs)


def mamba_inference_state_config(model: Any, ssm_states_dtype: Any = None, conv_states_dtype: Any = None) -> Any:
    """megatron-core's ``MambaInferenceStateConfig`` for a built hybrid model, with the SSM
    states and the conv states (and their prefix-cache snapshots) in ``ssm_states_dtype`` and
    ``conv_states_dtype`` (``torch.dtype``; None: megatron-core's default, the model's dtype)."""
    config = mcore.import_module("megatron.core.inference.config")
    options = {name: dtype for name, dtype in (("ssm_states_dtype", ssm_states_dtype),
                                               ("conv_states_dtype", conv_states_dtype)) if dtype is not None}
    return config.MambaInferenceStateConfig.from_model(model, **options)


#: Fault H2, the dtype rule of hybrid models with prefix caching (``status`` prints it; every
#: release 0.17-0.19 and upstream main store Mamba states in the model's dtype by default).
MAMBA_STATE_DTYPE_RULE = (
    "hybrid (Mamba) models with prefix caching need fp32 Mamba states: with a bf16 model's default "
    "(states in its own dtype) requests that restore a cached Mamba state differ from caching off "
    "(fault H2, every release, not patched); set MambaInferenceStateConfig ssm_states_dtype=torch.float32 "
    "(case: mamba_ssm_states_dtype: fp32)")


def bf16_mamba_states(spec: ModelSpec) -> bool:
    """Whether ``spec`` is a hybrid model whose Mamba SSM states (live, and the prefix cache's
    snapshots) are kept in bf16: ``mamba_ssm_states_dtype`` bf16, or unset on a bf16 model
    (megatron-core's ``MambaInferenceStateConfig.from_model`` then takes ``params_dtype``)."""
    if not spec.is_hybrid:
        return False
    return (spec.mamba_ssm_states_dtype or spec.params_dtype) != "fp32"


def kernel_dtypes(spec: ModelSpec) -> Any:
    """The dtypes a run of ``spec`` gives megatron's Mamba kernels, for their batch-invariance
    self-check: a :class:`~megatron_ext.cpu_backend.mamba_check.MambaDtypes` of the model's
    ``params_dtype`` and the SSM / conv state dtypes (unset: the model's, as megatron-core's
    ``MambaInferenceStateConfig.from_model`` takes them); None for a model without Mamba layers."""
    if not spec.is_hybrid:
        return None
    from ..cpu_backend.mamba_check import MambaDtypes  # here: a GPT run never imports the Mamba check

    return MambaDtypes(TORCH_DTYPES[spec.params_dtype], TORCH_DTYPES[spec.mamba_ssm_states_dtype or spec.params_dtype],
                       TORCH_DTYPES[spec.mamba_conv_states_dtype or spec.params_dtype])


def mamba_state_dtype_warning(spec: ModelSpec) -> Optional[str]:
    """One line for ``ab``'s report when ``spec`` breaks the dtype rule (:func:`bf16_mamba_states`),
    else None. Why: megatron-core's chunked scan carries the SSM state from chunk to chunk in fp32
    registers and only stores it in the state dtype; a prefix-cache snapshot is that stored bf16
    value, so the tokens after a restored state start from a rounded state, while caching off goes on
    from the unrounded one. With fp32 states the snapshot is the carried value itself."""
    if not bf16_mamba_states(spec):
        return None
    how = "bf16" if spec.mamba_ssm_states_dtype == "bf16" else "unset: the model's dtype, bf16"
    return (f"Mamba states in bf16 (mamba_ssm_states_dtype {how}) with prefix caching: requests that "
            "restore a cached Mamba state may differ from caching off (fault H2, not patched); set "
            "mamba_ssm_states_dtype: fp32")
