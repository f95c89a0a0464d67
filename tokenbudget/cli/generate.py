"""``tokenbudget generate``: one prompt streamed to the terminal, or a JSONL batch.

    tokenbudget generate "Write a haiku about the sea" --max-tokens 64
    tokenbudget generate --input prompts.jsonl --output outputs.jsonl --spec-method ngram
    tokenbudget generate "Tell me about the moon" --chat --spec-method eagle3

String prompts go through the model's chat template when it has one (as llama.cpp's CLI does:
an instruct model given a raw completion prompt rarely says anything useful); ``--raw`` sends
them as they are, ``--chat`` insists on the template (an error when the model has none).

Input lines are JSON objects with ``prompt`` (or ``messages`` for chat, or ``prompt_token_ids``)
and optional ``request_id`` and ``sampling_params``; a bare JSON string is a prompt. Output lines
are ``RequestOutput`` JSON in input order. A one-line throughput summary ends a batch.

With speculation on, a streamed prompt ends with a tau line (mean accepted length: tokens per
verify step, and the acceptance by draft position) and a speed-up line: the same prompt is run
again on the same engine with drafts off for it (``SamplingParams.num_speculative_tokens=0``) and
the two decode rates (output tokens after the first, so the prefill and its prefix-cache hit on
the re-run do not count) are compared. ``--no-compare`` skips the re-run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import msgspec

from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text (streamed, or a JSONL batch)")
    p.add_argument("prompt", nargs="?", help="a prompt to stream (omit with --input)")
    p.add_argument("--input", help="JSONL file of prompts")
    p.add_argument("--output", help="JSONL file for the outputs (default: stdout)")
    p.add_argument("--model", help="HF directory, .gguf file or Hugging Face Hub id org/name "
                                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--revision", default=None, help="a hub id's branch, tag or commit")
    template = p.add_mutually_exclusive_group()
    template.add_argument("--chat", action="store_true",
                          help="apply the model's chat template to string prompts (the default when it has one)")
    template.add_argument("--raw", action="store_true", help="send string prompts as they are, without a chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--spec-method", choices=SPEC_METHODS,
                   help="speculative decoding method (default: ngram; 'none' via --no-spec; eagle3: the "
                        "EAGLE-3 head shipped for the default model, or --spec-model DIR)")
    p.add_argument("--spec-model", default=None,
                   help="the drafter's files: a draft model (draft_model) or an EAGLE-3 head directory (eagle3)")
    p.add_argument("--no-compare", action="store_true",
                   help="streamed prompt with speculation: skip the re-run without drafts (the speed-up line)")
    p.add_argument("--num-spec-tokens", type=num_spec_tokens, default="auto",
                   help="drafts per step, or 'auto' (default: chosen per request and step from the "
                        "engine's measured step costs)")
    p.add_argument("--speculative-config", help="full speculative_config as JSON (overrides --spec-*)")
    p.add_argument("--no-spec", action="store_true", help="disable speculative decoding")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto",
                   help="auto | none | int8 | int4: weight-only quantized linears (CPU, float32); "
                        "auto keeps a GGUF's width (Q4_1 -> int4)")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(run=run)


SPEC_METHODS = ["ngram", "suffix", "draft_model", "self_draft", "eagle3"]


def num_spec_tokens(text: str) -> int | str:
    """argparse type of ``--num-spec-tokens``: 'auto' or an integer >= 1 (argparse names the
    flag in its error)."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {text!r}")
    return n


def speculative_config_from_args(args) -> dict | None:
    if args.speculative_config:
        return json.loads(args.speculative_config)
    if args.no_spec:
        return None
    config = {"method": args.spec_method or "ngram", "num_speculative_tokens": args.num_spec_tokens}
    if getattr(args, "spec_model", None):
        config["model"] = args.spec_model
    return config


def run(args) -> int:
    if (args.prompt is None) == (args.input is None):
        raise ValueError("give either a prompt or --input FILE")
    from tokenbudget.engine.entrypoints.llm import LLM
    options = dict(revision=args.revision, dtype=args.dtype, quantization=args.quantization, device=args.device,
                   max_model_len=args.max_model_len,
                   max_num_seqs=args.max_num_seqs, num_threads=args.threads,
                   speculative_config=speculative_config_from_args(args))
    llm = LLM(args.model, **options)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    chat = _use_chat_template(llm, args)
    if args.prompt is not None:
        return _stream_one(llm, args.prompt, params, chat, compare=not args.no_compare)
    return _batch(llm, args, params, chat)


