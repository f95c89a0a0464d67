#!/usr/bin/env bash
# The documented GPU command (docs/cuda.md), from a fresh working tree, offline:
#   bash benches/gpu_check.sh --device cuda --out benches/results/gpu_check
# 1. installs the carried wheels (.whl/*.whl, see docs/cuda.md, "The one command") and the project itself
#    (editable: its folders map into tokenbudget.* only through pyproject's package-dir), with
#    --no-index: nothing is fetched, a missing wheel fails here with pip's message;
# 2. on --device cuda checks that tokenbudget and flashinfer import, and sets the FlashInfer JIT
#    variables of the recipe unless already set;
# 3. runs benches/gpu_check.py with the arguments given; its exit status is this script's.
# PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
shopt -s nullglob
wheels=(.whl/*.whl)
if (( ${#wheels[@]} )); then
    "$py" -m pip install -q --no-index --no-deps --no-cache-dir "${wheels[@]}"
fi
# --no-build-isolation (no index to fetch a build backend from): the interpreter's own setuptools
# builds the editable install, and it needs bdist_wheel (setuptools >= 70.1, or the `wheel`
# package); a stock Python 3.11 venv has setuptools 65.5 without `wheel`. Carry setuptools in .whl.
if ! "$py" -c "import setuptools.command.bdist_wheel" 2>/dev/null && ! "$py" -c "import wheel" 2>/dev/null; then
    echo "gpu_check.sh: $("$py" -c 'import setuptools; print("setuptools", setuptools.__version__)' 2>&1 | tail -1)" \
         "cannot build the editable install offline (no bdist_wheel): carry 'setuptools>=70.1' in .whl" \
         "(docs/cuda.md, 'The one command')" >&2
    exit 2
fi
"$py" -m pip install -q --no-index --no-deps --no-build-isolation -e .
case " $* " in
    *" --device cpu "*|*" --device=cpu "*)
        "$py" -c "import tokenbudget" ;;
    *)
        export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0a}"
        export MAX_JOBS="${MAX_JOBS:-16}"
        export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}"
        "$py" -c "import tokenbudget, flashinfer" ;;
esac
exec "$py" benches/gpu_check.py "$@"
