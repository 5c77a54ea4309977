"""The case-file schema: pydantic models of a case's sections and their validators.

A :class:`Case` is one YAML case file (:mod:`megatron_ext.harness.cases` loads them); every model
refuses unknown fields and is frozen. Validation errors name the field
(:func:`describe_validation_error`); loading raises them as :class:`CaseFileError`.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ...errors import MegatronExtError
from ..tokenizer import BYTE_LEVEL_VOCAB_SIZE


class CaseFileError(MegatronExtError, ValueError):
    """A case file is missing, not YAML, or has a bad field (the message names the field)."""


class StrictModel(BaseModel):
    """Base of every case model: unknown keys are an error (a misspelt key is not ignored), and
    a loaded case is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


#: Layer symbols of ``hybrid_layer_pattern`` that megatron-ext's local hybrid spec builds.
HYBRID_LAYER_SYMBOLS = {"M": "Mamba", "*": "attention", "-": "MLP"}


#: :class:`ModelSpec` fields that only a multi-latent attention model uses.
MLA_SIZE_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")

#: :class:`ModelSpec` fields of an MLA model's RoPE: ``rope_type`` and megatron-core's YaRN
#: parameters (``MLATransformerConfig``'s fields, names and defaults).
MLA_ROPE_FIELDS = ("rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
                   "beta_slow", "mscale", "mscale_all_dim")


