"""Soak workload for ``megatron-ext soak``: a generated case of many requests with shared prefixes.

:func:`soak_case` turns a seed and a request count into an ordinary :class:`~megatron_ext.harness.cases.Case`
(the same schema, planner and ``ab`` harness as the shipped cases), so a soak is ``ab`` on a big,
random but reproducible workload:

* RL rollouts: one prompt sampled 2-8 times (fewer for the last group if fewer requests are left), all samples arriving together (siblings finish in
  the same step and release their shared blocks together);
* multi-turn conversations of 2-4 turns: each turn's prompt extends the previous turn's prompt;
* questions under one of a few shared system prompts (the ``prefix`` field);
* arrivals as a seeded Poisson process (exponential gaps between groups), prompt lengths of 1 to
  200 tokens on and off block boundaries (3 in 4 at most 40 tokens: the CPU backend's cost grows
  with the tokens computed), 2-16 generated tokens per request;
* chunked prefill on with 64-token chunks, and a KV pool of 48 blocks of 16 tokens for up to 16
  requests, far less than 16 requests of up to 14 blocks need: requests are paused, and LRU
  evicts cached blocks to admit new ones.

The same ``(requests, seed)`` gives the same case everywhere (Python's ``random.Random``; no
dependence on hash seeds or dict order). The prompts are English-like word salad from a fixed
word list (the byte tokenizer maps one character to one token).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

from pydantic import ValidationError

from .audits.speculative import DraftCounts
from .cases import load_case
from .cases.schema import (Case, CaseFileError, Expectations, InferenceSpec, ModelSpec, RequestSpec,
                           WeightUpdateSpec, describe_validation_error, turn_prompts)

if TYPE_CHECKING:
    from .ab import ABResult

#: The tiny model every shipped case uses.
SOAK_MODEL = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, params_dtype="bf16", seed=1234)

#: ``soak --moe``: the soak model with 4 experts, top-2 routing and routing replay (fp32, so the
#: routing of a token does not hang on bf16 ties between experts).
SOAK_MOE_MODEL = SOAK_MODEL.model_copy(update={"params_dtype": "fp32", "num_experts": 4, "moe_router_topk": 2,
                                               "moe_ffn_hidden_size": 64, "moe_enable_routing_replay": True})

#: KV pool of 48 usable blocks of 16 tokens (bf16, 2 layers x 4 heads x 16 channels x K,V = 8 KiB a
#: block; megatron-core adds one dummy block), up to 16 requests, 64-token prefill chunks.
SOAK_INFERENCE = InferenceSpec(block_size_tokens=16, buffer_size_gb=49 * 8192 / 1024**3, max_requests=16,
                               max_tokens=64, max_sequence_length=256, enable_chunked_prefill=True)

#: The longest prompt the generator writes (tokens) and the most tokens it asks to generate.
MAX_PROMPT_TOKENS, MAX_GENERATED_TOKENS = 200, 16

#: Prompts and messages up to this many tokens are "short"; 3 in 4 are short.
SHORT_TOKENS = 40

#: Mean gap between the arrivals of two groups (a rollout group, a conversation or a question), in
#: engine steps. Groups hold ~3 requests on average and the engine finishes ~1 request per step at
#: most here, so the queue and the pool stay full.
MEAN_ARRIVAL_GAP_STEPS = 2.5

#: ``soak --hybrid``: a tiny hybrid model (Mamba, attention, Mamba; fp32 weights and Mamba states,
#: Mamba chunk 16 = the block size, so every block boundary is a possible exact restore point).
SOAK_HYBRID_MODEL = ModelSpec(hybrid_layer_pattern="M*M", hidden_size=32, num_attention_heads=2, params_dtype="fp32",
                              seed=1234, init_method_std=0.1, mamba_state_dim=8, mamba_head_dim=16,
                              mamba_num_groups=1, mamba_chunk_size=16, mamba_ssm_states_dtype="fp32")

#: ``soak --hybrid``: up to 8 requests, 64-token prefill chunks, a 1 MiB Mamba snapshot cache
#: (hundreds of slots) and a 224 KiB buffer, which megatron-core splits between the 8 requests'
#: live Mamba states and the KV pool (42 blocks of 16 tokens on 0.19.2).
SOAK_HYBRID_INFERENCE = InferenceSpec(block_size_tokens=16, buffer_size_gb=224 * 1024 / 1024**3, max_requests=8,
                                      max_tokens=64, max_sequence_length=128, enable_chunked_prefill=True,
                                      prefix_caching_mamba_gb=0.001)

#: ``soak --hybrid``'s request shapes: prompts of at most 64 tokens, 2-3 generated tokens, 1-2 steps
#: between conversation turns, groups arriving every step on average: megatron's Mamba kernels run
#: under Triton's interpreter on the CPU, seconds per engine step, so the workload is short and dense.
HYBRID_MAX_PROMPT_TOKENS, HYBRID_MAX_GENERATED_TOKENS, HYBRID_MEAN_ARRIVAL_GAP_STEPS = 64, 3, 1.0

#: ``soak --mla``: the shipped ``mla_tiny`` case's multi-latent attention model (bf16; a latent KV
#: cache of kv_lora_rank 32 + qk_pos_emb_head_dim 8 channels per token and layer, query/KV norms).
SOAK_MLA_MODEL = load_case("mla_tiny").model

#: ``soak --mla``: blocks of 64 tokens (megatron-core's latent cache asserts it), whole prompts in one
#: step (no chunked prefill). :func:`soak_case` sizes ``max_requests``, ``max_tokens`` and the pool to
#: the workload (:func:`fit_without_waiting`): every request is admitted at its arrival step with
#: caching on and off, so both runs prefill the same requests in the same steps and a decode-only
#: step (absorbed-query attention over the latent cache) is decode-only in both; a step that also
#: prefills decodes over uncompressed keys and values, equal in exact arithmetic but not in bits
#: (docs/ab.md, multi-latent attention).
SOAK_MLA_INFERENCE = InferenceSpec(block_size_tokens=64, buffer_size_gb=33 * 10240 / 1024**3, max_requests=16,
                                   max_tokens=1024, max_sequence_length=128)

#: ``soak --mtp``: the shipped ``mtp_speculative_tiny`` case's model: 2 layers and 1 MTP layer applied
#: at both draft depths (``mtp_use_repeated_layer``), fp32, seed 8 (random weights whose drafts are
#: sometimes accepted).
SOAK_MTP_MODEL = load_case("mtp_speculative_tiny").model

#: ``soak --mtp``: 2 draft tokens per decode step, blocks of 8 tokens (so drafts often cross into a
#: block the rollback drops), 64-token prefill chunks, a pool of 96 blocks (fp32, 2 layers x K,V x
#: 32 channels x 8 tokens = 4 KiB a block; megatron-core adds one dummy block), up to 16 requests.
SOAK_MTP_INFERENCE = InferenceSpec(block_size_tokens=8, buffer_size_gb=97 * 4096 / 1024**3, max_requests=16,
                                   max_tokens=64, max_sequence_length=256, enable_chunked_prefill=True,
                                   num_speculative_tokens=2)

#: ``soak --mtp``: the most tokens a request generates.
MTP_MAX_GENERATED_TOKENS = 16


class _Shape(NamedTuple):
    """A soak model's request shapes.

    Attributes:
        longest: longest prompt (tokens); most_generated: most generated tokens per request;
        gap: mean gap between the arrivals of two groups (engine steps);
        longest_turn_interval: most steps between two turns of a conversation;
        cut_system_prompts: system prompts cut to half the prompt budget;
        aligned_block: rollout prompts are a whole number of blocks of this many tokens 1 time in
            4 (0: never), so their later samples match every block and recompute tokens inside the
            last one (fix 2's trigger);
        one_arrival_per_step: at most one new group and one rollout sample arrive per engine step
            (a rollout's samples arrive on consecutive steps, later groups after its last sample's step);
        short, short_share: this share of the prompts and messages are at most ``short`` tokens,
            the rest longer.
    """

    longest: int
    most_generated: int
    gap: float
    longest_turn_interval: int
    cut_system_prompts: bool
    aligned_block: int = 0
    one_arrival_per_step: bool = False
    short: int = SHORT_TOKENS
    short_share: float = 0.75


_GPT_SHAPE = _Shape(MAX_PROMPT_TOKENS, MAX_GENERATED_TOKENS, MEAN_ARRIVAL_GAP_STEPS, 12, False)

class SoakModel(NamedTuple):
    """One ``soak_case(model=...)`` kind: its model, inference settings, request shapes and the end
    of the case's description."""

    model: ModelSpec
    inference: InferenceSpec
    shape: _Shape
    description: str


_GPT_POOL = "48-block KV pool."

#: ``soak_case(model=...)`` kinds; the CLI's ``--hybrid``, ``--moe``, ``--mla``, ``--mtp`` (``gpt``:
#: none of them).
SOAK_MODELS: dict[str, SoakModel] = {
    "gpt": SoakModel(SOAK_MODEL, SOAK_INFERENCE, _GPT_SHAPE, _GPT_POOL),
    "hybrid": SoakModel(SOAK_HYBRID_MODEL, SOAK_HYBRID_INFERENCE,
                        _Shape(HYBRID_MAX_PROMPT_TOKENS, HYBRID_MAX_GENERATED_TOKENS, HYBRID_MEAN_ARRIVAL_GAP_STEPS, 2, True),
                        "hybrid M*M model, Mamba prefix cache."),
    "moe": SoakModel(SOAK_MOE_MODEL, SOAK_INFERENCE, _GPT_SHAPE, _GPT_POOL),
    "mla": SoakModel(SOAK_MLA_MODEL, SOAK_MLA_INFERENCE,
                     _Shape(112, MAX_GENERATED_TOKENS, MEAN_ARRIVAL_GAP_STEPS, 12, False, aligned_block=64,
                            one_arrival_per_step=True, short=64, short_share=0.0),
                     "multi-latent attention model, latent KV cache in blocks of 64 tokens."),
    "mtp": SoakModel(SOAK_MTP_MODEL, SOAK_MTP_INFERENCE, _GPT_SHAPE._replace(most_generated=MTP_MAX_GENERATED_TOKENS),
                     "MTP speculative decoding (2 drafts per step), blocks of 8 tokens."),
}

_WORDS = (
    "the a of to and in is it that for on with as was at by be this from or an are not have which "
    "river water block cache token prompt model layer engine request sample batch memory pool "
    "summary tensor kernel buffer query answer system user assistant reply question explain list "
    "three prime number larger ninety blue sky rain tin haiku bread dough oven hike lake mirror "
    "drill tile glue wood paint commit message hash table tree map cycle child step example tool "
    "safety power store careful brief kind warm rise hour double size start flour salt yeast plan "
    "short walk far eight kilometre weather storm cloud light wind north south east west green"
).split()

_SYSTEM_PROMPTS = (
    "System: You are a careful assistant for a hardware store. Answer briefly and name the tool.\n",
    "System: You are a patient tutor. Explain each step, then give one short example.\n",
    "System: Reply as a terse code reviewer: list problems first, then one fix each, no praise.\n",
)


def _text(rng: random.Random, length: int) -> str:
    """Words from the fixed list, cut to exactly ``length`` characters (ASCII: one token each)."""
    words: list[str] = []
    size = 0
    while size < length:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:length]


