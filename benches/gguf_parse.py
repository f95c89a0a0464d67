"""GGUF parse time of the default model: this checkout's ``engine/loader/gguf_file.py`` against
the same file at another git revision, side by side in one process (issue 39: the hardened
parser must stay ~0.1 s).

    OMP_NUM_THREADS=1 python benches/gguf_parse.py --against c68b2f2~1 --rounds 3 --repeat 5

Each round times ``read_gguf`` (metadata, tensor infos and views; the tensor data is not read)
``--repeat`` times per version, alternating versions, and prints the best and median of each
round; ``model_checks.check_gguf_model`` on the result is timed too. Compare the two columns of
one run, never across runs (the machine is shared).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module_at(revision: str):
    """``engine/loader/gguf_file.py`` as it was at ``revision``, imported under its own name."""
    source = subprocess.run(["git", "-C", ROOT, "show", f"{revision}:engine/loader/gguf_file.py"],
                            check=True, capture_output=True, text=True).stdout
    folder = tempfile.mkdtemp(prefix="gguf_parse-")
    path = os.path.join(folder, "gguf_file_at_revision.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("gguf_file_at_revision", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _times(read, path: str, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        read(path)
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    from tokenbudget.engine.loader import default_model_path, gguf_file
    from tokenbudget.engine.loader.model_checks import check_gguf_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", default="HEAD", help="git revision of the parser to compare with")
    p.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None, help="write the timings here")
    args = p.parse_args()
    path = args.model or default_model_path()
    other = _module_at(args.against)
    versions = {args.against: other.read_gguf, "this checkout": gguf_file.read_gguf}
    for read in versions.values():
        read(path)  # page the file in
    results: dict[str, list[float]] = {name: [] for name in versions}
    print(f"{path}\n| round | version | best ms | median ms |\n|---:|---|---:|---:|")
    for r in range(args.rounds):
        for name, read in versions.items():
            t = _times(read, path, args.repeat)
            results[name] += t
            print(f"| {r + 1} | {name} | {min(t) * 1e3:.1f} | {statistics.median(t) * 1e3:.1f} |")
    parsed = gguf_file.read_gguf(path)
    checks = _times(lambda _: check_gguf_model(parsed), path, args.repeat)
    print(f"check_gguf_model: best {min(checks) * 1e3:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": path, "seconds": results, "check_seconds": checks}, f, indent=1)


if __name__ == "__main__":
    main()
