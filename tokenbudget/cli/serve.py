"""``tokenbudget serve [MODEL]``: the OpenAI-compatible server (needs the ``serve`` extra).

    tokenbudget serve --port 8000 --api-key secret --spec-method ngram   # drafts per step: auto

Engine options are ``LLM``'s, as flags; speculation flags are ``generate``'s. Binds 127.0.0.1
unless ``--host`` says otherwise. Router-ready (``engine/serve/readiness.py``): the port opens
before the model loads, ``/health`` is 503 while it loads and while a SIGTERM drains.
"""

from __future__ import annotations

import os

from tokenbudget.cli.generate import SPEC_METHODS, num_spec_tokens, speculative_config_from_args
from tokenbudget.engine.serve.tool_parsers import PARSERS as _TOOL_PARSERS  # the standard library only


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (pip install 'tokenbudget[serve]')")
    p.add_argument("model", nargs="?", default=None,
                   help="HF directory, .gguf file or Hugging Face Hub id org/name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--revision", default=None, help="a hub id's branch, tag or commit")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--grpc", type=int, default=None, metavar="PORT",
                   help="serve the SMG gRPC worker protocol (VllmEngine, for `smg launch --worker-urls "
                        "grpc://HOST:PORT`) on this port instead of the HTTP server (pip install 'tokenbudget[grpc]')")
    p.add_argument("--api-key", default=os.environ.get("TOKENBUDGET_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $TOKENBUDGET_API_KEY)")
    p.add_argument("--served-model-name", default=None,
                   help="model name in the API (default: the hub id, or the file's name)")
    p.add_argument("--grace-period", type=float, default=30.0, help="seconds to drain requests on SIGTERM")
    p.add_argument("--spec-method", choices=SPEC_METHODS)
    p.add_argument("--spec-model", default=None,
                   help="a draft model (draft_model) or an EAGLE-3 head directory (eagle3)")
    p.add_argument("--num-spec-tokens", type=num_spec_tokens, default="auto",
                   help="drafts per step, or 'auto' (default: chosen per request and step)")
    p.add_argument("--speculative-config", help="full speculative_config as JSON (overrides --spec-*)")
    p.add_argument("--no-spec", action="store_true", help="disable speculative decoding")
    for flag, kind in (("--dtype", str), ("--device", str), ("--max-model-len", int), ("--max-num-seqs", int),
                       ("--max-num-batched-tokens", int), ("--kv-cache-memory-bytes", int), ("--block-size", int),
                       ("--scheduling-policy", str), ("--num-threads", int), ("--seed", int),
                       ("--long-prefill-token-threshold", int), ("--max-queued-requests", int),
                       ("--max-queued-tokens", int)):
        p.add_argument(flag, type=kind, default=None, help="EngineConfig option (default: the engine's)")
    from tokenbudget.engine.serve.limits import ServerLimits, flag
    defaults = ServerLimits()
    for name in ServerLimits.__struct_fields__:
        kind = float if isinstance(getattr(defaults, name), float) else int
        p.add_argument(flag(name), type=kind, default=getattr(defaults, name), dest=name,
                       help=f"limit (default: {getattr(defaults, name) or 'the context length'}; "
                            "docs/serving.md, Security and limits)")
    p.add_argument("--max-grammar-mask-ms", type=float, default=None,
                   help="CPU ms one request's grammar masks may take per step; past it the request fails "
                        "(default: 10)")
    p.add_argument("--max-batch-grammar-mask-ms", type=float, default=None,
                   help="CPU ms the grammar masks of all requests may take in a step (on average); past it the "
                        "costliest wait (default: 5)")
    p.add_argument("--max-grammar-mask-ms-in-flight", type=float, default=None,
                   help="estimated CPU ms a step of the masks of every structured request in flight; a new "
                        "structured request past it gets 429 (default: 100)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice \"auto\": the model's own tool calls, read by --tool-call-parser (vLLM's flags)")
    p.add_argument("--tool-call-parser", choices=sorted(_TOOL_PARSERS), default=None,
                   help="the format of the model's tool calls: hermes (Qwen2.5/3, Hermes), llama3_json (Llama 3.x), "
                        "mistral")
    p.add_argument("--generation-config", choices=("auto", "none"), default=None,
                   help="auto (default, vLLM's): the model's recommended sampling (generation_config.json, a "
                        "GGUF's general.sampling.*) for the fields a request leaves unset; none: the engine's")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--cuda-graphs", action="store_true", help="CUDA only: capture decode batches in CUDA graphs")
    p.set_defaults(run=run)


_ENGINE_FLAGS = ("revision", "dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "kv_cache_memory_bytes", "block_size", "scheduling_policy", "num_threads", "seed",
                 "long_prefill_token_threshold", "max_queued_requests", "max_queued_tokens", "max_grammar_mask_ms",
                 "max_batch_grammar_mask_ms", "max_grammar_mask_ms_in_flight", "generation_config")


def served_name(model: str | None) -> str:
    """The API's model name by default: a hub id as typed (vLLM's), a path's last component."""
    from tokenbudget.engine.loader.hub import is_hub_id
    if model is None:
        return "SmolLM2-135M-Instruct"
    if is_hub_id(model) and not os.path.exists(os.path.expanduser(model)):
        return model
    return os.path.basename(os.path.normpath(model))


def run(args) -> int:
    try:
        if args.grpc is not None:
            from tokenbudget.integrations.grpc.server import serve_grpc
        else:
            from tokenbudget.engine.serve.readiness import serve_replica
    except ImportError as exc:
        extra = "grpc" if args.grpc is not None else "serve"
        raise ValueError(f"tokenbudget serve needs the {extra} extra: pip install 'tokenbudget[{extra}]' "
                         f"({exc})") from None
    from tokenbudget.api.config import EngineConfig
    options = {name: getattr(args, name) for name in _ENGINE_FLAGS if getattr(args, name) is not None}
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    if args.cuda_graphs:
        options["cuda_graphs"] = True
    options["speculative_config"] = speculative_config_from_args(args)
    EngineConfig.from_kwargs(model=args.model, **options)  # a bad flag: ValueError before the port opens
    if args.model is not None and os.path.exists(os.path.expanduser(args.model)):
        # a bad local model file too: its header checks take milliseconds (a hub id is fetched by the load)
        from tokenbudget.engine.loader import check_model_files
        try:
            check_model_files(args.model)
        except (ValueError, OSError) as exc:  # worded as serve_replica words a failed load
            raise ValueError(f"model: {exc}") from None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(sorted(_TOOL_PARSERS))})")
    name = args.served_model_name or served_name(args.model)
    from tokenbudget.engine.serve.limits import ServerLimits
    limits = ServerLimits(**{name: getattr(args, name) for name in ServerLimits.__struct_fields__})

    def load():
        from tokenbudget.engine.entrypoints.async_llm import AsyncLLM
        return AsyncLLM(args.model, **options)
    if args.grpc is not None:  # HealthCheck unhealthy while the model loads and while SIGTERM drains
        return serve_grpc(load, name, args.model or name, host=args.host, port=args.grpc,
                          grace_period=args.grace_period)
    # the port opens at once (/health 503 while the model loads); SIGTERM drains (/health 503)
    return serve_replica(load, name, host=args.host, port=args.port, api_key=args.api_key,
                         grace_period=args.grace_period,
                         app_options={"limits": limits,
                                      "tool_parser": args.tool_call_parser if args.enable_auto_tool_choice else None})
