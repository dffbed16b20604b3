"""Builds kvcached_core._native from csrc/.

Each GPU backend is compiled in when its headers are found; the host backend
always is. Nothing links against a GPU library or torch: driver libraries are
loaded at run time with dlopen, and memory reaches torch through DLPack.

Header search: CUDA in $CUDA_HOME/include, /usr/local/cuda/include and
/usr/include; HIP in $ROCM_PATH/include, /opt/rocm/include and /usr/include.
KVCACHED_BACKENDS=cuda,hip,host (any subset) restricts what is compiled in.
"""

import os
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

HEADERS = {
    "cuda": ("cuda.h", ["CUDA_HOME", "CUDA_PATH"], ["/usr/local/cuda/include", "/usr/include"]),
    "hip": ("hip/hip_runtime_api.h", ["ROCM_PATH", "HIP_PATH"], ["/opt/rocm/include", "/usr/include"]),
}


def find_include(backend: str) -> str | None:
    header, env_vars, defaults = HEADERS[backend]
    roots = [os.path.join(os.environ[v], "include") for v in env_vars if os.environ.get(v)]
    for root in roots + defaults:
        if Path(root, header).is_file():
            return root
    return None


def wanted_backends() -> set[str]:
    raw = os.environ.get("KVCACHED_BACKENDS", "cuda,hip,host")
    names = {b.strip() for b in raw.split(",") if b.strip()}
    unknown = names - {"cuda", "hip", "host"}
    if unknown:
        raise SystemExit(f"KVCACHED_BACKENDS={raw!r}: unknown backend(s) {sorted(unknown)} (use cuda, hip, host)")
    return names


sources = ["csrc/backend.cpp", "csrc/backend_host.cpp", "csrc/page_mapper.cpp",
           "csrc/page_server.cpp", "csrc/faults.cpp",
           "csrc/raw_timing.cpp", "csrc/block_table.cpp",
           "csrc/block_table_type.cpp", "csrc/bindings.cpp"]
include_dirs = ["csrc"]
macros = []
wanted = wanted_backends()
for backend in ("cuda", "hip"):
    inc = find_include(backend) if backend in wanted else None
    if inc is None:
        continue
    sources.append(f"csrc/backend_{backend}.cpp")
    if inc != "/usr/include":
        include_dirs.append(inc)
    macros.append((f"KVCACHED_WITH_{backend.upper()}", "1"))
    if backend == "hip":
        macros.append(("__HIP_PLATFORM_AMD__", "1"))
    print(f"kvcached: compiling the {backend} backend (headers in {inc})")

ext = Pybind11Extension(
    "kvcached_core._native",
    sources,
    include_dirs=include_dirs,
    define_macros=macros,
    cxx_std=17,
    libraries=["dl", "pthread"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
