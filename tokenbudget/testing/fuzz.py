"""Run the scheduler state machine under Hypothesis from code or the command line.

``run_fuzz`` drives ``machine_for(config)`` (random small configurations when ``config`` is None,
else that one configuration) for ``examples`` programs of up to ``steps`` rules each. Every step
checks docs/DESIGN.md invariants 1-8 (see ``state_machine.py``).

Reproducibility: a run is a pure function of ``(seed, config, steps, examples)``. When no seed is
given one is drawn and printed, so every run can be replayed. No example database is used (a
database would make a run depend on earlier runs). On failure Hypothesis shrinks the program and
we print it step by step, the ``@reproduce_failure`` blob, and the exact command that replays it:
the same ``--seed/--config/--steps/--examples`` (re-finds and re-shrinks the failure), or
``--reproduce BLOB`` (replays the shrunk program directly, with the same Hypothesis version).

Seeding mechanism (hypothesis 6.x): ``hypothesis.seed(s)`` applied to a ``RuleBasedStateMachine``
subclass sets ``_hypothesis_internal_use_seed``, which ``get_state_machine_test`` copies onto the
generated test; likewise ``hypothesis.reproduce_failure(version, blob)``.
"""

from __future__ import annotations

import ast
import json
import random
import re
import shlex
import sys
import tomllib
import traceback
from pathlib import Path
from typing import TextIO

import hypothesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test

from tokenbudget.scheduler.config import SchedulerConfig
from tokenbudget.testing.coverage import EventCoverage
from tokenbudget.testing.state_machine import machine_for

_BLOB_RE = re.compile(r"@reproduce_failure\((['\"])([^'\"]+)\1,\s*(b(['\"])[^'\"]*\4)\)")


def load_config_file(path: str | Path) -> SchedulerConfig:
    """A ``SchedulerConfig`` from a JSON or TOML file of its fields.

    The file holds the fields at top level, or inside one ``scheduler`` table/object. The format
    follows the extension (``.json`` / ``.toml``); any other extension tries JSON, then TOML.
    An unknown key raises ValueError naming it; a bad value raises the config's own ValueError.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    if suffix == ".json":
        data = json.loads(text)
    elif suffix == ".toml":
        data = tomllib.loads(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = tomllib.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a table of SchedulerConfig fields, got {type(data).__name__}")
    if set(data) == {"scheduler"} and isinstance(data["scheduler"], dict):
        data = data["scheduler"]
    fields = SchedulerConfig.__struct_fields__
    for key in data:
        if key not in fields:
            raise ValueError(f"{path}: unknown SchedulerConfig key {key!r} (known: {', '.join(fields)})")
    return SchedulerConfig(**data)


def replay_command(seed: int, examples: int, steps: int, config_path: str | None = None,
                   blob: str | None = None) -> str:
    """The ``tokenbudget fuzz`` command line that replays a run."""
    parts = ["tokenbudget", "fuzz", "--examples", str(examples), "--seed", str(seed), "--steps", str(steps)]
    if config_path is not None:
        parts += ["--config", str(config_path)]
    if blob is not None:
        parts += ["--reproduce", blob]
    return shlex.join(parts)


def _parse_blob(blob: str) -> tuple[str, bytes]:
    """``"VERSION:BASE64"`` or a whole ``@reproduce_failure('VERSION', b'BASE64')`` line."""
    m = _BLOB_RE.search(blob)
    if m:
        return m.group(2), ast.literal_eval(m.group(3))
    version, sep, data = blob.partition(":")
    if not sep:
        raise ValueError(f"--reproduce expects VERSION:BLOB as printed by a failing run, got {blob!r}")
    return version, data.encode("ascii")


def run_fuzz(examples: int = 200, seed: int | None = None, config: SchedulerConfig | None = None,
             steps: int = 50, print_blob: bool = True, *, config_path: str | None = None,
             reproduce: str | None = None, out: TextIO | None = None, report: bool = False,
             report_json: str | None = None) -> int:
    """Fuzz the scheduler; 0 if every invariant held, 1 after printing a shrunk failing case.

    ``config_path`` only names the config in the printed replay command. ``reproduce`` replays
    one shrunk program from a printed blob instead of searching. ``report``: print the share of
    programs that reached each event (``testing.coverage``) after the run; ``report_json``: write it.
    """
    out = out or sys.stdout
    if examples < 1 or steps < 1:
        raise ValueError(f"examples and steps must be >= 1, got examples={examples}, steps={steps}")
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    coverage = EventCoverage()
    machine = machine_for(config, coverage)
    machine = hypothesis.seed(seed)(machine)
    if reproduce is not None:
        version, blob = _parse_blob(reproduce)
        machine = hypothesis.reproduce_failure(version, blob)(machine)
    where = f"config={config_path}" if config_path else ("config=" + repr(config) if config else "random configs")
    print(f"tokenbudget fuzz: {examples} examples x {steps} steps, seed={seed}, {where}", file=out, flush=True)
    run_settings = settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                            database=None, print_blob=print_blob, derandomize=False, report_multiple_bugs=False,
                            suppress_health_check=list(HealthCheck),
                            phases=[p for p in Phase if p is not Phase.explain])  # explain: slow coverage tracing
    try:
        with with_reporter(lambda text: print(text, file=out)):  # the shrunk program, step by step
            run_state_machine_as_test(machine, settings=run_settings)
    except Exception as exc:  # noqa: BLE001 - any failure of the system under test is a finding
        _report_failure(exc, seed, examples, steps, config_path, out, reproduce)
        return 1
    finally:
        if report:
            print(coverage.table(), file=out, flush=True)
        if report_json:
            with open(report_json, "w") as f:
                json.dump({"seed": seed, "examples": examples, "steps": steps, **coverage.as_dict()}, f, indent=1)
    print(f"OK: every invariant held ({examples} examples, seed={seed})", file=out, flush=True)
    return 0


def _report_failure(exc: BaseException, seed: int, examples: int, steps: int,
                    config_path: str | None, out: TextIO, reproduce: str | None = None) -> None:
    print("\nFAILED: an invariant broke. Shrunk failing program and error:\n", file=out)
    print("".join(traceback.format_exception(exc)), file=out)
    notes = "\n".join(getattr(exc, "__notes__", []))
    m = _BLOB_RE.search(notes)
    print("Replay (re-finds and shrinks the same failure):", file=out)
    print("  " + replay_command(seed, examples, steps, config_path), file=out)
    if m:
        blob = f"{m.group(2)}:{ast.literal_eval(m.group(3)).decode('ascii')}"
        print(f"Replay the shrunk program only ({m.group(0)}):", file=out)
        print("  " + replay_command(seed, examples, steps, config_path, blob), file=out)
    elif reproduce is not None:
        print("Replay the shrunk program only:", file=out)
        print("  " + replay_command(seed, examples, steps, config_path, reproduce), file=out)
    out.flush()
