#!/usr/bin/env bash
# The device checks, as one script for a lent GPU machine (see the device tool's README):
#   make gpu-wheels                      # here: wheels the GPU image lacks, into .gpu-wheels/
#   run(command="bash bench/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=540)
# It installs the carried wheels offline, runs the CUDA tests and the kernel matrix on the GPU
# machine's own torch, then the transfer benchmark in GPU mode; logs land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/hicache-gpu-out}
mkdir -p "$OUT"
PY=python3
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  $PY -m pip install -q --no-index --no-deps .gpu-wheels/*.whl
} 2>&1 | tee "$OUT/env.txt"
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/gpu tests/unit/kernels 2>&1 | tee "$OUT/tests.txt"
timeout 240 $PY bench/transfer.py --device cuda 2>&1 | tee "$OUT/transfer_gpu.txt"