class ModelSpec(StrictModel):
    """A GPT model with megatron-core's local layer spec; weights are seeded random unless loaded.

    Field names are Megatron-LM's training arguments; the defaults are megatron-ext's small GPT
    (LayerNorm, GELU, learned absolute positions, biases, untied embeddings, multi-head attention).

    * ``num_layers``, ``hidden_size`` (model width, elements), ``num_attention_heads``;
      ``num_query_groups``: key/value heads for grouped-query attention (Megatron-LM's
      ``--group-query-attention --num-query-groups``; None: one per attention head); ``kv_channels``:
      elements per attention head (None: ``hidden_size / num_attention_heads``).
    * ``ffn_hidden_size``: MLP width (elements). None: ``4 * hidden_size``, or with ``swiglu``
      Megatron-LM's ``int(4 * hidden_size * 2 / 3 / 64) * 64`` (:meth:`effective_ffn_hidden_size`).
    * ``normalization``: ``LayerNorm`` or ``RMSNorm``; ``norm_epsilon`` (megatron-core's
      ``layernorm_epsilon``); ``qk_layernorm``: a norm on queries and keys.
    * ``swiglu``: gated MLP with SiLU (``linear_fc1`` is ``[2 * ffn_hidden_size, hidden_size]``);
      otherwise GELU.
    * ``position_embedding_type``: ``learned_absolute`` (a ``[max_position_embeddings,
      hidden_size]`` table), ``rope`` (rotary, ``rotary_base``, applied to ``rotary_percent`` of
      each head's channels) or ``none`` (no position embedding: hybrid models, whose Mamba layers
      carry position, e.g. Nemotron-H).
    * ``add_bias_linear``: biases in every linear layer; ``add_qkv_bias``: a bias in the QKV
      projection even when ``add_bias_linear`` is off (Qwen-style).
    * ``untie_embeddings_and_output_weights``: a separate output layer instead of reusing the
      word embeddings (default True: megatron-core's ``GPTModel`` default, which megatron-ext's
      model has always used; Megatron-LM's training default is tied).
    * ``vocab_size``: rows of the word embedding (Megatron-LM's ``padded_vocab_size``), at least
      the byte tokenizer's 257; ``max_position_embeddings``: longest sequence (tokens).
    * ``params_dtype``: ``fp32`` or ``bf16``; ``seed`` of the random weights;
      ``init_method_std``: their standard deviation (megatron-core's ``TransformerConfig.init_method_std``;
      None keeps its default, 0.02). Tiny random models give near-uniform next-token log-probs
      at 0.02; around 0.1 they are peaked enough that greedy continuations differ between prompts.
    * ``hybrid_layer_pattern``: a hybrid (Mamba + attention) model, megatron-core's ``HybridModel``
      (``MambaModel`` before 0.19) with megatron-ext's local layer spec, one symbol per layer
      (Megatron-LM's ``--hybrid-override-pattern``): ``M`` Mamba, ``*`` self-attention, ``-``
      MLP; e.g. ``"M*M"``. ``num_layers`` is the pattern's length (filled in; give it only if equal). None: a
      GPT model. On the CPU it needs Triton's interpreter (:mod:`megatron_ext.cpu_backend.mamba`).
    * Mamba sizes (hybrid models only; Megatron-LM's ``--mamba-*`` arguments):
      ``mamba_state_dim`` (SSM state per head, ``d_state``), ``mamba_head_dim`` (channels per
      Mamba head), ``mamba_num_groups`` (B/C groups), ``mamba_num_heads`` (None:
      ``2 * hidden_size / mamba_head_dim``; Mamba width ``mamba_num_heads * mamba_head_dim``), ``mamba_chunk_size`` (the SSM scan's chunk,
      ``MambaMixer(chunk_size=...)``; Mamba prefix-cache snapshots are taken at block boundaries
      that are multiples of it), ``mamba_ssm_states_dtype`` (dtype of the inference SSM state and
      its prefix-cache snapshots) and ``mamba_conv_states_dtype`` (of the inference conv state and
      its snapshots); None: megatron-core's default, ``params_dtype`` (Megatron-LM's
      ``--mamba-inference-*-states-dtype`` default to bf16 instead).
    * Mixture of experts (GPT models only; Megatron-LM's ``--num-experts``, ``--moe-router-topk``,
      ``--moe-ffn-hidden-size``, ``--moe-enable-routing-replay``): ``num_experts`` routed experts
      in every layer's MLP (megatron-core's ``MoELayer`` with ``SequentialMLP`` experts, the local
      spec; None: a dense MLP), each token routed to ``moe_router_topk`` of them; each expert's MLP
      is ``moe_ffn_hidden_size`` wide (None: :meth:`effective_ffn_hidden_size`, else
      ``4 * hidden_size``). ``moe_enable_routing_replay``: megatron-core records every token's
      expert choices and returns them per request (``routing_indices``, ``[tokens - 1, layers,
      topk]``), which ``ab`` compares and audits. Load balancing is off (``none``: inference).
    * ``multi_latent_attention``: MLA layers (megatron-core's ``MLATransformerConfig`` and
      ``MLASelfAttention``, Megatron-LM's ``--multi-latent-attention``; :mod:`megatron_ext.harness.mla`),
      with their sizes (elements): ``q_lora_rank`` (query compression; None: no query compression,
      a direct query projection), ``kv_lora_rank`` (the latent KV vector), ``qk_head_dim`` and
      ``qk_pos_emb_head_dim`` (a query/key head's channels without and with RoPE), ``v_head_dim``.
      The KV cache holds ``kv_lora_rank + qk_pos_emb_head_dim`` latent channels per token and layer
      (``cache_mla_latents``, the only way megatron-core's dynamic engine runs MLA), which needs
      ``inference.block_size_tokens`` 64 and ``position_embedding_type: rope``; ``qk_layernorm``
      puts RMS/LayerNorms on the compressed query and KV (DeepSeek's q_a / kv_a norms);
      ``num_attention_heads`` heads, ``kv_channels`` / ``num_query_groups`` unused.
      ``rope_type`` (MLA only; Megatron-LM's ``--rope-type``): ``yarn`` (the default, as in
      megatron-core's ``MLATransformerConfig`` and Megatron-LM: ``YarnRotaryEmbedding``) or ``rope``
      (``RotaryEmbedding`` with ``rotary_base`` and ``rotary_percent``). YaRN's parameters are
      ``MLATransformerConfig``'s fields with its defaults: ``rotary_scaling_factor`` (40; Megatron-LM's
      ``--rotary-scaling-factor``), ``original_max_position_embeddings`` (4096), ``beta_fast`` (32),
      ``beta_slow`` (1), ``mscale`` (1.0; ``--mscale``), ``mscale_all_dim`` (0.0; ``--mscale-all-dim``).
      megatron-core also scales MLA's softmax by ``rotary_scaling_factor`` and ``mscale_all_dim``
      with either ``rope_type`` (1 with the defaults).
    * ``mtp_num_layers``: multi-token prediction layers after the decoder (Megatron-LM's
      ``--mtp-num-layers``; megatron-core's MTP block spec over the local layer spec), the draft
      heads of speculative decoding (``inference.num_speculative_tokens``). None: no MTP block.
      ``mtp_use_repeated_layer``: one MTP layer applied at every depth (Megatron-LM's
      ``--mtp-use-repeated-layer``), so more draft tokens than MTP layers.
    """

    num_layers: int = Field(2, ge=1)
    hidden_size: int = Field(64, ge=8)
    num_attention_heads: int = Field(4, ge=1)
    num_query_groups: Optional[int] = Field(None, ge=1)
    kv_channels: Optional[int] = Field(None, ge=1)
    ffn_hidden_size: Optional[int] = Field(None, ge=8)
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    norm_epsilon: float = Field(1e-5, gt=0)
    qk_layernorm: bool = False
    swiglu: bool = False
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    rotary_base: int = Field(10000, ge=1)
    rotary_percent: float = Field(1.0, gt=0, le=1)
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    untie_embeddings_and_output_weights: bool = True
    vocab_size: int = Field(BYTE_LEVEL_VOCAB_SIZE, ge=BYTE_LEVEL_VOCAB_SIZE)
    max_position_embeddings: int = Field(1024, ge=16)
    params_dtype: Literal["fp32", "bf16"] = "bf16"
    seed: int = 1234
    init_method_std: Optional[float] = Field(None, gt=0)
    hybrid_layer_pattern: Optional[str] = None
    mamba_state_dim: int = Field(16, ge=1)
    mamba_head_dim: int = Field(16, ge=1)
    mamba_num_groups: int = Field(1, ge=1)
    mamba_num_heads: Optional[int] = Field(None, ge=1)
    mamba_chunk_size: int = Field(128, ge=1)
    mamba_ssm_states_dtype: Optional[Literal["fp32", "bf16"]] = None
    mamba_conv_states_dtype: Optional[Literal["fp32", "bf16"]] = None
    num_experts: Optional[int] = Field(None, ge=2)
    moe_router_topk: int = Field(2, ge=1)
    moe_ffn_hidden_size: Optional[int] = Field(None, ge=8)
    moe_enable_routing_replay: bool = False
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = Field(None, ge=1)
    kv_lora_rank: int = Field(32, ge=1)
    qk_head_dim: int = Field(16, ge=1)
    qk_pos_emb_head_dim: int = Field(8, ge=2)
    v_head_dim: int = Field(16, ge=1)
    rope_type: Literal["rope", "yarn"] = "yarn"
    rotary_scaling_factor: float = Field(40.0, gt=0)
    original_max_position_embeddings: int = Field(4096, ge=1)
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    mtp_num_layers: Optional[int] = Field(None, ge=1)
    mtp_use_repeated_layer: bool = False

    @model_validator(mode="before")
    @classmethod
    def _hybrid_num_layers(cls, data: Any) -> Any:
        # a hybrid model's layer count is its pattern's length: filled in when not given
        if isinstance(data, dict) and isinstance(data.get("hybrid_layer_pattern"), str) and "num_layers" not in data:
            data = {**data, "num_layers": max(1, len(data["hybrid_layer_pattern"]))}
        return data

    @model_validator(mode="after")
    def _hybrid(self) -> "ModelSpec":
        pattern = self.hybrid_layer_pattern
        # set to a non-default value (a dumped GPT case lists every field at its default)
        mamba_fields = sorted(f for f in self.model_fields_set if f.startswith("mamba_")
                              and getattr(self, f) != type(self).model_fields[f].default)
        if pattern is None:
            if mamba_fields:
                raise ValueError(f"{', '.join(mamba_fields)} {'applies' if len(mamba_fields) == 1 else 'apply'} "
                                 "to hybrid models only; set "
                                 "hybrid_layer_pattern (e.g. \"M*M\") or remove them")
            return self
        bad = sorted(set(pattern) - set(HYBRID_LAYER_SYMBOLS))
        if not pattern or bad:
            raise ValueError(f"hybrid_layer_pattern {pattern!r}: use one symbol per layer from "
                             f"{', '.join(f'{k} ({v})' for k, v in HYBRID_LAYER_SYMBOLS.items())}"
                             + (f"; {''.join(bad)!r} is not one" if bad else ""))
        if "M" not in pattern:
            raise ValueError(f"hybrid_layer_pattern {pattern!r} has no Mamba layer ('M'); "
                             "for a model without Mamba layers drop hybrid_layer_pattern")
        if self.num_layers != len(pattern):
            raise ValueError(f"num_layers={self.num_layers} but hybrid_layer_pattern {pattern!r} has "
                             f"{len(pattern)} layers; drop num_layers or make them agree")
        if self.mamba_num_heads is None and (2 * self.hidden_size) % self.mamba_head_dim:
            raise ValueError(f"mamba_head_dim={self.mamba_head_dim} must divide 2 * hidden_size = "
                             f"{2 * self.hidden_size} (megatron-core's Mamba width), or set mamba_num_heads")
        heads = self.effective_mamba_num_heads()
        if heads % self.mamba_num_groups:
            raise ValueError(f"mamba_num_groups={self.mamba_num_groups} must divide mamba_num_heads={heads}")
        return self

    @model_validator(mode="after")
    def _moe(self) -> "ModelSpec":
        moe_fields = sorted(f for f in self.model_fields_set if f.startswith("moe_")
                            and getattr(self, f) != type(self).model_fields[f].default)
        if self.num_experts is None:
            if moe_fields:
                raise ValueError(f"{', '.join(moe_fields)} {'applies' if len(moe_fields) == 1 else 'apply'} "
                                 "to mixture-of-experts models only; set num_experts (e.g. 4) or remove them")
            return self
        if self.is_hybrid:
            raise ValueError("num_experts with hybrid_layer_pattern: megatron-ext builds mixture-of-experts "
                             "layers for GPT models only; drop one of them")
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk={self.moe_router_topk} is more than num_experts="
                             f"{self.num_experts}; a token cannot be routed to more experts than exist")
        return self

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts model: ``num_experts`` is set."""
        return self.num_experts is not None

    @model_validator(mode="after")
    def _mla(self) -> "ModelSpec":
        # set to a non-default value (a dumped GPT case lists every field at its default)
        mla_fields = sorted(f for f in MLA_SIZE_FIELDS + MLA_ROPE_FIELDS if f in self.model_fields_set
                            and getattr(self, f) != type(self).model_fields[f].default)
        if not self.multi_latent_attention:
            if mla_fields:
                raise ValueError(f"{', '.join(mla_fields)} {'applies' if len(mla_fields) == 1 else 'apply'} to "
                                 "multi-latent attention only; set multi_latent_attention: true or remove them")
            return self
        problems = [why for why, bad in (
            ("hybrid_layer_pattern (MLA is for GPT models here)", self.is_hybrid),
            ("position_embedding_type must be rope (MLA applies RoPE to its qk_pos_emb_head_dim channels)",
             self.position_embedding_type != "rope"),
            ("qk_pos_emb_head_dim must be even (RoPE rotates channel pairs)", self.qk_pos_emb_head_dim % 2),
            ("qk_layernorm without q_lora_rank (megatron-core 0.19 then fuses a query norm into linear_q_proj, "
             "with Transformer Engine only, and 0.18 has none; set q_lora_rank)",
             self.qk_layernorm and self.q_lora_rank is None)) if bad]
        if problems:
            raise ValueError(f"multi_latent_attention: {'; '.join(problems)}")
        return self

    @property
    def features(self) -> list[str]:
        """What the model is beyond a dense GPT, as ``ab --json`` reports it (``model_features``):
        ``"hybrid"``, ``"moe"``, ``"routing_replay"``, ``"mla"``, ``"mtp"`` (in that order; [] for a
        dense GPT). :attr:`Case.model_features` adds the engine's speculative decoding."""
        return [name for name, on in (("hybrid", self.is_hybrid), ("moe", self.is_moe),
                                      ("routing_replay", self.is_moe and self.moe_enable_routing_replay),
                                      ("mla", self.multi_latent_attention), ("mtp", bool(self.mtp_num_layers))) if on]

    @property
    def is_hybrid(self) -> bool:
        """A hybrid (Mamba + attention) model: ``hybrid_layer_pattern`` is set."""
        return self.hybrid_layer_pattern is not None

    def effective_mamba_num_heads(self) -> int:
        """``mamba_num_heads``, or megatron-core's default ``2 * hidden_size // mamba_head_dim``
        (then the Mamba width ``d_inner`` is ``2 * hidden_size``; else ``heads * mamba_head_dim``)."""
        if self.mamba_num_heads is not None:
            return self.mamba_num_heads
        return 2 * self.hidden_size // self.mamba_head_dim

    @model_validator(mode="after")
    def _consistent(self) -> "ModelSpec":
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_query_groups={self.num_query_groups} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.effective_ffn_hidden_size() == 0:
            raise ValueError(f"swiglu with hidden_size={self.hidden_size} gives Megatron-LM's default "
                             "ffn_hidden_size 0; set ffn_hidden_size")
        return self

    def effective_ffn_hidden_size(self) -> Optional[int]:
        """``ffn_hidden_size`` as Megatron-LM sets it when not given: with ``swiglu``
        ``int(4 * hidden_size * 2 / 3 / 64) * 64``; otherwise None (megatron-core's
        ``4 * hidden_size``)."""
        if self.ffn_hidden_size is not None or not self.swiglu:
            return self.ffn_hidden_size
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64

    def effective_moe_ffn_hidden_size(self) -> Optional[int]:
        """Width (elements) of each expert's MLP: ``moe_ffn_hidden_size``, else the dense MLP's
        (:meth:`effective_ffn_hidden_size`, else ``4 * hidden_size``); None for a dense model."""
        if not self.is_moe:
            return None
        if self.moe_ffn_hidden_size is not None:
            return self.moe_ffn_hidden_size
        return self.effective_ffn_hidden_size() or 4 * self.hidden_size


