"""The wheels of scripts/build_wheels.sh: a manylinux kvcached-core and two pure adapters.

The kvcached-core wheel installs into a clean virtual environment where no compiler
can be found (PATH holds only the environment's own bin/, CC and CXX point nowhere,
and pip may only take wheels), then imports and maps pages on the ``cpu`` device.
Marked ``slow``: building the wheels takes a minute or two (CI runs it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.packaging.conftest import TAG, clean_env, wheels

pytestmark = pytest.mark.slow

COMPILERS = ("cc", "gcc", "c++", "g++", "clang", "clang++")

# Run inside the clean environment: what a user does first after pip install.
PROBE = r"""
import ctypes, json
import kvcached_core
from kvcached_core import _native
from kvcached_core.vmm import open_mapper

mapper = open_mapper("cpu")
vt = mapper.reserve(4 * mapper.page_size)
mapper.map([vt], [0, 2])
page = mapper.page_size
ctypes.memset(vt.address + 2 * page, 0x5A, page)          # write through the mapping
tail = ctypes.string_at(vt.address + 3 * page - 16, 16)    # and read it back
mapper.unmap([vt], [0])
print(json.dumps({"file": kvcached_core.__file__, "backends": list(_native.compiled_backends()),
                  "backend": mapper.backend, "mapped": [p for p in range(4) if vt.is_mapped(p)],
                  "tail": tail.hex()}))
"""


def test_the_wheels_are_what_users_need(wheelhouse):
    found = wheels(wheelhouse)
    core = found["core"]
    assert f"-{TAG}-{TAG}-manylinux_" in core.name
    with zipfile.ZipFile(core) as zf:
        names = zf.namelist()
        wheel_meta = zf.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert any(n.startswith("kvcached_core/_native.") and n.endswith(".so") for n in names)
    assert "Root-Is-Purelib: false" in wheel_meta
    assert "manylinux" in wheel_meta
    for adapter in ("vllm", "sglang"):
        with zipfile.ZipFile(found[adapter]) as zf:
            assert not [n for n in zf.namelist() if n.endswith(".so")]
            meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        assert "Requires-Dist: kvcached-core>=0.1.0" in meta


def test_core_wheel_installs_without_a_compiler_and_opens_cpu(wheelhouse, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=clean_env(), timeout=300)
    env = clean_env(PATH=str(venv / "bin"), CC="/nonexistent/cc", CXX="/nonexistent/c++")
    assert [c for c in COMPILERS if shutil.which(c, path=env["PATH"])] == []
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--only-binary", ":all:",
         str(wheels(wheelhouse)["core"])],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    run = subprocess.run([python, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["file"].startswith(str(venv))  # the installed wheel, not the checkout
    assert report["backends"] == ["cuda", "hip", "host"]
    assert report["backend"] == "host"
    assert report["mapped"] == [2]
    assert report["tail"] == "5a" * 16
