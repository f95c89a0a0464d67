"""Offline generation on Ray Data: one engine per actor, every row of a batch in flight at once.

    import ray
    from tokenbudget.integrations.ray import ProcessorConfig, build_processor

    processor = build_processor(ProcessorConfig(
        model="model.gguf",                                    # actors and CPUs: sized from the cluster
        engine_options={"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
        sampling_params={"max_tokens": 128, "temperature": 0}))
    processor(ray.data.read_json("prompts.jsonl")).write_parquet("out/")

``build_processor`` is ``ds.map_batches(TokenbudgetStage, concurrency=N, ...)``: Ray starts N
actors, each builds one ``AsyncLLM`` in ``__init__``; Ray calls the async ``__call__`` on an
event loop in another thread (``AsyncLLM`` is bound to no loop), which submits every row of the
batch at once (the engine batches them under its token budget) and yields each row as it
finishes. N and each actor's CPUs default to what the cluster holds (``resources``).

The stage's own errors come before Ray starts anything, as the ``ValueError`` /
``FileNotFoundError`` they are (not inside Ray's actor-death traceback): a bad engine option or
sampling default at ``build_processor``, a local model path that does not exist or whose files are
malformed (header checks, milliseconds) too, an actor that fits no node when the processor is
applied.

A row has ``prompt`` (a string, put through the model's chat template when it has one, as
``tokenbudget generate`` does; ``apply_chat_template=False`` sends it as it is), or ``messages``
(a chat, always templated), or ``prompt_token_ids``; optionally
``sampling_params`` (a dict or its JSON) over the config's defaults. Its other columns pass
through. Added columns: ``OUTPUT_COLUMNS``. A row whose request fails (a bad field, a fault the
engine isolated to it, a dead engine) comes back with ``error`` set and ``finish_reason``
"error" instead of failing the job: a job of a million rows must not die at row 900,000.
``error`` is "" on success (never null: every block, and every Parquet file written from one,
then has the same string column).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams
from tokenbudget.integrations.ray.resources import cluster_nodes, plan_actors

logger = logging.getLogger("tokenbudget")

# What every output row has, next to the input columns.
OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "num_input_tokens", "num_generated_tokens",
                  "finish_reason", "error", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                  "num_cached_tokens")


class ProcessorConfig(msgspec.Struct, kw_only=True, frozen=True):
    """What ``build_processor`` builds: the engine of each actor, how many actors, row defaults.

    ``engine_options`` are ``EngineConfig``'s (``speculative_config``, ``max_num_seqs``, ...);
    ``num_threads`` defaults to the actor's ``num_cpus``. ``sampling_params``: the defaults every
    row's own ``sampling_params`` override. ``concurrency`` and ``num_cpus`` unset: sized from the
    Ray cluster (``resources``)."""

    model: str | None = None  # .gguf file, HF directory (on every node) or hub id; None: the default model
    engine_options: dict[str, Any] = {}
    sampling_params: dict[str, Any] = {}
    concurrency: int | None = None  # actors (engines); None: as many as fit, one CPU left for Ray Data
    batch_size: int = 64  # rows handed to an actor at once (all of them in flight together)
    num_cpus: float | None = None  # per actor; None: a node's CPUs less one (1 with GPUs)
    num_gpus: float = 0.0  # per actor
    # template ``prompt`` strings (``messages`` rows always are); None: when the model has a chat
    # template (as ``tokenbudget generate``), False: never
    apply_chat_template: bool | None = None

    def __post_init__(self) -> None:
        for name in ("concurrency", "batch_size"):
            v = getattr(self, name)
            if v is None and name == "concurrency":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if (self.num_cpus is not None and not self.num_cpus > 0) or not self.num_gpus >= 0:
            raise ValueError(f"num_cpus must be > 0 (or None) and num_gpus >= 0, got {self.num_cpus!r}, "
                             f"{self.num_gpus!r}")
        _sampling_params(self.sampling_params, {})  # a bad default is a ValueError here, not per row


def build_processor(config: ProcessorConfig):
    """A callable ``Dataset -> Dataset`` that adds ``OUTPUT_COLUMNS`` to every row. The engine
    options and a local model's files are checked here, the actors against the cluster when it is
    applied: ``ValueError`` / ``FileNotFoundError`` naming what is wrong, before Ray runs anything."""
    _check_engine(config)

    def process(ds):
        plan = plan_actors(cluster_nodes(), config.concurrency, config.num_cpus, config.num_gpus)
        logger.info("tokenbudget: Ray Data: %d actor(s) of %g CPU(s)%s", plan.concurrency, plan.num_cpus,
                    f" and {plan.num_gpus:g} GPU(s)" if plan.num_gpus else "")
        sized = msgspec.structs.replace(config, concurrency=plan.concurrency, num_cpus=plan.num_cpus)
        return ds.map_batches(TokenbudgetStage, fn_constructor_kwargs={"config": sized},
                              concurrency=plan.concurrency, batch_size=config.batch_size,
                              num_cpus=plan.num_cpus, num_gpus=plan.num_gpus)
    return process


def _check_engine(config: ProcessorConfig) -> None:
    """What each actor's ``AsyncLLM`` would refuse, refused here: its options, and a local
    model path that is missing or malformed (a hub id is fetched by the actors)."""
    from tokenbudget.api.config import EngineConfig
    from tokenbudget.engine.loader import check_model_files
    from tokenbudget.engine.loader.hub import is_hub_id

    EngineConfig.from_kwargs(model=config.model, **config.engine_options)
    if config.model is not None and (os.path.exists(os.path.expanduser(config.model)) or not is_hub_id(config.model)):
        check_model_files(config.model)


class TokenbudgetStage:
    """A Ray Data stage (``map_batches`` callable class): one ``AsyncLLM`` per actor."""

    def __init__(self, config: ProcessorConfig) -> None:
        from tokenbudget.engine.entrypoints.async_llm import AsyncLLM
        options = dict(config.engine_options)
        options.setdefault("num_threads", max(1, int(config.num_cpus)))
        self.config = config
        self.llm = AsyncLLM(config.model, **options)
        self._ids = itertools.count()

    async def __call__(self, batch: dict[str, Any]) -> AsyncIterator[dict[str, list]]:
        columns = list(batch)
        n = len(batch[columns[0]]) if columns else 0
        rows = [{c: batch[c][i] for c in columns} for i in range(n)]
        for done in asyncio.as_completed([self._generate(row) for row in rows]):
            row = await done
            yield {k: [v] for k, v in row.items()}

    async def _generate(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row with its output columns; ``error`` set (not raised) when its request failed."""
        out = None
        try:
            params = _sampling_params(self.config.sampling_params, row.get("sampling_params"))
            stream = self.llm.add_request(f"ray-{next(self._ids)}", self._prompt(row), params)
            async for out in stream:
                pass
            return {**row, **_result(out, "")}
        except Exception as exc:  # noqa: BLE001 - the row carries it; the job goes on
            failed = getattr(exc, "output", None) or out
            return {**row, **_result(failed, f"{type(exc).__name__}: {exc}")}

    def _prompt(self, row: dict[str, Any]):
        if row.get("messages") is not None:
            messages = [dict(m) for m in row["messages"]]
            return self.llm.tokenizer.chat_prompt(messages)
        if row.get("prompt_token_ids") is not None:
            return {"prompt_token_ids": [int(t) for t in row["prompt_token_ids"]]}
        prompt = row.get("prompt")
        if prompt is None:
            raise ValueError("a row needs 'prompt', 'messages' or 'prompt_token_ids'")
        prompt = str(prompt)
        templated = self.config.apply_chat_template
        if templated is None:
            templated = self.llm.tokenizer.chat_template is not None
        if templated:
            prompt = self.llm.tokenizer.chat_prompt([{"role": "user", "content": prompt}])
        return prompt


