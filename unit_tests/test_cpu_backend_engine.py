"""megatron-core's real dynamic inference engine on the CPU backend, end to end.

Builds a tiny GPTModel (local layer spec), a DynamicInferenceContext with prefix caching and the
DynamicInferenceEngine from a case (``megatron_ext.harness.engine``), drives the requests to completion
with the ``ab`` harness (``megatron_ext.harness.step_loop.drive``), and checks that ``cpu_backend()`` puts
every replaced object back.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ext import mcore  # noqa: E402
from megatron_ext.harness.ab import backend  # noqa: E402
from megatron_ext.harness.cases import Case, CaseFileError, parse_case, plan_requests  # noqa: E402
from megatron_ext.cpu_backend import attention, batch_invariant, cpu_backend, pipeline  # noqa: E402
from megatron_ext.cpu_backend.device import CUDA_STANDINS  # noqa: E402
from megatron_ext.harness.engine import build_engine, build_model, ensure_model_parallel  # noqa: E402
from megatron_ext.harness.step_loop import RunRecord, drive  # noqa: E402
from megatron_ext.harness.tokenizer import default_tokenizer  # noqa: E402

ATTENTION_NAMES = ("flash_attn_varlen_func", "flash_attn_with_kvcache", "is_fa_min_version",
                   "HAVE_FA3", "HAVE_FA4")

SHARED = "The quick brown fox jumped over "  # 32 bytes: two 16-token blocks
OTHER = "Five boxing wizards!"  # 20 bytes
assert len(SHARED) == 32 and len(OTHER) == 20

# Arrival steps chosen so that, besides ordinary prefills, the exact shared prompt arrives while
# the others decode: its matched blocks leave 1 token to compute on 0.17 (all query lengths 1 in
# a mixed step) and a whole recomputed block on 0.18+ (chunks kept at >= 2 tokens).
# init_method_std 0.1: peaked enough that greedy continuations differ between prompts.
CASE = parse_case(f"""
name: cpu-backend-engine
model: {{num_layers: 2, hidden_size: 64, num_attention_heads: 4, params_dtype: fp32,
        init_method_std: 0.1, seed: 1234}}
inference: {{block_size_tokens: 16, buffer_size_gb: 0.01, max_requests: 16, max_tokens: 512,
            max_sequence_length: 256}}
requests:
  - {{prefix: "{SHARED}", prompt: "abc", num_tokens_to_generate: 6, arrival_step: 0}}
  - {{prompt: "{OTHER}", num_tokens_to_generate: 6, arrival_step: 0}}
  - {{prompt: "{SHARED}", num_tokens_to_generate: 6, arrival_step: 2}}
  - {{prefix: "{SHARED}", prompt: "de", num_tokens_to_generate: 6, arrival_step: 4}}
