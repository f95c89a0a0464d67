"""Shared helpers for the CPU benchmarks: engine/transformers runners, timing, tables, JSON.

Timing conventions (every bench here):

* decode tokens/s = (generated tokens - 1) / (time from the first generated token to the last);
  prefill (time to first token) is reported separately. End-to-end tokens/s = generated / total.
* tokenbudget is timed through ``LLMEngine.step()`` directly (the loop ``LLM.generate`` runs),
  so the time of the first token is observable; transformers through ``model.generate`` with a
  streamer whose second ``put`` is the first generated token.
* The machine is shared and noisy: benches interleave configurations prompt by prompt and
  report medians; compare ratios measured in the same run, not absolute numbers across runs.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


# ------------------------------------------------------------------------------ results
@dataclass(slots=True)
class GenTiming:
    """One generation: tokens produced, prefill (TTFT) seconds and total seconds."""

    token_ids: list[list[int]]
    ttft_s: float
    total_s: float

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def decode_s(self) -> float:
        return self.total_s - self.ttft_s

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first one per second of decode (batch: summed over sequences)."""
        n = self.num_tokens - len(self.token_ids)
        return n / self.decode_s if self.decode_s > 0 and n > 0 else float("nan")

    @property
    def e2e_tok_s(self) -> float:
        return self.num_tokens / self.total_s if self.total_s > 0 else float("nan")


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------------ tokenbudget
def engine_generate(llm, prompts: Sequence[list[int]], max_tokens: int, ignore_eos: bool = False) -> GenTiming:
    """Run ``prompts`` (token ids) to completion through ``LLMEngine.step()``; greedy.

    ``ttft_s`` is when every request has its first generated token (for batch 1: time to
    first token).
    """
    from tokenbudget.api.sampling_params import RequestOutputKind, SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos,
                            output_kind=RequestOutputKind.DELTA)
    ids = [f"bench-{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, list(p), params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    num_finished = 0
    ttft = None
    while num_finished < len(ids) and engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
            if ttft is None and all(tokens.values()):
                ttft = time.perf_counter() - t0
            num_finished += out.finished
    total = time.perf_counter() - t0
    return GenTiming([tokens[r] for r in ids], ttft if ttft is not None else total, total)


# ------------------------------------------------------------------------------ transformers
def load_hf_model(threads: int | None = None):
    """transformers ``LlamaForCausalLM`` with the default model's weights (fp32), and its tokenizer."""
    import transformers

    from tokenbudget.engine.loader import load_model_files

    if threads:
        torch.set_num_threads(threads)
    loaded = load_model_files(None)
    c = loaded.config
    hf = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.resolved_head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, pad_token_id=c.eos_token_ids[0] if c.eos_token_ids else 0)
    model = transformers.LlamaForCausalLM(hf).eval()
    missing, unexpected = model.load_state_dict(loaded.state_dict, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    model.tie_weights()
    model.generation_config.pad_token_id = hf.pad_token_id
    return model, loaded.tokenizer


class _FirstTokenStreamer:
    """transformers streamer: the first ``put`` is the prompt, the second the first new token."""

    def __init__(self) -> None:
        self.calls = 0
        self.t_first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.t_first = time.perf_counter()

    def end(self) -> None:
        pass


def hf_generate(model, prompts: Sequence[list[int]], max_tokens: int, ignore_eos: bool = False,
                pad_id: int = 0, eos_ids: Sequence[int] = (), **gen_kwargs: Any) -> GenTiming:
    """Greedy ``model.generate`` (left-padded batch); outputs cut at the first EOS.

    The streamer is only usable at batch 1 in transformers; at batch > 1, TTFT is measured by
    a separate ``max_new_tokens=1`` call right before (same inputs).
    """
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    kw: dict[str, Any] = dict(max_new_tokens=max_tokens, do_sample=False, attention_mask=mask,
                              pad_token_id=pad_id, **gen_kwargs)
    if ignore_eos:
        kw["min_new_tokens"] = max_tokens
    with torch.inference_mode():
        if len(prompts) == 1:
            streamer = _FirstTokenStreamer()
            t0 = time.perf_counter()
            out = model.generate(ids, streamer=streamer, **kw)
            total = time.perf_counter() - t0
            ttft = (streamer.t_first - t0) if streamer.t_first else total
        else:
            t0 = time.perf_counter()
            model.generate(ids, **{**kw, "max_new_tokens": 1, "min_new_tokens": 0})
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(ids, **kw)
            total = time.perf_counter() - t0
    toks = []
    for row in out[:, n:].tolist():
        cut = [t for t in row]
        if not ignore_eos:
            for j, t in enumerate(cut):
                if t in eos_ids:
                    cut = cut[:j + 1]
                    break
        toks.append(cut)
    return GenTiming(toks, ttft, total)


# ------------------------------------------------------------------------------ step profiler
@dataclass
class StepProfile:
    """Seconds spent in each part of ``LLMEngine.step`` (and inside the runner), summed."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    steps: int = 0
    step_total_s: float = 0.0
    # runner.execute seconds keyed by the step's scheduled token count
    execute_by_tokens: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))

    def execute_ms_by_tokens(self, max_tokens: int = 32) -> dict[int, float]:
        """Median ``runner.execute`` milliseconds per scheduled-token count (decode/verify sizes)."""
        return {n: 1000 * median(v) for n, v in sorted(self.execute_by_tokens.items()) if n <= max_tokens}

    def split(self) -> dict[str, float]:
        """Fraction of step time per part; 'python glue' is the step time nobody else claims."""
        s = dict(self.seconds)
        parts = {
            "forward (model)": s.get("forward", 0.0),
            "logits (lm_head)": s.get("logits", 0.0),
            "input prep": s.get("prepare", 0.0),
            "sampler/verify": s.get("sampler", 0.0),
            "runner other": s.get("execute", 0.0) - s.get("forward", 0.0) - s.get("logits", 0.0)
            - s.get("prepare", 0.0) - s.get("sampler", 0.0),
            "scheduler.schedule": s.get("schedule", 0.0),
            "scheduler.plan/apply_update": s.get("update", 0.0),
            "output_processor (detok)": s.get("process", 0.0),
            "proposer.propose": s.get("propose", 0.0),
            "speculator other": s.get("speculate", 0.0) - s.get("propose", 0.0),
        }
        parts["python glue (step - parts)"] = self.step_total_s - s.get("execute", 0.0) - s.get(
            "schedule", 0.0) - s.get("update", 0.0) - s.get("process", 0.0) - s.get("speculate", 0.0)
        return parts


class StepProfiler:
    """Wraps the engine's components with ``perf_counter`` timers (instance attributes only).

    Use as a context manager around generation on an ``LLM``; restores everything on exit.
    """

    def __init__(self, llm) -> None:
        self.engine = llm.engine
        self.profile = StepProfile()
        self._restore: list[tuple[object, str, Any]] = []

    def _wrap(self, obj, name: str, key: str) -> None:
        if obj is None or not hasattr(obj, name):
            return
        fn = getattr(obj, name)
        prof = self.profile

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                prof.seconds[key] += time.perf_counter() - t
                prof.calls[key] += 1

        own = name in vars(obj)
        setattr(obj, name, timed)
        self._restore.append((obj, name, fn if own else None))

    def __enter__(self) -> StepProfile:
        e = self.engine
        runner = e.runner
        self._wrap_execute(runner)
        self._wrap(e.scheduler, "schedule", "schedule")
        self._wrap(e.scheduler, "plan_update", "update")
        self._wrap(e.scheduler, "apply_update", "update")
        self._wrap(e.core.outputs, "prepare", "process")
        self._wrap(e.speculator, "propose", "speculate")
        self._wrap(e.speculator, "commit", "speculate")
        self._wrap(e.speculator.proposer, "propose", "propose")
        self._wrap(runner, "_prepare", "prepare")
        self._wrap(runner.model, "forward", "forward")
        self._wrap(runner.model, "compute_logits", "logits")
        self._wrap(runner, "sampler", "sampler")
        self._wrap(e, "step", "step")
        return self.profile

    def _wrap_execute(self, runner) -> None:
        fn = runner.execute
        prof = self.profile

        def timed(sched):
            t = time.perf_counter()
            try:
                return fn(sched)
            finally:
                dt = time.perf_counter() - t
                prof.seconds["execute"] += dt
                prof.calls["execute"] += 1
                prof.execute_by_tokens[sched.total_num_scheduled_tokens].append(dt)

        runner.execute = timed
        self._restore.append((runner, "execute", None))

    def __exit__(self, *exc) -> None:
        for obj, name, orig in reversed(self._restore):
            if orig is not None:
                setattr(obj, name, orig)
            else:
                delattr(obj, name)
        self.profile.step_total_s = self.profile.seconds.get("step", 0.0)
        self.profile.steps = self.profile.calls.get("step", 0)


# ------------------------------------------------------------------------------ output
def fmt(v: Any, nd: int = 2) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.{nd}f}"
    return str(v)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [list(headers)] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str | None, obj: Any) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def machine_info(threads: int) -> dict[str, Any]:
    import platform

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"torch": torch.__version__, "threads": threads, "cpus": os.cpu_count(),
            "python": platform.python_version(), "loadavg_at_start": load}


def replace_section(path: str, title: str, body: str) -> None:
    """Replace (or append) the ``## title`` section of a markdown file; other sections untouched.

    Re-reads the file right before writing, so sections other engineers append in between survive.
    """
    header = f"## {title}"
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    lines = text.split("\n")
    start = next((i for i, l in enumerate(lines) if l.strip() == header), None)
    new = [header, "", body.rstrip(), ""]
    if start is None:
        if lines and lines[-1] != "":
            lines.append("")
        lines += new
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = new
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