class InferenceSpec(StrictModel):
    """Fields passed to megatron-core's ``InferenceConfig`` (same names)."""

    block_size_tokens: int = Field(16, ge=1)
    buffer_size_gb: float = Field(0.004, gt=0)
    max_requests: int = Field(16, ge=1)
    max_tokens: int = Field(512, ge=2)
    max_sequence_length: int = Field(512, ge=2)
    enable_chunked_prefill: bool = False
    #: hybrid models: memory for the Mamba state snapshots prefix caching restores (GiB; None:
    #: megatron-core's default, no Mamba prefix cache, so a hybrid model's prompts never skip prefill)
    prefix_caching_mamba_gb: Optional[float] = Field(None, gt=0)
    #: speculative decoding: draft tokens the model's MTP layers propose per decode step, verified
    #: in the next forward (at most ``model.mtp_num_layers``; 0: off)
    num_speculative_tokens: int = Field(0, ge=0)


class SamplingSpec(StrictModel):
    """Sampling for every request. Greedy (top_k=1) by default, so outputs are deterministic."""

    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(1, ge=0)
    top_p: float = Field(0.0, ge=0, le=1)
    #: megatron-core's ``SamplingParams.top_n_logprobs``: record and compare, bit for bit, the
    #: top-n log-probs of every generated token (0: off)
    top_n_logprobs: int = Field(0, ge=0)


