"""Models by Hugging Face Hub id: ``org/name`` -> a local directory or GGUF file, as vLLM and
transformers users type it.

Accepted forms (a path that exists on disk always wins):

* ``org/name``: the repository's Hugging Face checkpoint (config, generation config, tokenizer and
  chat template files, ``*.safetensors``), fetched with ``huggingface_hub.snapshot_download``;
* ``org/name:QUANT`` (llama.cpp's ``-hf`` form, e.g. ``Qwen/Qwen3-0.6B-GGUF:Q8_0``): the one GGUF
  file of the repository whose name carries that quantization tag;
* ``org/name/file.gguf``: that file of the repository.

huggingface_hub's own settings apply: ``HF_HOME`` / ``HF_HUB_CACHE`` (the cache), ``HF_TOKEN``,
``HF_HUB_OFFLINE=1`` (cache only, no network), and ``revision`` (a branch, tag or commit). A
model it cannot get (offline and not cached, no such repository or revision, no network) is a
``FileNotFoundError`` saying which and how to fix it; nothing is downloaded for a local path.
"""

from __future__ import annotations

import os
import re

__all__ = ["is_hub_id", "resolve_model_path"]

_REPO = r"[A-Za-z0-9][\w.-]*/[\w.-]*[\w]"
_FORMS = re.compile(rf"^(?P<repo>{_REPO})(?::(?P<quant>[\w.-]+)|/(?P<file>[\w./-]+\.gguf))?$")
# what a Hugging Face checkpoint directory needs (weights, configs, tokenizer, chat templates)
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


def is_hub_id(model: str) -> bool:
    """Whether ``model`` reads as one of the hub forms above (not whether it exists there)."""
    return bool(_FORMS.match(model)) and ".." not in model.split("/")


def resolve_model_path(model: str, revision: str | None = None) -> str:
    """``model`` itself when it exists on disk (or is not a hub id: the caller reports it);
    else the local path of the hub model it names (fetched, or read from the cache)."""
    path = os.path.expanduser(model)
    if os.path.exists(path) or not is_hub_id(model):
        if revision is not None and os.path.exists(path):
            raise ValueError(f"revision={revision!r} applies to hub ids, but {model!r} is a local path")
        return path
    m = _FORMS.match(model)
    repo, quant, file = m["repo"], m["quant"], m["file"]
    try:
        import huggingface_hub
    except ImportError:  # a dependency; only a broken install lacks it
        raise FileNotFoundError(f"model {model!r} is not a local path and huggingface_hub is not installed "
                                "to fetch it from the Hugging Face Hub") from None
    # read at each call, not when huggingface_hub was imported: an embedding program may set them late
    where = dict(revision=revision, cache_dir=_cache_dir(huggingface_hub), local_files_only=_offline())
    try:
        if file is not None:
            return huggingface_hub.hf_hub_download(repo, file, **where)
        patterns = CHECKPOINT_FILES if quant is None else [f"*{t}*.gguf" for t in {quant, quant.upper(), quant.lower()}]
        local = huggingface_hub.snapshot_download(repo, allow_patterns=patterns, **where)
    except Exception as e:  # huggingface_hub's errors: offline and not cached, no repo/revision, no network
        raise FileNotFoundError(_why(model, revision, e)) from None
    if quant is not None:
        return _one_gguf(local, model, quant)
    if not os.path.isfile(os.path.join(local, "config.json")):
        raise FileNotFoundError(f"hub model {model!r} has no config.json (a GGUF-only repository?): name a file "
                                f"as {repo}/FILE.gguf or a quantization as {repo}:Q8_0")
    return local


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _cache_dir(huggingface_hub) -> str:
    """huggingface_hub's cache: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else its default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return huggingface_hub.constants.HF_HUB_CACHE


def _one_gguf(local: str, model: str, quant: str) -> str:
    found = sorted(os.path.join(root, f) for root, _, files in os.walk(local) for f in files if f.endswith(".gguf"))
    found = [f for f in found if quant.lower() in os.path.basename(f).lower()]
    if len(found) != 1:
        names = ", ".join(os.path.relpath(f, local) for f in found) or "none"
        raise FileNotFoundError(f"hub model {model!r}: {len(found)} GGUF files carry {quant!r} ({names}); "
                                "name one as org/name/FILE.gguf")
    return found[0]


def _why(model: str, revision: str | None, error: Exception) -> str:
    kind = type(error).__name__
    at = f" at revision {revision!r}" if revision else ""
    if _offline() or "LocalEntryNotFound" in kind:
        hint = ("it is not in the Hugging Face cache (HF_HOME / HF_HUB_CACHE) and the Hub cannot be reached "
                "(HF_HUB_OFFLINE=1 or no network): download it once online, or pass a local path")
    elif "RepositoryNotFound" in kind or "GatedRepo" in kind:
        hint = "no such repository, or it is gated/private (set HF_TOKEN)"
    elif "RevisionNotFound" in kind:
        hint = "no such revision"
    else:
        hint = f"the Hugging Face Hub could not be reached ({kind}: {str(error).splitlines()[0][:200]})"
    return f"model {model!r}{at} is not a local path and could not be fetched from the Hugging Face Hub: {hint}"
