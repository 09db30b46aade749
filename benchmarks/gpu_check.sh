#!/usr/bin/env bash
# The GPU checks in one run, for a CUDA machine with PyTorch but perhaps no package index (such as the
# device machines this project is lent): predicted vs measured memory and step time of real calibration
# runs (world size 1; rank 0 of an emulated 8-rank job; a LoRA fine-tune), and the CUDA paths of the
# optimizations (tests/gpu/test_float8.py: Float8 linears + FP8 all-gather + selective-op + per-block
# compile training one rank, on GPUs with FP8 and torchao installed), via tests/gpu.
#
#   bash benchmarks/gpu_check.sh [OUT]          # OUT defaults to $OUT, else ./gpu-check
#
# Pure-Python dependencies the machine lacks are installed from .device-wheels/ when it exists; make it
# on a machine with an index (cp312: the device image's Python), then carry it along:
#   pip download pydantic typer tabulate pyyaml --only-binary :all: --platform manylinux2014_x86_64 \
#       --python-version 3.12 -d .device-wheels
# Writes OUT/nvidia-smi.txt, OUT/pytest_gpu.txt (pass/fail and the predicted-vs-measured lines), and per
# calibration OUT/<name>/results.jsonl and OUT/<name>.txt (the report table). Record them in
# docs/calibration.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu-check}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
missing=$($PY -c '
import importlib.util as u
need = {"pydantic": "pydantic", "typer": "typer", "tabulate": "tabulate", "yaml": "pyyaml", "scipy": "scipy"}
print(" ".join(pkg for mod, pkg in need.items() if u.find_spec(mod) is None))')
if [ -n "$missing" ]; then
    echo "installing from .device-wheels: $missing"
    $PY -m pip install -q --no-index --find-links .device-wheels $missing || echo "could not install: $missing"
fi
{ nvidia-smi; $PY -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'; } \
    > "$OUT/nvidia-smi.txt" 2>&1
GPU_CHECK_OUT="$OUT" PYTHONPATH=. $PY -m pytest tests/gpu -rs -s -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.txt"
