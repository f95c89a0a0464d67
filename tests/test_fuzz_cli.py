"""`tokenbudget fuzz`: passes on the real scheduler, fails (with a shrunk, replayable case) on a broken one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenbudget.cli import fuzz as cli_fuzz
from tokenbudget.kv_cache.manager import KVCacheManager
from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.testing.fuzz import load_config_file, run_fuzz

REPO = Path(__file__).resolve().parents[1]


def _args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli_fuzz.add_parser(sub)
    return parser.parse_args(["fuzz", *argv])


def test_fuzz_passes_on_real_scheduler(capsys):
    assert cli_fuzz.run(_args("--examples", "25", "--seed", "7", "--steps", "25")) == 0
    out = capsys.readouterr().out
    assert "seed=7" in out and "OK" in out


def test_report_says_what_the_programs_reached(tmp_path, capsys):
    """``--report``: the share of programs reaching each event, printed and as JSON; the machine
    admits a batch at setup and steps it, so programs step and drafts get rejected."""
    path = tmp_path / "coverage.json"
    assert cli_fuzz.run(_args("--examples", "30", "--seed", "3", "--steps", "30", "--report",
                              "--report-json", str(path))) == 0
    out = capsys.readouterr().out
    assert "event coverage over" in out and "late_fault_evicted" in out
    report = json.loads(path.read_text())
    assert report["programs"] >= 30 and report["seed"] == 3
    assert all(0.0 <= share <= 1.0 for share in report["share"].values())
    assert report["share"]["stepped"] > 0.3 and report["share"]["rejected_draft"] > 0


def test_fuzz_with_config_file(tmp_path, capsys):
    path = tmp_path / "sched.toml"
    path.write_text("max_num_batched_tokens = 12\nmax_num_seqs = 3\nmax_model_len = 48\n"
                    "block_size = 4\nnum_blocks = 16\npolicy = 'priority'\n")
    assert cli_fuzz.run(_args("--examples", "15", "--seed", "1", "--config", str(path))) == 0
    assert "config=" in capsys.readouterr().out


def _leak_on_rewind(monkeypatch):
    """A broken scheduler: rewind frees nothing, so rejected-draft blocks stay held."""
    monkeypatch.setattr(KVCacheManager, "rewind", lambda self, request, num_lookahead_tokens=0: 0)


def test_fuzz_fails_with_shrunk_case_on_broken_scheduler(monkeypatch, capsys):
    _leak_on_rewind(monkeypatch)
    rc = cli_fuzz.run(_args("--examples", "50", "--seed", "1", "--steps", "20"))
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED" in out and "AssertionError" in out
    assert "state.setup(config=SchedulerConfig(" in out  # the shrunk program, step by step
    assert "@reproduce_failure(" in out
    replay = "tokenbudget fuzz --examples 50 --seed 1 --steps 20"
    assert replay in out
    # The printed blob replays the shrunk program directly and fails again.
    line = next(l for l in out.splitlines() if "--reproduce" in l)
    blob = line.split("--reproduce", 1)[1].strip()
    assert run_fuzz(50, seed=1, steps=20, reproduce=blob) == 1
    # The same seed finds the same shrunk failure (deterministic).
    assert run_fuzz(50, seed=1, steps=20) == 1
    assert blob in capsys.readouterr().out


def test_skipped_rollback_is_caught(monkeypatch, capsys):
    """Another broken scheduler: rejected drafts are not rolled back (num_computed_tokens stays advanced)."""
    from tokenbudget.scheduler import scheduler as sched_mod

    real = sched_mod.Scheduler.apply_update

    def no_rollback(self, sched, plan):
        saved = {sr.request_id: self.requests[sr.request_id].num_computed_tokens for sr in sched.scheduled}
        finished = real(self, sched, plan)
        for rid, computed in saved.items():
            request = self.requests.get(rid)
            if request is not None and request.status == sched_mod.RUNNING:
                request.num_computed_tokens = max(request.num_computed_tokens, computed)
        return finished

    monkeypatch.setattr(sched_mod.Scheduler, "apply_update", no_rollback)
    assert run_fuzz(60, seed=2, steps=20) == 1
    out = capsys.readouterr().out
    # The shrunk program is printed step by step (Hypothesis words its heading differently across
    # versions: "Falsifying example" / "Failing test case"), then the replay commands.
    assert "state = PinnedSchedulerMachine()" in out and "--reproduce" in out


def test_load_config_file_json_toml_and_unknown_key(tmp_path):
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"max_num_seqs": 3, "block_size": 4}))
    assert load_config_file(j) == SchedulerConfig(max_num_seqs=3, block_size=4)
    t = tmp_path / "c.toml"
    t.write_text("[scheduler]\nnum_blocks = 7\nenable_prefix_caching = false\n")
    assert load_config_file(t) == SchedulerConfig(num_blocks=7, enable_prefix_caching=False)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"max_num_seqs": 3, "max_seqs": 4}))
    with pytest.raises(ValueError, match="max_seqs"):
        load_config_file(bad)
    badval = tmp_path / "badval.toml"
    badval.write_text("block_size = 0\n")
    with pytest.raises(ValueError, match="block_size"):
        load_config_file(badval)


def test_bad_config_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nonsense": 1}))
    assert cli_fuzz.run(_args("--config", str(bad))) == 2
    assert "nonsense" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "tokenbudget.cli.fuzz",
                           "--examples", "5", "--seed", "3", "--steps", "10"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


def test_tokenbudget_console_script_dispatches_fuzz() -> None:
    """The ``tokenbudget fuzz`` entry point (engine.cli.main), not only ``python -m engine.cli_fuzz``."""
    from tokenbudget.cli.main import main
    assert main(["fuzz", "--examples", "3", "--seed", "0", "--steps", "10"]) == 0
