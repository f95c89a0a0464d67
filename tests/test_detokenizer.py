"""IncrementalDetokenizer: streaming equals full decode, no broken characters, stop strings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbudget.engine.text.detokenizer import IncrementalDetokenizer
from tokenbudget.engine.text.gguf_tokenizer import build_gguf_tokenizer
from tokenbudget.engine.text.tokenizer import Tokenizer

from model_helpers import smollm2_gguf_tokenizer  # noqa: E402

TEXTS = ["Hello, world!", "emoji 🎉👍🏽🇫🇷 and CJK 世界你好, ünïcödé", "日本語のテキスト🙂🙃",
         "code:\n    x = [1, 2, 3]  # ✓\n", "👨‍👩‍👧‍👦 family", " leading space", "é" * 7]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return smollm2_gguf_tokenizer()


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    """SentencePiece-style tokenizer (byte fallback, leading-space marker) from GGUF metadata."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["\u2581", "h", "i", "\u2581h", "\u2581hi", "!"]
    return build_gguf_tokenizer({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces + words,
        "tokenizer.ggml.scores": [0.0] * len(pieces) + [-float(i) for i in range(len(words))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(words),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0})


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], chunk: int = 1,
            skip: bool = True) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add_tokens(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    deltas, detok = _stream(smol, [], ids)
    assert "".join(deltas) == smol.decode(ids) == text == detok.output_text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.num_pending_tokens == 0


def test_multibyte_characters_are_held_back(smol: Tokenizer) -> None:
    ids = smol.encode("🎉")
    assert len(ids) > 1  # the emoji's 4 bytes span several tokens
    deltas, _ = _stream(smol, [], ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🎉"


@settings(max_examples=40, deadline=None)
@given(st.text(st.characters(min_codepoint=0x20, max_codepoint=0x3FFFF, exclude_categories=("Cs",)),
               max_size=30),
       st.sampled_from(["", "Once upon a time", "数字 🎉"]), st.integers(1, 4))
def test_streaming_property(smol: Tokenizer, text: str, prompt: str, chunk: int) -> None:
    prompt_ids, ids = smol.encode(prompt), smol.encode(text)
    deltas, detok = _stream(smol, prompt_ids, ids, chunk)
    full = smol.decode(ids)
    assert "".join(deltas) == detok.output_text
    if "\ufffd" not in full:
        assert detok.output_text == full
        assert all("\ufffd" not in d for d in deltas)
    else:  # the vocabulary lacks some bytes of text: broken text is genuine, still emitted
        assert detok.output_text.replace("\ufffd", "") == full.replace("\ufffd", "")


def test_special_tokens(smol: Tokenizer) -> None:
    ids = smol.encode("Hi<|im_end|>\nthere")
    _, skipped = _stream(smol, [], ids)
    assert skipped.output_text == "Hi\nthere"
    _, kept = _stream(smol, [], ids, skip=False)
    assert kept.output_text == "Hi<|im_end|>\nthere"


def test_sentencepiece_leading_space_uses_prompt_context(sp_tok: Tokenizer) -> None:
    prompt = sp_tok.encode("hi")
    out = sp_tok.encode("hi hi!")
    deltas, detok = _stream(sp_tok, prompt, out)
    assert detok.output_text == " hi hi!"  # a continuation keeps its leading space
    assert sp_tok.decode(prompt + out).endswith(detok.output_text)
    _, no_prompt = _stream(sp_tok, [], out)
    assert no_prompt.output_text == sp_tok.decode(out) == "hi hi!"
    _, split = _stream(sp_tok, prompt, sp_tok.encode("hé"))  # é via byte fallback, 2 tokens
    assert split.output_text == " hé"


def test_invalid_bytes_are_emitted_eventually(smol: Tokenizer) -> None:
    lead = smol.encode("🎉")[0]  # an incomplete lead sequence, never completed
    ids = [lead] + smol.encode(" and more text after it")
    deltas, detok = _stream(smol, [], ids)
    assert "".join(deltas) == detok.output_text
    assert detok.output_text.endswith("more text after it") and "\ufffd" in detok.output_text


# ---------------------------------------------------------------- stop strings


def _run_until_stop(tok: Tokenizer, text: str, stop: list[str], include: bool = False):
    detok = IncrementalDetokenizer(tok, [])
    streamed, result = [], (None, -1)
    for tid in tok.encode(text):
        detok.add_tokens([tid])
        result = detok.check_stop(stop, include)
        streamed.append(detok.stream_delta(finished=result[0] is not None, stop=stop))
        if result[0] is not None:
            break
    return detok, result, "".join(streamed)


def test_stop_string_truncates(smol: Tokenizer) -> None:
    detok, (matched, cut), streamed = _run_until_stop(smol, "Answer: 42\n###\nmore", ["###"])
    assert matched == "###" and cut == len("Answer: 42\n")
    assert detok.output_text == streamed == "Answer: 42\n"
    assert detok.add_tokens(smol.encode("ignored")) == ""  # finished: nothing more is added


def test_stop_string_included_and_earliest_wins(smol: Tokenizer) -> None:
    detok, (matched, cut), _ = _run_until_stop(smol, "one two three four", ["four", "two"], include=True)
    assert matched == "two" and detok.output_text == "one two" and cut == 7


def test_stop_string_spanning_tokens_and_unicode(smol: Tokenizer) -> None:
    detok, (matched, _), streamed = _run_until_stop(smol, "世界你好🎉 end", ["好🎉"])
    assert matched == "好🎉" and detok.output_text == streamed == "世界你"


def test_no_stop_and_stream_holdback(smol: Tokenizer) -> None:
    detok = IncrementalDetokenizer(smol, [])
    detok.add_tokens(smol.encode("abc de"))
    assert detok.check_stop(["xyz"]) == (None, -1)
    assert detok.stream_delta(stop=["xyz"]) == "abc "  # last 2 chars could start "xyz"
    assert detok.stream_delta(finished=True, stop=["xyz"]) == "de"
    assert detok.stream_delta(finished=True) == ""
    assert detok.check_stop([]) == (None, -1)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_text_does_not_depend_on_step_grouping(sp_tok: Tokenizer, data) -> None:
    """Byte-fallback tokens, invalid UTF-8 included, in random step groupings: the same text as
    one token at a time (a DELTA stream and a FINAL_ONLY output of one request agree)."""
    byte_ids = st.integers(3, 3 + 255)  # <0x00>..<0xFF>
    ids = data.draw(st.lists(st.one_of(byte_ids, st.sampled_from([259, 260, 262, 264])), min_size=1, max_size=24))
    one_by_one, _ = _stream(sp_tok, [1], ids)
    detok = IncrementalDetokenizer(sp_tok, [1])
    deltas, i = [], 0
    while i < len(ids):
        n = data.draw(st.integers(1, 6))
        deltas.append(detok.add_tokens(ids[i:i + n]))
        i += n
    assert "".join(deltas) == "".join(one_by_one) == detok.output_text


@pytest.mark.parametrize("stop", [(), ("world",)])
def test_a_rolled_back_step_leaves_no_text_behind(smol: Tokenizer, stop) -> None:
    """The detokenizer is part of its output record (``RequestState.__copy__`` copies it): a step
    whose outputs were prepared and then rolled back leaves the text as it was, so running the
    step again gives the text of one run (fails if the record's copy shares the detokenizer: the
    step's tokens are added twice)."""
    from tokenbudget import SamplingParams
    from tokenbudget.api.sampling_params import RequestOutputKind
    from tokenbudget.engine.core.output_processor import OutputProcessor
    from tokenbudget.scheduler.output import EngineCoreOutput
    from tokenbudget.scheduler.request import Request

    ids = smol.encode("Hello, big world of text")
    params = SamplingParams(max_tokens=32, stop=list(stop), output_kind=RequestOutputKind.DELTA)
    processor = OutputProcessor(smol)
    request = Request("a", smol.encode("A prompt:"), max_tokens=32, sampling_params=params)
    processor.add_request(request)
    states = processor.states

    def step(tokens: list[int]) -> str:
        outputs = processor.prepare([EngineCoreOutput("a", list(tokens))])
        request.all_token_ids.extend(tokens)
        return "".join(o.outputs[0].text for o in outputs)

    request.all_token_ids = list(request.prompt_token_ids)
    first = step(ids[:2])  # committed (no step open)
    states.begin()
    step(ids[2:])
    states.rollback()
    del request.all_token_ids[len(request.all_token_ids) - len(ids[2:]):]
    states.begin()
    again = step(ids[2:])
    states.commit()
    want = smol.decode(ids)
    want = want.split("world")[0] if stop else want
    assert first + again == want and states["a"].detok.output_text == want, (first, again)