class RequestSpec(StrictModel):
    """One prompt (``samples`` copies) or one multi-turn ``conversation``.

    A conversation ``[u1, a1, u2, a2, u3]`` becomes requests whose prompts are ``u1``,
    ``u1+a1+u2``, ``u1+a1+u2+a2+u3``: each turn's prompt is the previous prompt + reply + a new
    message. Turn k arrives at ``arrival_step + k * turn_interval``.
    """

    prompt: Optional[str] = None
    prefix: str = ""
    conversation: Optional[list[str]] = Field(None, min_length=1)
    turn_interval: int = Field(2, ge=0)
    samples: int = Field(1, ge=1)
    arrival_step: int = Field(0, ge=0)
    num_tokens_to_generate: int = Field(8, ge=1)
    #: the round (weight version) the request belongs to: 0 before the first weight update, k after
    #: update k; its ``arrival_step`` counts from the round's start (:class:`WeightUpdateSpec`)
    round: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _one_source(self) -> "RequestSpec":
        if (self.prompt is None) == (self.conversation is None):
            raise ValueError("give exactly one of 'prompt' or 'conversation'")
        if self.prefix == "" and self.prompt == "":
            raise ValueError("empty prompt: 'prompt' and 'prefix' are both empty, so the request has 0 "
                             "tokens and megatron-core cannot prefill it; write at least one character "
                             "in 'prompt'")
        if self.prefix == "" and self.conversation is not None and self.conversation[0] == "":
            raise ValueError("empty prompt: the first turn 'conversation.0' is empty and there is no "
                             "'prefix', so turn 0 has 0 tokens and megatron-core cannot prefill it; "
                             "write at least one character in 'conversation.0'")
        return self


