"""What a new user meets first (issue 46, item 6), through ``LLM`` and the ``openai`` client:

* the model's recommended sampling (``generation_config.json``; a GGUF's ``general.sampling.*``)
  fills what a request leaves unset, as vLLM's ``--generation-config auto`` (values equal to
  transformers' defaults recommend nothing, as in vLLM), and the start-up log says so;
  ``generation_config="none"`` keeps the engine's neutral defaults;
* a model name the server does not serve is OpenAI's 404 ``model_not_found``;
* a logprob token that holds part of a multi-byte character reads as vLLM gives it: ``""`` until
  the token that completes the character, which carries all of it, so the tokens join to the
  text and their ``bytes`` to its bytes (never U+FFFD).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="needs the [test] extra (openai)")

from tokenbudget import LLM, AsyncLLM, SamplingParams, StructuredOutputsParams  # noqa: E402

from engine_fixtures import ENGINE_OPTS, default_target  # noqa: E402
from gguf_families import write_family_gguf  # noqa: E402
from model_helpers import write_tokenizer_files  # noqa: E402
from serve_fixtures import KEY, MODEL, running_server  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

TINY = dict(num_threads=1, kv_cache_memory_bytes=4 << 20, max_model_len=256)
# top_k 50 is transformers' default: vLLM reads GenerationConfig.to_diff_dict(), where it is absent
GENERATION = {"temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 5, "top_k": 50, "do_sample": True}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = make_tiny_llama(tmp_path_factory.mktemp("gen") / "llama", layers=1, hidden=32, scale=25.0)
    (Path(path) / "generation_config.json").write_text(json.dumps(GENERATION))
    return path


def test_generation_config_fills_what_a_request_leaves_unset(tiny_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tokenbudget"):
        llm = LLM(tiny_dir, **TINY)
    assert "sampling defaults from the model's generation config: max_tokens=5, repetition_penalty=1.3, " \
           "temperature=0.0" in caplog.text
    recommended = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=5)
    assert llm.get_default_sampling_params() == recommended
    want = llm.generate(PROMPT, recommended, use_tqdm=False)[0].outputs[0]
    got = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]  # no SamplingParams: the model's
    assert got.token_ids == want.token_ids and len(got.token_ids) == 5
    neutral = LLM(tiny_dir, generation_config="none", **TINY)
    assert neutral.get_default_sampling_params() == SamplingParams()


def test_the_server_uses_them_for_the_fields_a_body_does_not_set(tiny_dir):
    llm = AsyncLLM(tiny_dir, **TINY)
    offline = LLM(tiny_dir, **TINY)
    with running_server(llm) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        r = client.completions.create(model=MODEL, prompt=PROMPT)  # OpenAI's temperature 1 would sample
        want = offline.generate(PROMPT, SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=5),
                                use_tqdm=False)[0].outputs[0].text
        assert r.choices[0].text == want and r.usage.completion_tokens == 5
        own = client.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0, seed=3, max_tokens=7,
                                        extra_body={"repetition_penalty": 1.0})
        want_own = offline.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=7),
                                    use_tqdm=False)[0].outputs[0].text
        assert own.choices[0].text == want_own and own.usage.completion_tokens == 7


def test_a_ggufs_sampling_keys_are_its_defaults(tmp_path):
    write_tokenizer_files(str(tmp_path))
    path = str(tmp_path / "m.gguf")
    write_family_gguf(path, "llama", str(tmp_path), sampling={"temp": 0.6, "top_p": 0.95, "top_k": 20})
    assert LLM(path, **TINY).get_default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.95, top_k=20)


def test_a_bad_recommendation_is_refused_at_start_up_naming_the_key(tmp_path):
    path = make_tiny_llama(tmp_path / "bad", layers=1, hidden=32)
    (Path(path) / "generation_config.json").write_text(json.dumps({"temperature": -2}))
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        LLM(path, **TINY)


@pytest.fixture(scope="module")
def client():
    llm = AsyncLLM(default_target(), **ENGINE_OPTS)
    with running_server(llm) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def test_an_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.status_code == 404
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    assert info.value.body["type"] == "invalid_request_error" and "gpt-5" in info.value.body["message"]


CHINESE = StructuredOutputsParams(choice=["你好世界"])  # byte-level BPE: each character in 2-3 tokens


def test_logprob_tokens_of_partial_characters_as_vllm_gives_them():
    llm = LLM(default_target(), **ENGINE_OPTS)
    out = llm.generate("Chinese: 你好", SamplingParams(temperature=0, max_tokens=20, logprobs=2, prompt_logprobs=0,
                                                      structured_outputs=CHINESE), use_tqdm=False)[0]
    c = out.outputs[0]
    tokens = [entry[t].decoded_token for t, entry in zip(c.token_ids, c.logprobs)]
    assert "".join(tokens) == c.text == "你好世界" and "" in tokens  # parts give "", the last part the character
    assert all("\ufffd" not in lp.decoded_token for entry in c.logprobs for lp in entry.values())
    prompt = [entry[t].decoded_token for t, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
    assert "".join(prompt) == "Chinese: 你好"[len(llm.tokenizer.decode(out.prompt_token_ids[:1])):]


def test_logprob_tokens_and_bytes_through_the_openai_client(client):
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello in Chinese."}], temperature=0,
                      max_tokens=20, logprobs=True, top_logprobs=2,
                      response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {
                          "type": "string", "enum": ["你好世界"]}}})
        if stream:
            content, items = "", []
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices and chunk.choices[0].logprobs:
                    items += chunk.choices[0].logprobs.content
                content += chunk.choices[0].delta.content or "" if chunk.choices else ""
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            content, items = choice.message.content, choice.logprobs.content
        assert content == '"你好世界"'
        assert "".join(i.token for i in items) == content
        assert b"".join(bytes(i.bytes) for i in items) == content.encode()
        assert all("\ufffd" not in t.token for i in items for t in i.top_logprobs)
