"""Ray (``tokenbudget.integrations.ray``) on one real local Ray cluster (``ray.init(num_cpus=2)``;
one file, so xdist's loadfile runs both parts in one worker and one cluster).

Ray Data: 2 actors with one engine each (ngram speculation, one torch thread), 32 prompts; every
row's greedy text is exactly offline ``LLM.generate``'s (speculation is lossless), per-row
sampling parameters apply, the speculation figures come with each row, and a row with a bad
field carries its error instead of failing the job.

Ray Serve: two replicas behind Ray's HTTP proxy on 127.0.0.1, deployed through ``app_builder``
(the documented ``serve run`` target), answer the OpenAI routes and the router probes;
``max_ongoing_requests`` is raised from Ray's default of 5; scaling down to one replica drains:
streams in flight on the removed replica still end with ``[DONE]``.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

ray = pytest.importorskip("ray", reason="needs the [ray] extra: ray[data,serve]")
pytest.importorskip("ray.data", reason="needs the [ray] extra: ray[data,serve]")
serve = pytest.importorskip("ray.serve", reason="needs the [ray] extra: ray[data,serve]")
httpx = pytest.importorskip("httpx")

from tokenbudget import LLM, SamplingParams  # noqa: E402
from tokenbudget.integrations.ray import OUTPUT_COLUMNS, ProcessorConfig, build_processor  # noqa: E402

from engine_fixtures import ENGINE_OPTS, default_loaded  # noqa: E402
from serve_fixtures import free_port  # noqa: E402

pytestmark = pytest.mark.ray

PROMPTS = [f"Question {i}: the number after {i * 7} is" if i % 2 else f"List {i} colors of the rainbow:"
           for i in range(32)]
MAX_TOKENS = 8
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def cluster():
    default_loaded()  # skips when the default model cannot be had
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine
    # Ray's single-node mode: every Ray process (GCS, raylets, workers) talks over 127.0.0.1 instead
    # of the machine's interface address (ray._private.services.get_node_ip_address).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture()
def serve_url(cluster):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def test_two_actors_match_offline_generate_and_bad_rows_carry_their_error(cluster):
    reference = LLM(None, **ENGINE_OPTS).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                                  use_tqdm=False)
    rows = [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)]
    rows[5]["sampling_params"] = {"max_tokens": 3}  # per-row parameters over the defaults
    rows.append({"id": 99, "prompt": "bad", "sampling_params": {"temperature": -1.0}})
    config = ProcessorConfig(engine_options=dict(ENGINE_OPTS, speculative_config=SPEC),
                             sampling_params={"max_tokens": MAX_TOKENS, "temperature": 0},
                             concurrency=2, batch_size=8, num_cpus=1, apply_chat_template=False)
    out = {row["id"]: row for row in build_processor(config)(ray.data.from_items(rows)).take_all()}

    assert sorted(out) == list(range(32)) + [99]
    for i, ref in enumerate(reference):
        row = out[i]
        assert set(OUTPUT_COLUMNS) <= set(row) and row["prompt"] == PROMPTS[i]
        assert row["error"] == "", row["error"]
        c = ref.outputs[0]
        if i == 5:
            assert list(row["generated_token_ids"]) == c.token_ids[:3] and row["finish_reason"] == "length"
            continue
        assert row["generated_text"] == c.text
        assert list(row["generated_token_ids"]) == c.token_ids
        assert row["num_generated_tokens"] == len(c.token_ids) and row["finish_reason"] == c.finish_reason
        assert row["num_input_tokens"] == len(ref.prompt_token_ids)
        assert 0 <= row["num_accepted_tokens"] <= row["num_draft_tokens"]
    assert sum(out[i]["num_draft_tokens"] for i in range(32)) > 0  # speculation ran, per row
    bad = out[99]
    assert bad["finish_reason"] == "error" and "temperature" in bad["error"] and bad["generated_text"] == ""


def test_the_documented_snippet_runs_on_two_cpus_and_templates_chat_prompts(cluster, tmp_path):
    """docs/scaling.md's snippet as written (``read_json`` -> ``write_parquet``, no
    ``concurrency``/``num_cpus``) on the 2-CPU cluster: sized to one actor of 1 CPU, it finishes
    (4 actors or 4 CPUs each would wait forever), and a chat model's ``prompt`` strings go through
    its chat template as ``tokenbudget generate`` does (the offline ``LLM.chat`` texts)."""
    prompts = ["What is the capital of France?", "Name a primary colour.", "Say hello."]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0}
    processor = build_processor(ProcessorConfig(engine_options=dict(ENGINE_OPTS, speculative_config=SPEC),
                                                sampling_params=sampling))
    processor(ray.data.read_json(str(src))).write_parquet(str(tmp_path / "out"))
    rows = {r["prompt"]: r for r in ray.data.read_parquet(str(tmp_path / "out")).take_all()}

    chats = [[{"role": "user", "content": p}] for p in prompts]
    reference = LLM(None, **ENGINE_OPTS).chat(chats, SamplingParams(**sampling), use_tqdm=False)
    assert sorted(rows) == sorted(prompts)
    for p, ref in zip(prompts, reference):
        assert rows[p]["error"] == "" and rows[p]["generated_text"] == ref.outputs[0].text
        assert rows[p]["num_input_tokens"] == len(ref.prompt_token_ids)


def test_an_actor_no_node_can_hold_is_refused_before_ray_runs_it(cluster):
    """Ray would leave an actor of 4 CPUs pending forever on 2 CPUs: a ValueError naming
    ``num_cpus`` instead, when the processor is applied (nothing scheduled)."""
    processor = build_processor(ProcessorConfig(engine_options=ENGINE_OPTS, num_cpus=4))
    with pytest.raises(ValueError, match="num_cpus=4"):
        processor(ray.data.from_items([{"prompt": "x"}]))


def test_a_missing_model_or_bad_option_is_the_stages_own_error(tmp_path):
    """Raised by ``build_processor``, as the error it is, not inside Ray's actor-death traceback."""
    with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
        build_processor(ProcessorConfig(model=str(tmp_path / "nowhere.gguf")))
    with pytest.raises(ValueError, match="max_num_seqs"):
        build_processor(ProcessorConfig(engine_options={"max_num_seqs": 0}))


