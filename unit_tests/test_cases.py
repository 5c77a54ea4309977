"""Case files: shipped cases load and expand as documented; malformed files name the bad field."""

from __future__ import annotations

import pytest

from megatron_ext.cases import CaseFileError, load_case, parse_case, plan_requests, shipped_cases
from megatron_ext.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()


def test_shipped_cases():
    assert shipped_cases() == [
        "chunked_prefill", "memory_pressure", "multi_turn_chat", "rl_rollouts", "shared_system_prompt",
    ]


def test_rl_rollouts_expands_samples_with_block_multiple_and_odd_lengths():
    planned = plan_requests(load_case("rl_rollouts"), TOKENIZER)
    assert [len(p.prompt_tokens) for p in planned] == [48] * 4 + [32] * 4 + [60] * 4 + [48] * 2
    assert [p.arrival_step for p in planned] == [0] * 12 + [12, 12]
    assert planned[0].prompt_tokens == planned[13].prompt_tokens
    assert [p.label for p in planned[:2]] == ["r0.s0", "r0.s1"]


def test_conversation_turns_extend_the_previous_prompt():
    case = parse_case(
        "name: c\nrequests:\n  - conversation: ['ab', 'cd', 'ef']\n    turn_interval: 3\n"
    )
    planned = plan_requests(case, TOKENIZER)
    assert [TOKENIZER.detokenize(p.prompt_tokens) for p in planned] == ["ab", "abcdef"]
    assert [p.arrival_step for p in planned] == [0, 3]


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: x\nrequests: []\n", "field 'requests': List should have at least 1 item"),
        ("name: x\nrequests:\n  - {prompt: hi, samples: zero}\n", "field 'requests.0.samples'"),
        ("name: x\nrequests:\n  - {prompt: hi, sample: 2}\n", "field 'requests.0.sample': Extra inputs"),
        ("name: x\nrequests:\n  - {samples: 2}\n", "give exactly one of 'prompt' or 'conversation'"),
        ("name: x\ninference: {block_size_tokens: 0}\nrequests: [{prompt: hi}]\n",
         "field 'inference.block_size_tokens'"),
        ("name: x\nprefix_caching_eviction_policies: [fifo]\nrequests: [{prompt: hi}]\n",
         "field 'prefix_caching_eviction_policies.0'"),
        ("requests: [{prompt: hi}]\n", "field 'name': Field required"),
        ("name: x\nrequests: [{prompt: hi\n", "not valid YAML"),
        ("- just a list\n", "expected a mapping"),
    ],
)
def test_malformed_case_names_the_problem(text, message):
    with pytest.raises(CaseFileError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_case(text, "case.yaml")


def test_prompt_longer_than_max_sequence_length_is_refused():
    case = parse_case("name: x\ninference: {max_sequence_length: 10}\nrequests: [{prompt: abcdefgh}]\n")
    with pytest.raises(CaseFileError, match=r"requests.0.*8 tokens \+ 8 generated = 16 exceeds"):
        plan_requests(case, TOKENIZER)


def test_unknown_case_name_lists_the_shipped_ones(tmp_path):
    with pytest.raises(CaseFileError, match="no case named 'nope'; shipped cases: chunked_prefill"):
        load_case("nope")
    with pytest.raises(CaseFileError, match="cannot read case file"):
        load_case(str(tmp_path / "missing.yaml"))
    truncated = tmp_path / "t.yaml"
    truncated.write_text("name: t\nrequests:\n  - {prompt: 'unterminated\n")
    with pytest.raises(CaseFileError, match=f"{truncated}: not valid YAML"):
        load_case(str(truncated))
