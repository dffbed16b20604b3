"""The project's own driver declarations (csrc/driver_api/) against the real headers.

The GPU backends build without any GPU header: csrc/driver_api/cuda_driver.h
and hip_runtime.h declare what they call. These tests compile
tests/backends/driver_abi_check.cpp, whose static_asserts compare every enum value
and underlying type, struct size, alignment and field offset, function type and
ABI symbol name with the real cuda.h / hip/hip_runtime_api.h, wherever the real
header and a C++ compiler exist (skipped, saying which is missing, otherwise).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from kvcached_core import _native

ROOT = Path(__file__).resolve().parents[2]
CHECK = Path(__file__).with_name("driver_abi_check.cpp")

# Where each real header is looked for: the usual variables, then the usual places.
REAL_HEADERS = {
    "cuda": ("cuda.h", ["CUDA_HOME", "CUDA_PATH"], ["/usr/local/cuda/include", "/usr/include"]),
    "hip": ("hip/hip_runtime_api.h", ["ROCM_PATH", "HIP_PATH"], ["/opt/rocm/include", "/usr/include"]),
}


def compiler() -> str:
    for candidate in (os.environ.get("CXX"), sysconfig.get_config_var("CXX"), "c++", "g++", "clang++"):
        if candidate:
            path = shutil.which(candidate.split()[0])
            if path:
                return path
    pytest.skip("no C++ compiler on PATH to compile the ABI check with")


def real_include(backend: str) -> str:
    header, env_vars, defaults = REAL_HEADERS[backend]
    roots = [os.path.join(os.environ[v], "include") for v in env_vars if os.environ.get(v)]
    for root in roots + defaults:
        if Path(root, header).is_file():
            return root
    pytest.skip(f"the real {header} is not installed here; nothing to check {backend} against")


def compile_check(backend: str, project_include: Path) -> subprocess.CompletedProcess:
    cmd = [compiler(), "-std=c++17", "-fsyntax-only", f"-DKVCACHED_CHECK_{backend.upper()}",
           f"-I{project_include}", f"-I{real_include(backend)}", str(CHECK)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def failed_asserts(stderr: str) -> list[str]:
    return re.findall(r"static assertion failed: (.*)", stderr)


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_declarations_match_the_real_header(backend):
    result = compile_check(backend, ROOT / "csrc")
    assert result.returncode == 0, f"{backend} declarations differ from the real header:\n{result.stderr}"


@pytest.mark.parametrize(
    "backend, header, edit, expected",
    [
        # A wrong enumerator value, a wrong ABI symbol and a wrong parameter type are each caught.
        ("cuda", "cuda_driver.h", ("CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3", "CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x2"),
         "CU_MEM_ACCESS_FLAGS_PROT_READWRITE: value differs"),
        ("cuda", "cuda_driver.h", ('"cuMemGetInfo_v2"', '"cuMemGetInfo"'),
         "cuMemGetInfo: the real header exports it under another symbol"),
        ("cuda", "cuda_driver.h", ('X(cuMemUnmap, "cuMemUnmap", CUresult(CUdeviceptr, std::size_t))',
                                   'X(cuMemUnmap, "cuMemUnmap", CUresult(CUdeviceptr, unsigned int))'),
         "cuMemUnmap: function type differs from the real header's"),
        # Swapped struct fields are caught by their offsets.
        ("cuda", "cuda_driver.h", ("  CUmemLocationType type;\n  int id;", "  int id;\n  CUmemLocationType type;"),
         "CUmemLocation.type: offset differs"),
        ("hip", "hip_runtime.h", ("  hipMemLocationType type;\n  int id;", "  int id;\n  hipMemLocationType type;"),
         "hipMemLocation.type: offset differs"),
        ("hip", "hip_runtime.h", ("hipSuccess = 0", "hipSuccess = 7"), "hipSuccess: value differs"),
    ],
)
def test_the_check_catches_a_wrong_declaration(tmp_path, backend, header, edit, expected):
    """The check has teeth: a copy of the headers with one mistake fails, naming it."""
    shutil.copytree(ROOT / "csrc" / "driver_api", tmp_path / "driver_api")
    target = tmp_path / "driver_api" / header
    text = target.read_text()
    assert edit[0] in text, f"the edit no longer applies to {header}: {edit[0]!r}"
    target.write_text(text.replace(edit[0], edit[1], 1))
    result = compile_check(backend, tmp_path)
    assert result.returncode != 0
    assert any(expected in message for message in failed_asserts(result.stderr)), result.stderr


@pytest.mark.parametrize("source", ["backend_cuda.cpp", "backend_hip.cpp"])
def test_backends_include_no_gpu_header(source):
    """The GPU backends' whole include graph is the project's own and the system's C++ headers."""
    import pybind11

    cmd = [compiler(), "-std=c++17", "-M", "-I", str(ROOT / "csrc"), "-I", pybind11.get_include(),
           "-I", sysconfig.get_paths()["include"], str(ROOT / "csrc" / source)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    deps = [os.path.abspath(d) for d in result.stdout.replace("\\\n", " ").split()[1:]]
    own = str(ROOT / "csrc" / "driver_api")
    assert any(d.startswith(own) for d in deps)
    gpu = [d for d in deps if not d.startswith(own) and re.search(r"/(cuda[^/]*\.h|hip/|cuda/|rocm)", d)]
    assert gpu == [], f"{source} includes GPU headers: {gpu}"


def test_every_backend_is_compiled_in():
    """setup.py builds cuda, hip and host unless KVCACHED_BACKENDS narrows it (this build: unset)."""
    if os.environ.get("KVCACHED_BACKENDS"):
        pytest.skip(f"this build was narrowed by KVCACHED_BACKENDS={os.environ['KVCACHED_BACKENDS']}")
    assert _native.compiled_backends() == ["cuda", "hip", "host"]
