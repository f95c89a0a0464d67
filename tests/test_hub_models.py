"""Models by Hugging Face Hub id (``engine/loader/hub.py``), with no network: a cache directory laid
out as huggingface_hub lays it out (``models--org--name/{refs,snapshots}``), built here, and
``HF_HUB_OFFLINE=1``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tokenbudget.api.sampling_params import SamplingParams
from tokenbudget.engine.entrypoints.llm import LLM
from tokenbudget.engine.loader.hub import is_hub_id, resolve_model_path

from tiny_llama import make_tiny_llama


def _cache_repo(hub: str, repo: str, files: dict[str, str], revision: str = "main", commit: str = "a" * 40) -> str:
    """Put ``files`` (repo path -> local source) in huggingface_hub's cache layout for ``repo`` at
    ``revision``; returns the snapshot folder."""
    folder = os.path.join(hub, "models--" + repo.replace("/", "--"))
    snap = os.path.join(folder, "snapshots", commit)
    for name, src in files.items():
        os.makedirs(os.path.dirname(os.path.join(snap, name)), exist_ok=True)
        shutil.copyfile(src, os.path.join(snap, name))
    os.makedirs(os.path.join(folder, "refs"), exist_ok=True)
    with open(os.path.join(folder, "refs", revision), "w") as f:
        f.write(commit)
    return snap


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", layers=2, seed=3)


@pytest.fixture()
def hub(tmp_path, monkeypatch, tiny):
    cache = str(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = {f: os.path.join(tiny, f) for f in os.listdir(tiny)}
    _cache_repo(cache, "org/tiny", files)
    return cache


def _tokens(llm: LLM) -> list[int]:
    out = llm.generate(["hello hub"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_a_cached_hub_id_loads_offline_like_its_directory(hub, tiny) -> None:
    path = resolve_model_path("org/tiny")
    assert path.startswith(hub) and os.path.isfile(os.path.join(path, "config.json"))
    assert _tokens(LLM("org/tiny", num_threads=1)) == _tokens(LLM(tiny, num_threads=1))


def test_revision_picks_its_snapshot(hub, tiny) -> None:
    files = {f: os.path.join(tiny, f) for f in os.listdir(tiny)}
    snap = _cache_repo(hub, "org/tiny", files, revision="v2", commit="b" * 40)
    assert resolve_model_path("org/tiny", revision="v2") == snap
    assert LLM("org/tiny", revision="v2", num_threads=1).engine is not None
    with pytest.raises(FileNotFoundError, match="revision 'v3'"):
        resolve_model_path("org/tiny", revision="v3")


def test_gguf_forms(hub, tmp_path) -> None:
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")  # resolution only: never loaded here
    snap = _cache_repo(hub, "org/m-GGUF", {"m-Q8_0.gguf": str(gguf), "m-Q4_K_M.gguf": str(gguf),
                                           "sub/m-f16.gguf": str(gguf)}, commit="c" * 40)
    assert resolve_model_path("org/m-GGUF:Q8_0") == os.path.join(snap, "m-Q8_0.gguf")
    assert resolve_model_path("org/m-GGUF:q4_k_m") == os.path.join(snap, "m-Q4_K_M.gguf")
    assert resolve_model_path("org/m-GGUF/sub/m-f16.gguf") == os.path.join(snap, "sub", "m-f16.gguf")
    with pytest.raises(FileNotFoundError, match="0 GGUF files carry 'Q2_K'"):
        resolve_model_path("org/m-GGUF:Q2_K")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path("org/m-GGUF")


def test_not_cached_offline_says_so(hub) -> None:
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE=1"):
        LLM("org/absent", num_threads=1)


def test_a_local_path_wins_and_other_strings_are_not_hub_ids(tmp_path, monkeypatch, tiny) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny, tmp_path / "org" / "tiny")
    assert resolve_model_path("org/tiny") == "org/tiny"  # the directory, no hub lookup
    with pytest.raises(ValueError, match="revision"):
        resolve_model_path("org/tiny", revision="v1")
    for s in ("a/b", "Qwen/Qwen3-0.6B", "unsloth/Qwen3-0.6B-GGUF:Q4_K_M", "org/name/file.gguf"):
        assert is_hub_id(s), s
    for s in ("model.gguf", "/abs/dir", "./rel/dir", "a/b/c", "org/../etc", "a/b:", "org/name/x.bin"):
        assert not is_hub_id(s), s


def test_cli_generate_and_serve_name_take_hub_ids(hub) -> None:
    env = dict(os.environ, HF_HUB_CACHE=hub, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "tokenbudget.cli.main", "generate", "--model", "org/tiny", "--raw",
                          "--max-tokens", "4", "--threads", "1", "hi"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    from tokenbudget.cli.serve import served_name
    assert served_name("org/tiny") == "org/tiny"
    assert served_name(None) == "SmolLM2-135M-Instruct"
