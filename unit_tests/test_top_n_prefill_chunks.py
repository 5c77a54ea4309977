"""Fault 7: top-n log-probs under chunked prefill, on megatron-core's real engine (CPU backend).

A tiny GPT with greedy sampling and top-3 log-probs prefills a 160-token prompt in chunks of at
most 64 tokens (3 chunks). A copy of it arriving while the first still decodes matches its cached
blocks and computes fewer positions in fewer chunks; a 120-token prompt shares its first 6 blocks.
The engine's own bookkeeping is checked, per request:

- ``generated_top_n_logprobs`` has exactly one entry per generated token, and entry i belongs to
  token i: greedy sampling picks the most likely token, so the entry's top key is token i and
  its value has the bits of ``generated_log_probs[i]``;
- with ``skip_prompt_log_probs=False``, ``prompt_top_n_logprobs`` has one entry per prompt
  position the engine computed, in order: all but the last position of an uncached prompt (the
  last one predicts the first generated token), and for a cached copy exactly the uncached
  request's entries from the first position it computed on.

The tokenizer detokenizes each ID to its decimal string, so a top-n key names its token exactly
(the byte-level tokenizer maps every byte above 127 to one text). Unpatched
(``MEGATRON_EXT_TEST_UNPATCHED=1``) both engine tests fail on 0.17.1, 0.18.2 and 0.19.2. The last
tests check the patch's filing rule itself (``refile_step_entries``) on stand-in requests.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

pytestmark = pytest.mark.every_tree  # runs under every tree in .ci/run

pytest.importorskip("megatron.core")

from megatron_ext import mcore  # noqa: E402
from megatron_ext.harness import engine as harness_engine  # noqa: E402
from megatron_ext.harness.ab import backend  # noqa: E402
from megatron_ext.harness.cases import parse_case  # noqa: E402
from megatron_ext.harness.step_loop import merged_record  # noqa: E402
from megatron_ext.patches.top_n_prefill_chunks import TopNBooks, refile_step_entries  # noqa: E402

PROMPT = bytes(range(32, 192))  # 160 tokens, 10 blocks of 16; 3 chunks of at most 64
SHARED = 96  # SHARING's first 96 tokens (6 blocks) are PROMPT's
SHARING = PROMPT[:SHARED] + bytes(range(192, 216))  # 120 tokens
GENERATE = 5
CASE = parse_case("""
name: top-n-chunks
model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, params_dtype: fp32,
        init_method_std: 0.1, seed: 1234}
inference: {block_size_tokens: 16, buffer_size_gb: 0.004, max_requests: 8, max_tokens: 64,
            max_sequence_length: 256, enable_chunked_prefill: true}
requests: [{prompt: unused}]
""")
#: request ID -> (prompt, arrival step): 1 and 2 arrive while 0 decodes, so its blocks are cached.
REQUESTS = {0: (PROMPT, 0), 1: (PROMPT, 4), 2: (SHARING, 6)}
ID_TOKENIZER = types.SimpleNamespace(
    eod=-1, vocab_size=257, tokenize=list, detokenize=lambda ids: ",".join(str(int(i)) for i in ids))


@dataclasses.dataclass
class Finished:
    """A finished request as the engine left it (its record merged over evictions)."""

    tokens: list[int]
    log_probs: list[float]
    generated_top_n: list[dict[str, float]]
    prompt_top_n: list[dict[str, float]] | None


def _sampling(skip_prompt: bool):
    module = mcore.import_module("megatron.core.inference.sampling_params")
    return module.SamplingParams(top_k=1, return_log_probs=True, skip_prompt_log_probs=skip_prompt,
                                 num_tokens_to_generate=GENERATE, top_n_logprobs=3)


def _run(skip_prompt: bool, monkeypatch) -> dict[int, Finished]:
    """Drive :data:`REQUESTS` through a fresh engine (prefix caching on, REF_ZERO) to the end.
    Logits of every position are materialized (megatron-core requires it for prompt log-probs)."""
    original = harness_engine.inference_config
    monkeypatch.setattr(harness_engine, "inference_config", lambda *args: dataclasses.replace(
        original(*args), materialize_only_last_token_logits=skip_prompt))
    records, step = {}, 0
    with backend("cpu") as (invariant, detail), torch.inference_mode():
        assert invariant, detail
        harness_engine.ensure_model_parallel()
        engine, _ = harness_engine.build_engine(
            harness_engine.build_model(CASE), CASE, True, "ref_zero", ID_TOKENIZER)
        while len(records) < len(REQUESTS) or engine.requests:
            for request_id, (prompt, arrival) in REQUESTS.items():
                if arrival == step:
                    engine.add_request(request_id, list(prompt), _sampling(skip_prompt))
                    records[request_id] = engine.requests[request_id].record
            if engine.requests:
                engine.step_modern()
            step += 1
            assert step < 100, "the engine made no progress"
    return {i: _finished(r) for i, r in records.items()}


def _finished(record) -> Finished:
    merged = merged_record(record)
    return Finished([int(t) for t in merged.generated_tokens], list(merged.generated_log_probs),
                    list(merged.generated_top_n_logprobs or []), merged.prompt_top_n_logprobs)


def _top(entry: dict[str, float]) -> tuple[str, str]:
    """The most likely token of a top-n entry and its log-prob bits."""
    token, log_prob = max(entry.items(), key=lambda item: item[1])
    return token, log_prob.hex()


def _assert_generated_entries_belong_to_their_tokens(finished: Finished, log_probs: bool = True) -> None:
    """One entry per generated token, its top key that token; with ``log_probs`` the entry's top
    value has the bits of the token's ``generated_log_probs`` entry."""
    assert len(finished.tokens) == GENERATE
    assert len(finished.generated_top_n) == GENERATE
    assert all(len(entry) == 3 for entry in finished.generated_top_n)
    assert [_top(entry)[0] for entry in finished.generated_top_n] == [str(t) for t in finished.tokens]
    if log_probs:
        assert len(finished.log_probs) == GENERATE
        assert [_top(entry)[1] for entry in finished.generated_top_n] == [x.hex() for x in finished.log_probs]


