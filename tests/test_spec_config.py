"""SpeculativeConfig: vLLM keys, defaults, and errors that name the offending key."""

from __future__ import annotations

import pytest

from tokenbudget.api.spec_config import SpecConfigError, SpeculativeConfig


def test_defaults_and_derived():
    c = SpeculativeConfig()
    assert c.method == "ngram" and (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 4)
    assert c.num_speculative_tokens == "auto" and c.is_adaptive and c.max_spec_tokens == 8
    assert SpeculativeConfig(num_speculative_tokens=None).max_spec_tokens == 8
    suffix = SpeculativeConfig(method="suffix")
    assert suffix.is_adaptive and suffix.max_spec_tokens == 24
    fixed = SpeculativeConfig(num_speculative_tokens=7)
    assert fixed.max_spec_tokens == 7 and not fixed.is_adaptive


def test_auto_and_adaptive_alias():
    a = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": "auto"})
    assert a.is_adaptive and a.max_spec_tokens == 8
    b = SpeculativeConfig(num_speculative_tokens=5, adaptive=True)
    assert b.is_adaptive and b.max_spec_tokens == 5


def test_vllm_dicts():
    c = SpeculativeConfig.from_dict({"method": "[ngram]", "num_speculative_tokens": 5,
                                     "prompt_lookup_max": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 3)
    c = SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_min": 2,
                                     "prompt_lookup_max": 5})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 5)
    c = SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 32,
                                     "suffix_decoding_min_token_prob": 0.2})
    assert c.suffix_max_tree_depth == 32 and c.suffix_min_token_prob == 0.2
    c = SpeculativeConfig.from_dict({"method": "draft_model", "model": "/m",
                                     "num_speculative_tokens": 3})
    assert c.uses_draft_kv
    c = SpeculativeConfig.from_dict({"method": "self_draft", "draft_num_layers": 4})
    assert c.draft_num_layers == 4
    assert SpeculativeConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("d, key", [
    ({"bogus": 1}, "bogus"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": "many"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "medusa"}, "method"),
    ({"method": "draft_model"}, "model"),
    ({"method": "ngram", "model": "/m"}, "model"),
    ({"method": "self_draft"}, "draft_num_layers"),
    ({"method": "self_draft", "draft_num_layers": 0}, "draft_num_layers"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"suffix_min_token_prob": 1.5}, "suffix_min_token_prob"),
    ({"suffix_max_cached_requests": -2}, "suffix_max_cached_requests"),
    ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"suffix_max_tree_depth": 0}, "suffix_max_tree_depth"),
    ({"suffix_max_spec_factor": -1.0}, "suffix_max_spec_factor"),
    ({"adaptive": "yes"}, "adaptive"),
])
def test_from_dict_errors_name_the_key(d, key):
    with pytest.raises(ValueError, match=rf"speculative_config\['{key}'\]"):
        SpeculativeConfig.from_dict(d)


def test_alias_given_twice():
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth|suffix_max_tree_depth"):
        SpeculativeConfig.from_dict({"suffix_max_tree_depth": 8, "suffix_decoding_max_tree_depth": 8})


def test_constructor_errors_name_the_field():
    with pytest.raises(SpecConfigError) as e:
        SpeculativeConfig(method="draft_model")
    assert e.value.key == "model" and str(e.value).startswith("model ")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=-1)


def test_frozen():
    c = SpeculativeConfig()
    with pytest.raises(AttributeError):
        c.method = "suffix"  # type: ignore[misc]


def test_not_a_dict():
    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig.from_dict([("method", "ngram")])  # type: ignore[arg-type]
