"""The load generator behind ``tokenbudget bench serve`` (and ``benches/serve_overhead.py``).

Replays prompts against an OpenAI-compatible server over streaming HTTP, either open-loop at a
request rate (Poisson arrivals; ``inf`` = all at once) or closed-loop at a fixed concurrency, and
measures per request, from the client's side: TTFT (request sent to first content chunk), ITL
(gaps between content chunks), TPOT ((e2e - TTFT) / (output tokens - 1)), e2e latency, output
tokens (from the server's ``usage``). Acceptance by position is read from the server's
``/metrics`` before and after the run (the difference), when the server is a tokenbudget one.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class Prompt:
    text: str | None = None
    messages: list[dict] | None = None  # chat (Spec-Bench questions, {"messages": ...} lines)


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def load_prompts(path: str, limit: int | None = None) -> list[Prompt]:
    """JSONL lines: Spec-Bench questions (``turns``: the first is used, as chat), ``{"prompt": ...}``,
    ``{"messages": [...]}``, or a bare JSON string."""
    out: list[Prompt] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if isinstance(row, str):
                out.append(Prompt(text=row))
            elif "turns" in row:
                out.append(Prompt(messages=[{"role": "user", "content": row["turns"][0]}]))
            elif "messages" in row:
                out.append(Prompt(messages=row["messages"]))
            else:
                out.append(Prompt(text=row["prompt"]))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"dataset {path!r} has no prompts")
    return out


async def one_request(client: httpx.AsyncClient, prompt: Prompt, body: dict) -> RequestResult:
    chat = prompt.messages is not None
    payload = dict(body, stream=True, stream_options={"include_usage": True})
    payload.update({"messages": prompt.messages} if chat else {"prompt": prompt.text})
    start = time.perf_counter()
    last, result, pieces = start, RequestResult(ok=False), []
    try:
        async with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=payload) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.ok = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = event["error"]["message"]
                    break
                if event.get("usage"):
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
                    result.output_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    piece = choice["delta"].get("content") if chat else choice.get("text")
                    if piece:
                        now = time.perf_counter()
                        if not pieces:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        pieces.append(piece)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - start
    result.text = "".join(pieces)
    return result


async def run_load(base_url: str, prompts: list[Prompt], body: dict, request_rate: float = float("inf"),
                   concurrency: int | None = None, api_key: str | None = None, seed: int = 0,
                   progress=None) -> tuple[list[RequestResult], float]:
    """Send every prompt; (results in prompt order, wall seconds)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency or len(prompts) or 1)
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:

        async def task(p: Prompt) -> RequestResult:
            if gate is None:
                res = await one_request(client, p, body)
            else:
                async with gate:
                    res = await one_request(client, p, body)
            if progress is not None:
                progress.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(task(p)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def scrape_spec(base_url: str, api_key: str | None = None) -> dict[str, list[float]] | None:
    """Drafted and accepted tokens by position from ``/metrics`` (None when not available)."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except (ImportError, httpx.HTTPError):
        return None
    out: dict[str, list[float]] = {"drafted": [], "accepted": []}
    for fam in text_string_to_metric_families(text):
        key = {"tokenbudget_spec_decode_num_draft_tokens_per_pos": "drafted",
               "tokenbudget_spec_decode_num_accepted_tokens_per_pos": "accepted"}.get(fam.name)
        if key is None:
            continue
        for s in fam.samples:
            pos = int(s.labels["position"])
            out[key].extend([0.0] * (pos + 1 - len(out[key])))
            out[key][pos] = s.value
    return out


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"mean": statistics.fmean(values), **{f"p{p}": qs[p - 1] for p in PERCENTILES}}


def summarize(results: list[RequestResult], wall_s: float, spec_before=None, spec_after=None) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5], "wall_s": wall_s,
        "request_throughput": len(ok) / wall_s if wall_s else 0.0,
        "output_token_throughput": out_tokens / wall_s if wall_s else 0.0,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / wall_s if wall_s else 0.0,
        "ttft_s": _pcts([r.ttft for r in ok]), "tpot_s": _pcts([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": _pcts([g for r in ok for g in r.itl]), "e2e_s": _pcts([r.e2e for r in ok]),
    }
    if spec_before is not None and spec_after is not None and spec_after["drafted"]:
        drafted = [a - (spec_before["drafted"][i] if i < len(spec_before["drafted"]) else 0)
                   for i, a in enumerate(spec_after["drafted"])]
        accepted = [a - (spec_before["accepted"][i] if i < len(spec_before["accepted"]) else 0)
                    for i, a in enumerate(spec_after["accepted"])]
        summary["acceptance_by_position"] = [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
        summary["acceptance_rate"] = sum(accepted) / sum(drafted) if sum(drafted) else 0.0
    return summary


def format_summary(s: dict) -> str:
    lines = [f"requests {s['completed']}/{s['requests']} ok in {s['wall_s']:.2f}s: "
             f"{s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output tok/s, "
             f"{s['total_token_throughput']:.1f} total tok/s"]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "e2e")):
        p = s[key]
        if p:
            lines.append(f"{label:>5} ms: mean {p['mean'] * 1e3:8.1f}  " +
                         "  ".join(f"p{q} {p[f'p{q}'] * 1e3:8.1f}" for q in PERCENTILES))
    if "acceptance_by_position" in s:
        lines.append(f"spec: acceptance {s['acceptance_rate']:.3f}, by position "
                     f"[{', '.join(f'{a:.2f}' for a in s['acceptance_by_position'])}]")
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    return "\n".join(lines)


def plot(results: list[RequestResult], summary: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, (values, title) in zip(axes, ((([r.ttft * 1e3 for r in ok]), "TTFT (ms)"),
                                         ([r.tpot * 1e3 for r in ok if r.tpot is not None], "TPOT (ms)"),
                                         ([r.e2e for r in ok], "e2e latency (s)"))):
        ax.hist(values, bins=20)
        ax.set_title(title)
    by_pos = summary.get("acceptance_by_position", [])
    axes[3].bar(range(len(by_pos)), by_pos)
    axes[3].set_title("acceptance by draft position")
    axes[3].set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