def _sampling_params(defaults: dict[str, Any], row_params) -> SamplingParams:
    """The config's defaults overridden by a row's (a dict, its JSON, or None; the None values
    that Arrow gives the keys other rows have are dropped); one final output per row."""
    if isinstance(row_params, (str, bytes)):
        row_params = json.loads(row_params)
    own = {k: _plain(v) for k, v in dict(row_params or {}).items() if v is not None}
    try:
        params = msgspec.convert({**defaults, **own}, SamplingParams, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"sampling_params: {exc}") from None
    return msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _plain(value):
    """numpy scalars and arrays (what Ray Data batches hold) as Python values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    return value


def _result(out, error: str) -> dict[str, Any]:
    c = out.outputs[0] if out is not None and out.outputs else None
    m = out.metrics if out is not None else None
    return {"generated_text": c.text if c else "",
            "generated_token_ids": list(c.token_ids) if c else [],
            "num_input_tokens": len(out.prompt_token_ids) if out is not None else 0,
            "num_generated_tokens": len(c.token_ids) if c else 0,
            "finish_reason": "error" if error else c.finish_reason,
            "error": error,
            "num_draft_tokens": m.num_draft_tokens if m else 0,
            "num_accepted_tokens": m.num_accepted_tokens if m else 0,
            "acceptance_rate": m.acceptance_rate if m else 0.0,
            "num_cached_tokens": m.num_cached_tokens if m else 0}
