#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one go: build, GPU tests, GPU benchmarks.
# Run on a GPU machine with torch installed:
#     OUT=/tmp/out bash scripts/run_gpu.sh
# Logs and JSON results land in $OUT (default benchmarks/results/gpu-run; a relative path is
# the repository root's).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/gpu.txt"
rm -rf build kvcached_core/_native*.so
python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
status=0
python3 -m pytest tests/core tests/backends -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/tests-core.log" | tail -4 || status=1
python3 -m pytest tests/allocator tests/ipc -m gpu -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/tests-gpu-marked.log" | tail -4 || status=1
python3 benchmarks/bench_mapper.py --device cuda:0 --out "$OUT/mapper-cuda.json" 2>&1 | tee "$OUT/bench-mapper.log" || status=1
python3 benchmarks/bench_tp_broadcast.py --device cuda --ranks 2 --out "$OUT/tp-broadcast-cuda.json" 2>&1 | tee "$OUT/bench-tp.log" | tail -12 || status=1
exit $status