#: megatron-core's ``KVCacheManagementMode`` values (inference/config.py, the same in 0.17-0.19),
#: spelled out so a case file is checked without importing megatron-core; all run on the CPU too.
KV_CACHE_MANAGEMENT_MODES = ("persist", "offload", "recompute")

#: Fields of :class:`WeightUpdateSpec` that only one update kind (or only suspend/resume) uses.
_FIELDS_OF_KIND = {"optimizer": "train_step", "learning_rate": "train_step", "perturb_scale": "perturb",
                   "checkpoints": "checkpoint"}


class WeightUpdateSpec(StrictModel):
    """Weight updates between rounds of requests (the training-to-inference loop of an RL job).

    The run is split into rounds: round 0 starts at engine step 0, round ``k`` at
    ``update_at_steps[k-1]``, where the harness updates the weights before it adds that step's
    arrivals. A request's ``round`` picks its round and its ``arrival_step`` counts from that
    round's start. Requests of an earlier round that are still running at an update keep running
    across it (partial rollouts). Steps are the harness's loop iterations (idle ones included), so
    caching off (A) and on (B) update at the same step.

    * ``kind``: ``train_step`` (one optimizer step of the same GPTModel on the previous round's
      finished requests, prompt + generated tokens of that run), ``perturb`` (seeded Gaussian noise
      of standard deviation ``perturb_scale`` added to every parameter through ``.data``, as a weight
      refit writes) or ``checkpoint`` (the next of ``checkpoints``, or ``ab --update-from DIR``,
      loaded into the model).
    * ``suspend_resume``: ``engine.suspend()`` before the update and ``engine.resume()`` after,
      with the engine's ``kv_cache_management_mode`` (``persist``, Megatron-LM RL's default,
      ``offload`` or ``recompute``); otherwise the harness calls
      ``megatron_ext.invalidate_prefix_cache(engine)`` after the update, as a loop without
      suspend/resume must.
    * ``optimizer`` (``sgd`` or ``adam``), ``learning_rate``: the training step's; ``seed``: of the
      perturbation and of the training step's dropout (update ``k`` uses ``seed + k``).
    """

    kind: Literal["train_step", "perturb", "checkpoint"]
    update_at_steps: list[int] = Field(min_length=1)
    suspend_resume: bool = False
    kv_cache_management_mode: str = "persist"
    optimizer: Literal["sgd", "adam"] = "sgd"
    learning_rate: float = Field(0.01, gt=0)
    perturb_scale: float = Field(0.01, gt=0)
    seed: int = 0
    checkpoints: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> "WeightUpdateSpec":
        steps = self.update_at_steps
        if steps[0] < 1 or any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"update_at_steps {steps} must be engine steps >= 1 in increasing order")
        for name, kind in _FIELDS_OF_KIND.items():
            if name in self.model_fields_set and self.kind != kind:
                raise ValueError(f"'{name}' applies to kind {kind} only, this update is kind {self.kind}; "
                                 "remove it")
        if "kv_cache_management_mode" in self.model_fields_set and not self.suspend_resume:
            raise ValueError("'kv_cache_management_mode' is the engine's mode across suspend()/resume(); "
                             "set suspend_resume: true or remove it")
        if self.kv_cache_management_mode not in KV_CACHE_MANAGEMENT_MODES:
            raise ValueError(f"kv_cache_management_mode '{self.kv_cache_management_mode}' is not one of "
                             f"megatron-core's modes that run here: {', '.join(KV_CACHE_MANAGEMENT_MODES)}")
        if self.kind == "checkpoint" and self.checkpoints and len(self.checkpoints) not in (1, len(steps)):
            raise ValueError(f"{len(self.checkpoints)} checkpoints for {len(steps)} updates; give one (loaded "
                             "at every update) or one per update")
        return self

    @property
    def rounds(self) -> int:
        """Rounds of requests: one more than the updates."""
        return len(self.update_at_steps) + 1

    def round_start(self, round_index: int) -> int:
        """Engine step at which round ``round_index`` starts (0 for round 0)."""
        return 0 if round_index == 0 else self.update_at_steps[round_index - 1]


