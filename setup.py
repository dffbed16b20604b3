"""Builds kvcached_core._native from csrc/.

Every backend is compiled in: cuda, hip and host. No GPU header or library is
needed at build time: the driver types, constants and signatures the GPU
backends use are declared in csrc/driver_api/ (checked against the real
cuda.h and hip/hip_runtime_api.h by tests/backends/test_driver_abi.py wherever
those are installed), driver libraries are loaded at run time with dlopen,
and memory reaches torch through DLPack. So a wheel built on a machine
without CUDA or ROCm opens cuda:N on a host with an NVIDIA driver.

KVCACHED_BACKENDS=cuda,hip,host (any non-empty subset) restricts which GPU
backends are compiled in; the host backend always is (CPU engines and the
tests run on it). _native.compiled_backends() reports what was. KVCACHED_BUILD_JOBS=N
sets how many sources compile at once (default: one per CPU).
"""

import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup


BACKENDS = ("cuda", "hip", "host")


# Build variables of the original kvcached (or a near miss) -> what to set instead.
LEGACY_BUILD_VARIABLES = {
    "KVCACHED_USE_CUDA": "every build now holds the cuda, hip and host backends; "
                         "to leave one out set KVCACHED_BACKENDS (e.g. KVCACHED_BACKENDS=cuda,host)",
    "KVCACHED_USE_HIP": "every build now holds the cuda, hip and host backends; "
                        "to leave one out set KVCACHED_BACKENDS (e.g. KVCACHED_BACKENDS=hip,host)",
    "KVCACHED_BACKEND": "is not read; the build setting is KVCACHED_BACKENDS (plural), "
                        "e.g. KVCACHED_BACKENDS=cuda,host",
}


def reject_legacy_variables() -> None:
    for name, advice in LEGACY_BUILD_VARIABLES.items():
        if os.environ.get(name, "").strip():
            raise SystemExit(f"{name}={os.environ[name].strip()!r}: {advice}")


def wanted_backends() -> set[str]:
    raw = os.environ.get("KVCACHED_BACKENDS", ",".join(BACKENDS))
    names = {b.strip() for b in raw.split(",") if b.strip()}
    unknown = names - set(BACKENDS)
    if unknown:
        raise SystemExit(f"KVCACHED_BACKENDS={raw!r}: unknown backend(s) {sorted(unknown)} (use cuda, hip, host)")
    if not names:
        raise SystemExit(f"KVCACHED_BACKENDS={raw!r} names no backend (use a subset of cuda, hip, host)")
    return names


def build_jobs() -> int:
    """Sources compiled at once: KVCACHED_BUILD_JOBS, or 0 (one per CPU)."""
    raw = os.environ.get("KVCACHED_BUILD_JOBS", "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise SystemExit(f"KVCACHED_BUILD_JOBS={raw!r}: give a whole number of compile jobs "
                         "(0 or unset: one per CPU)")
    return int(raw)


sources = ["csrc/backend.cpp", "csrc/backend_host.cpp", "csrc/page_mapper.cpp",
           "csrc/page_server.cpp", "csrc/faults.cpp",
           "csrc/raw_timing.cpp", "csrc/block_table.cpp",
           "csrc/block_table_type.cpp", "csrc/bindings.cpp"]
include_dirs = ["csrc"]
macros = []
reject_legacy_variables()
wanted = wanted_backends()
# The sources compile side by side: an editable install or a wheel builds in a fresh
# directory, so every build compiles them all.
ParallelCompile(default=build_jobs()).install()
for backend in ("cuda", "hip"):
    if backend not in wanted:
        continue
    sources.append(f"csrc/backend_{backend}.cpp")
    macros.append((f"KVCACHED_WITH_{backend.upper()}", "1"))
    print(f"kvcached: compiling the {backend} backend (declarations in csrc/driver_api/)")

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
