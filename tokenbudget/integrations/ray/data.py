"""Offline generation on Ray Data: one engine per actor, every row of a batch in flight at once.

    import ray
    from tokenbudget.integrations.ray import ProcessorConfig, build_processor

    processor = build_processor(ProcessorConfig(
        model="model.gguf", concurrency=4,                     # 4 actors, one engine each
        engine_options={"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
        sampling_params={"max_tokens": 128, "temperature": 0}))
    processor(ray.data.read_json("prompts.jsonl")).write_parquet("out/")

``build_processor`` is ``ds.map_batches(TokenbudgetStage, concurrency=N, ...)``: Ray starts N
actors, each builds one ``AsyncLLM`` in ``__init__``; Ray calls the async ``__call__`` on an
event loop in another thread (``AsyncLLM`` is bound to no loop), which submits every row of the
batch at once (the engine batches them under its token budget) and yields each row as it
finishes.

A row has ``prompt`` (a string; ``apply_chat_template`` puts it through the model's template),
or ``messages`` (a chat, always templated), or ``prompt_token_ids``; optionally
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
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams

# What every output row has, next to the input columns.
OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "num_input_tokens", "num_generated_tokens",
                  "finish_reason", "error", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                  "num_cached_tokens")


class ProcessorConfig(msgspec.Struct, kw_only=True, frozen=True):
    """What ``build_processor`` builds: the engine of each actor, how many actors, row defaults.

    ``engine_options`` are ``EngineConfig``'s (``speculative_config``, ``max_num_seqs``, ...);
    ``num_threads`` defaults to the actor's ``num_cpus``. ``sampling_params``: the defaults every
    row's own ``sampling_params`` override."""

    model: str | None = None  # .gguf file or HF directory (on every node); None: the default model
    engine_options: dict[str, Any] = {}
    sampling_params: dict[str, Any] = {}
    concurrency: int = 1  # actors (engines)
    batch_size: int = 64  # rows handed to an actor at once (all of them in flight together)
    num_cpus: float = 1.0  # per actor
    num_gpus: float = 0.0  # per actor
    apply_chat_template: bool = False  # template ``prompt`` strings (``messages`` rows always are)

    def __post_init__(self) -> None:
        for name in ("concurrency", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_cpus <= 0 or self.num_gpus < 0:
            raise ValueError(f"num_cpus must be > 0 and num_gpus >= 0, got {self.num_cpus!r}, {self.num_gpus!r}")
        _sampling_params(self.sampling_params, {})  # a bad default is a ValueError here, not per row


def build_processor(config: ProcessorConfig):
    """A callable ``Dataset -> Dataset`` that adds ``OUTPUT_COLUMNS`` to every row."""

    def process(ds):
        return ds.map_batches(TokenbudgetStage, fn_constructor_kwargs={"config": config},
                              concurrency=config.concurrency, batch_size=config.batch_size,
                              num_cpus=config.num_cpus, num_gpus=config.num_gpus)
    return process


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
        if self.config.apply_chat_template:
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
