"""Build a small GPTModel, a DynamicInferenceContext and a DynamicInferenceEngine, and run requests.

One place for what differs between megatron-core releases when building and stepping the dynamic
inference stack, so that tests and the ``megatron-ext ab`` harness share it. For 0.17.1, 0.18.2
and 0.19.2 the constructors and the stepping API are the same
(``DynamicInferenceContext(model_config, inference_config)``, ``GPTInferenceWrapper(model,
context)``, ``TextGenerationController(wrapped, tokenizer)``,
``DynamicInferenceEngine(controller, context)``, ``engine.add_request`` / ``engine.step_modern``);
what differs is which ``InferenceConfig`` and ``SamplingParams`` fields exist (0.19 adds e.g.
``sampling_backend``, ``async_sched_mode``, ``return_prompt_tokens``), so extra fields are checked
against the installed release and refused with a clear error instead of a ``TypeError`` deep in a
dataclass.

On a machine without a GPU every function here that touches megatron-core must run inside
:func:`megatron_ext.cpu_backend.cpu_backend` (building allocates "CUDA" tensors, seeds the "CUDA"
RNG, and the engine calls the attention kernels).

Typical use::

    with cpu_backend(), torch.inference_mode():
        init_parallel_state(seed=1234)
        built = build_engine(ModelSpec(dtype=torch.float32), ContextSpec())
        results = run_requests(built.engine, [RequestSpec(prompt=[1, 2, 3])])
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from .. import mcore


# --- specifications --------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSpec:
    """A GPTModel built from ``get_gpt_layer_local_spec()`` (no Transformer Engine).

    Attributes:
        num_layers: transformer layers.
        hidden_size: model width (elements).
        num_attention_heads: query heads; ``hidden_size`` must be a multiple.
        num_query_groups: key/value heads (grouped-query attention); None means one per head.
        ffn_hidden_size: MLP width; None means ``4 * hidden_size``.
        vocab_size: vocabulary size (token ids are ``0 .. vocab_size - 1``).
        max_sequence_length: longest prompt + generation, in tokens (also the position limit).
        dtype: parameter and activation dtype (``torch.float32`` or ``torch.bfloat16``).
        seed: seeds the CPU RNG right before weight initialization, so equal specs give equal
            weights.
        sampling_seed: ``TransformerConfig.inference_sampling_seed`` (the controller's sampling
            generator).
        init_method_std: standard deviation of the weight initialization; larger values give
            peakier next-token distributions.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        add_bias_linear: biases in the linear layers.
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    vocab_size: int = 256
    max_sequence_length: int = 256
    dtype: torch.dtype = torch.bfloat16
    seed: int = 1234
    sampling_seed: int = 42
    init_method_std: float = 0.02
    normalization: str = "LayerNorm"
    add_bias_linear: bool = True


@dataclass(frozen=True)
class ContextSpec:
    """The ``InferenceConfig`` of the dynamic inference context.

    Attributes:
        enable_prefix_caching: share KV blocks between requests with equal prompt prefixes.
        block_size_tokens: tokens per KV block.
        buffer_size_gb: KV cache size in GiB (``0.01`` holds ~1000 blocks of the default model).
        max_requests: concurrent request limit; None lets the context derive it.
        max_tokens: tokens per step limit; None lets the context use its default.
        max_sequence_length: per-request limit in tokens; None means the model's.
        enable_chunked_prefill: split long prompts over several steps.
        prefix_caching_eviction_policy: ``"ref_zero"`` or ``"lru"``.
        materialize_only_last_token_logits: compute logits for the last token of each request
            only (prompt log-probs then need ``skip_prompt_log_probs``).
        extra: further ``InferenceConfig`` fields by name; a field the installed release lacks
            raises ``ValueError``.
    """

    enable_prefix_caching: bool = True
    block_size_tokens: int = 16
    buffer_size_gb: float = 0.01
    max_requests: Optional[int] = None
    max_tokens: Optional[int] = None
    max_sequence_length: Optional[int] = None
    enable_chunked_prefill: bool = False
    prefix_caching_eviction_policy: str = "ref_zero"
    materialize_only_last_token_logits: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestSpec:
    """One request for :func:`run_requests`.

    Attributes:
        prompt: prompt token ids.
        num_tokens_to_generate: tokens to generate (no early stop: ``termination_id`` is -1
            unless ``sampling`` sets it).
        arrival_step: engine step before which the request is added (0: before the first step).
            Requests are added in list order, each no earlier than its arrival step.
        sampling: further ``SamplingParams`` fields; default greedy (``top_k=1``) with generated
            log-probs returned.
    """

    prompt: Sequence[int]
    num_tokens_to_generate: int = 8
    arrival_step: int = 0
    sampling: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Completion:
    """What one finished request produced.

    Attributes:
        request_id: the id it was added under (its index in the request list).
        tokens: generated token ids.
        log_probs: float log-probabilities (natural log) of the generated tokens; empty unless
            requested.
        status: megatron-core's final request status, as a string.
    """

    request_id: int
    tokens: list[int]
    log_probs: list[float]
    status: str