class Expectations(StrictModel):
    """What ``ab`` checks beyond the audits."""

    bit_identical: bool = True
    min_blocks_matched: int = Field(0, ge=0)
    min_prefill_tokens_skipped: int = Field(0, ge=0)
    #: a request in flight at a weight update that had generated another number of tokens with
    #: caching on than off (megatron-core schedules the two differently, e.g. it defers a request
    #: whose prefix a same-step sibling computes), so the new weights start at another token of it:
    #: ``fail`` the case (designed cases: move the update or the arrivals), or ``exclude`` that
    #: request from the bit-identity check (generated workloads, ``soak --update-every``)
    update_timing: Literal["fail", "exclude"] = "fail"


class Case(StrictModel):
    """A whole case file."""

    name: str = Field(min_length=1)
    description: str = ""
    model: ModelSpec = ModelSpec()
    inference: InferenceSpec = InferenceSpec()
    prefix_caching_eviction_policies: list[Literal["ref_zero", "lru"]] = Field(
        default_factory=lambda: ["ref_zero"], min_length=1
    )
    sampling: SamplingSpec = SamplingSpec()
    requests: list[RequestSpec] = Field(min_length=1)
    expectations: Expectations = Expectations()
    weight_updates: Optional[WeightUpdateSpec] = None

    @property
    def model_features(self) -> list[str]:
        """What was built beyond a dense GPT (``ab --json``'s ``model_features``): the model's
        :attr:`ModelSpec.features`, then ``speculative:N`` with ``N`` draft tokens per decode step."""
        n = self.inference.num_speculative_tokens
        return self.model.features + ([f"speculative:{n}"] if n else [])

    @model_validator(mode="after")
    def _speculative(self) -> "Case":
        # without a model section the model may come from a checkpoint's args (ab --load): checked
        # again then, by harness.speculative.check_supported
        problem = speculative_problem(self, with_model="model" in self.model_fields_set)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _mla_block_size(self) -> "Case":
        # megatron-core's latent KV cache asserts FlashMLA's page size (dynamic_context.py)
        if self.model.multi_latent_attention and self.inference.block_size_tokens != 64:
            raise ValueError(f"inference.block_size_tokens is {self.inference.block_size_tokens} but a "
                             "multi_latent_attention model's latent KV cache needs 64 (megatron-core asserts it); "
                             "set block_size_tokens: 64")
        return self

    @model_validator(mode="after")
    def _rounds(self) -> "Case":
        updates = self.weight_updates
        rounds = 1 if updates is None else updates.rounds
        for index, spec in enumerate(self.requests):
            if spec.round >= rounds:
                fix = ("add a weight_updates section" if updates is None
                       else "add an update to weight_updates.update_at_steps or lower 'round'")
                raise ValueError(f"requests.{index}.round is {spec.round} but the case has {rounds} round(s) "
                                 f"(0 to {rounds - 1}); {fix}")
            if updates is None or spec.round == rounds - 1:
                continue
            last = updates.round_start(spec.round) + spec.arrival_step + spec.turn_interval * (len(turn_prompts(spec)) - 1)
            end = updates.update_at_steps[spec.round]
            if last >= end:
                raise ValueError(f"requests.{index} (round {spec.round}) arrives at engine step {last}, not before "
                                 f"the update at step {end} that ends its round; lower its arrival_step "
                                 f"(it counts from the round's start) or give it round {spec.round + 1}")
        if updates is not None and all(spec.round < rounds - 1 for spec in self.requests):
            raise ValueError(f"no request is in the last round ({rounds - 1}), so the update at step "
                             f"{updates.update_at_steps[-1]} may come after every request finished; give a "
                             f"request 'round: {rounds - 1}' or drop that update")
        return self


