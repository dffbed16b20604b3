"""The fault-injection switch (KVCACHED_FAULTS): parsing, off by default, each native site."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvcached_core import _native, faults
from kvcached_core.allocator import KVLayout, KVTensors, PageAllocator
from kvcached_core.errors import DeviceOutOfMemoryError, KVCachedConfigError
from kvcached_core.vmm import open_mapper

from tests.allocator.conftest import QUIET

PAGE = 64 << 10


@pytest.fixture(autouse=True)
def disarmed():
    faults.configure(None)
    yield
    faults.configure(None)


@pytest.mark.parametrize("spec, shown", [
    ("map:3:fail", ["map:3:fail"]),
    ("MAP:3:FAIL, ipc:5-9:stall=2.0", ["map:3:fail", "ipc:5-9:stall=2"]),
    ("create:10+:kill,call:1:fail,", ["create:10+:kill", "call:1:fail"]),
    ("", []),
])
def test_rules_parse_and_print_back(spec, shown):
    assert [str(r) for r in faults.parse(spec)] == shown


@pytest.mark.parametrize("spec, why", [
    ("map:0:fail", "counts calls from 1"),
    ("map:5-4:fail", "N <= M"),
    ("disk:1:fail", "names no fault site"),
    ("map:1:explode", "names no action"),
    ("map:1:stall", "stall=SECONDS"),
    ("map:1:stall=inf", "stall=SECONDS"),
    ("map:1:stall=1e10", "stall=SECONDS"),
    ("map:1:fail=2", "does not take"),
    ("call:1:kill", "native sites only"),
    ("map:" + "9" * 40 + ":fail", "malformed"),
    ("map;1;fail", "malformed"),
])
def test_bad_rules_are_config_errors_naming_the_variable(spec, why):
    with pytest.raises(KVCachedConfigError, match="KVCACHED_FAULTS") as info:
        faults.parse(spec)
    assert why in str(info.value)


def _fresh_interpreter(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "KVCACHED_FAULTS"}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, check=True,
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip()


def test_off_by_default_and_read_once_at_load():
    probe = ("import os; from kvcached_core import _native, faults; "
             "print(_native._faults_armed(), faults.ACTIVE is None, faults.rules()); "
             "os.environ['KVCACHED_FAULTS'] = 'map:1:fail'; "  # too late: read once
             "from kvcached_core.vmm import open_mapper; m = open_mapper('cpu', 65536); "
             "t = m.reserve(65536); m.map([t], [0]); print(t.is_mapped(0))")
    assert _fresh_interpreter(probe).splitlines() == ["False True ()", "True"]
    armed = _fresh_interpreter("from kvcached_core import _native, faults; "
                               "print(_native._faults_armed(), faults.ACTIVE is None)",
                               KVCACHED_FAULTS="map:1:fail")
    assert armed == "True True"  # native sites only: the Python check stays None
    bad = subprocess.run([sys.executable, "-c", "import kvcached_core._native"],
                         env={**os.environ, "KVCACHED_FAULTS": "map:x:fail"},
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "KVCachedConfigError" in bad.stderr
    assert "KVCACHED_FAULTS" in bad.stderr


def test_nth_map_fails_as_out_of_memory_and_maps_nothing():
    mapper = open_mapper("cpu", PAGE)
    a, b = mapper.reserve(4 * PAGE), mapper.reserve(4 * PAGE)
    faults.configure("map:2:fail")
    mapper.map([a, b], [0])
    with pytest.raises(DeviceOutOfMemoryError, match="injected fault.*map call 2"):
        mapper.map([a, b], [1, 2])
    assert [a.is_mapped(p) or b.is_mapped(p) for p in (1, 2)] == [False, False]
    mapper.map([a, b], [1, 2])  # call 3: past the rule
    assert faults.counts()["map"] == 3 and mapper.stats().mapped_pages == 6


def test_failed_handle_create_is_a_scheduling_miss_and_the_allocator_recovers():
    layout = KVLayout(2, 8 * PAGE, PAGE, 2, False)
    kv = KVTensors.open("cpu", layout)
    pa = PageAllocator(kv, settings=QUIET)
    try:
        first = pa.alloc_pages(1)
        before = pa.stats()
        # The page's first handle is created, its second is refused: the map rolls back.
        faults.configure("create:2:fail")
        assert pa.alloc_pages(2) is None
        assert pa.stats() == before and kv.mapped_pages == len(first)
        assert kv.mapper.stats().mapped_pages == len(first) * kv.handles_per_page
        time.sleep(0.15)  # after an out-of-memory the allocator trusts only a fresh reading
        got = pa.alloc_pages(2)
        assert got is not None and len(got) == 2 and faults.counts()["create"] > 2
        pa.free_pages(first + got)
    finally:
        pa.close()


def test_stall_delays_the_call_then_it_succeeds():
    mapper = open_mapper("cpu", PAGE)
    t = mapper.reserve(2 * PAGE)
    faults.configure("map:1:stall=0.3")
    t0 = time.monotonic()
    mapper.map([t], [0])
    assert time.monotonic() - t0 >= 0.3 and t.is_mapped(0)


def test_configure_none_disarms_every_site():
    faults.configure("map:1+:fail,call:1+:fail")
    assert _native._faults_armed() and faults.ACTIVE is not None
    faults.configure(None)
    assert not _native._faults_armed() and faults.ACTIVE is None
    mapper = open_mapper("cpu", PAGE)
    t = mapper.reserve(PAGE)
    mapper.map([t], [0])
    assert t.is_mapped(0)
