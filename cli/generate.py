"""``tokenbudget generate``: one prompt streamed to the terminal, or a JSONL batch.

    tokenbudget generate "Write a haiku about the sea" --max-tokens 64
    tokenbudget generate --input prompts.jsonl --output outputs.jsonl --spec-method ngram

String prompts go through the model's chat template when it has one (as llama.cpp's CLI does:
an instruct model given a raw completion prompt rarely says anything useful); ``--raw`` sends
them as they are, ``--chat`` insists on the template (an error when the model has none).

Input lines are JSON objects with ``prompt`` (or ``messages`` for chat, or ``prompt_token_ids``)
and optional ``request_id`` and ``sampling_params``; a bare JSON string is a prompt. Output lines
are ``RequestOutput`` JSON in input order. A one-line throughput summary ends a batch.
"""

from __future__ import annotations

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
    p.add_argument("--model", help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    template = p.add_mutually_exclusive_group()
    template.add_argument("--chat", action="store_true",
                          help="apply the model's chat template to string prompts (the default when it has one)")
    template.add_argument("--raw", action="store_true", help="send string prompts as they are, without a chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--spec-method", choices=["ngram", "suffix", "draft_model", "self_draft"],
                   help="speculative decoding method (default: ngram; 'none' via --no-spec)")
    p.add_argument("--num-spec-tokens", default="auto",
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


def speculative_config_from_args(args) -> dict | None:
    if args.speculative_config:
        return json.loads(args.speculative_config)
    if args.no_spec:
        return None
    n = "auto" if args.num_spec_tokens is None else args.num_spec_tokens  # serve/bench: no default of their own
    return {"method": args.spec_method or "ngram", "num_speculative_tokens": n if n == "auto" else int(n)}


def run(args) -> int:
    if (args.prompt is None) == (args.input is None):
        raise ValueError("give either a prompt or --input FILE")
    from tokenbudget.engine.entrypoints.llm import LLM
    options = dict(dtype=args.dtype, quantization=args.quantization, device=args.device,
                   max_model_len=args.max_model_len,
                   max_num_seqs=args.max_num_seqs, num_threads=args.threads,
                   speculative_config=speculative_config_from_args(args))
    llm = LLM(args.model, **options)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    chat = _use_chat_template(llm, args)
    if args.prompt is not None:
        return _stream_one(llm, args.prompt, params, chat)
    return _batch(llm, args, params, chat)


def _use_chat_template(llm, args) -> bool:
    has = llm.tokenizer.chat_template is not None
    if args.chat and not has:
        raise ValueError("--chat: the model has no chat template (use --raw)")
    return has and not args.raw


def _stream_one(llm, prompt: str, params, chat: bool) -> int:
    if chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    engine = llm.engine
    engine.add_request("cli-0", prompt, msgspec.structs.replace(params, output_kind=RequestOutputKind.DELTA))
    start, n_tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
            n_tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(_summary(1, n_tokens, elapsed, llm.get_spec_stats()), file=sys.stderr)
    return 0


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
                prompt = llm.tokenizer.apply_chat_template(item["messages"])
            elif "prompt_token_ids" in item:
                prompt = {"prompt_token_ids": item["prompt_token_ids"]}
            elif "prompt" in item:
                prompt = item["prompt"]
                if chat:
                    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
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