""")


def _variant(model: dict | None = None, sampling: dict | None = None) -> Case:
    """:data:`CASE` with some ``model`` / ``sampling`` fields replaced (validated again)."""
    data = CASE.model_dump()
    data["model"].update(model or {})
    data["sampling"].update(sampling or {})
    return Case.model_validate(data)


def _patched_objects():
    attention_module = mcore.import_module(attention.ATTENTION_MODULE)
    context_module = mcore.import_module(mcore.DYNAMIC_CONTEXT_MODULE)
    return {
        **{("attention", n): attention_module.__dict__.get(n, "<absent>") for n in ATTENTION_NAMES},
        ("context", "triton"): context_module.__dict__["triton_append_key_value_cache"],
        ("comms", "_is_cuda"): mcore.import_module(pipeline.COMMUNICATION_MODULE).__dict__["_is_cuda"],
        **{("cuda", n): torch.cuda.__dict__.get(n, "<absent>") for n in CUDA_STANDINS},
        ("torch", "Generator"): torch.Generator,
        ("torch", "function modes"): torch._C._len_torch_function_stack(),
        ("bik", "enabled"): batch_invariant.is_enabled(),
    }


def _changed(before, after):
    return {key for key in before if before[key] is not after[key] and before[key] != after[key]}


def test_cpu_backend_installs_and_restores_everything():
    before = _patched_objects()
    available = torch.cuda.is_available()
    attention_module = mcore.import_module(attention.ATTENTION_MODULE)
    context_module = mcore.import_module(mcore.DYNAMIC_CONTEXT_MODULE)
    with cpu_backend():
        assert attention_module.flash_attn_varlen_func is attention.varlen_attention
        assert attention_module.flash_attn_with_kvcache is attention.kvcache_attention
        assert attention_module.is_fa_min_version("2.7.3")
        assert context_module.triton_append_key_value_cache is None
        comms = mcore.import_module(pipeline.COMMUNICATION_MODULE)
        comms._is_cuda_contiguous(torch.zeros(2, device="cpu"))  # CPU tensors pass between stages
        with pytest.raises(AssertionError):
            comms._is_cuda(None)
        assert torch.cuda.is_available() and batch_invariant.is_enabled()
        assert _changed(before, _patched_objects()) != set()  # something did change
    assert _changed(before, _patched_objects()) == set()
    assert torch.cuda.is_available() == available
    with pytest.raises(LookupError):
        with cpu_backend(batch_invariant=False):
            assert not batch_invariant.is_enabled()
            raise LookupError
    assert _changed(before, _patched_objects()) == set()


def test_cpu_backend_keeps_an_outer_batch_invariant_mode():
    with batch_invariant.batch_invariant_mode():
        with cpu_backend():
            pass
        assert batch_invariant.is_enabled()
    assert not batch_invariant.is_enabled()


def _run(case: Case, caching: tuple[bool, ...] = (True,), spy: list | None = None) -> list[RunRecord]:
    """One model for ``case``, then per entry of ``caching`` a fresh engine (prefix caching on or
    off, ``ref_zero`` eviction) driven to completion, all inside ``ab.backend("cpu")`` (CPU
    backend, one intra-op thread). ``spy`` collects ``(query rows, sequences)`` of every decode
    kernel call."""
    planned = plan_requests(case, default_tokenizer())
    records = []
    threads = torch.get_num_threads()
    with backend("cpu") as (invariant, detail), torch.inference_mode():
        assert invariant, detail
        assert torch.get_num_threads() == 1
        if spy is not None:
            module = mcore.import_module(attention.ATTENTION_MODULE)
            real = module.flash_attn_with_kvcache

            def recording(**kwargs):
                spy.append((kwargs["q"].shape[0], kwargs["cache_seqlens"].shape[0]))
                return real(**kwargs)

            module.flash_attn_with_kvcache = recording  # restored by cpu_backend's exit
        ensure_model_parallel()
        model = build_model(case)
        for on in caching:
            engine, context = build_engine(model, case, on, "ref_zero")
            record = RunRecord(on, "ref_zero" if on else None)
            drive(engine, context, case, planned, record)
            assert record.error is None, record.error
            records.append(record)
    assert torch.get_num_threads() == threads
    return records


def _results(record: RunRecord) -> dict[int, tuple[list[int], list[str]]]:
    """request ID -> (tokens, log-prob bits as float hex)."""
    return {i: (o.tokens, [x.hex() for x in o.log_probs]) for i, o in record.outputs.items()}


def test_engine_generates_with_prefix_caching_and_is_reproducible(mcore_series):
    decode_calls = []
    (first,) = _run(CASE, spy=decode_calls)
    assert sorted(first.outputs) == [0, 1, 2, 3]
    for output in first.outputs.values():
        assert len(output.tokens) == 6 and all(0 <= t < 257 for t in output.tokens)
        assert len(output.log_probs) == 6 and all(lp <= 0.0 for lp in output.log_probs)
    # The prefix is real: greedy continuations differ between prompts.
    assert first.outputs[0].tokens != first.outputs[1].tokens
    # Requests 2 and 3 arrive after request 0 filled the two shared blocks: they match them.
    assert first.counters.blocks_matched >= 4
    assert first.counters.prefill_tokens_skipped > 0
    # A fresh model (same seed) and engine give the same bits.
    (second,) = _run(CASE)
    assert _results(first) == _results(second)
    # 0.17 sends the mixed step whose requests all have one query token to the decode kernel,
    # with more query rows (padded tokens) than sequences; 0.18+ use the prefill kernel.
    mismatched = [call for call in decode_calls if call[0] != call[1]]
    assert bool(mismatched) == (mcore_series == "0.17"), decode_calls


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_prefix_caching_on_and_off_bit_identical(dtype):
    cached, uncached = _run(_variant(model={"params_dtype": dtype}), caching=(True, False))
    assert cached.counters.prefill_tokens_skipped > 0
    assert uncached.counters.prefill_tokens_skipped == 0
    assert _results(cached) == _results(uncached)


def test_grouped_query_attention_model():
    case = _variant(model={"num_attention_heads": 4, "num_query_groups": 2})
    cached, uncached = _run(case, caching=(True, False))
    assert all(len(o.tokens) == 6 for o in cached.outputs.values())
    assert cached.counters.prefill_tokens_skipped > 0
    assert _results(cached) == _results(uncached)


def test_sampling_from_the_full_distribution_is_reproducible():
    # Each engine gets a fresh controller whose sampling generator is seeded the same way.
    case = _variant(model={"params_dtype": "bf16"}, sampling={"top_k": 0, "temperature": 1.0})
    first, second = _run(case, caching=(True, True))
    assert all(len(o.tokens) == 6 for o in first.outputs.values())
    assert _results(first) == _results(second)


def test_unknown_case_fields_are_refused():
    # The case schema is the one place engine settings come from; a typo must not be ignored.
    with pytest.raises(CaseFileError, match=r"field 'inference\.no_such_field'"):
        parse_case("name: x\ninference: {no_such_field: 1}\nrequests: [{prompt: hi}]")
    with pytest.raises(CaseFileError, match=r"field 'sampling\.bogus'"):
        parse_case("name: x\nsampling: {bogus: 1}\nrequests: [{prompt: hi}]")
    with pytest.raises(CaseFileError, match=r"field 'model\.init_method_std'"):
        parse_case("name: x\nmodel: {init_method_std: 0}\nrequests: [{prompt: hi}]")
