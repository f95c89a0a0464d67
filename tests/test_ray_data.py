"""Offline generation on Ray Data (``tokenbudget.integrations.ray``), on a real local Ray cluster
(``ray.init(num_cpus=2)``): 2 actors with one engine each (ngram speculation, one torch thread),
32 prompts; every row's greedy text is exactly offline ``LLM.generate``'s (speculation is
lossless), per-row sampling parameters apply, the speculation figures come with each row, and a
row with a bad field carries its error instead of failing the job.
"""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray", reason="needs the [ray] extra: ray[data,serve]")
pytest.importorskip("ray.data", reason="needs the [ray] extra: ray[data,serve]")

from tokenbudget import LLM, SamplingParams  # noqa: E402
from tokenbudget.integrations.ray import OUTPUT_COLUMNS, ProcessorConfig, build_processor  # noqa: E402

from engine_fixtures import ENGINE_OPTS, default_loaded  # noqa: E402

pytestmark = pytest.mark.ray

PROMPTS = [f"Question {i}: the number after {i * 7} is" if i % 2 else f"List {i} colors of the rainbow:"
           for i in range(32)]
MAX_TOKENS = 8
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def cluster():
    default_loaded()  # skips when the default model cannot be had
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def test_two_actors_match_offline_generate_and_bad_rows_carry_their_error(cluster):
    reference = LLM(None, **ENGINE_OPTS).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                                  use_tqdm=False)
    rows = [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)]
    rows[5]["sampling_params"] = {"max_tokens": 3}  # per-row parameters over the defaults
    rows.append({"id": 99, "prompt": "bad", "sampling_params": {"temperature": -1.0}})
    config = ProcessorConfig(engine_options=dict(ENGINE_OPTS, speculative_config=SPEC),
                             sampling_params={"max_tokens": MAX_TOKENS, "temperature": 0},
                             concurrency=2, batch_size=8, num_cpus=1)
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