@dataclass
class BuiltEngine:
    """The objects :func:`build_engine` made (the engine holds the others too)."""

    engine: Any
    context: Any
    controller: Any
    model: Any


# --- parallel state --------------------------------------------------------------------------

_OWN_PROCESS_GROUP = False


def init_parallel_state(seed: int = 1234) -> None:
    """Single-process model parallel state: gloo process group, TP = PP = 1, RNG tracker.

    Creates a world-size-1 gloo process group (file store in a fresh temp dir, no network) if
    none exists, initializes megatron-core's model parallel groups if needed, and calls
    ``model_parallel_cuda_manual_seed(seed)``. Idempotent apart from re-seeding.

    Raises:
        MegatronCoreNotFoundError: megatron-core is not importable.
        RuntimeError: from torch.distributed if the process group cannot be created.
    """
    global _OWN_PROCESS_GROUP
    parallel_state = mcore.import_module("megatron.core.parallel_state")
    random = mcore.import_module("megatron.core.tensor_parallel.random")
    if not torch.distributed.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="megatron-ext-gloo-"), "store")
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{store}", rank=0, world_size=1)
        _OWN_PROCESS_GROUP = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    random.model_parallel_cuda_manual_seed(seed)


def destroy_parallel_state() -> None:
    """Undo :func:`init_parallel_state`: model parallel groups, and the process group if it
    created it."""
    global _OWN_PROCESS_GROUP
    mcore.import_module("megatron.core.parallel_state").destroy_model_parallel()
    if _OWN_PROCESS_GROUP and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _OWN_PROCESS_GROUP = False


# --- builders --------------------------------------------------------------------------------

def _checked_fields(cls: type, values: Mapping[str, Any], what: str) -> dict[str, Any]:
    """``values`` if every key is a field of dataclass ``cls`` in this release, else ValueError."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{what} of megatron-core {mcore.installed_version()} has no field(s) "
                         f"{', '.join(unknown)}")
    return dict(values)


def transformer_config(spec: ModelSpec) -> Any:
    """The ``TransformerConfig`` for ``spec`` (CPU initialization, local implementation)."""
    config_module = mcore.import_module("megatron.core.transformer.transformer_config")
    return config_module.TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        params_dtype=spec.dtype,
        pipeline_dtype=spec.dtype,
        use_cpu_initialization=True,
        init_method_std=spec.init_method_std,
        normalization=spec.normalization,
        add_bias_linear=spec.add_bias_linear,
        transformer_impl="local",
        inference_sampling_seed=spec.sampling_seed,
    )


def build_model(spec: ModelSpec) -> Any:
    """A ``GPTModel`` in eval mode with weights in ``spec.dtype``, seeded by ``spec.seed``.

    Requires :func:`init_parallel_state` first.
    """
    gpt_model = mcore.import_module("megatron.core.models.gpt.gpt_model")
    layer_specs = mcore.import_module("megatron.core.models.gpt.gpt_layer_specs")
    config = transformer_config(spec)
    torch.manual_seed(spec.seed)
    model = gpt_model.GPTModel(
        config=config,
        transformer_layer_spec=layer_specs.get_gpt_layer_local_spec(),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_sequence_length,
        parallel_output=True,
        pre_process=True,
        post_process=True,
    )
    for parameter in model.parameters():
        parameter.data = parameter.data.to(spec.dtype)
    if torch.cuda.is_available():  # under cpu_backend() this is a no-op on the CPU
        model = model.cuda()
    return model.eval()


def inference_config(spec: ContextSpec, max_sequence_length: int) -> Any:
    """The ``InferenceConfig`` for ``spec``.

    Raises:
        ValueError: ``spec.extra`` names a field the installed release lacks.
    """
    config_module = mcore.import_module("megatron.core.inference.config")
    cls = config_module.InferenceConfig
    values = {
        "max_sequence_length": spec.max_sequence_length or max_sequence_length,
        "buffer_size_gb": spec.buffer_size_gb,
        "block_size_tokens": spec.block_size_tokens,
        "max_requests": spec.max_requests,
        "max_tokens": spec.max_tokens,
        "enable_chunked_prefill": spec.enable_chunked_prefill,
        "enable_prefix_caching": spec.enable_prefix_caching,
        "prefix_caching_eviction_policy":
            config_module.PrefixCachingEvictionPolicy(spec.prefix_caching_eviction_policy),
        "materialize_only_last_token_logits": spec.materialize_only_last_token_logits,
        "unified_memory_level": 0,  # CUDA unified memory has no CPU meaning
        **_checked_fields(cls, spec.extra, "InferenceConfig"),
    }
    return cls(**values)


class TokenIdTokenizer:
    """Minimal tokenizer for prompts given as token ids: the controller only needs
    ``vocab_size``, ``eod`` (default termination id) and ``detokenize`` (for text fields)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.bos = None

    def detokenize(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return " ".join(str(int(t)) for t in tokens)

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]


