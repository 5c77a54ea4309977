"""Megatron functional-test cases (``model_config.yaml``) as ``ab`` cases.

Megatron-LM describes each of its inference tests (``tests/functional_tests/test_cases/gpt/
gpt_dynamic_inference_*prefix_caching*/model_config.yaml``) as ``MODE``, ``ENV_VARS`` and
``MODEL_ARGS``: the command-line arguments of ``gpt_dynamic_inference.py``. ``ab --case
model_config.yaml`` reads such a file: every argument megatron-ext understands is mapped onto the
case (inference config, eviction policy, prompts, sampling, model and its ``--seed``, checkpoint,
layout); every other one is listed once, as ignored (:data:`IGNORED_GROUPS`: it changes neither the
model nor the engine: logging, training-only settings, GPU kernels, output paths) or refused (it
changes the model or the engine in a way ``ab`` cannot reproduce). An argument in none of these
lists stops the run (``ab`` cannot tell what it changes) unless ``ab --allow-unknown-args``.
``${VARIABLES}`` in mapped values are expanded from the environment.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from .. import mcore
from .cases import parse_case
from .cases.schema import Case, CaseFileError, ModelSpec, RequestSpec

#: Megatron-LM's default KV block size (``--inference-dynamic-batching-block-size``) when absent.
MEGATRON_BLOCK_SIZE_TOKENS = 256

#: Buffer sizes above this are refused on the CPU: megatron-core allocates the whole KV buffer.
CPU_BUFFER_LIMIT_GB = 4.0

#: The one list of Megatron arguments that change neither the model nor the engine (nothing ``ab``
#: compares): ``{why: arguments}``, one reason per group. An argument ending in ``*`` stands for
#: every argument that starts with it (``--log-*``: ``--log-interval``, ``--log-params-norm``, ...).
#: Listed as ignored when a file gives them; any other argument not known to megatron-ext stops a run.
IGNORED_GROUPS: dict[str, tuple[str, ...]] = {
    "logging, timers and experiment tracking": (
        "--log-*", "--tensorboard-*", "--wandb-*", "--timing-log-level", "--timing-log-option", "--logging-level",
        "--inference-logging-step-interval"),
    "training only (ab runs no training loop: its weight updates come from the case)": (
        "--micro-batch-size", "--global-batch-size", "--train-iters", "--train-samples", "--eval-iters",
        "--eval-interval", "--exit-*", "--lr", "--min-lr", "--lr-*", "--weight-decay", "--clip-grad",
        "--adam-beta1", "--adam-beta2", "--adam-eps", "--optimizer", "--use-distributed-optimizer",
        "--overlap-grad-reduce", "--overlap-param-gather", "--no-gradient-accumulation-fusion",
        "--check-for-nan-in-loss-and-grad", "--manual-gc", "--manual-gc-interval"),
    "training setting (the engine's limit is --inference-max-seq-length)": ("--seq-length",),
    "checkpoint saving (ab saves nothing)": ("--save", "--save-*", "--async-save"),
    "checkpoint I/O strategy": ("--ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
                                "--ckpt-assume-constant-structure"),
    "data loading (ab takes the prompts from this file)": (
        "--num-workers", "--no-create-attention-mask-in-dataloader", "--data-path", "--data-cache-path", "--split",
        "--mock-data"),
    "tokenizer settings of TikTokenizer: ab loads it with megatron-core's defaults (pattern v2, 1000 special "
    "tokens); they change the prompts' token IDs, not the model or the engine": ("--tiktoken-*",),
    "ab always runs prefix caching off (A) and on (B)": ("--inference-dynamic-batching-prefix-caching",),
    "ab always records log-probs": ("--return-log-probs",),
    "megatron-core's GPTModel is what ab builds": ("--use-mcore-models",),
    "ab reads torch_dist checkpoints only and checks the format": ("--auto-detect-ckpt-format",),
    "ab loads model weights only": ("--no-load-optim",),
    "ab takes the tokenizer from this file": ("--no-use-tokenizer-model-from-checkpoint-args",),
    "a GPU kernel setting, ab checks batch invariance itself on the CPU": ("--deterministic-mode",),
    "a GPU communication setting; outputs do not depend on it": ("--sequence-parallel",),
    "GPU kernel choice, the CPU backend has one reference attention": ("--attention-backend",),
    "ab builds megatron-core's local layer spec (same parameter names)": ("--transformer-impl",),
    "ab runs CPU ranks over gloo": ("--distributed-backend", "--distributed-timeout-minutes"),
    "a GPU memory guard": ("--max-tokens-to-oom",),
    "ab never fuses RoPE on the CPU": ("--no-rope-fusion",),
    "the CPU backend has no fused softmax": ("--no-masked-softmax-fusion",),
    "ab's checkpoint load is always strict": ("--dist-ckpt-strictness", "--inference-ckpt-non-strict"),
    "ab writes its own results (--json)": ("--output-path",),
    "no dropout at inference": ("--hidden-dropout", "--attention-dropout"),
    "ab builds a hybrid model when the file gives --hybrid-layer-pattern, else a GPT model": ("--model-provider",),
    "ab builds a hybrid model when the file gives --hybrid-layer-pattern": ("--is-hybrid-model",),
    "a training loss (ab builds the router without load balancing: inference)": (
        "--moe-aux-loss-coeff", "--moe-z-loss-coeff"),
    "how tokens reach the experts on several ranks; ab keeps every expert on every rank": (
        "--moe-token-dispatcher-type",),
    "ab runs one engine per layout, not data-parallel engines behind a coordinator": (
        "--inference-dynamic-batching-prefix-caching-coordinator-policy",
        "--inference-dynamic-batching-prefix-caching-routing-alpha"),
    "training loss weight of the MTP layers": ("--mtp-loss-scaling-factor",),
}

#: Ignored arguments by name -> why (from :data:`IGNORED_GROUPS`).
IGNORED = {arg: why for why, args in IGNORED_GROUPS.items() for arg in args if not arg.endswith("*")}
#: Ignored arguments by prefix -> why (from :data:`IGNORED_GROUPS`).
IGNORED_PREFIXES = {arg[:-1]: why for why, args in IGNORED_GROUPS.items() for arg in args if arg.endswith("*")}


def ignored_why(arg: str) -> Optional[str]:
    """Why ``arg`` changes nothing ``ab`` compares (:data:`IGNORED_GROUPS`), or None if it is not listed."""
    if arg in IGNORED:
        return IGNORED[arg]
    return next((why for prefix, why in IGNORED_PREFIXES.items() if arg.startswith(prefix)), None)


#: Argument prefixes and arguments that change the model or engine beyond what ab reproduces.
REFUSED_PREFIXES = {
    "--moe-": "of the mixture-of-experts arguments ab builds --num-experts, --moe-router-topk, "
              "--moe-ffn-hidden-size and --moe-enable-routing-replay only",
    "--fp8": "FP8 needs Transformer Engine on a GPU",
    "--cuda-graph": "CUDA graphs need a GPU",
}
REFUSED = {
    "--expert-model-parallel-size": "expert parallelism is not supported by ab (experts on every rank)",
    "--expert-tensor-parallel-size": "expert parallelism is not supported by ab (experts on every rank)",
    "--hybrid-attention-ratio": "a layer pattern derived from ratios: give --hybrid-layer-pattern",
    "--hybrid-mlp-ratio": "a layer pattern derived from ratios: give --hybrid-layer-pattern",
    "--mtp-hybrid-override-pattern": "MTP layers of a hybrid model are not supported by ab (GPT MTP layers are)",
    "--window-size": "sliding-window attention is not supported by the CPU backend",
    "--softmax-type": "only the default softmax is supported",
    "--fp16": "ab runs bf16 or fp32",
    "--stop-words": "stop words are not supported by ab",
    "--termination-id": "a custom termination token is not supported by ab",
}

#: ``--flag`` -> model section field, where they differ only in spelling.
MODEL_FIELDS = {
    "--num-layers": "num_layers",
    "--hidden-size": "hidden_size",
    "--ffn-hidden-size": "ffn_hidden_size",
    "--num-attention-heads": "num_attention_heads",
    "--num-query-groups": "num_query_groups",
    "--kv-channels": "kv_channels",
    "--max-position-embeddings": "max_position_embeddings",
    "--padded-vocab-size": "vocab_size",
    "--init-method-std": "init_method_std",
    "--normalization": "normalization",
    "--norm-epsilon": "norm_epsilon",
    "--swiglu": "swiglu",
    "--position-embedding-type": "position_embedding_type",
    "--rotary-base": "rotary_base",
    "--rotary-percent": "rotary_percent",
    "--qk-layernorm": "qk_layernorm",
    "--untie-embeddings-and-output-weights": "untie_embeddings_and_output_weights",
    "--add-qkv-bias": "add_qkv_bias",
    "--mamba-state-dim": "mamba_state_dim",
    "--mamba-head-dim": "mamba_head_dim",
    "--mamba-num-groups": "mamba_num_groups",
    "--mamba-num-heads": "mamba_num_heads",
    "--num-experts": "num_experts",
    "--moe-router-topk": "moe_router_topk",
    "--moe-ffn-hidden-size": "moe_ffn_hidden_size",
    "--moe-enable-routing-replay": "moe_enable_routing_replay",
    "--mtp-num-layers": "mtp_num_layers",
    "--mtp-use-repeated-layer": "mtp_use_repeated_layer",
}

#: Multi-latent attention: ``--flag`` -> model section field, and Megatron-LM's default where the
#: file does not give it (megatron-ext's model section has smaller defaults of its own).
MLA_ARGS = {
    "--q-lora-rank": ("q_lora_rank", None),
    "--kv-lora-rank": ("kv_lora_rank", 32),
    "--qk-head-dim": ("qk_head_dim", 128),
    "--qk-pos-emb-head-dim": ("qk_pos_emb_head_dim", 64),
    "--v-head-dim": ("v_head_dim", 128),
}

#: Multi-latent attention's YaRN RoPE: ``--flag`` -> model section field, and Megatron-LM's argument
#: default where the file does not give it (its ``--rotary-scaling-factor`` defaults to 1.0, where
#: megatron-core's ``MLATransformerConfig`` and the model section default to 40). Megatron-LM has no
#: MLA arguments for ``original_max_position_embeddings``, ``beta_fast`` and ``beta_slow``: an MLA
#: model takes megatron-core's defaults (4096, 32, 1), as the model section does.
MLA_YARN_ARGS = {
    "--rotary-scaling-factor": ("rotary_scaling_factor", 1.0),
    "--mscale": ("mscale", 1.0),
    "--mscale-all-dim": ("mscale_all_dim", 0.0),
}

#: Megatron-LM's YaRN arguments for GPT models (``--position-embedding-type yarn``), which it does not
#: pass to an MLA model's ``MLATransformerConfig`` (another field name): listed as ignored with MLA.
GPT_YARN_ARGS = ("--yarn-original-max-position-embeddings", "--yarn-beta-fast", "--yarn-beta-slow",
                 "--yarn-correction-range-round-to-int", "--no-yarn-correction-range-round-to-int")

#: Hybrid (Mamba + attention) models: the layer pattern's arguments (the second is Megatron-LM's
#: older name), and the Mamba inference state dtypes (Megatron-LM's default for both: bf16).
HYBRID_PATTERN_ARGS = ("--hybrid-layer-pattern", "--hybrid-override-pattern")
MAMBA_STATE_DTYPE_ARGS = {"--mamba-inference-ssm-states-dtype": "mamba_ssm_states_dtype",
                          "--mamba-inference-conv-states-dtype": "mamba_conv_states_dtype"}
MEGATRON_MAMBA_STATE_DTYPE = "bf16"

#: ``--spec`` values ab builds itself: megatron-core's hybrid stack specs (0.17: ``mamba_stack_spec``),
#: rebuilt from local modules with the same checkpoint keys.
HYBRID_SPEC_FUNCTIONS = ("hybrid_stack_spec", "mamba_stack_spec")

_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclass
class MegatronCase:
    """A Megatron ``model_config.yaml`` read as an ``ab`` case.

    Attributes:
        case: the case (its ``model`` section only where MODEL_ARGS give model flags and not
            ``--use-checkpoint-args``).
        load: ``--load`` with variables expanded, or None.
        use_checkpoint_args: the model is to be built from the checkpoint's arguments.
        tokenizer: ``(tokenizer type, tokenizer model path)`` from ``--tokenizer-type`` /
            ``--tokenizer-model``, or None.
        tensor_model_parallel_size, pipeline_model_parallel_size: the layout the file asks for,
            None where it does not say (the command line's then holds).
        ignored: ``(argument, why)`` for every argument known to change nothing ab compares.
        unknown_allowed: arguments not known to megatron-ext that ``ab --allow-unknown-args`` let
            the run go without (ab cannot tell whether they change the model or the engine).
        notes: ``(argument, how it was mapped)`` where Megatron's meaning differs from ab's.
    """

    case: Case
    load: Optional[str] = None
    use_checkpoint_args: bool = False
    tokenizer: Optional[tuple[str, Optional[str]]] = None
    tensor_model_parallel_size: Optional[int] = None
    pipeline_model_parallel_size: Optional[int] = None
    ignored: list[tuple[str, str]] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)
    unknown_allowed: list[str] = field(default_factory=list)


def is_megatron_case_file(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is a readable YAML file with Megatron's ``MODEL_ARGS`` section."""
    path = Path(name_or_path)
    if not path.is_file():
        return False
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False  # load_case reports it
    return isinstance(data, dict) and "MODEL_ARGS" in data


def load_megatron_case(path: Path, device: str = "cpu", environ: Optional[dict[str, str]] = None,
                       load_given: bool = False, allow_unknown: bool = False) -> MegatronCase:
    """Read a Megatron ``model_config.yaml`` as an ``ab`` case.

    Args:
        path: the file.
        device: ``cpu`` or ``cuda`` (the KV buffer size is bounded on the CPU).
        environ: variables for ``${NAME}`` (default: the process environment).
        load_given: ``ab --load`` was given: the file's ``--load`` is not read (nor expanded).
        allow_unknown: ``ab --allow-unknown-args``: arguments not known to megatron-ext are left
            out (listed in ``unknown_allowed``) instead of refused.

    Raises:
        CaseFileError: ``MODE`` is not ``inference``; an argument is refused (all of them named in
            one message, with why); an argument is not known to megatron-ext and ``allow_unknown``
            is off (all of them named); a mapped value uses an unset variable or is malformed; the
            resulting case is invalid (field named).
    """
    data = yaml.safe_load(path.read_text())
    mode = data.get("MODE", "inference")
    if mode != "inference":
        raise CaseFileError(f"{path}: MODE {mode!r}: ab runs inference cases only")
    args = data.get("MODEL_ARGS") or {}
    if not isinstance(args, dict):
        raise CaseFileError(f"{path}: MODEL_ARGS must be a mapping of '--argument: value'")
    refused = [f"{arg} ({why})" for arg in args if (why := _refusal(arg, args)) is not None]
    if refused:
        raise CaseFileError(f"{path}: refused: {'; '.join(refused)}")
    reader = _ArgReader(path, args, environ if environ is not None else dict(os.environ))
    if load_given and "--load" in args:
        reader.skip("--load", "ab --load DIR given on the command line")
    megatron_case = _build(path, reader, device)
    unknown = reader.unknown()
    if unknown and not allow_unknown:
        raise CaseFileError(f"{path}: not known to megatron-ext: {', '.join(unknown)}; ab cannot tell whether "
                            f"{'it changes' if len(unknown) == 1 else 'they change'} the model or the engine, "
                            "so it would report on a model it may not have built: remove "
                            f"{'it' if len(unknown) == 1 else 'them'} from a copy of the file, or run ab "
                            "--allow-unknown-args (the verdict then names what it ran without)")
    megatron_case.unknown_allowed = unknown
    return megatron_case


def _refusal(arg: str, args: dict[str, Any]) -> Optional[str]:
    if arg == "--spec":
        return _spec_refusal(args)
    if arg in REFUSED:
        return REFUSED[arg]
    if arg in MODEL_FIELDS or ignored_why(arg) is not None:  # read or known harmless, even under a refused prefix
        return None
    return next((why for prefix, why in REFUSED_PREFIXES.items() if arg.startswith(prefix)), None)


def _spec_refusal(args: dict[str, Any]) -> Optional[str]:
    """``--spec MODULE FUNCTION``: accepted for a hybrid model when it names megatron-core's
    hybrid stack spec (ab builds the same layers from local modules); refused otherwise."""
    value = args["--spec"]
    function = (value.split() if isinstance(value, str) else list(value or []))[-1:]
    if function and function[0] in HYBRID_SPEC_FUNCTIONS and any(a in args for a in HYBRID_PATTERN_ARGS):
        return None
    return "a custom layer spec: ab builds megatron-core's local GPT layer spec, or for a hybrid model its hybrid stack spec"


class _ArgReader:
    """MODEL_ARGS with the arguments read so far remembered (the rest are listed as ignored)."""

    def __init__(self, path: Path, args: dict[str, Any], environ: dict[str, str]):
        self.path, self.args, self.environ = path, args, environ
        self.used: set[str] = set()
        self.skipped: dict[str, str] = {}

    def skip(self, arg: str, why: str) -> None:
        """Leave ``arg`` unread, listed as ignored with ``why``."""
        self.skipped[arg] = why

    def get(self, arg: str, convert: Callable[[Any], Any] = lambda v: v, default: Any = None) -> Any:
        if arg not in self.args or arg in self.skipped:
            return default
        self.used.add(arg)
        value = self.args[arg]
        if isinstance(value, str):
            value = self._expand(arg, value)
        try:
            return convert(value)
        except (TypeError, ValueError):
            raise CaseFileError(f"{self.path}: {arg}: {value!r} is not a valid value") from None

    def _expand(self, arg: str, value: str) -> str:
        def variable(match: re.Match) -> str:
            name = match.group(1) or match.group(2)
            if name not in self.environ:
                raise CaseFileError(f"{self.path}: {arg} uses ${{{name}}}, which is not set; set it in the "
                                    "environment (Megatron's CI sets it)")
            return self.environ[name]

        return _VARIABLE.sub(variable, value)

    def ignored(self) -> list[tuple[str, str]]:
        """``(argument, why)`` of the arguments left unread that are known to change nothing ab compares."""
        return [(arg, self.skipped.get(arg) or ignored_why(arg)) for arg in self._unread()
                if arg in self.skipped or ignored_why(arg) is not None]

    def unknown(self) -> list[str]:
        """The arguments left unread that megatron-ext knows nothing about."""
        return [arg for arg in self._unread() if arg not in self.skipped and ignored_why(arg) is None]

    def _unread(self) -> list[str]:
        return [arg for arg in self.args if arg not in self.used]


#: Megatron's ``--tokenizer-type`` -> megatron-core's tokenizer library (megatron.core.tokenizers).
TOKENIZER_LIBRARIES = {
    "HuggingFaceTokenizer": "huggingface",
    "SentencePieceTokenizer": "sentencepiece",
    "GPTSentencePieceTokenizer": "sentencepiece",
    "TikTokenizer": "tiktoken",
}


def megatron_tokenizer(tokenizer: tuple[str, Optional[str]], source: str) -> tuple[str, str]:
    """``(--tokenizer-type, --tokenizer-model)`` of a Megatron case -> ``(path, library)`` for
    ``ab --tokenizer PATH --tokenizer-library LIB``.

    Raises:
        CaseFileError: a tokenizer type megatron-core's tokenizer stack does not load by path, or no
            ``--tokenizer-model``.
    """
    kind, model = tokenizer
    if kind not in TOKENIZER_LIBRARIES:
        raise CaseFileError(f"{source}: --tokenizer-type {kind}: ab loads {', '.join(TOKENIZER_LIBRARIES)}; "
                            "give another tokenizer with ab --tokenizer PATH --tokenizer-library LIB")
    if not model:
        raise CaseFileError(f"{source}: --tokenizer-type {kind} without --tokenizer-model; add it, or give "
                            "ab --tokenizer PATH")
    return model, TOKENIZER_LIBRARIES[kind]


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise ValueError(value)


def _build(path: Path, args: _ArgReader, device: str) -> MegatronCase:
    notes: list[tuple[str, str]] = []
    inference = _inference(path, args, device)
    policy = args.get("--inference-dynamic-batching-prefix-caching-eviction-policy", str, "ref_zero")
    sampling = {key: value for key, value in (
        ("temperature", args.get("--temperature", float)), ("top_k", args.get("--top_k", int)),
        ("top_p", args.get("--top_p", float)), ("top_n_logprobs", args.get("--top-n-logprobs", int)))
        if value is not None}
    use_checkpoint_args = args.get("--use-checkpoint-args", _flag, False)
    model = _model(args)
    seed = args.get("--seed", int)
    if seed is not None and not use_checkpoint_args:
        model["seed"] = seed  # after _model's Megatron defaults: a file that gives only --seed changes only the seed
    elif seed is not None:
        notes.append(("--seed", "the weights come from the checkpoint (--use-checkpoint-args); no seeded weights "
                                "are built"))
    fields: dict[str, Any] = {
        "name": path.parent.name or path.stem,
        "description": f"Megatron functional-test case {path}",
        "inference": inference,
        "prefix_caching_eviction_policies": [policy],
        "sampling": sampling,
        "requests": _requests(path, args, notes),
    }
    if model and not use_checkpoint_args:
        fields["model"] = model
    elif model:
        notes.append(("--use-checkpoint-args", "the model comes from the checkpoint's arguments; the file's "
                                               "model flags are not used"))
    case = parse_case(yaml.safe_dump(fields), str(path))
    tokenizer_type = args.get("--tokenizer-type", str)
    return MegatronCase(
        case=case,
        load=args.get("--load", str),
        use_checkpoint_args=use_checkpoint_args,
        tokenizer=(tokenizer_type, args.get("--tokenizer-model", str)) if tokenizer_type else None,
        tensor_model_parallel_size=args.get("--tensor-model-parallel-size", int),
        pipeline_model_parallel_size=args.get("--pipeline-model-parallel-size", int),
        ignored=args.ignored(),
        notes=notes,
    )


def _inference(path: Path, args: _ArgReader, device: str) -> dict[str, Any]:
    fields = {key: value for key, value in (
        ("buffer_size_gb", args.get("--inference-dynamic-batching-buffer-size-gb", float)),
        ("max_requests", args.get("--inference-dynamic-batching-max-requests", int)),
        ("max_tokens", args.get("--inference-dynamic-batching-max-tokens", int)),
        ("max_sequence_length", args.get("--inference-max-seq-length", int)),
        ("enable_chunked_prefill", args.get("--enable-chunked-prefill", _flag)),
        ("num_speculative_tokens", args.get("--num-speculative-tokens", int)),
    ) if value is not None}
    fields["block_size_tokens"] = args.get("--inference-dynamic-batching-block-size", int, MEGATRON_BLOCK_SIZE_TOKENS)
    if fields.get("buffer_size_gb", 0) > CPU_BUFFER_LIMIT_GB and device == "cpu":
        raise CaseFileError(
            f"{path}: --inference-dynamic-batching-buffer-size-gb {fields['buffer_size_gb']} would allocate "
            f"that much CPU memory for the KV cache; on the CPU ab allows up to {CPU_BUFFER_LIMIT_GB} GB: "
            "lower it in a copy of the file (the pool's pressure then differs from the GPU test's)")
    if args.get("--ckpt-format", str, "torch_dist") != "torch_dist":
        raise CaseFileError(f"{path}: --ckpt-format {args.args['--ckpt-format']}: ab loads torch_dist checkpoints only")
    if args.get("--incoming-requests-per-sec", float, -1) > 0:
        raise CaseFileError(f"{path}: --incoming-requests-per-sec > 0 draws random arrival times; ab needs a "
                            "reproducible schedule: use -1 (all at once) or --incoming-requests-per-step")
    return fields


def _model(args: _ArgReader) -> dict[str, Any]:
    model: dict[str, Any] = {}
    gqa = args.get("--group-query-attention", _flag, False)
    for arg, name in MODEL_FIELDS.items():
        if arg == "--num-query-groups" and not gqa:
            if arg in args.args:
                args.skip(arg, "Megatron-LM uses it only with --group-query-attention")
            continue
        if arg in args.args:
            if name not in ModelSpec.model_fields:
                raise CaseFileError(f"{args.path}: refused: {arg} (this megatron-ext's model section has no "
                                    f"'{name}')")
            model[name] = args.get(arg)
    bf16 = args.get("--bf16", _flag, False)
    if model or bf16:  # Megatron's default without --bf16 / --fp16 is fp32
        model["params_dtype"] = "bf16" if bf16 else "fp32"
    if model and "untie_embeddings_and_output_weights" in ModelSpec.model_fields:
        # Megatron ties the output layer to the embedding unless the flag says otherwise
        model.setdefault("untie_embeddings_and_output_weights", False)
    if args.get("--disable-bias-linear", _flag, False):
        if "add_bias_linear" not in ModelSpec.model_fields:
            raise CaseFileError(f"{args.path}: refused: --disable-bias-linear (this megatron-ext's model section "
                                "has no 'add_bias_linear')")
        model["add_bias_linear"] = False
    if gqa and "num_query_groups" not in model:
        raise CaseFileError(f"{args.path}: --group-query-attention needs --num-query-groups")
    model.update(_hybrid_model(args))
    model.update(_mla_model(args))
    return model


def _mla_model(args: _ArgReader) -> dict[str, Any]:
    """The multi-latent attention fields (``--multi-latent-attention`` and its sizes, Megatron-LM's
    defaults where absent; ``--rope-type``, yarn where absent as in Megatron-LM, and the YaRN
    arguments :data:`MLA_YARN_ARGS`). Nothing without ``--multi-latent-attention``.

    Raises:
        CaseFileError: MLA sizes without ``--multi-latent-attention``;
            the installed release cannot run MLA (named with the argument), a ``--rope-type`` other
            than ``rope`` or ``yarn``, ``--cache-mla-latents`` false, or a block size other than 64.
    """
    from .mla import MLA_BLOCK_SIZE_TOKENS, MLA_SERIES

    if not args.get("--multi-latent-attention", _flag, False):
        sizes = [arg for arg in MLA_ARGS if arg in args.args]
        if sizes:
            raise CaseFileError(f"{args.path}: {', '.join(sizes)} without --multi-latent-attention: Megatron-LM "
                                "uses them only with it; add it or remove them")
        rope = args.get("--rope-type", str, None)  # read: rope is what a GPT model's attention builds
        if rope not in (None, "rope"):
            raise CaseFileError(f"{args.path}: --rope-type {rope} without --multi-latent-attention: Megatron-LM "
                                "asserts common attention only supports rope_type rope")
        return {}
    version = mcore.installed_version()
    if mcore.release_series(version) not in MLA_SERIES:
        raise CaseFileError(f"{args.path}: refused: --multi-latent-attention (megatron-core {version} cannot run "
                            "multi-latent attention with prefix caching; use 0.18 or 0.19)")
    rope = args.get("--rope-type", str, None)
    if rope not in (None, "rope", "yarn"):
        raise CaseFileError(f"{args.path}: --rope-type {rope}: Megatron-LM's choices are rope and yarn")
    if not args.get("--cache-mla-latents", _flag, True):
        raise CaseFileError(f"{args.path}: --cache-mla-latents false: megatron-core's dynamic engine runs "
                            "multi-latent attention with cached latents only (it asserts cache_mla_latents)")
    block = args.get("--inference-dynamic-batching-block-size", int, MEGATRON_BLOCK_SIZE_TOKENS)
    if block != MLA_BLOCK_SIZE_TOKENS:
        raise CaseFileError(f"{args.path}: --multi-latent-attention needs --inference-dynamic-batching-block-size "
                            f"{MLA_BLOCK_SIZE_TOKENS} (megatron-core's latent KV cache asserts it), not {block}")
    # Megatron-LM leaves rope_type out of the config when --rope-type is absent: MLATransformerConfig's yarn
    model: dict[str, Any] = {"multi_latent_attention": True, "rope_type": rope or "yarn"}
    for arg, (name, default) in MLA_ARGS.items():
        value = args.get(arg, int, default)
        if value is not None:
            model[name] = value
    for arg, (name, default) in MLA_YARN_ARGS.items():
        model[name] = args.get(arg, float, default)
    for arg in GPT_YARN_ARGS:
        if arg in args.args:
            args.skip(arg, "Megatron-LM passes the --yarn-* arguments to a GPT model's YaRN "
                           "(--position-embedding-type yarn), not to multi-latent attention, which takes "
                           "megatron-core's original_max_position_embeddings, beta_fast and beta_slow")
    return model


def _hybrid_model(args: _ArgReader) -> dict[str, Any]:
    """The hybrid model fields: the layer pattern (pipeline separators ``|`` dropped: ab lays
    stages out itself), ``num_layers`` from it (as Megatron-LM), the Mamba state dtypes
    (Megatron-LM's bf16 default where absent). Nothing for a GPT model (Mamba sizes alone are
    refused by the model section)."""
    given = [arg for arg in HYBRID_PATTERN_ARGS if arg in args.args]
    if not given:
        return {}
    if len(given) > 1:
        raise CaseFileError(f"{args.path}: {' and '.join(given)} both given; keep --hybrid-layer-pattern "
                            "(Megatron-LM refuses both)")
    pattern = args.get(given[0], str)
    if "/" in pattern:
        raise CaseFileError(f"{args.path}: {given[0]} {pattern!r}: multi-token prediction layers (after '/') "
                            "are not supported by ab")
    model: dict[str, Any] = {"hybrid_layer_pattern": pattern.replace("|", "")}
    model["num_layers"] = len(model["hybrid_layer_pattern"])
    args.get("--spec")  # read, not ignored: _spec_refusal accepted megatron-core's hybrid stack spec
    for arg, name in MAMBA_STATE_DTYPE_ARGS.items():
        dtype = args.get(arg, str, MEGATRON_MAMBA_STATE_DTYPE)
        if dtype not in ("fp32", "bf16"):
            raise CaseFileError(f"{args.path}: {arg} {dtype}: ab runs bf16 or fp32 Mamba states")
        model[name] = dtype
    return model


def _requests(path: Path, args: _ArgReader, notes: list) -> list[dict[str, Any]]:
    prompts = args.get("--prompts")
    prompt_file = args.get("--prompt-file", str)
    if prompts is None and prompt_file is None:
        raise CaseFileError(f"{path}: no --prompts or --prompt-file; ab needs the prompts (or give them with "
                            "ab --prompts FILE)")
    prompts = [prompts] if isinstance(prompts, str) else list(prompts or [])
    if prompt_file is not None:
        from .prompts import read_prompts

        prompts += [spec.prompt for _, spec in read_prompts(path.parent / prompt_file)]
    samples = args.get("--inference-repeat-n", int, 1)
    if samples > 1:
        notes.append(("--inference-repeat-n", f"each prompt runs as {samples} samples admitted together (they "
                                              "share prefix blocks); Megatron repeats the whole trial instead"))
    per_step = args.get("--incoming-requests-per-step", int)
    generate = args.get("--num-tokens-to-generate", int, RequestSpec.model_fields["num_tokens_to_generate"].default)
    return [{"prompt": prompt, "samples": samples, "num_tokens_to_generate": generate,
             "arrival_step": index // per_step if per_step else 0} for index, prompt in enumerate(prompts)]
