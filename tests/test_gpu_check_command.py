"""N2: the documented GPU command works from a fresh working tree with no network.

``PYTHONPATH=. python benches/gpu_check.py`` failed with ``No module named 'tokenbudget.engine'``
(the folders map into ``tokenbudget.*`` only when installed) and the GPU machine has no package
registry. Here the documented command, ``bash benches/gpu_check.sh ...``, runs in a copy of the
tracked files with a fresh virtual environment (seeing this interpreter's site-packages, as the
image's torch & co, through a ``.pth``; no tokenbudget of its own: the outer editable install's
finder is not activated from there), pip's index switched off and every proxy pointing at a closed port,
so any download attempt fails. ``--device cpu`` stands in for the GPU; the script's install
steps are the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fresh_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


@pytest.mark.slow
def test_documented_gpu_command_runs_offline_from_a_fresh_tree(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (git ls-files) to copy the tracked tree")
    tree, venv, out = tmp_path / "tree", tmp_path / "venv", tmp_path / "out"
    _fresh_tree(tree)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # this interpreter's packages (a venv's, not only the base Python's, which --system-site-packages
    # would give): paths only, so their .pth files (the outer editable install) stay inactive
    inner_site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                capture_output=True, text=True, check=True).stdout.strip()
    outer = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    Path(inner_site, "outer_site.pth").write_text("".join(f"{p}\n" for p in outer))
    dead = "http://127.0.0.1:9"  # nothing listens: a download attempt fails at once
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PYTHON": str(py), "PIP_NO_INDEX": "1", "http_proxy": dead, "https_proxy": dead,
            "HTTP_PROXY": dead, "HTTPS_PROXY": dead, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    cmd = ["bash", "benches/gpu_check.sh", "--device", "cpu", "--out", str(out), "--no-pytest",
           "--attn-shape", "tiny", "--contexts", "40", "--ks", "1,3",
           "--sections", "backend_vs_ref,row_invariance"]
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and set(report["sections"]) == {"backend_vs_ref", "row_invariance"}
    where = subprocess.run([str(py), "-c", "import tokenbudget.engine as e; print(e.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.strip().startswith(str(tree)), where.stdout  # the fresh tree's code ran