def _length(rng: random.Random, longest: int, short: int = SHORT_TOKENS, short_share: float = 0.75) -> int:
    """A length in [1, longest]: ``short_share`` of them at most ``short``, the rest above."""
    if longest <= short or rng.random() < short_share:
        return rng.randint(1, min(longest, short))
    return rng.randint(short + 1, longest)


def soak_case(
    requests: int,
    seed: int = 0,
    policies: Sequence[str] = ("ref_zero", "lru"),
    chunked_prefill: bool = True,
    update_every: Optional[int] = None,
    model: str = "gpt",
    rope_type: Optional[str] = None,
) -> Case:
    """A reproducible soak workload of exactly ``requests`` engine requests.

    Args:
        requests: number of engine requests (samples and conversation turns each count one), >= 1.
        seed: seed of the generator; the same ``(requests, seed, policies, model)`` gives the same case.
        policies: prefix-caching eviction policies to run B with (``ref_zero``, ``lru``).
        chunked_prefill: megatron-core's ``enable_chunked_prefill``. Off, prompts longer than a
            step's token budget cannot be admitted, so ``max_tokens`` is raised to 256 (every
            prompt then prefills in one step); the workload is the same.
        update_every: a weight update every this many engine steps (:func:`with_weight_updates`).
        model: one of :data:`SOAK_MODELS` (the ``soak`` options ``--hybrid``, ``--moe``, ``--mla``,
            ``--mtp``; ``gpt`` without one):

            * ``gpt``: :data:`SOAK_MODEL`, :data:`SOAK_INFERENCE`;
            * ``hybrid``: a hybrid (Mamba + attention) model (:data:`SOAK_HYBRID_MODEL`,
              :data:`SOAK_HYBRID_INFERENCE`) and shorter requests (prompts of at most
              :data:`HYBRID_MAX_PROMPT_TOKENS` tokens, 2-:data:`HYBRID_MAX_GENERATED_TOKENS`
              generated tokens, groups every :data:`HYBRID_MEAN_ARRIVAL_GAP_STEPS` steps on average,
              1-2 steps between turns); the same kinds of groups (rollouts, conversations, questions
              under the shared system prompts, cut to half the prompt budget). Needs Triton's
              interpreter on the CPU (``TRITON_INTERPRET=1 MAMBA_DETERMINISTIC=1``);
            * ``moe``: the mixture-of-experts model :data:`SOAK_MOE_MODEL` (routing replay audited;
              the figures give the allocator's stored block routing at its largest), the GPT
              workload and pool;
            * ``mla``: multi-latent attention, :data:`SOAK_MLA_MODEL` and :data:`SOAK_MLA_INFERENCE`
              (see there for why its steps keep one kind with caching on and off), the GPT workload;
            * ``mtp``: MTP speculative decoding, :data:`SOAK_MTP_MODEL` and :data:`SOAK_MTP_INFERENCE`,
              the GPT workload with :data:`MTP_MAX_GENERATED_TOKENS` generated tokens at most. Needs
              Triton's interpreter on the CPU (``TRITON_INTERPRET=1``).
        rope_type: ``mla`` only (``soak --mla --rope-type``): the MLA model's ``rope_type``, ``rope``
            (None: :data:`SOAK_MLA_MODEL`'s, ``mla_tiny``'s) or ``yarn`` (megatron-core's
            ``YarnRotaryEmbedding`` with its default parameters, Megatron's MLA default); the case
            is then named ``...-mla-<rope_type>``.

    Returns:
        A :class:`Case` named ``soak-<requests>-seed<seed>`` (``-<model>`` for a model other than
        ``gpt``; ``-unchunked`` where chunked prefill was turned off, not for ``mla``, which never
        chunks), the model's KV pool and the expectations of a soak:
        bit-identical, at least one matched block.

    Raises:
        ValueError: ``requests`` < 1, or ``model`` not in :data:`SOAK_MODELS`.
        CaseFileError: ``rope_type`` for a model other than ``mla``, or neither ``rope`` nor ``yarn``.
        CaseFileError: unknown policy (the case schema refuses it, naming the field).
    """
    if requests < 1:
        raise ValueError(f"soak: --requests must be >= 1, got {requests}")
    if model not in SOAK_MODELS:
        raise ValueError(f"soak: model {model!r} is none of {', '.join(SOAK_MODELS)}")
    spec, base, shape, description = SOAK_MODELS[model]
    if rope_type is not None:
        if model != "mla" or rope_type not in ("rope", "yarn"):
            raise CaseFileError(f"soak: --rope-type {rope_type} applies to --mla only, and is rope or yarn")
        spec = ModelSpec.model_validate({**spec.model_dump(), "rope_type": rope_type})
        description = f"{description[:-1]}, RoPE type {rope_type}."
    specs = _workload(requests, seed, shape)
    unchunked = not chunked_prefill and base.enable_chunked_prefill  # MLA never chunks: nothing to turn off
    inference = base if not unchunked else base.model_copy(
        update={"enable_chunked_prefill": False, "max_tokens": max(256, base.max_tokens)})
    if shape.one_arrival_per_step:  # a workload that must never wait (MLA): the engine sized to it
        inference = fit_without_waiting(inference, specs, spec)
    updates = None
    if update_every is not None:
        specs, updates = with_weight_updates(specs, update_every, seed)
    try:
        return Case(
            name=f"soak-{requests}-seed{seed}" + ("" if model == "gpt" else f"-{model}")
            + ("" if rope_type is None else f"-{rope_type}")
            + ("-unchunked" if unchunked else "")
            + ("" if update_every is None else f"-update-every-{update_every}"),
            weight_updates=updates,
            description=f"Generated soak workload: {requests} requests (RL rollouts, multi-turn "
                        f"conversations, shared system prompts), seed {seed}, " + description,
            model=spec,
            inference=inference,
            prefix_caching_eviction_policies=list(policies),
            requests=specs,
            expectations=Expectations(bit_identical=True, min_blocks_matched=1, min_prefill_tokens_skipped=1,
                                      update_timing="fail" if update_every is None else "exclude"),
        )
    except ValidationError as exc:
        raise CaseFileError(f"soak: {describe_validation_error(exc)}") from None


