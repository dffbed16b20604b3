"""The host backend in a memory-limited cgroup: running out is a scheduling miss.

Each test creates a nested memory cgroup (v2 ``memory.max``, or v1
``memory.limit_in_bytes`` where the memory controller is on v1), runs a child
process in it and maps pages until the limit: the child must get
``DeviceOutOfMemoryError`` (and the allocator ``None``), never the OOM killer.
It needs root and a writable cgroup tree, and is skipped otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 160 << 20
PAGE = 2 << 20


def _own_cgroup(controller_line: str) -> str | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if controller_line == "" and hid == "0" and controllers == "":
            return path
        if controller_line and controller_line in controllers.split(","):
            return path
    return None


def _make_cgroup() -> tuple[Path, str, str]:
    """A fresh child memory cgroup: (directory, file of its limit, file to join it)."""
    if os.geteuid() != 0:
        pytest.skip("creating a cgroup needs root")
    name = f"kvcached-test-{uuid.uuid4().hex[:8]}"
    v2_root = Path("/sys/fs/cgroup")
    v2_path = _own_cgroup("")
    if (v2_root / "cgroup.controllers").exists() and v2_path is not None:
        parent = v2_root / v2_path.lstrip("/")
        if "memory" not in (parent / "cgroup.controllers").read_text().split():
            pytest.skip("the memory controller is not available in this cgroup")
        try:
            if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                (parent / "cgroup.subtree_control").write_text("+memory")
            child = parent / name
            child.mkdir()
        except OSError as exc:
            pytest.skip(f"cannot create a nested cgroup v2 under {parent}: {exc}")
        return child, "memory.max", "cgroup.procs"
    v1_path = _own_cgroup("memory")
    v1_root = Path("/sys/fs/cgroup/memory")
    if v1_path is None or not v1_root.is_dir():
        pytest.skip("no memory cgroup controller mounted")
    parent = v1_root / v1_path.lstrip("/")
    try:
        child = parent / name
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a nested cgroup v1 under {parent}: {exc}")
    return child, "memory.limit_in_bytes", "cgroup.procs"


@pytest.fixture
def cgroup():
    child, limit_file, procs_file = _make_cgroup()
    try:
        (child / limit_file).write_text(str(LIMIT))
    except OSError as exc:
        child.rmdir()
        pytest.skip(f"cannot set {limit_file}: {exc}")
    yield child / procs_file
    for _ in range(50):
        try:
            child.rmdir()
            return
        except OSError:
            time.sleep(0.1)


CHILD = r"""
import json, os, sys
Path = __import__("pathlib").Path
Path(sys.argv[1]).write_text(str(os.getpid()))  # join the cgroup before allocating anything
from kvcached_core.allocator import KVLayout, KVTensors, PageAllocator
from kvcached_core.errors import DeviceOutOfMemoryError
from kvcached_core.vmm import open_mapper

PAGE = 2 << 20
out = {}
mapper = open_mapper("cpu", PAGE)
free, total = mapper.mem_info()
out["free"], out["total"] = free, total
vt = mapper.reserve(512 * PAGE)
mapped = 0
try:
    for p in range(512):
        mapper.map([vt], [p])
        mapped += 1
except DeviceOutOfMemoryError as exc:
    out["error"] = str(exc)
out["mapped"] = mapped
mapper.unmap([vt], list(range(mapped)))
mapper.trim_pool(0)

kv = KVTensors.open("cpu", KVLayout(2, 256 * PAGE, PAGE, 2, False))
pages = PageAllocator(kv, prealloc=False, idle_trim_s=0, min_reserved=0, max_reserved=0,
                      mem_info_ttl_s=0)
out["available"] = pages.available_pages()  # the allocator reads the limit, as on a GPU
got = []
while True:
    page = pages.alloc_page()
    if page is None:
        break
    got.append(page)
out["alloc"] = len(got)
pages.free_pages(got[:4])
out["again"] = pages.alloc_pages(2) is not None
pages.close()
print(json.dumps(out))
"""


def test_mapping_past_the_cgroup_limit_is_out_of_memory_not_a_kill(cgroup):
    env = dict(os.environ, PYTHONPATH=REPO)
    for var in ("KVCACHED_MEMORY_LIMIT", "KVCACHED_GPU_UTILIZATION"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(cgroup)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, f"child ended with {proc.returncode}: {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["total"] <= LIMIT and out["free"] < LIMIT
    assert "memory.max" in out["error"] or "cgroup" in out["error"], out["error"]
    assert 0 < out["mapped"] * PAGE < LIMIT
    # Every allocator page is 2 layers x 2 buffers x 2 MiB; it stops short of the limit.
    assert 0 < out["alloc"] * 4 * PAGE < LIMIT and out["again"]
    assert out["available"] * 4 * PAGE < LIMIT
