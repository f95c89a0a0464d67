"""``tokenbudget generate`` through ``engine.cli.main``: JSONL batch, streamed prompt, errors.

To keep this file fast, ``llm_module.LLM`` is replaced (for these tests only) by a factory that
builds one engine per distinct set of options, reuses it across CLI calls, and gives it a small
KV pool; everything the CLI does with it is the real thing.
"""

from __future__ import annotations

import json

import msgspec
import pytest

import tokenbudget.engine.entrypoints.llm as llm_module
from tokenbudget.api.outputs import RequestOutput
from tokenbudget.cli.main import main

from engine_fixtures import ENGINE_OPTS, assert_all_blocks_free, default_target  # noqa: E402

COMMON = ["--max-tokens", "12", "--threads", "1", "--max-model-len", "512"]
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Please repeat: one two three, one two three, one two three,"]


@pytest.fixture(scope="module")
def engines():
    real = llm_module.LLM
    built: dict[str, object] = {}

    def factory(model=None, **options):
        options = {**options, "kv_cache_memory_bytes": ENGINE_OPTS["kv_cache_memory_bytes"]}
        key = repr((model, sorted(options.items())))
        if key not in built:
            built[key] = real(default_target() if model is None else model, **options)
        return built[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_module, "LLM", factory)
        yield built


@pytest.fixture(scope="module")
def jsonl_in(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "in.jsonl"
    lines = [json.dumps({"prompt": PROMPTS[0], "request_id": "first"}),
             json.dumps(PROMPTS[1]),  # a bare string is a prompt
             "",  # blank lines are skipped
             json.dumps({"prompt": PROMPTS[2], "sampling_params": {"temperature": 0, "max_tokens": 5}}),
             json.dumps({"messages": [{"role": "user", "content": "Say hi"}], "request_id": "chat"})]
    path.write_text("\n".join(lines) + "\n")
    return path


def _run_batch(jsonl_in, tmp_path, capsys, *flags) -> list[RequestOutput]:
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "--input", str(jsonl_in), "--output", str(out), *COMMON, *flags])
    assert rc == 0
    err = capsys.readouterr().err
    assert "4 request(s)" in err and "tok/s" in err  # the summary line
    lines = out.read_text().splitlines()
    assert len(lines) == 4
    return [msgspec.json.decode(line, type=RequestOutput) for line in lines]


def test_batch_jsonl_no_spec_and_ngram_agree(engines, jsonl_in, tmp_path, capsys) -> None:
    plain = _run_batch(jsonl_in, tmp_path, capsys, "--no-spec", "--raw")
    assert [o.request_id for o in plain] == ["first", "2", "4", "chat"]  # input order, line numbers
    assert [o.prompt for o in plain[:3]] == PROMPTS
    assert "Say hi" in plain[3].prompt and plain[3].prompt.endswith("assistant\n")
    assert len(plain[2].outputs[0].token_ids) == 5  # per-line sampling_params
    assert all(o.finished and o.outputs[0].text for o in plain)
    spec = _run_batch(jsonl_in, tmp_path, capsys, "--spec-method", "ngram", "--num-spec-tokens", "3", "--raw")
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0  # speculation really ran
    for llm in engines.values():
        assert_all_blocks_free(llm.engine)


def test_chat_template_by_default(engines, jsonl_in, tmp_path, capsys) -> None:
    """An instruct model's string prompts get its chat template unless --raw (as llama.cpp's CLI)."""
    default = _run_batch(jsonl_in, tmp_path, capsys, "--no-spec")
    assert all(o.prompt.startswith("<|im_start|>") and o.prompt.endswith("assistant\n") for o in default)
    assert "<|im_start|>user\nThe capital of France is<|im_end|>" in default[0].prompt


def test_stream_one_prompt(engines, jsonl_in, tmp_path, capsys) -> None:
    rc = main(["generate", PROMPTS[0], *COMMON, "--no-spec", "--raw"])
    assert rc == 0
    captured = capsys.readouterr()
    batch = _run_batch(jsonl_in, tmp_path, capsys, "--no-spec", "--raw")
    assert captured.out == batch[0].outputs[0].text + "\n"
    assert "1 request(s), 12 tokens" in captured.err


def test_stream_chat_prompt(engines, capsys) -> None:
    assert main(["generate", "Say hi", "--chat", *COMMON, "--no-spec"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "<|im_start|>" not in captured.out


@pytest.mark.parametrize("argv,message", [
    (["generate", "--bogus"], "unrecognized arguments"),
    (["generate", "x", "--spec-method", "magic"], "invalid choice"),
    (["generate", "x", "--max-tokens", "many"], "invalid int value"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_option_exits_2(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_values_return_2_with_message(engines, tmp_path, capsys) -> None:
    assert main(["generate"]) == 2
    assert "give either a prompt or --input" in capsys.readouterr().err
    assert main(["generate", "hi", "--max-tokens", "0", *COMMON[2:], "--no-spec"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no prompt key"}) + "\n")
    assert main(["generate", "--input", str(bad), *COMMON, "--no-spec"]) == 2
    assert "prompt" in capsys.readouterr().err
    for llm in engines.values():
        assert_all_blocks_free(llm.engine)


def test_speculation_defaults_to_the_adaptive_draft_length() -> None:
    """The showcase (`tokenbudget generate PROMPT`) speculates with ``num_speculative_tokens="auto"``
    unless told otherwise; an explicit count and ``--no-spec`` still win."""
    import argparse

    from tokenbudget.cli import generate

    parser = argparse.ArgumentParser()
    generate.add_parser(parser.add_subparsers())
    cfg = generate.speculative_config_from_args
    assert cfg(parser.parse_args(["generate", "x"])) == {"method": "ngram", "num_speculative_tokens": "auto"}
    assert cfg(parser.parse_args(["generate", "x", "--spec-method", "suffix"]))["num_speculative_tokens"] == "auto"
    assert cfg(parser.parse_args(["generate", "x", "--num-spec-tokens", "3"]))["num_speculative_tokens"] == 3
    assert cfg(parser.parse_args(["generate", "x", "--no-spec"])) is None


def test_serve_and_bench_share_the_default_draft_length() -> None:
    """``tokenbudget serve`` has no --num-spec-tokens default of its own: without the flag it
    speculates like ``generate`` (a None count once crashed ``serve`` before the port opened)."""
    import argparse

    from tokenbudget.cli import generate, serve

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert generate.speculative_config_from_args(args) == {"method": "ngram", "num_speculative_tokens": "auto"}


def test_serve_with_a_missing_model_exits_2_with_one_line(tmp_path) -> None:
    """The real CLI process: a model path that does not exist ends ``tokenbudget serve`` with the
    CLI's one-line error and status 2, not a traceback."""
    import subprocess
    import sys

    from serve_fixtures import free_port

    missing = tmp_path / "missing.gguf"
    res = subprocess.run([sys.executable, "-m", "tokenbudget", "serve", str(missing), "--host", "127.0.0.1",
                          "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "tokenbudget: error: model:" in res.stderr and str(missing) in res.stderr
    assert "Traceback" not in res.stderr


def test_version_and_plain_help(capsys) -> None:
    """``tokenbudget --version`` prints the installed version (pyproject's, through the package
    metadata) and exits 0; the top-level help is plain text (no reST ``quotes``)."""
    import importlib.metadata

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"tokenbudget {importlib.metadata.version('tokenbudget')}"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out