#: Bytes of one element of the KV cache per ``params_dtype``.
_DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def fit_without_waiting(inference: InferenceSpec, specs: Sequence[RequestSpec], model: ModelSpec) -> InferenceSpec:
    """``inference`` with ``max_requests``, ``max_tokens`` and the KV pool (``buffer_size_gb``) just
    large enough that no request of ``specs`` ever waits: each is admitted at its arrival step and
    runs its ``num_tokens_to_generate`` steps (arrival to last token) without pausing.

    A request of ``P`` prompt tokens (one per byte: the byte tokenizer; a subword tokenizer gives
    fewer) generating ``g`` is counted, from its arrival step through its ``g``-th step, as one
    request, ``ceil((P + g) / block_size_tokens)`` blocks (at least what megatron-core allocates for
    it at any time) and one token, ``P`` in its arrival step. The bounds are the largest sums over
    any step, so they hold with prefix caching off (every request holding its own blocks) and on
    (shared and cached blocks only lower what must come from the free pool). Not for chunked
    prefill (a prompt would take several steps). One dummy block is added to the pool; a latent
    block (multi-latent attention) is ``layers x block x (kv_lora_rank + qk_pos_emb_head_dim)``
    elements, another block ``layers x block x 2 x hidden_size`` (keys and values).
    """
    block = inference.block_size_tokens
    live: dict[int, list[int]] = {}  # step -> [requests, blocks, tokens]
    for spec in specs:
        g = spec.num_tokens_to_generate
        for turn, text in enumerate(turn_prompts(spec)):
            prompt = len((spec.prefix + text).encode())
            arrival = spec.arrival_step + turn * spec.turn_interval
            for step in range(arrival, arrival + g):
                row = live.setdefault(step, [0, 0, 0])
                row[0] += spec.samples
                row[1] += spec.samples * -(-(prompt + g) // block)
                row[2] += spec.samples * (prompt if step == arrival else 1)
    requests, blocks, tokens = (max(row[k] for row in live.values()) for k in range(3))
    channels = (model.kv_lora_rank + model.qk_pos_emb_head_dim if model.multi_latent_attention
                else 2 * model.hidden_size)
    block_bytes = _DTYPE_BYTES[model.params_dtype] * model.num_layers * block * channels
    # rounded up to 256: megatron-core pads a step's token count and asserts the padded count fits max_tokens
    return inference.model_copy(update={"max_requests": requests, "max_tokens": max(inference.max_tokens, -(-tokens // 256) * 256),
                                        "buffer_size_gb": (blocks + 1) * block_bytes / 1024**3})


def _workload(requests: int, seed: int, shape: _Shape) -> list[RequestSpec]:
    """The request groups of :func:`soak_case`: exactly ``requests`` engine requests of ``shape``."""
    system_prompts = tuple(s[:shape.longest // 2] for s in _SYSTEM_PROMPTS) if shape.cut_system_prompts \
        else _SYSTEM_PROMPTS
    rng = random.Random(f"megatron-ext soak {seed}")
    specs: list[RequestSpec] = []
    left, arrival, free_step = requests, 0.0, 0
    while left:
        kind = rng.random()
        step = max(int(arrival), free_step) if shape.one_arrival_per_step else int(arrival)
        generate = rng.randint(2, shape.most_generated)
        if kind < 0.45:  # RL rollout: one prompt sampled N times, admitted together
            samples = min(left, rng.randint(2, 8))
            length = _length(rng, shape.longest, shape.short, shape.short_share)
            if shape.aligned_block and rng.random() < 0.25:
                length = shape.aligned_block * rng.randint(1, shape.longest // shape.aligned_block)
            prompt = _text(rng, length)
            if shape.one_arrival_per_step:  # one sample a step: none held back behind a sibling's prefill
                specs.extend(RequestSpec(prompt=prompt, arrival_step=step + k, num_tokens_to_generate=generate)
                             for k in range(samples))
            else:
                specs.append(RequestSpec(prompt=prompt, samples=samples, arrival_step=step,
                                         num_tokens_to_generate=generate))
            free_step = step + samples
            left -= samples
        elif kind < 0.80:  # multi-turn conversation: turn k's prompt extends turn k-1's
            turns = min(left, rng.randint(2, 4))
            budget = shape.longest // (2 * turns - 1)  # the last turn holds 2*turns-1 messages
            messages = [("User: " if k % 2 == 0 else "Assistant: ") + _text(rng, _length(rng, max(1, budget - 12), shape.short, shape.short_share)) + "\n"
                        for k in range(2 * turns - 1)]
            specs.append(RequestSpec(conversation=messages, turn_interval=rng.randint(1, shape.longest_turn_interval),
                                     arrival_step=step, num_tokens_to_generate=generate))
            free_step = step + 1
            left -= turns
        else:  # a question under a shared system prompt
            system = rng.choice(system_prompts)
            question = "User: " + _text(rng, _length(rng, shape.longest - len(system) - 7, shape.short, shape.short_share)) + "\n"
            specs.append(RequestSpec(prefix=system, prompt=question, arrival_step=step,
                                     num_tokens_to_generate=generate))
            free_step = step + 1
            left -= 1
        arrival += rng.expovariate(1.0 / shape.gap)
    return specs


#: Standard deviation of the noise of a ``soak --update-every`` weight update.
UPDATE_PERTURB_SCALE = 0.01


def with_weight_updates(specs: list[RequestSpec], every: int, seed: int
                        ) -> tuple[list[RequestSpec], Optional[WeightUpdateSpec]]:
    """``specs`` split into rounds of ``every`` engine steps, with a ``perturb`` update (then
    ``invalidate_prefix_cache``) at each round boundary up to the last arrival.

    A request arriving at step ``a`` is in round ``a // every`` at ``a % every`` from its start.
    A conversation becomes one request per turn (same prompts and arrival steps; labels
    ``rN.s0``), since its later turns may fall in later rounds.

    Raises:
        ValueError: ``every`` < 1.
    """
    if every < 1:
        raise ValueError(f"soak: --update-every must be >= 1, got {every}")
    out: list[RequestSpec] = []
    for spec in specs:
        for turn, text in enumerate(turn_prompts(spec)):
            arrival = spec.arrival_step + turn * spec.turn_interval
            out.append(RequestSpec(prefix=spec.prefix, prompt=text, samples=spec.samples,
                                   round=arrival // every, arrival_step=arrival % every,
                                   num_tokens_to_generate=spec.num_tokens_to_generate))
    last_round = max(spec.round for spec in out)
    if last_round == 0:
        return out, None
    steps = [every * k for k in range(1, last_round + 1)]
    return out, WeightUpdateSpec(kind="perturb", update_at_steps=steps, perturb_scale=UPDATE_PERTURB_SCALE,
                                 seed=seed)


def soak_summary(result: "ABResult") -> dict[str, Any]:
    """The soak's figures per run: requests, engine steps, seconds, prefix-cache counters and KV
    pool pressure (``peak_pool_use`` is ``"held/total"`` blocks), megatron-core's error if any;
    per model: Mamba restores (hybrid), routing replay (MoE), the KV-write audit's latent writes
    (MLA: ``kv_writes_checked``, ``kv_writes_redirected`` to the dummy block), the speculative
    audit (MTP: ``drafts`` proposed / accepted / rejected / rejected_across_block /
    accepted_across_block, ``draft_block_violations``: hash-registered blocks holding drafts,
    ``spec_rewind_violations``: rollbacks leaving the bookkeeping broken)."""
    runs = [("caching off", result.baseline)] + [(p.policy, p.run) for p in result.policies]
    out: dict[str, Any] = {"case": result.case.name, "requests": len(result.baseline.outputs),
                           "megatron_core_version": result.megatron_core_version,
                           "verdict": "pass" if not result.failures() else "fail", "runs": {}}
    for name, run in runs:
        pressure = run.pressure
        out["runs"][name] = {
            "engine_steps": run.steps, "wall_s": round(run.wall_s, 1),
            "blocks_matched": run.counters.blocks_matched,
            "prefill_tokens_skipped": run.counters.prefill_tokens_skipped,
            "peak_pool_use": f"{pressure.peak_blocks_held}/{pressure.total_blocks}",
            **{k: getattr(pressure, k) for k in ("peak_paused_requests", "requests_paused",
                                                  "requests_evicted", "cached_blocks_evicted")},
            "kv_write_violations": run.audit.kv_write_violations,
            "refcount_violations": run.audit.refcount_violations,
            "lru_violations": run.audit.lru_violations,
            "stale_hits": run.audit.stale_hits,
            **_model_figures(result.case, run.audit),
            "weight_updates": len(run.updates),
            "error": run.error,
        }
    if result.post_update_reference is not None:
        out["post_update_reference"] = result.post_update_reference.as_json()
    return out


def _model_figures(case: Case, audit: Any) -> dict[str, Any]:
    """The audit figures of the model's own paths (see :func:`soak_summary`)."""
    figures: dict[str, Any] = {}
    if case.model.is_hybrid:
        figures.update(mamba_restores=audit.mamba_restores, mamba_restores_failed=audit.mamba_restores_failed,
                       mamba_restore_violations=audit.mamba_restore_violations,
                       kv_writes_redirected=audit.kv_writes_redirected)
    if "routing_replay" in case.model.features:
        figures.update(routing_tokens_checked=audit.routing_tokens_checked,
                       routing_replay_violations=audit.routing_replay_violations,
                       block_routing_max_entries=audit.block_routing_max_entries)
    if case.model.multi_latent_attention:
        figures.update(kv_writes_checked=audit.kv_writes_checked, kv_writes_redirected=audit.kv_writes_redirected)
    if case.inference.num_speculative_tokens:
        kinds = audit.violations_by_kind
        figures.update(drafts=audit.drafts.as_json(), draft_block_violations=kinds.get("draft_block", 0),
                       spec_rewind_violations=kinds.get("spec_rewind", 0))
    return figures


def soak_lines(summary: dict[str, Any]) -> list[str]:
    """One report line per run of :func:`soak_summary`'s figures (``soak <run>: ...``), then the
    post-update reference's (``soak --update-every``)."""
    reference = summary.get("post_update_reference")
    return [
        f"soak {name}: {summary['requests']} requests, {run['engine_steps']} engine steps, "
        f"{run['wall_s']} s, {run['blocks_matched']} blocks matched, peak pool use "
        f"{run['peak_pool_use']} blocks, {run['requests_paused']} requests paused "
        f"after a step (peak {run['peak_paused_requests']} at once), {run['requests_evicted']} requests "
        f"evicted, {run['cached_blocks_evicted']} cached blocks evicted"
        + (f", {run['mamba_restores']} Mamba restores ({run['mamba_restores_failed']} failed)"
           if "mamba_restores" in run else "")
        + (f", stored block routing at most {run['block_routing_max_entries']} blocks"
           if "block_routing_max_entries" in run else "")
        + (f", {run['kv_writes_redirected']} of {run['kv_writes_checked']} latent writes sent to the dummy block"
           if "kv_writes_checked" in run else "")
        + (f", {DraftCounts(**run['drafts']).clause()}, "
           f"{run['drafts']['rejected_across_block']} rejections across a block boundary, "
           f"{run['draft_block_violations']} registered blocks holding drafts, "
           f"{run['spec_rewind_violations']} rollbacks leaving the bookkeeping broken"
           if "drafts" in run else "")
        + (f"; megatron-core raised: {run['error']}" if run["error"] else "")
        for name, run in summary["runs"].items()
    ] + ([] if reference is None else [_reference_line(reference)])


def _reference_line(reference: dict[str, Any]) -> str:
    if not reference["checked"]:
        return f"soak post-update reference: not run ({reference['why_not']})"
    compared = sum(run["requests_compared"] for run in reference["runs"])
    tokens = sum(run["tokens_compared"] for run in reference["runs"])
    differing = sum(len(run["requests_differing"]) for run in reference["runs"])
    return (f"soak post-update reference: {compared} requests ({tokens} tokens) of {len(reference['runs'])} runs "
            f"against fresh engines on {reference['weight_versions']} weight versions, {differing} differing, "
            f"max |Δ log-prob| {max((run['max_abs_diff'] for run in reference['runs']), default=0.0):.3g}")


def fit_vocab(case: Case, vocab_size: int) -> tuple[Case, Optional[str]]:
    """``case`` with its model's ``vocab_size`` grown to ``vocab_size`` if smaller (the soak model
    has no case file to edit, and its weights are random either way), and the line that says so
    (None when it fits), so a dumped case reruns with ``ab --case ... --tokenizer``."""
    if vocab_size <= case.model.vocab_size:
        return case, None
    note = f"model vocab_size {case.model.vocab_size} -> {vocab_size}"
    return case.model_copy(update={"model": case.model.model_copy(update={"vocab_size": vocab_size})}), note
