"""Chat templates: each family's real template rendered by our sandbox equals transformers'
``apply_chat_template``; Qwen3's ``enable_thinking`` and other template variables pass through
``chat_template_kwargs`` (vLLM's field) in ``Tokenizer.chat_prompt``, ``LLM.chat``, ``AsyncLLM.chat``
and the server, checked and refused with a ``ValueError`` / 400 naming the field; a chat stops at
the family's end-of-turn token; a hostile template fails its request fast with bounded memory.
"""

from __future__ import annotations

import asyncio
import json
import tracemalloc

import httpx
import pytest
from chat_templates import FAMILY_TEMPLATES, QWEN3  # noqa: E402
from tokenizers import Tokenizer as HFTok
from tokenizers import models

from tokenbudget import LLM, AsyncLLM, SamplingParams
from tokenbudget.engine.text.chat_template import render_chat_template
from tokenbudget.engine.text.gguf_tokenizer import build_gguf_tokenizer
from tokenbudget.engine.text.tokenizer import Tokenizer

from engine_fixtures import ENGINE_OPTS  # noqa: E402
from serve_fixtures import KEY, running_server  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

transformers = pytest.importorskip("transformers", reason="needs transformers (the [test] extra)")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi  there\n\n"},
     {"role": "assistant", "content": "Hello! 👋"}, {"role": "user", "content": "naïve café — 世界 🎉"}],
    [{"role": "user", "content": "Think first."},
     {"role": "assistant", "content": "<think>\nLet me see.\n</think>\n\nFour."},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": "",
      "tool_calls": [{"function": {"name": "get", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny"}, {"role": "user", "content": "Thanks"}],
]
TOOLS = [{"type": "function", "function": {
    "name": "get", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _pair(family: str) -> tuple[Tokenizer, object]:
    """Our tokenizer and transformers' with the family's template and bos/eos tokens."""
    template, bos, eos = FAMILY_TEMPLATES[family]
    backend = HFTok(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    ours = Tokenizer(backend, bos_token=bos, eos_token=eos, chat_template=template)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    return ours, hf


def _render_both(ours, hf, messages, **kwargs):
    try:
        expected = hf.apply_chat_template(messages, chat_template=ours.chat_template, tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the template refuses the conversation: so must ours
        with pytest.raises(ValueError, match="chat template error"):
            ours.apply_chat_template(messages, **kwargs)
        return str(exc)
    assert ours.apply_chat_template(messages, **kwargs) == expected
    return expected


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_family_templates_render_like_transformers(family: str, add_generation_prompt: bool) -> None:
    ours, hf = _pair(family)
    for messages in CONVERSATIONS:
        _render_both(ours, hf, messages, add_generation_prompt=add_generation_prompt)
    if family == "qwen3":
        text = _render_both(ours, hf, CONVERSATIONS[3], add_generation_prompt=True, tools=TOOLS)
        assert '"city": {"type": "string"}' in text and "<tool_call>" in text


def test_qwen3_enable_thinking_through_chat_template_kwargs() -> None:
    ours, hf = _pair("qwen3")
    messages = CONVERSATIONS[2]
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, {}):
        expected = hf.apply_chat_template(messages, chat_template=QWEN3, tokenize=False, add_generation_prompt=True,
                                          **kwargs)
        prompt = ours.chat_prompt(messages, chat_template_kwargs=kwargs)
        assert prompt["prompt"] == expected
        assert expected.endswith("<think>\n\n</think>\n\n") == (kwargs.get("enable_thinking") is False)
    # vLLM: chat_template_kwargs override the named arguments
    no_gen = ours.chat_prompt(messages, chat_template_kwargs={"add_generation_prompt": False})["prompt"]
    assert no_gen == hf.apply_chat_template(messages, chat_template=QWEN3, tokenize=False)


def test_continue_final_message_like_transformers() -> None:
    ours, hf = _pair("qwen3")
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, "}]
    expected = hf.apply_chat_template(messages, chat_template=QWEN3, tokenize=False, continue_final_message=True)
    text = ours.chat_prompt(messages, add_generation_prompt=False, continue_final_message=True)["prompt"]
    assert text == expected and text.endswith("1, 2, ")  # the trailing space kept, as transformers
    with pytest.raises(ValueError, match="continue_final_message"):
        ours.chat_prompt(messages, continue_final_message=True)  # with add_generation_prompt=True


@pytest.mark.parametrize("kwargs,match", [
    ([("a", 1)], "object"), ({1: True}, "string keys"), ({"messages": []}, "messages"),
    ({"chat_template": "x"}, "chat_template"), ({"tokenize": True}, "tokenize"), ({"x": {1, 2}}, "JSON"),
    ({"x": float("nan")}, "JSON"), ({"x": "y" * 70_000}, "characters"),
])
def test_chat_template_kwargs_are_checked(kwargs, match: str) -> None:
    ours, _ = _pair("qwen3")
    with pytest.raises(ValueError, match="chat_template_kwargs") as err:
        ours.chat_prompt(CONVERSATIONS[0], chat_template_kwargs=kwargs)
    assert match in str(err.value)


# --------------------------------------------------------------------- hostile templates

# name -> (template, what the error names). Sizes are such that a missing guard shows without
# taking the machine down: the template then builds 50 MB-1 GB or stops at another limit.
HOSTILE = {
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    "string repetition": ("{{ 'x' * 100000000 }}", "a repetition"),
    "repetition via a variable": ("{% set n = 10 ** 8 %}{{ 'x' * n }}", "a repetition"),
    "doubling with ~": ("{% set ns = namespace(s='x') %}{% for i in range(27) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s|length }}", "a ~ concatenation"),
    "doubling with +": ("{% set ns = namespace(s='x') %}{% for i in range(27) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}", "a concatenation"),
    "shared references printed": ("{% set ns = namespace(a=['x']) %}{% for i in range(24) %}"
                                  "{% set ns.a = [ns.a, ns.a] %}{% endfor %}{{ ns.a }}", "printing a value"),
    "shared references to json": ("{% set ns = namespace(a=['x']) %}{% for i in range(24) %}"
                                  "{% set ns.a = [ns.a, ns.a] %}{% endfor %}{{ ns.a|tojson }}", "|tojson"),
    "join of a repeated string": ("{{ (['x' * 10000] * 10000)|join }}", "a repetition"),
    "join with a long separator": ("{{ range(10000)|join('x' * 10000) }}", "a join"),
    "str.join with a long separator": ("{{ ('x' * 10000).join(range(10000)|map('string')) }}", "a join"),
    "output inside a macro": ("{% macro m() %}{% for i in range(100000) %}{{ messages }}{{ messages }}{% endfor %}"
                              "{% endmacro %}{{ m()|length }}", "printing a value"),
    "set block": ("{% set x %}{% for i in range(100000) %}{{ 'y' * 90000 }}{% endfor %}{% endset %}{{ x|length }}",
                  "characters built past"),
    "exponential macro": ("{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                          "steps"),
    "recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    "huge integer": ("{{ 7 ** 10000000 }}", "bits"),
    "center filter": ("{{ 'x'|center(100000000) }}", "was given 100000000"),
    "ljust method": ("{{ 'x'.ljust(100000000) }}", "was given 100000000"),
    "% width": ("{{ '%99999999s' % 'x' }}", "format width"),
    "format filter width": ("{{ '%99999999s'|format('x') }}", "format width"),
    "str.format width": ("{{ '{:>99999999}'.format('x') }}", "format width"),
    "str.format width from an argument": ("{{ '{0:{1}}'.format('x', 99999999) }}", "was given 99999999"),
    "replace": ("{% set s = 'x' * 10000 %}{{ s.replace('x', s) }}", "a replace"),
    "replace filter": ("{% set s = 'x' * 10000 %}{{ s|replace('x', s) }}", "a replace"),
    "indent": ("{{ ('\\n' * 10000)|indent(10000) }}", "an indent"),
    "slices in a loop": ("{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{% set t = s[1:] %}{% endfor %}",
                         "characters built past"),
    "tojson indent": ("{{ range(10000)|list|tojson(indent=9000) }}", "|tojson"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_fails_fast_with_bounded_memory(name: str) -> None:
    """Each fails with a ValueError naming chat_template, at the limit it goes past (never the
    wall-clock backstop), having built at most a few MiB."""
    template, reason = HOSTILE[name]
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="chat_template") as err:
            render_chat_template(template, CONVERSATIONS[1])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert reason in str(err.value)
    assert peak < 24 << 20, f"{name}: peak {peak >> 20} MiB"


def test_guards_keep_legitimate_templates_working() -> None:
    """What the guards touch (iterators read once to be measured, joins, slices, formats) renders as
    in transformers."""
    ours, hf = _pair("qwen3")
    template = ("{{ messages|map(attribute='role')|join(', ') }}|{{ ', '.join(messages|map(attribute='role')) }}|"
                "{% for m in messages|selectattr('role', 'equalto', 'user') %}{{ loop.index }}/{{ loop.length }} "
                "{{ m.content[:5] }}{{ m.content[::-1][:3] }} {% endfor %}|{{ '%-6s|' % 'ab' }}{{ '{:>4}'.format(7) }}"
                "{{ messages|length * 'ab' }}{{ [1, 2] + [3] }}{{ 2 ** 10 }}{{ 'x'|center(5) }}")
    messages = CONVERSATIONS[1]
    assert ours.apply_chat_template(messages, chat_template=template) == hf.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True)


def test_limits_scale_with_a_large_legitimate_conversation() -> None:
    ours, hf = _pair("qwen3")
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " + "word " * 300}
                for i in range(3000)]  # 4.5 MB of text, 3000 turns
    prompt = ours.chat_prompt(messages, chat_template_kwargs={"enable_thinking": False})
    assert prompt["prompt"] == hf.apply_chat_template(messages, chat_template=QWEN3, tokenize=False,
                                                      add_generation_prompt=True, enable_thinking=False)


# --------------------------------------------------------------------- stop tokens

def test_gguf_end_of_turn_tokens_found_by_text() -> None:
    """Where the file names no eot/eom id, llama.cpp's end-of-generation texts are stop tokens."""
    for end in ("<end_of_turn>", "<|end|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>"):
        tokens = ["<unk>", "<s>", "</s>", end, "a"]
        tok = build_gguf_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                                    "tokenizer.ggml.token_type": [2, 3, 3, 3, 1]})
        assert tok.eos_token_ids == [2, 3], end
    named = build_gguf_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.eot_token_id": 3,
                                  "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "x"]})
    assert named.eos_token_ids == [2, 3]


@pytest.fixture(scope="module")
def gemma_like_dir(tmp_path_factory):
    """A tiny random Llama whose byte-level tokenizer has Gemma's turn markers, Gemma 3's template,
    and generation_config.json naming <end_of_turn> as a stop token (as Gemma's does)."""
    from tokenizers import decoders, pre_tokenizers
    path = make_tiny_llama(tmp_path_factory.mktemp("gemma_like"), layers=1)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = HFTok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<eos>", "<end_of_turn>"])  # ids 256, 257, 258
    tok.save(f"{path}/tokenizer.json")
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>"}, f)
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write(FAMILY_TEMPLATES["gemma3"][0])
    with open(f"{path}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": [257, 258]}, f)
    return path


def test_llm_chat_stops_at_end_of_turn_and_passes_kwargs(gemma_like_dir) -> None:
    llm = LLM(gemma_like_dir, **ENGINE_OPTS)
    assert llm.tokenizer.eos_token_ids == [257, 258]
    forced = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={258: 100.0})
    (out,) = llm.chat([{"role": "user", "content": "hi"}], forced, use_tqdm=False)
    assert out.outputs[0].token_ids == [258] and out.outputs[0].finish_reason == "stop"
    assert out.prompt == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert out.prompt_token_ids.count(256) == 1  # BOS from the template only, none added on top
    # chat_template_kwargs reach the template; a bad one is refused before anything is queued
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (out,) = llm.chat([{"role": "user", "content": "x"}], forced, use_tqdm=False, chat_template=template,
                      chat_template_kwargs={"greeting": "hello "})
    assert out.prompt == "hello x"
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat([{"role": "user", "content": "x"}], forced, use_tqdm=False, chat_template_kwargs={"messages": 1})
    assert not llm.llm_engine.has_unfinished_requests()


def test_async_chat_passes_kwargs(gemma_like_dir) -> None:
    llm = AsyncLLM(gemma_like_dir, **ENGINE_OPTS)

    async def run():
        stream = llm.chat([{"role": "user", "content": "x"}], SamplingParams(max_tokens=2, temperature=0.0),
                          chat_template="{{ pre }}{{ messages[0].content }}", chat_template_kwargs={"pre": "> "})
        return [o async for o in stream][-1]
    assert asyncio.run(run()).prompt == "> x"
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat([{"role": "user", "content": "x"}], chat_template=HOSTILE["nested loops"][0])


def test_server_chat_template_kwargs_and_hostile_template(gemma_like_dir) -> None:
    llm = AsyncLLM(gemma_like_dir, **ENGINE_OPTS)
    llm.tokenizer.chat_template = QWEN3
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
    with running_server(llm) as url, httpx.Client(base_url=url, headers=auth, timeout=60) as http:
        plain = http.post("/v1/chat/completions", json=body).json()
        off = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
        assert off.status_code == 200
        think = len(llm.tokenizer.encode("<think>\n\n</think>\n\n"))
        assert off.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + think
        no_gen = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": False}).json()
        assert no_gen["usage"]["prompt_tokens"] < plain["usage"]["prompt_tokens"]
        for bad, param in [({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                           ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                           ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
                           ({"continue_final_message": True}, "continue_final_message")]:
            r = http.post("/v1/chat/completions", json={**body, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        llm.tokenizer.chat_template = HOSTILE["doubling with ~"][0]
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "chat_template" in r.json()["error"]["message"]
        llm.tokenizer.chat_template = QWEN3
        assert http.post("/v1/chat/completions", json=body).status_code == 200  # the server carries on
