#!/usr/bin/env bash
# kvcached inside a real vLLM on one NVIDIA GPU (H100/H200: the bundle's kernels are sm_90).
# Run on the GPU machine, the offline vLLM bundle copied into the checkout's ignored .gpu-vllm/
# folder (cp ../shared/gpu-vllm/*.tar.xz .gpu-vllm/); relative paths are the repository root's:
#     OUT=/tmp/out bash scripts/run_gpu_vllm.sh tests tokens perf
#     OUT=/tmp/out bash scripts/run_gpu_vllm.sh perf:throughput tokens:v2-graphs
# Steps (each once per machine): unpack vLLM 0.26.0 to /tmp/site, build kvcached-core in
# place, install kvcached-vllm (its entry points) beside vLLM. Then, in order:
#   tests    the GPU tests (tests/backends, tests/core, tests/ipc/test_remote.py, gpu-marked
#            allocator and IPC tests)
#   tokens   benchmarks/bench_vllm_gpu.py tokens -> $OUT/vllm-gpu-tokens.json
#   perf     benchmarks/bench_vllm_gpu.py perf   -> $OUT/vllm-gpu-perf.json
#   serve    benchmarks/bench_serve.py --device cuda:0 -> $OUT/serve-gpu.json (+ .png): several
#            `vllm serve` engines behind kvcached-serve, shared budget against a static split;
#            needs the server wheels the bundle leaves out (scripts/fetch_gpu_serve_wheels.sh
#            puts them in .gpu-vllm/serve-wheels/); SERVE_ARGS passes more options
#   lifecycle  benchmarks/bench_vllm_lifecycle.py --device cuda -> $OUT/vllm-gpu-lifecycle.json
#            (engine start and shutdown against vanilla; LIFECYCLE_ARGS, default
#            "--reps 2 --pool-reps 0": the block pools are measured on the CPU)
# BUDGET (seconds, default 540) bounds the whole run; phases stop early when it runs out.
# BENCH_ARGS passes more options to bench_vllm_gpu.py (e.g. BENCH_ARGS="--reps 12", or
# "--variant held:KVCACHED_IDLE_TRIM_S=0" to compare settings); STACKS=1 samples where each
# engine's Python threads spend their time (--stacks $OUT/stacks): $OUT/stacks.tgz, compared with
# vanilla's by benchmarks/stack_sampler/compare.py in $OUT/stacks-compare.{txt,json}; "--kv-gib 12 --variant
# ahead-off:KVCACHED_MAP_AHEAD=0" for map-ahead's share of perf; "--inproc" (tokens, perf) for
# engine cores in their LLM's process, so batches do not depend on request arrival).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu-run}
BUDGET=${BUDGET:-540}
BUNDLE=${BUNDLE:-$(ls .gpu-vllm/vllm-*-sm90-site.tar.xz 2>/dev/null | head -1)}
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
# No network there: never try the hub or usage stats; loopback for torch.distributed;
# flashinfer is not in the bundle, and vLLM's sampler imports it unless told not to.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_HOST_IP=127.0.0.1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} 2>&1 | tee -a "$OUT/setup.log"
if [ ! -f /tmp/site/vllm/__init__.py ]; then
  [ -n "$BUNDLE" ] || { echo "no vLLM bundle in .gpu-vllm/" | tee -a "$OUT/setup.log"; exit 1; }
  python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('/tmp/site')" "$BUNDLE"
fi
if ! python3 -c 'import kvcached_core._native' 2>/dev/null; then
  rm -rf build kvcached_core/_native*.so
  python3 setup.py build_ext --inplace >> "$OUT/setup.log" 2>&1 \
    || { tail -30 "$OUT/setup.log"; exit 1; }
fi
if [ ! -d /tmp/site/kvcached_vllm ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site ./kvcached_vllm \
    >> "$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 1; }
fi
python3 -c 'import vllm, kvcached_core._native as n, importlib.metadata as md
print("vllm", vllm.__version__, "| kvcached backends", n.compiled_backends(),
      "| entry points", [e.value for e in md.entry_points(group="vllm.general_plugins")])' \
  2>&1 | tee -a "$OUT/setup.log"
echo "setup done after $(( $(date +%s) - start )) s" | tee -a "$OUT/setup.log"

status=0
for phase in "$@"; do
  case $phase in
    tests)
      python3 -m pytest -q -p no:cacheprovider -rs tests/backends tests/ipc/test_remote.py \
        tests/core 2>&1 | tee "$OUT/tests.log" | tail -5 || status=1
      python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/allocator tests/ipc 2>&1 \
        | tee -a "$OUT/tests.log" | tail -3 || status=1 ;;
    tokens*|perf*)  # tokens:v2-graphs,batch-invariant runs only those parts
      name=${phase%%:*}; parts=(); [ "$name" != "$phase" ] && IFS=, read -ra parts <<< "${phase#*:}"
      stacks=(); [ "${STACKS:-0}" = 1 ] && stacks=(--stacks "$OUT/stacks")
      # shellcheck disable=SC2086  # BENCH_ARGS: more options, e.g. "--reps 12"
      python3 benchmarks/bench_vllm_gpu.py "$name" --budget "$(left)" --configs "${parts[@]}" \
        ${BENCH_ARGS:-} "${stacks[@]}" \
        --out "$OUT/vllm-gpu-$name.json" 2>&1 | tee "$OUT/bench-$name.log" \
        | grep -v "^(EngineCore\|^(Worker\|^INFO\|^WARNING" || status=1 ;;
    serve)
      if ! python3 -c 'import uvicorn, jmespath' 2>/dev/null; then
        ls .gpu-vllm/serve-wheels/*.whl >/dev/null 2>&1 \
          || { echo "serve: no wheels in .gpu-vllm/serve-wheels (scripts/fetch_gpu_serve_wheels.sh)"; status=1; continue; }
        python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu-vllm/serve-wheels/*.whl \
          >> "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; status=1; continue; }
      fi
      [ "$(left)" -gt 120 ] || { echo "serve: no time left"; status=1; continue; }
      # shellcheck disable=SC2086  # SERVE_ARGS: more options
      timeout "$(left)" python3 benchmarks/bench_serve.py --device cuda:0 ${SERVE_ARGS:-} \
        --out "$OUT/serve-gpu.json" 2>&1 | tee "$OUT/bench-serve.log" || status=1 ;;
    lifecycle)
      [ "$(left)" -gt 60 ] || { echo "lifecycle: no time left"; status=1; continue; }
      # shellcheck disable=SC2086  # LIFECYCLE_ARGS: more options
      timeout "$(left)" python3 benchmarks/bench_vllm_lifecycle.py --device cuda \
        ${LIFECYCLE_ARGS:---reps 2 --pool-reps 0} --out "$OUT/vllm-gpu-lifecycle.json" 2>&1 \
        | tee "$OUT/bench-lifecycle.log" | grep -v "^(EngineCore\|^INFO\|^WARNING" || status=1 ;;
    *) echo "unknown phase $phase"; status=1 ;;
  esac
done
# Stack samples (STACKS=1) come back as one file: a run returns few files.
if [ -d "$OUT/stacks" ]; then
  python3 benchmarks/stack_sampler/compare.py "$OUT/stacks" --top 30 \
    --json "$OUT/stacks-compare.json" > "$OUT/stacks-compare.txt" 2>&1
  head -80 "$OUT/stacks-compare.txt"
  tar czf "$OUT/stacks.tgz" -C "$OUT" stacks && rm -rf "$OUT/stacks"
fi
echo "total $(( $(date +%s) - start )) s"
exit $status