def _use_chat_template(llm, args) -> bool:
    has = llm.tokenizer.chat_template is not None
    if args.chat and not has:
        raise ValueError("--chat: the model has no chat template (use --raw)")
    return has and not args.raw


def _stream_one(llm, prompt: str, params, chat: bool, compare: bool = True) -> int:
    if chat:
        prompt = llm.tokenizer.chat_prompt([{"role": "user", "content": prompt}])
    n_tokens, elapsed, decode_rate = _timed_run(llm.engine, "cli-0", prompt, params, echo=True)
    sys.stdout.write("\n")
    sys.stdout.flush()
    stats = llm.get_spec_stats()
    print(_summary(1, n_tokens, elapsed, stats), file=sys.stderr)
    if stats is None:
        return 0
    by_pos = ", ".join(f"{r:.2f}" for r in stats.acceptance_by_position())
    print(f"tau = {stats.mean_accepted_length:.2f} tokens per verify step ({stats.num_drafts} verify steps; "
          f"acceptance by draft position [{by_pos}])", file=sys.stderr)
    if compare and decode_rate is not None:
        plain = msgspec.structs.replace(params, num_speculative_tokens=0)
        _, _, plain_rate = _timed_run(llm.engine, "cli-plain", prompt, plain, echo=False)
        if plain_rate:
            print(f"speed-up: {decode_rate / plain_rate:.2f}x vs plain decoding ({decode_rate:.1f} vs "
                  f"{plain_rate:.1f} decode tok/s; the same prompt re-run on this engine with drafts off)",
                  file=sys.stderr)
    return 0


def _timed_run(engine, request_id: str, prompt, params, echo: bool):
    """(output tokens, seconds, decode tok/s after the first output token or None)."""
    engine.add_request(request_id, prompt, msgspec.structs.replace(params, output_kind=RequestOutputKind.DELTA))
    start, n_tokens, first_at, n_first = time.perf_counter(), 0, None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if echo:
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
            n_tokens += len(out.outputs[0].token_ids)
            if first_at is None and n_tokens:
                first_at, n_first = time.perf_counter(), n_tokens
    end = time.perf_counter()
    rate = (n_tokens - n_first) / (end - first_at) if first_at is not None and n_tokens > n_first else None
    return n_tokens, end - start, rate


def _read_inputs(path: str, llm, default_params, chat: bool):
    prompts, params, ids = [], [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if isinstance(item, str):
                item = {"prompt": item}
            if "messages" in item:
                prompt = llm.tokenizer.chat_prompt(item["messages"])
            elif "prompt_token_ids" in item:
                prompt = {"prompt_token_ids": item["prompt_token_ids"]}
            elif "prompt" in item:
                prompt = item["prompt"]
                if chat:
                    prompt = llm.tokenizer.chat_prompt([{"role": "user", "content": prompt}])
            else:
                raise ValueError(f"{path}:{lineno}: a line needs 'prompt', 'messages' or 'prompt_token_ids'")
            sp = item.get("sampling_params")
            params.append(msgspec.convert(sp, SamplingParams) if sp else default_params)
            prompts.append(prompt)
            ids.append(item.get("request_id", str(lineno)))
    return prompts, params, ids


def _batch(llm, args, default_params, chat: bool) -> int:
    prompts, params, ids = _read_inputs(args.input, llm, default_params, chat)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    sink = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        for rid, out in zip(ids, outputs):
            out.request_id = rid
            sink.write(msgspec.json.encode(out).decode() + "\n")
    finally:
        if args.output:
            sink.close()
    n_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(_summary(len(outputs), n_tokens, elapsed, llm.get_spec_stats()), file=sys.stderr)
    return 0


def _summary(n_requests: int, n_tokens: int, elapsed: float, spec_stats) -> str:
    line = (f"{n_requests} request(s), {n_tokens} tokens in {elapsed:.2f}s: "
            f"{n_tokens / max(elapsed, 1e-9):.1f} tok/s")
    if spec_stats is not None:
        line += f" | {spec_stats.summary()}"
    return line
