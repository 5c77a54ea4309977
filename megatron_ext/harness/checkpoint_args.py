"""Megatron-LM training arguments in a checkpoint: written by ``save-checkpoint``, read by ``ab --load``.

Megatron-LM stores its training arguments (an ``argparse.Namespace``) under ``args`` in a
checkpoint's common state, next to ``iteration`` and ``checkpoint_version``; its
``--use-checkpoint-args`` builds the model from them. :func:`megatron_lm_args` writes the
architecture arguments of a :class:`~megatron_ext.harness.cases.ModelSpec` under the same names,
and :func:`model_spec_from_args` maps a checkpoint's arguments back to a ``ModelSpec``, refusing
by name every argument whose value the harness cannot build (grouped-GEMM experts, a RoPE type
other than ``rope`` or ``yarn`` for multi-latent attention, ...). Runtime and fusion flags in the arguments (``apply_rope_fusion``,
``bias_swiglu_fusion``, ``masked_softmax_fusion``, ...) are never read: they describe the
training machine, not the model.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

import torch
from pydantic import ValidationError

from .cases.schema import MLA_ROPE_FIELDS, ModelSpec, describe_validation_error
from .checkpoint import CheckpointError, CheckpointSource, read_common_state
from .dtypes import TORCH_DTYPES

#: ``checkpoint_version`` Megatron-LM writes (training/checkpointing.py).
CHECKPOINT_VERSION = 3.0

#: Argument -> (the value it must have, what a different value means), for arguments the harness
#: cannot honour. None also accepts 0 / False / a missing argument.
UNSUPPORTED_ARGS = {
    "moe_grouped_gemm": (False, "grouped-GEMM experts (the harness builds SequentialMLP experts)"),
    "moe_shared_expert_intermediate_size": (None, "shared experts"),
    "moe_router_score_function": ("softmax", "a router score function other than softmax"),
    "moe_router_pre_softmax": (False, "softmax before top-k routing"),
    "moe_router_num_groups": (None, "group-limited routing"),
    "moe_router_enable_expert_bias": (False, "expert bias in the router"),
    "spec": (None, "a custom layer spec module"),
    "heterogeneous_layers_config_path": (None, "heterogeneous layers"),
    "experimental_attention_variant": (None, "an experimental attention variant"),
    "window_size": (None, "sliding-window attention"),
    "apply_layernorm_1p": (False, "zero-centered (1p) layer norm"),
    "squared_relu": (False, "squared-ReLU activation"),
    "rotary_interleaved": (False, "interleaved rotary embeddings"),
    "use_rope_scaling": (False, "Llama-3.1 RoPE scaling"),
    "rotary_seq_len_interpolation_factor": (None, "RoPE sequence-length interpolation"),
    "fp16": (False, "fp16 parameters (the harness builds fp32 or bf16)"),
    "softmax_type": ("vanilla", "a softmax other than the default (off-by-one or learnable)"),
    "expert_model_parallel_size": (1, "expert parallelism (the harness keeps every expert on every rank)"),
    "mtp_hybrid_override_pattern": (None, "MTP layers of a hybrid model"),
}

_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")

#: ``--spec`` values of megatron-core's own hybrid stack specs (Transformer Engine modules; 0.17
#: ``mamba_stack_spec``): the harness builds the same layers from local modules, saved and loaded
#: under the same checkpoint keys (:mod:`megatron_ext.harness.hybrid`).
HYBRID_STACK_SPECS = ("hybrid_stack_spec", "mamba_stack_spec")

#: Megatron-LM's Mamba sizes in a checkpoint's args, with its defaults (``TransformerConfig``'s)
#: where they are absent, and the ``ModelSpec`` field each becomes.
MAMBA_ARGS = {"mamba_state_dim": 128, "mamba_head_dim": 64, "mamba_num_groups": 8, "mamba_num_heads": None}

#: Megatron-LM's ``--mamba-inference-*-states-dtype`` values (strings, or torch dtypes once its
#: argument parsing mapped them) -> ``ModelSpec`` dtype names.
_STATE_DTYPES = {**{name: name for name in TORCH_DTYPES}, **{dtype: name for name, dtype in TORCH_DTYPES.items()}}


def megatron_lm_args(spec: ModelSpec, padded_vocab_size: int, tensor_model_parallel_size: int = 1,
                     pipeline_model_parallel_size: int = 1) -> argparse.Namespace:
    """The Megatron-LM training arguments that describe the model ``spec`` builds, under
    Megatron-LM's names and conventions (``kv_channels`` and ``num_query_groups`` always set,
    ``group_query_attention`` on when ``spec.num_query_groups`` is, ``params_dtype`` a torch dtype).

    Args:
        spec: the model.
        padded_vocab_size: rows of the saved word embedding (``spec.vocab_size`` rounded up for TP).
        tensor_model_parallel_size, pipeline_model_parallel_size: the layout it was saved from.
    """
    dtype = TORCH_DTYPES[spec.params_dtype]
    rope = spec.position_embedding_type == "rope"
    return argparse.Namespace(
        **_hybrid_args(spec),
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.effective_ffn_hidden_size() or 4 * spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        group_query_attention=spec.num_query_groups is not None,
        num_query_groups=spec.num_query_groups or spec.num_attention_heads,
        kv_channels=spec.kv_channels or spec.hidden_size // spec.num_attention_heads,
        normalization=spec.normalization,
        norm_epsilon=spec.norm_epsilon,
        apply_layernorm_1p=False,
        qk_layernorm=spec.qk_layernorm,
        swiglu=spec.swiglu,
        squared_relu=False,
        position_embedding_type=spec.position_embedding_type,
        add_position_embedding=spec.position_embedding_type == "learned_absolute",
        use_rotary_position_embeddings=rope,
        rotary_base=spec.rotary_base,
        rotary_percent=spec.rotary_percent,
        rotary_interleaved=False,
        use_rope_scaling=False,
        rotary_seq_len_interpolation_factor=None,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        untie_embeddings_and_output_weights=spec.untie_embeddings_and_output_weights,
        padded_vocab_size=padded_vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        seq_length=spec.max_position_embeddings,
        init_method_std=0.02 if spec.init_method_std is None else spec.init_method_std,
        seed=spec.seed,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=False,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        **_moe_args(spec),
        **_mla_args(spec),
        mtp_num_layers=spec.mtp_num_layers,
        mtp_use_repeated_layer=spec.mtp_use_repeated_layer,
        spec=None,
        transformer_impl="local",
        ckpt_format="torch_dist",
    )


def _hybrid_args(spec: ModelSpec) -> dict[str, Any]:
    """A hybrid model's Megatron-LM arguments (``hybrid_layer_pattern``, the ``mamba_*`` sizes, the
    inference state dtypes where the spec sets them, as torch dtypes like Megatron-LM's parsed
    args); none for a GPT model."""
    if not spec.is_hybrid:
        return {}
    states = {arg: TORCH_DTYPES[value] for arg, value in (
        ("mamba_inference_ssm_states_dtype", spec.mamba_ssm_states_dtype),
        ("mamba_inference_conv_states_dtype", spec.mamba_conv_states_dtype)) if value is not None}
    return {"hybrid_layer_pattern": spec.hybrid_layer_pattern, "hybrid_override_pattern": None,
            **{name: getattr(spec, name) for name in MAMBA_ARGS}, **states}


def _moe_args(spec: ModelSpec) -> dict[str, Any]:
    """A mixture-of-experts model's Megatron-LM arguments (``num_experts`` None for a dense one)."""
    if not spec.is_moe:
        return {"num_experts": None}
    return {"num_experts": spec.num_experts, "moe_router_topk": spec.moe_router_topk,
            "moe_ffn_hidden_size": spec.effective_moe_ffn_hidden_size(),
            "moe_enable_routing_replay": spec.moe_enable_routing_replay,
            "moe_router_load_balancing_type": "none", "moe_layer_freq": 1}


