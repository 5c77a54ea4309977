"""megatron-core's real dynamic inference engine on the CPU backend, end to end.

Builds a tiny GPTModel (local layer spec), a DynamicInferenceContext with prefix caching and the
DynamicInferenceEngine through ``engine_factory``, runs requests to completion, and checks that
``cpu_backend()`` puts every replaced object back.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ext import mcore  # noqa: E402
from megatron_ext.cpu_backend import attention, batch_invariant, cpu_backend  # noqa: E402
from megatron_ext.cpu_backend import engine_factory as ef  # noqa: E402
from megatron_ext.cpu_backend.device import CUDA_STANDINS  # noqa: E402

ATTENTION_NAMES = ("flash_attn_varlen_func", "flash_attn_with_kvcache", "is_fa_min_version",
                   "HAVE_FA3", "HAVE_FA4")

gen = torch.Generator().manual_seed(2024)
SHARED = torch.randint(0, 255, (32,), generator=gen).tolist()  # two 16-token blocks
OTHER = torch.randint(0, 255, (20,), generator=gen).tolist()

# Arrival steps chosen so that, besides ordinary prefills, the exact shared prompt arrives while
# the others decode: its matched blocks leave 1 token to compute on 0.17 (all query lengths 1 in
# a mixed step) and a whole recomputed block on 0.18+ (chunks kept at >= 2 tokens).
REQUESTS = [
    ef.RequestSpec(SHARED + [1, 2, 3], num_tokens_to_generate=6, arrival_step=0),
    ef.RequestSpec(OTHER, num_tokens_to_generate=6, arrival_step=0),
    ef.RequestSpec(SHARED, num_tokens_to_generate=6, arrival_step=2),
    ef.RequestSpec(SHARED + [4, 5], num_tokens_to_generate=6, arrival_step=4),
]


def _patched_objects():
    attention_module = mcore.import_module(attention.ATTENTION_MODULE)
    context_module = mcore.import_module(mcore.DYNAMIC_CONTEXT_MODULE)
    return {
        **{("attention", n): attention_module.__dict__.get(n, "<absent>") for n in ATTENTION_NAMES},
        ("context", "triton"): context_module.__dict__["triton_append_key_value_cache"],
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


@pytest.fixture(scope="module")
def parallel_state():
    # One intra-op thread: the row-wise products are many tiny kernels, and on a busy 2-core
    # machine every parallel region can wait milliseconds for the second core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with cpu_backend():
        ef.init_parallel_state(seed=1234)
    yield
    ef.destroy_parallel_state()
    torch.set_num_threads(threads)


def _run(model_spec, context_spec, requests=REQUESTS, spy=None):
    with cpu_backend(), torch.inference_mode():
        if spy is not None:
            module = mcore.import_module(attention.ATTENTION_MODULE)
            real = module.flash_attn_with_kvcache

            def recording(**kwargs):
                spy.append((kwargs["q"].shape[0], kwargs["cache_seqlens"].shape[0]))
                return real(**kwargs)

            module.flash_attn_with_kvcache = recording  # restored by cpu_backend's exit
        built = ef.build_engine(model_spec, context_spec)
        return ef.run_requests(built.engine, requests)


FP32 = ef.ModelSpec(dtype=torch.float32, init_method_std=0.1)
CACHING = ef.ContextSpec(enable_prefix_caching=True, block_size_tokens=16)
NO_CACHING = ef.ContextSpec(enable_prefix_caching=False, block_size_tokens=16)


def test_engine_generates_with_prefix_caching_and_is_reproducible(parallel_state, mcore_series):
    decode_calls = []
    first = _run(FP32, CACHING, spy=decode_calls)
    assert sorted(first) == [0, 1, 2, 3]
    for completion in first.values():
        assert completion.status == "COMPLETED"
        assert len(completion.tokens) == 6 and all(0 <= t < 256 for t in completion.tokens)
        assert len(completion.log_probs) == 6 and all(lp <= 0.0 for lp in completion.log_probs)
    # The prefix is real: greedy continuations differ between prompts.
    assert first[0].tokens != first[1].tokens
    second = _run(FP32, CACHING)
    assert {i: (c.tokens, c.log_probs) for i, c in first.items()} == \
        {i: (c.tokens, c.log_probs) for i, c in second.items()}
    # 0.17 sends the mixed step whose requests all have one query token to the decode kernel,
    # with more query rows (padded tokens) than sequences; 0.18+ use the prefill kernel.
    mismatched = [call for call in decode_calls if call[0] != call[1]]
    assert bool(mismatched) == (mcore_series == "0.17"), decode_calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefix_caching_on_and_off_bit_identical(parallel_state, dtype):
    spec = dataclasses.replace(FP32, dtype=dtype)
    cached = _run(spec, CACHING)
    uncached = _run(spec, NO_CACHING)
    for i in cached:
        assert cached[i].tokens == uncached[i].tokens, f"request {i}"
        assert [x.hex() for x in cached[i].log_probs] == \
            [x.hex() for x in uncached[i].log_probs], f"request {i}"


def test_sampling_is_reproducible_with_the_same_seed(parallel_state):
    full_distribution = {"top_k": 0, "temperature": 1.0}
    sampled = [ef.RequestSpec(r.prompt, 5, r.arrival_step, sampling=full_distribution)
               for r in REQUESTS]
    spec = ef.ModelSpec(dtype=torch.bfloat16, sampling_seed=5)
    first, second = _run(spec, CACHING, sampled), _run(spec, CACHING, sampled)
    assert {i: c.tokens for i, c in first.items()} == {i: c.tokens for i, c in second.items()}
    assert all(len(c.tokens) == 5 for c in first.values())


def test_grouped_query_attention_model(parallel_state):
    spec = ef.ModelSpec(dtype=torch.float32, num_attention_heads=4, num_query_groups=2)
    cached, uncached = _run(spec, CACHING), _run(spec, NO_CACHING)
    assert all(len(c.tokens) == 6 for c in cached.values())
    assert {i: c.log_probs for i, c in cached.items()} == \
        {i: c.log_probs for i, c in uncached.items()}


def test_unknown_config_fields_are_refused(parallel_state):
    with pytest.raises(ValueError, match="InferenceConfig .* no field.*no_such_field"):
        ef.inference_config(ef.ContextSpec(extra={"no_such_field": 1}), 128)
    with pytest.raises(ValueError, match="SamplingParams .* no field.*bogus"):
        ef.sampling_params(ef.RequestSpec([1], sampling={"bogus": 1}))