def test_two_replicas_serve_and_scale_down_drains(serve_url):
    from tokenbudget.integrations.ray.serve import MAX_ONGOING_REQUESTS, TokenbudgetDeployment, app_builder

    assert TokenbudgetDeployment._deployment_config.max_ongoing_requests == MAX_ONGOING_REQUESTS > 5

    def deploy(n: int):  # what `serve run tokenbudget.integrations.ray.serve:app_builder k=v ...` does
        args = {"num_replicas": str(n), **{k: json.dumps(v) for k, v in ENGINE_OPTS.items()}}
        serve.run(app_builder(args), name="tokenbudget", route_prefix="/")

    deploy(2)
    r = httpx.post(f"{serve_url}/v1/completions", timeout=120,
                   json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert httpx.get(f"{serve_url}/health", timeout=30).status_code == 200
    assert "vllm:kv_cache_usage_perc" in httpx.get(f"{serve_url}/metrics", timeout=30).text

    n = 4  # Ray routes them over both replicas (power of two choices by queue length)
    streams: list[list[str]] = [[] for _ in range(n)]
    started = [threading.Event() for _ in range(n)]
    body = {"prompt": "Tell me a story", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}

    def client(i: int) -> None:
        with httpx.stream("POST", f"{serve_url}/v1/completions", json=body, timeout=180) as resp:
            for line in resp.iter_lines():
                streams[i].append(line)
                started[i].set()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(120), "a stream never started"
    deploy(1)  # scale down while both streams run: the removed replica drains first
    for t in threads:
        t.join(180)
    for lines in streams:
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