def build_engine(model_spec: ModelSpec, context_spec: ContextSpec,
                 model: Optional[Any] = None) -> BuiltEngine:
    """Model (unless given), context, wrapper, controller and ``DynamicInferenceEngine``.

    Args:
        model_spec: what model to build (and its sampling seed, vocab size, length limit).
        context_spec: the context's ``InferenceConfig``.
        model: an existing model built from ``model_spec`` to reuse (saves the build time when
            comparing contexts on the same weights).

    Returns:
        :class:`BuiltEngine`.

    Raises:
        ValueError: ``context_spec.extra`` names an unknown ``InferenceConfig`` field.
        MegatronCoreNotFoundError: megatron-core is not importable.
    """
    context_module = mcore.import_module("megatron.core.inference.contexts.dynamic_context")
    wrapper_module = mcore.import_module(
        "megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper")
    controller_module = mcore.import_module(
        "megatron.core.inference.text_generation_controllers.text_generation_controller")
    engines = mcore.import_module("megatron.core.inference.engines")
    model = build_model(model_spec) if model is None else model
    context = context_module.DynamicInferenceContext(
        model_config=model.config,
        inference_config=inference_config(context_spec, model_spec.max_sequence_length),
    )
    wrapped = wrapper_module.GPTInferenceWrapper(model, context)
    controller = controller_module.TextGenerationController(
        inference_wrapped_model=wrapped, tokenizer=TokenIdTokenizer(model_spec.vocab_size))
    engine = engines.DynamicInferenceEngine(controller, context)
    return BuiltEngine(engine=engine, context=context, controller=controller, model=model)


# --- running ---------------------------------------------------------------------------------

def sampling_params(spec: RequestSpec) -> Any:
    """``SamplingParams`` for ``spec``: greedy, no early stop, generated log-probs returned,
    overridden by ``spec.sampling``.

    Raises:
        ValueError: ``spec.sampling`` names a field the installed release lacks.
    """
    cls = mcore.import_module("megatron.core.inference.sampling_params").SamplingParams
    values = {
        "num_tokens_to_generate": spec.num_tokens_to_generate,
        "termination_id": -1,
        "top_k": 1,
        "return_log_probs": True,
        "skip_prompt_log_probs": True,
        **_checked_fields(cls, spec.sampling, "SamplingParams"),
    }
    return cls(**values)


def _as_floats(values: Any) -> list[float]:
    if values is None:
        return []
    if isinstance(values, torch.Tensor):
        return [float(v) for v in values.flatten().tolist()]
    return [float(v) for v in values]


def run_requests(engine: Any, requests: Sequence[RequestSpec],
                 max_steps: int = 10_000) -> dict[int, Completion]:
    """Add ``requests`` at their arrival steps and step ``engine`` until all have finished.

    Request ``i`` gets request id ``i``.

    Returns:
        request id -> :class:`Completion`.

    Raises:
        RuntimeError: not finished after ``max_steps`` engine steps.
    """
    done: dict[int, Completion] = {}
    added = steps = 0
    while added < len(requests) or engine.has_unfinished_requests():
        if steps >= max_steps:
            raise RuntimeError(f"run_requests: {len(requests) - len(done)} requests unfinished "
                               f"after {max_steps} steps")
        while added < len(requests) and requests[added].arrival_step <= steps:
            spec = requests[added]
            engine.add_request(added, list(spec.prompt), sampling_params(spec))
            added += 1
        result = engine.step_modern()
        steps += 1
        for record in result["finished_request_records"]:
            request = record.merge()
            done[request.request_id] = Completion(
                request_id=request.request_id,
                tokens=[int(t) for t in request.generated_tokens],
                log_probs=_as_floats(request.generated_log_probs),
                status=getattr(request.status, "name", str(request.status)),
            )
    return done
