#!/usr/bin/env bash
# The SGLang adapter's tests against every covered SGLang release (kvcached_sglang's
# COVERED_RELEASES), where scripts/test.sh (CI) runs one release of each class the adapter's
# gates tell apart (kvcached_testing/sglang_release.py, DEFAULT_TESTED). Installs the releases
# that are missing into .sglang/<version> first. About twice the SGLang tests' time of CI.
# Usage: scripts/sglang_release_matrix.sh [PYTEST ARGS ...]   (e.g. -m "not engine")
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=.venv/bin/python bash scripts/setup_sglang.sh || exit 1
KVCACHED_TEST_SGLANG_RELEASES=all exec .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/sglang "$@"