def _moe_fields(args: Any) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a mixture-of-experts model's args (none for a dense model)."""
    if not getattr(args, "num_experts", None):
        return {}
    return {"num_experts": args.num_experts, "moe_router_topk": getattr(args, "moe_router_topk", 2),
            "moe_ffn_hidden_size": getattr(args, "moe_ffn_hidden_size", None),
            "moe_enable_routing_replay": bool(getattr(args, "moe_enable_routing_replay", False))}


#: Megatron-LM's MLA sizes (``--q-lora-rank`` ...) with its defaults where the args lack them.
MLA_ARGS = {"q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
            "v_head_dim": 128}


#: An MLA model's YaRN fields under Megatron-LM's argument names (``--rotary-scaling-factor``,
#: ``--mscale``, ``--mscale-all-dim``), with Megatron-LM's argument defaults where the args lack them.
MLA_YARN_ARGS = {"rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}

#: An MLA model's YaRN fields Megatron-LM has no MLA argument for: ``MLATransformerConfig``'s own
#: names (Megatron-LM builds the config from every args attribute named like one of its fields),
#: with megatron-core's defaults where the args lack them.
MLA_CONFIG_YARN_ARGS = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


def _mla_args(spec: ModelSpec) -> dict[str, Any]:
    """A multi-latent attention model's Megatron-LM arguments (``multi_latent_attention`` False for
    any other model): the sizes, ``rope_type`` (``rope`` or ``yarn``), the YaRN parameters
    (:data:`MLA_YARN_ARGS`, :data:`MLA_CONFIG_YARN_ARGS`) and ``cache_mla_latents`` (how the
    harness's engine runs it; no tensor depends on it)."""
    if not spec.multi_latent_attention:
        return {"multi_latent_attention": False}
    return {"multi_latent_attention": True, **{name: getattr(spec, name) for name in MLA_ARGS},
            "rope_type": spec.rope_type, **{name: getattr(spec, name) for name in (*MLA_YARN_ARGS, *MLA_CONFIG_YARN_ARGS)},
            "cache_mla_latents": True}


def _mla_fields(args: Any) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a multi-latent attention model's args (none for another model).
    ``rope_type`` None (Megatron-LM's ``--rope-type`` default) is megatron-core's MLA default, yarn."""
    if not getattr(args, "multi_latent_attention", False):
        return {}
    sizes = {name: getattr(args, name, None) for name in MLA_ARGS}
    yarn = {name: default if getattr(args, name, None) is None else getattr(args, name)
            for name, default in {**MLA_YARN_ARGS, **MLA_CONFIG_YARN_ARGS}.items()}
    return {"multi_latent_attention": True,
            **{name: default if sizes[name] is None else sizes[name] for name, default in MLA_ARGS.items()},
            "rope_type": getattr(args, "rope_type", None) or "yarn", **yarn}


def _hybrid_pattern(args: Any) -> tuple[Optional[str], list[str]]:
    """``(layer pattern or None, refusals)`` from ``hybrid_layer_pattern`` (or the older
    ``hybrid_override_pattern``). Pipeline-stage separators (``|``) are dropped: they lay the
    layers out over stages, which ``ab`` takes from the case (dist checkpointing reshards)."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    legacy = getattr(args, "hybrid_override_pattern", None)
    if pattern is not None and legacy is not None and pattern != legacy:
        return None, [f"hybrid_layer_pattern={pattern!r} and hybrid_override_pattern={legacy!r} (two layer patterns)"]
    pattern = pattern if pattern is not None else legacy
    if pattern is None:
        ratios = [f"{name}={getattr(args, name)!r}" for name in ("hybrid_attention_ratio", "hybrid_mlp_ratio")
                  if getattr(args, name, 0)]
        if ratios or getattr(args, "is_hybrid_model", False):
            return None, [f"{', '.join(ratios) or 'is_hybrid_model=True'} without hybrid_layer_pattern (a "
                          "layer pattern Megatron-LM derives from ratios)"]
        return None, []
    if "/" in pattern:
        return None, [f"hybrid_layer_pattern={pattern!r} (multi-token prediction layers after '/')"]
    return pattern.replace("|", ""), []


def _refusals(args: Any) -> list[str]:
    pattern, refused = _hybrid_pattern(args)
    for name, (required, what) in UNSUPPORTED_ARGS.items():
        value = getattr(args, name, required)
        if name == "spec" and pattern is not None and _is_hybrid_stack_spec(value):
            continue
        if value == required or (required is None and value in (0, False)):
            continue
        refused.append(f"{name}={value!r} ({what})")
    rope_type = getattr(args, "rope_type", None)
    if getattr(args, "multi_latent_attention", False) and rope_type not in (None, "rope", "yarn"):
        refused.append(f"multi_latent_attention=True with rope_type={rope_type!r} (megatron-core's MLA builds "
                       "'rope' or 'yarn')")
    freq = getattr(args, "moe_layer_freq", 1)
    if getattr(args, "num_experts", None) and freq != 1:
        refused.append(f"moe_layer_freq={freq!r} (experts in some layers only; the harness puts them in every layer)")
    normalization = getattr(args, "normalization", "LayerNorm")
    if normalization not in _NORMALIZATIONS:
        refused.append(f"normalization={normalization!r} (the harness builds {' or '.join(_NORMALIZATIONS)})")
    position = _position_embedding_type(args)
    if position not in _POSITION_EMBEDDINGS:
        refused.append(f"position_embedding_type={position!r} (the harness builds "
                       f"{' or '.join(_POSITION_EMBEDDINGS)})")
    return refused


def _is_hybrid_stack_spec(value: Any) -> bool:
    """Whether a ``--spec`` value (``[module, function]``) names megatron-core's hybrid stack spec."""
    return isinstance(value, (list, tuple)) and len(value) == 2 and value[1] in HYBRID_STACK_SPECS


def _mamba_fields(args: Any, pattern: Optional[str]) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a hybrid model's Mamba sizes and inference state dtypes
    (none for a GPT model; dtypes only where the args carry a value the harness builds)."""
    if pattern is None:
        return {}
    fields: dict[str, Any] = {"hybrid_layer_pattern": pattern, "num_layers": len(pattern)}
    for name, default in MAMBA_ARGS.items():
        value = getattr(args, name, default)
        fields[name] = default if value is None and default is not None else value
    for field_name, arg in (("mamba_ssm_states_dtype", "mamba_inference_ssm_states_dtype"),
                            ("mamba_conv_states_dtype", "mamba_inference_conv_states_dtype")):
        value = getattr(args, arg, None)
        if value is not None and value in _STATE_DTYPES:
            fields[field_name] = _STATE_DTYPES[value]
    return fields


def _position_embedding_type(args: Any) -> Any:
    if hasattr(args, "position_embedding_type"):
        return args.position_embedding_type
    return "rope" if getattr(args, "use_rotary_position_embeddings", False) else "learned_absolute"


def _add_bias_linear(args: Any) -> bool:
    if hasattr(args, "add_bias_linear"):
        return bool(args.add_bias_linear)
    return not getattr(args, "disable_bias_linear", False)  # Megatron-LM before add_bias_linear


def _params_dtype(args: Any) -> str:
    if getattr(args, "bf16", False):
        return "bf16"
    return "bf16" if getattr(args, "params_dtype", None) is torch.bfloat16 else "fp32"


def model_spec_from_args(args: Any, where: str, base: Optional[ModelSpec] = None) -> ModelSpec:
    """The :class:`ModelSpec` a checkpoint's Megatron-LM arguments describe (what Megatron-LM's
    ``--use-checkpoint-args`` would build), with ``seed`` and ``init_method_std`` from ``base``
    (they only shape random weights, which the checkpoint replaces).

    A hybrid model (``hybrid_layer_pattern``, or the older ``hybrid_override_pattern``) gets its
    pattern (pipeline separators ``|`` dropped; ``num_layers`` its length, as Megatron-LM does),
    its Mamba sizes (Megatron-LM's defaults where absent) and the Mamba chunk size 128
    (``MambaMixer``'s; Megatron-LM has no argument for it). ``--spec`` naming megatron-core's
    hybrid stack spec is accepted for it.

    Args:
        args: the ``args`` of a checkpoint's common state (an ``argparse.Namespace``).
        where: the checkpoint, named in errors.
        base: supplies ``seed`` and ``init_method_std`` (default: ``ModelSpec()``'s).

    Raises:
        CheckpointError: an argument the harness cannot honour (named with its value, e.g.
            ``num_experts=64 (mixture of experts)``, a layer pattern derived from ratios or with
            multi-token prediction layers), a required one missing (``num_layers``,
            ``hidden_size``, ``num_attention_heads``, ``padded_vocab_size``, and
            ``max_position_embeddings`` or ``seq_length``), or values ``ModelSpec`` refuses.
    """
    base = base or ModelSpec()
    refused = _refusals(args)
    if refused:
        raise CheckpointError(f"{where}: the checkpoint's model has arguments the harness cannot build: "
                              f"{'; '.join(refused)}")
    max_positions = getattr(args, "max_position_embeddings", None) or getattr(args, "seq_length", None)
    missing = [name for name, value in (
        ("num_layers", getattr(args, "num_layers", None)),
        ("hidden_size", getattr(args, "hidden_size", None)),
        ("num_attention_heads", getattr(args, "num_attention_heads", None)),
        ("padded_vocab_size", getattr(args, "padded_vocab_size", None)),
        ("max_position_embeddings (or seq_length)", max_positions)) if value is None]
    if missing:
        raise CheckpointError(f"{where}: the checkpoint's args lack {', '.join(missing)}; pass a --case "
                              "whose model section describes the checkpoint's model")
    heads, hidden = args.num_attention_heads, args.hidden_size
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (heads, hidden, args.num_layers)):
        raise CheckpointError(f"{where}: the checkpoint's args give num_layers={args.num_layers!r}, "
                              f"hidden_size={hidden!r}, num_attention_heads={heads!r}: positive integers "
                              "expected; pass a --case whose model section describes the checkpoint's model")
    kv_channels = getattr(args, "kv_channels", None)
    swiglu = bool(getattr(args, "swiglu", False))
    ffn = getattr(args, "ffn_hidden_size", None)
    default_ffn = int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden  # Megatron-LM's
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None,
        kv_channels=None if kv_channels in (None, hidden // heads) else kv_channels,
        ffn_hidden_size=None if ffn == default_ffn else ffn,
        normalization=getattr(args, "normalization", "LayerNorm"),
        norm_epsilon=getattr(args, "norm_epsilon", 1e-5),
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        swiglu=swiglu,
        position_embedding_type=_position_embedding_type(args),
        rotary_base=getattr(args, "rotary_base", 10000),
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        add_bias_linear=_add_bias_linear(args),
        add_qkv_bias=bool(getattr(args, "add_qkv_bias", False)),
        untie_embeddings_and_output_weights=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
        vocab_size=args.padded_vocab_size,
        max_position_embeddings=max_positions,
        params_dtype=_params_dtype(args),
        seed=base.seed,
        init_method_std=base.init_method_std,
        mtp_num_layers=getattr(args, "mtp_num_layers", None) or None,  # Megatron-LM: None or 0 without MTP
        mtp_use_repeated_layer=bool(getattr(args, "mtp_use_repeated_layer", False)),
    )
    fields.update(_mamba_fields(args, _hybrid_pattern(args)[0]))
    fields.update(_moe_fields(args))
    fields.update(_mla_fields(args))
    try:
        return ModelSpec.model_validate(fields)
    except ValidationError as exc:
        raise CheckpointError(f"{where}: the checkpoint's args do not make a model the harness can build: "
                              f"{describe_validation_error(exc)}") from None


#: ``ModelSpec`` fields no tensor shape depends on: a case's model section that disagrees with the
#: checkpoint on one of them loads without a shape mismatch and runs a different model. Megatron-LM's
#: defaults where the args lack them (as :func:`model_spec_from_args`).
SHAPELESS_FIELDS = {"norm_epsilon": 1e-5, "rotary_base": 10000, "rotary_percent": 1.0}


def _attention_geometry(heads: Any, groups: Any, kv_channels: Any, hidden: Any) -> Optional[tuple]:
    """``(heads, query groups, kv_channels)`` with Megatron's defaults filled in; None if not integers."""
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (heads, hidden)):
        return None
    kv_channels = kv_channels or hidden // heads
    return heads, groups or heads, kv_channels


def shapeless_disagreements(spec: ModelSpec, args: Any) -> list[tuple[str, Any, Any]]:
    """``(field, case value, checkpoint value)`` for each model value the case's ``spec`` gives
    otherwise than the checkpoint's Megatron-LM ``args`` where the weights' shapes cannot show it.

    Compared: :data:`SHAPELESS_FIELDS` (the rotary ones only when both are RoPE models; otherwise the
    position embedding tensor differs), an MLA model's ``rope_type`` and YaRN parameters
    (``MLA_ROPE_FIELDS``, when both are MLA models), and the attention geometry (heads, query groups,
    kv_channels) when every attention shape agrees (e.g. 8 heads of 8 channels against 4 of 16).
    Everything else a difference changes shows as a tensor shape (or a missing tensor) at load.
    """
    found = []
    rope = spec.position_embedding_type == "rope" and _position_embedding_type(args) == "rope"
    for name, default in SHAPELESS_FIELDS.items():
        if name.startswith("rotary_") and not rope:
            continue
        theirs = getattr(args, name, default)
        if theirs is None:
            theirs = default
        if getattr(spec, name) != theirs:
            found.append((name, getattr(spec, name), theirs))
    if spec.multi_latent_attention and getattr(args, "multi_latent_attention", False):
        theirs_mla = _mla_fields(args)
        found += [(name, getattr(spec, name), theirs_mla[name]) for name in MLA_ROPE_FIELDS
                  if getattr(spec, name) != theirs_mla[name]]
    group_query = getattr(args, "group_query_attention", False)
    ours = _attention_geometry(spec.num_attention_heads, spec.num_query_groups, spec.kv_channels, spec.hidden_size)
    theirs = _attention_geometry(getattr(args, "num_attention_heads", None),
                                 getattr(args, "num_query_groups", None) if group_query else None,
                                 getattr(args, "kv_channels", None), getattr(args, "hidden_size", None))
    if ours and theirs and ours != theirs and getattr(args, "hidden_size", None) == spec.hidden_size:
        (heads, groups, kv), (their_heads, their_groups, their_kv) = ours, theirs
        if heads * kv == their_heads * their_kv and groups * kv == their_groups * their_kv:
            for name, mine, other in zip(("num_attention_heads", "num_query_groups", "kv_channels"), ours, theirs):
                if mine != other:
                    found.append((name, mine, other))
    return found


def check_case_model_matches_args(source: CheckpointSource, spec: ModelSpec) -> None:
    """Refuse a case's model section that disagrees with the checkpoint's Megatron-LM args on a
    value its weights' shapes cannot show (:func:`shapeless_disagreements`): loading would succeed
    and run another model than the one trained, silently. Nothing is checked when the checkpoint
    stores no args (or args that are not a Namespace: the shapes are all there is then).

    Raises:
        CheckpointError: the first disagreement, both values named, with the fix.
    """
    args = read_common_state(source.path).get("args")
    if not isinstance(args, argparse.Namespace):
        return
    found = shapeless_disagreements(spec, args)
    if found:
        name, ours, theirs = found[0]
        others = "".join(f", {n}: {o!r} vs {t!r}" for n, o, t in found[1:])
        raise CheckpointError(
            f"--load {source.requested}: the case's model section has {name}={ours!r} but the checkpoint's "
            f"Megatron-LM args have {name}={theirs!r}{others} (the weights' shapes cannot show it, so the run "
            f"would use the wrong one); set {name}: {theirs!r} in the case's model section, or leave the "
            "model section out to build the model from the checkpoint's args")


def checkpoint_model_spec(source: CheckpointSource, base: Optional[ModelSpec] = None) -> Optional[ModelSpec]:
    """The :class:`ModelSpec` from the Megatron-LM ``args`` in ``source``'s common state, or None
    when the checkpoint stores no ``args`` (e.g. saved by ``dist_checkpointing.save`` alone).

    Raises:
        CheckpointError: the common state is unreadable; see :func:`model_spec_from_args`.
    """
    args = read_common_state(source.path).get("args")
    if args is None:
        return None
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"--load {source.requested}: the common state's 'args' is a "
                              f"{type(args).__name__}, not Megatron-LM's argparse.Namespace; pass a --case "
                              "whose model section describes the checkpoint's model")
    return model_spec_from_args(args, f"--load {source.requested}", base)
