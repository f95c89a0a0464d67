"""``tokenbudget generate … --spec-method eagle3``: the tau line and the measured speed-up line;
``serve`` takes the same flags. A tiny random target and a random head (tests/eagle3_fixtures.py)."""

from __future__ import annotations

import argparse

import pytest

from tokenbudget.cli import generate, serve
from tokenbudget.cli.main import main

from eagle3_fixtures import make_target, random_head, write_head


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_cli")
    return make_target(root / "target"), write_head(root / "head", random_head(0))


def test_generate_prints_tau_and_speed_up(dirs, capsys) -> None:
    target, head = dirs
    rc = main(["generate", "hello world, hello", "--raw", "--model", target, "--spec-method", "eagle3",
               "--spec-model", head, "--num-spec-tokens", "3", "--max-tokens", "16", "--threads", "1",
               "--max-model-len", "256"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "spec: drafts=" in err
    tau = next(line for line in err.splitlines() if line.startswith("tau = "))
    assert "tokens per verify step" in tau and "acceptance by draft position [" in tau
    speed = next(line for line in err.splitlines() if line.startswith("speed-up: "))
    assert "x vs plain decoding" in speed


def test_no_compare_skips_the_plain_rerun(dirs, capsys) -> None:
    target, head = dirs
    assert main(["generate", "abc", "--raw", "--model", target, "--spec-method", "eagle3", "--spec-model", head,
                 "--max-tokens", "8", "--threads", "1", "--max-model-len", "256", "--no-compare"]) == 0
    err = capsys.readouterr().err
    assert "tau = " in err and "speed-up" not in err


def test_eagle3_flags_build_the_speculative_config() -> None:
    for add in (generate.add_parser, serve.add_parser):
        parser = argparse.ArgumentParser()
        add(parser.add_subparsers())
        cmd = "generate" if add is generate.add_parser else "serve"
        args = parser.parse_args([cmd, *(["x"] if cmd == "generate" else []), "--spec-method", "eagle3",
                                  "--spec-model", "/heads/h"])
        assert generate.speculative_config_from_args(args) == {"method": "eagle3", "num_speculative_tokens": "auto",
                                                               "model": "/heads/h"}
        args = parser.parse_args([cmd, *(["x"] if cmd == "generate" else []), "--spec-method", "eagle3"])
        assert "model" not in generate.speculative_config_from_args(args)  # the shipped head


def test_eagle3_without_a_head_for_another_target_is_one_line_error(dirs, capsys) -> None:
    target, _ = dirs
    rc = main(["generate", "abc", "--raw", "--model", target, "--spec-method", "eagle3", "--max-tokens", "4",
               "--threads", "1"])
    assert rc == 2
    assert "speculative_config.model" in capsys.readouterr().err