def speculative_problem(case: Case, with_model: bool = True) -> Optional[str]:
    """Why ``case``'s speculative decoding cannot be built (one sentence), or None.
    ``with_model``: also check ``inference.num_speculative_tokens`` against the model's MTP layers."""
    n, spec = case.inference.num_speculative_tokens, case.model
    if n and n >= case.inference.block_size_tokens:
        return (f"inference.num_speculative_tokens={n} must be below block_size_tokens="
                f"{case.inference.block_size_tokens} (megatron-core pre-allocates one block per step)")
    if not n or not with_model:
        return None
    if not spec.mtp_num_layers:
        return (f"inference.num_speculative_tokens={n} needs MTP layers to draft them: set "
                "model.mtp_num_layers (or num_speculative_tokens: 0)")
    if n > spec.mtp_num_layers and not spec.mtp_use_repeated_layer:
        return (f"inference.num_speculative_tokens={n} exceeds model.mtp_num_layers={spec.mtp_num_layers}: "
                "megatron-core drafts one token per MTP layer; raise mtp_num_layers or set "
                "mtp_use_repeated_layer: true")
    return None


def turn_prompts(spec: RequestSpec) -> list[str]:
    """The prompt text of each turn (one for a ``prompt``), without the ``prefix``."""
    if spec.prompt is not None:
        return [spec.prompt]
    turns, history = [], ""
    for k in range(0, len(spec.conversation), 2):
        history += spec.conversation[k]
        turns.append(history)
        if k + 1 < len(spec.conversation):
            history += spec.conversation[k + 1]
    return turns


def describe_validation_error(exc: ValidationError) -> str:
    """``field 'requests.0.samples': <pydantic's message>; ...`` for every error in ``exc``."""
    return "; ".join(
        f"field '{'.'.join(str(p) for p in err['loc']) or '<top>'}': {err['msg']}"
        for err in exc.errors()
    )
