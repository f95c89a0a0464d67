"""SamplingParams: validation names the bad field; msgspec JSON/msgpack round trips."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from tokenbudget.api.sampling_params import SamplingParams

BAD_VALUES = [
    ("n", 0),
    ("n", -2),
    ("n", 1.5),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "hot"),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("seed", 1.5),
    ("seed", "7"),
    ("seed", -3),
    ("seed", 2**64),
    ("top_k", 2**63),
    ("max_tokens", 0),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("min_tokens", 17),  # > max_tokens (16)
    ("stop", [1]),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("include_stop_str_in_output", 1),
    ("ignore_eos", "yes"),
    ("logprobs", -2),
    ("logprobs", 1.5),
    ("prompt_logprobs", -2),
    ("prompt_logprobs", "3"),
    ("presence_penalty", 2.5),
    ("presence_penalty", "x"),
    ("frequency_penalty", -2.01),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {3: float("nan")}),
    ("logit_bias", {"a": 1.0}),
    ("logit_bias", [1, 2]),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [-1]),
    ("allowed_token_ids", ["a"]),
    ("bad_words", [""]),
    ("bad_words", [3]),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("logits_processors", ["not callable"]),
    ("logits_processors", len),  # a callable, not a list of them
    ("skip_special_tokens", None),
    ("num_speculative_tokens", -1),
    ("num_speculative_tokens", 2.0),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_field_raises_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_defaults_are_valid_and_not_greedy():
    p = SamplingParams()
    assert not p.is_greedy
    assert p.uses_default_processing
    assert p.stop == [] and p.stop_token_ids == []


def test_greedy_definitions():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy
    assert isinstance(SamplingParams(temperature=0).temperature, float)


def test_stop_string_is_normalized_to_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_frozen():
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


def test_accepted_edge_values():
    SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, min_tokens=16, max_tokens=16, logprobs=0)
    SamplingParams(n=4, logprobs=-1, prompt_logprobs=-1, truncate_prompt_tokens=-1, presence_penalty=-2,
                   frequency_penalty=2, repetition_penalty=1e-3, logits_processors=[lambda ids, row: row])
    SamplingParams(num_speculative_tokens=0, seed=2**64 - 1)
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(seed=np.int64(3), stop_token_ids=np.array([5, 6])).stop_token_ids == [5, 6]


def test_logit_bias_is_clipped_and_keys_normalized_as_openai_does():
    p = SamplingParams(logit_bias={"5": 250, np.int64(7): -101.5, 9: 0.5})
    assert p.logit_bias == {5: 100.0, 7: -100.0, 9: 0.5}
    assert SamplingParams(bad_words="hello").bad_words == ["hello"]
    assert SamplingParams(allowed_token_ids=np.array([3, 4])).allowed_token_ids == [3, 4]
    assert SamplingParams(presence_penalty=1).presence_penalty == 1.0
    assert not SamplingParams().needs_row_preparation
    assert SamplingParams(repetition_penalty=1.1).needs_row_preparation


FULL = SamplingParams(
    temperature=0.7,
    top_k=40,
    top_p=0.9,
    min_p=0.05,
    seed=1234,
    max_tokens=64,
    min_tokens=2,
    stop=["</s>", "\n\n"],
    stop_token_ids=[2, 7],
    include_stop_str_in_output=True,
    ignore_eos=True,
    logprobs=5,
    skip_special_tokens=False,
    num_speculative_tokens=3,
    n=3,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.3,
    logit_bias={5: -3.0, 11: 2.5},
    allowed_token_ids=[1, 5, 11, 20],
    bad_words=["foo bar", "baz"],
    prompt_logprobs=2,
    truncate_prompt_tokens=100,
)


@pytest.mark.parametrize("codec", [msgspec.json, msgspec.msgpack])
@pytest.mark.parametrize("params", [SamplingParams(), FULL])
def test_round_trip(codec, params):
    decoded = codec.decode(codec.encode(params), type=SamplingParams)
    assert decoded == params


def test_decode_validates():
    raw = msgspec.json.encode({"top_p": 0.0})
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.json.decode(raw, type=SamplingParams)