@pytest.mark.usefixtures("runtime_patches")
def test_generated_top_n_has_one_entry_per_token_with_chunked_prefill(monkeypatch):
    finished = _run(skip_prompt=True, monkeypatch=monkeypatch)
    for request_id in REQUESTS:
        _assert_generated_entries_belong_to_their_tokens(finished[request_id])
    assert finished[1].generated_top_n == finished[0].generated_top_n  # same prompt, cached: same bits
    assert finished[0].prompt_top_n == []


@pytest.mark.usefixtures("runtime_patches")
def test_prompt_top_n_has_one_entry_per_computed_position_in_order(monkeypatch):
    finished = _run(skip_prompt=False, monkeypatch=monkeypatch)
    uncached, cached, sharing = finished[0], finished[1], finished[2]
    _assert_generated_entries_belong_to_their_tokens(uncached)
    # Not the log-probs of requests with skipped positions: megatron-core splits plain log-probs
    # by the same kind of count (not fault 7, not changed here), so theirs are misfiled.
    _assert_generated_entries_belong_to_their_tokens(cached, log_probs=False)
    _assert_generated_entries_belong_to_their_tokens(sharing, log_probs=False)
    assert len(uncached.prompt_top_n) == len(PROMPT) - 1  # every position but the last
    # The copy computed only its last positions; their entries are the uncached request's.
    computed = len(cached.prompt_top_n)
    assert 0 <= computed < len(PROMPT) - 1 - 16  # at least one block of positions skipped
    assert cached.prompt_top_n == uncached.prompt_top_n[len(PROMPT) - 1 - computed:]
    assert cached.generated_top_n == uncached.generated_top_n
    # SHARING skips at most its matched blocks; the positions it computed within them carry the
    # uncached request's entries (a position's top-n depends on the tokens up to it only).
    first = len(SHARING) - 1 - len(sharing.prompt_top_n)
    assert 16 <= first <= SHARED
    assert sharing.prompt_top_n[:SHARED - first] == uncached.prompt_top_n[first:SHARED]


def _request(skip_prompt: bool, tokens: int, prompt_entries: list, generated_entries: list):
    return types.SimpleNamespace(
        generated_tokens=list(range(tokens)), prompt_top_n_logprobs=list(prompt_entries),
        generated_top_n_logprobs=list(generated_entries),
        sampling_params=types.SimpleNamespace(skip_prompt_log_probs=skip_prompt))


@pytest.mark.parametrize(("skip_prompt", "filed_as", "tokens_after", "prompt", "generated", "prompt_count"), [
    # a non-final chunk's entry, filed as generated by the count: dropped (skip) / a prompt entry
    (True, "generated", 0, [], [], 1),
    (False, "prompt", 0, ["c1", "c2", "c3"], [], 3),
    # the final chunk after skipped positions: the count filed all three as prompt entries
    (False, "prompt", 1, ["c1", "c2"], ["c3"], 2),
])
def test_a_prefill_step_files_its_last_entries_to_its_tokens(
        skip_prompt, filed_as, tokens_after, prompt, generated, prompt_count):
    request = _request(skip_prompt, 0, [], [])
    books = TopNBooks.of(request)
    new = ["c1"] if skip_prompt else ["c1", "c2", "c3"]
    getattr(request, f"{filed_as}_top_n_logprobs").extend(new)  # what the released code did
    request.generated_tokens.extend(range(tokens_after))
    assert refile_step_entries(books) == prompt_count
    assert (request.prompt_top_n_logprobs, request.generated_top_n_logprobs) == (prompt, generated)


def test_a_decode_step_files_every_entry_to_the_generated_tokens():
    # 2 prompt entries and 1 generated token so far; a prompt of 10 makes the count file the
    # decode entry as the 3rd prompt entry
    request = _request(False, 1, ["p1", "p2"], ["g0"])
    books = TopNBooks.of(request)
    request.prompt_top_n_logprobs.append("g1")
    request.generated_tokens.append(1)
    assert refile_step_entries(books) == 0
    assert (request.prompt_top_n_logprobs, request.generated_top_n_logprobs) == (["p1", "p2"], ["g0", "g1"])
