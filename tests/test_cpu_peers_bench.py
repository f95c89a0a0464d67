"""benches/cpu_peers.py: its prompt mix and "= plain" rule, and a smoke run without llama.cpp.

The smoke run is what CI can afford: tokenbudget plain and ngram plus transformers on the default
model (llama-cpp-python is an optional extra that CI never installs). It checks the JSON the bench
writes and the project's invariant on the bench's own prompts: ngram output equals plain.
"""

from __future__ import annotations

import json
import statistics

import pytest

from benches import cpu_peers


def test_prompts_alternate_workloads_and_chat_categories():
    ps = cpu_peers.workload_prompts(4)
    assert [w for w, _ in ps] == list(cpu_peers.WORKLOADS) * 4
    chat = [t for w, t in ps if w == "open chat"]
    assert len(set(chat)) == 4  # writing, roleplay, qa, writing: four different questions
    assert all("Rewrite the following function" in t for w, t in ps if w == "code editing")


def _run(prompt, repeat, ids):
    return {"prompt": prompt, "repeat": repeat, "token_ids": ids}


def test_equal_to_plain_needs_every_repeat_equal():
    runs = {"tokenbudget-plain": [_run(0, 0, [1, 2]), _run(1, 0, [3, 4]), _run(0, 1, [1, 2]), _run(1, 1, [3, 4])],
            "tokenbudget-ngram": [_run(0, 0, [1, 2]), _run(1, 0, [3, 4]), _run(0, 1, [1, 2]), _run(1, 1, [3, 5])],
            "transformers-pld": [_run(0, 0, [1, 2])]}
    assert cpu_peers.equal_to_plain("tokenbudget-ngram", runs) == (1, 2)
    assert cpu_peers.equal_to_plain("tokenbudget-plain", runs) is None  # a plain mode is the reference
    assert cpu_peers.equal_to_plain("transformers-pld", runs) is None  # its plain mode did not run


@pytest.mark.slow
def test_quick_run_without_llama_cpp(tmp_path):
    from engine_fixtures import default_model_path_or_skip
    default_model_path_or_skip()
    path = tmp_path / "peers.json"
    modes = ["tokenbudget-plain", "tokenbudget-ngram", "transformers-plain"]
    cpu_peers.main(["--quick", "--threads", "1", "--modes", *modes, "--json", str(path)])
    res = json.loads(path.read_text())

    assert list(res["modes"]) == modes
    for m in modes:
        runs = res["modes"][m]["runs"]
        assert len(runs) == 3 and {r["workload"] for r in runs} == set(cpu_peers.WORKLOADS)
        assert all(r["tokens"] == 16 and len(r["token_ids"]) == 16 for r in runs)  # EOS ignored
        # each rate is its run's tokens over its timed seconds, and the table reports their median
        assert all(r["tok_s"] == pytest.approx(r["tokens"] / r["total_s"]) and r["ttft_s"] < r["total_s"]
                   for r in runs)
        assert res["modes"][m]["tok_s"] == {
            w: pytest.approx(statistics.median(r["tok_s"] for r in runs if r["workload"] == w))
            for w in cpu_peers.WORKLOADS}
        assert res["modes"][m]["vs_llamacpp_plain"] is None  # llama.cpp did not run
    assert res["modes"]["tokenbudget-ngram"]["equal_to_plain"] == [3, 3]
    assert res["modes"]["tokenbudget-plain"]["equal_to_plain"] is None
    assert res["warnings"] == []
    assert len(res["table"]["rows"]) == 3

    batch = res["batch"]
    cells = {(c["engine"], c["max_batch"]): c for c in batch["cells"]}
    assert set(cells) == {("tokenbudget", 1), ("tokenbudget", 8), ("transformers", 1), ("transformers", 8)}
    assert all(c["tokens"] == 8 * 16 and c["tok_s"] == pytest.approx(c["tokens"] / c["total_s"])
               for c in cells.values())
    assert cells[("tokenbudget", 8)]["equal_to_b1"] == 8  # batch invariance on the bench's prompts
    assert set(batch["ratios"]) == {"tokenbudget b8 / transformers b8"}
    assert "## " not in res["markdown"] and "| tokenbudget ngram k=4 |" in res["markdown"]
