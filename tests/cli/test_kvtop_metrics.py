"""kvtop, kvctl status and the Prometheus collector over real shared-memory records,
and the publisher that times a real page allocator's map / unmap calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcached_core.ipc.budget import BudgetRecord
from kvcached_core.ipc.shm import LATENCY_BUCKETS, SIZE, PoolSegment, list_pools

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(module: str, *args: str, shm_dir) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVCACHED_SHM_DIR=str(shm_dir), PYTHONPATH=REPO, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                          text=True, env=env, timeout=60)


def kvctl(*args: str, shm_dir) -> subprocess.CompletedProcess:
    return run("kvcached_core.cli.kvctl", *args, shm_dir=shm_dir)


@pytest.fixture
def engines(tmp_path):
    """Two engines' pools on the host budget, one with a limit and timed maps."""
    tmp_path.chmod(0o700)
    rec = BudgetRecord.open("host", tmp_path)
    rec.set_capacity(64 << 20)
    a = PoolSegment.create("engine-a", "kv0", capacity=1 << 30, directory=tmp_path)
    b = PoolSegment.create("engine-b", "mha-tp0", capacity=1 << 30, directory=tmp_path)
    slot = rec.join("engine-a/kv0")
    slot.claim(8 << 20)
    a.update(used=6 << 20, reserved=2 << 20)
    a.observe("map", 0.0004, 8 << 20)
    a.observe("map", 0.003, 2 << 20)
    a.observe("unmap", 2.0, 2 << 20)
    b.update(used=4 << 20, reserved=0)
    b.set_limit(16 << 20)
    yield tmp_path, a, b
    slot.close()
    a.close()
    b.close()
    rec.close()


def test_segment_histograms_and_totals(engines):
    tmp, a, _b = engines
    (p,) = list_pools("engine-a", directory=tmp)
    assert p.mapped == 8 << 20 and p.map_bytes == 10 << 20 and p.unmap_bytes == 2 << 20
    assert p.map_latency.count == 2 and p.map_latency.sum_ns == 3_400_000
    cum = dict(p.map_latency.cumulative())
    assert cum[5e-4] == 1 and cum[5e-3] == 2 and cum[float("inf")] == 2
    assert p.unmap_latency.buckets[-1] == 1  # above the last bound: +Inf
    assert len(p.map_latency.buckets) == len(LATENCY_BUCKETS) + 1


def test_old_256_byte_segment_still_reads(tmp_path):
    seg = PoolSegment.create("old", "kv0", capacity=100, directory=tmp_path)
    seg.update(used=10, reserved=5)
    seg.close(unlink=False)
    path = tmp_path / "kvcached.old.kv0"
    data = bytearray(path.read_bytes()[:256])
    data[12:16] = (256).to_bytes(4, sys.byteorder)  # the size field of the older layout
    path.write_bytes(bytes(data))
    (p,) = list_pools(directory=tmp_path)
    assert (p.used, p.reserved, p.mapped, p.map_latency.count) == (10, 5, 15, 0)
    assert SIZE == 512


def test_status_json_groups_pools_by_device_and_engine(engines):
    tmp, _a, _b = engines
    out = kvctl("status", "--json", shm_dir=tmp)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    devices = {d["device"]: d for d in snap["devices"]}
    host = devices["host"]
    assert host["budget"] == 64 << 20 and host["budget_mapped"] == 8 << 20
    (eng,) = host["engines"]
    assert eng["namespace"] == "engine-a" and eng["mapped"] == 8 << 20
    assert eng["pools"][0]["map_latency"]["count"] == 2
    other = devices["-"]["engines"][0]  # no budget slot: listed under "-"
    assert other["namespace"] == "engine-b" and other["pools"][0]["limit"] == 16 << 20
    text = kvctl("status", shm_dir=tmp).stdout
    assert "device host" in text and "engine engine-b" in text and "2 maps" in text


def test_limit_and_budget_and_list_speak_json(engines):
    tmp, _a, b = engines
    out = kvctl("limit", "engine-b", "mha-tp0", "8M", "--json", shm_dir=tmp)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["limit"] == 8 << 20 and b.poll_limit() == 8 << 20
    listed = json.loads(kvctl("list", "--json", shm_dir=tmp).stdout)["pools"]
    assert {p["pool"]: p["mapped"] for p in listed} == {"kv0": 8 << 20, "mha-tp0": 4 << 20}
    budgets = json.loads(kvctl("budget", "--json", shm_dir=tmp).stdout)["budgets"]
    assert budgets[0]["device"] == "host"


def test_unknown_names_and_stale_records_get_clear_messages(engines):
    tmp, a, _b = engines
    out = kvctl("status", "--namespace", "nobody", shm_dir=tmp)
    assert out.returncode == 2 and "no live pool in namespace nobody" in out.stderr
    out = kvctl("status", "--namespace", "../etc", shm_dir=tmp)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    out = kvctl("limit", "engine-a", "nope", "1G", "--json", shm_dir=tmp)
    assert out.returncode == 2 and "no pool nope" in out.stderr
    out = run("kvcached_core.cli.kvtop", "--once", "--namespace", "nobody", shm_dir=tmp)
    assert out.returncode == 2 and "no live pool" in out.stderr
    # A foreign file and a dead engine's record beside the live ones.
    (tmp / "kvcached.junk.kv0").write_bytes(b"x" * 600)
    dead = subprocess.run(
        [sys.executable, "-c", "import sys; from kvcached_core.ipc.shm import PoolSegment; "
         f"s = PoolSegment.create('gone', 'kv0', directory={str(tmp)!r}); "
         "s.close(unlink=False)"], env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    assert dead.returncode == 0
    snap = json.loads(kvctl("status", "--json", shm_dir=tmp).stdout)
    assert [s["namespace"] for s in snap["stale"]] == ["gone"]
    assert "kvctl status --remove-stale" in kvctl("status", shm_dir=tmp).stdout
    cleaned = json.loads(kvctl("status", "--json", "--remove-stale", shm_dir=tmp).stdout)
    assert cleaned["stale"] == [] and len(cleaned["removed"]) == 1
    assert a.read().alive  # the live engines' records are untouched
    assert len(list_pools(directory=tmp)) == 2


def test_kvtop_once_reads_shared_memory_only(engines):
    pytest.importorskip("rich")
    tmp, _a, _b = engines
    probe = ("import sys; from kvcached_core.cli.kvtop import main; rc = main(['--once']); "
             "maps = open('/proc/self/maps').read(); "
             "assert 'torch' not in sys.modules and 'libcuda' not in maps "
             "and 'libamdhip' not in maps; "
             "sys.exit(rc)")
    env = dict(os.environ, KVCACHED_SHM_DIR=str(tmp), PYTHONPATH=REPO, COLUMNS="200")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for word in ("device host", "engine-a", "engine-b", "mha-tp0", "16.0 MiB", "budget 64.0 MiB"):
        assert word in out.stdout, out.stdout


def test_map_rate_between_snapshots(engines):
    from kvcached_core.cli.view import rates, snapshot

    tmp, a, _b = engines
    first = snapshot(directory=tmp)
    a.observe("map", 0.001, 4 << 20)
    second = snapshot(directory=tmp)
    second["time_ns"] = first["time_ns"] + 2_000_000_000
    assert rates(first, second)[("engine-a", "kv0")] == 2 << 20


def test_prometheus_collector(engines):
    prom = pytest.importorskip("prometheus_client")
    from kvcached_core.metrics import register

    tmp, _a, _b = engines
    registry = prom.CollectorRegistry()
    assert register(registry, directory=tmp) is register(registry, directory=tmp)  # once
    text = prom.generate_latest(registry).decode()
    assert 'kvcached_pool_mapped_bytes{namespace="engine-a",pool="kv0"} 8.388608e+06' in text
    assert 'kvcached_pool_limit_bytes{namespace="engine-b",pool="mha-tp0"} 1.6777216e+07' in text
    assert ('kvcached_pool_map_latency_seconds_bucket{le="0.0005",namespace="engine-a",'
            'pool="kv0"} 1.0') in text
    assert 'kvcached_pool_map_latency_seconds_count{namespace="engine-a",pool="kv0"} 2.0' in text
    assert 'kvcached_pool_unmap_bytes_total{namespace="engine-a",pool="kv0"} 2.097152e+06' in text
    assert 'kvcached_budget_capacity_bytes{device="host"} 6.7108864e+07' in text
    assert 'kvcached_budget_mapped_bytes{device="host"} 8.388608e+06' in text


def test_publisher_times_a_real_allocators_maps(tmp_path):
    from kvcached_core.allocator import KVLayout, KVTensors, PageAllocator
    from kvcached_core.config import load_settings
    from kvcached_core.ipc.publish import publish_pool

    tmp_path.chmod(0o700)
    layout = KVLayout(num_layers=1, buffer_bytes=8 << 20, page_size=2 << 20, num_buffers=1)
    kv = KVTensors.open("cpu", layout)
    pages = PageAllocator(kv, settings=load_settings(idle_trim_s=0))
    seg = PoolSegment.create("pub", "kv0", capacity=layout.total_bytes, directory=tmp_path)
    try:
        pages.watch_limit(publish_pool(kv, pages, seg))
        import time

        got = pages.alloc_pages(2)
        assert got is not None
        deadline = time.monotonic() + 5  # allocations from the reserve: the next poll
        while seg.read().used != 2 * layout.page_bytes and time.monotonic() < deadline:
            time.sleep(0.02)
        st = seg.read()
        assert st.map_latency.count >= 1 and st.map_bytes >= 2 * layout.page_bytes
        assert st.used == 2 * layout.page_bytes and st.mapped >= st.used
        seg.set_limit(0)
        pages.free_pages(got)
        deadline = time.monotonic() + 5
        while seg.read().unmap_latency.count == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        st = seg.read()
        assert st.unmap_latency.count >= 1 and st.used == 0
    finally:
        pages.close()
        seg.close()


def test_publishing_a_backing_again_times_its_calls_once_into_the_new_segment():
    """The backing records which publisher its timed calls report to (its own state), so a
    second ``publish_pool`` neither stacks the timers nor leaves them on the old segment."""
    from types import SimpleNamespace

    from kvcached_core.ipc.publish import publish_pool

    class Backing:
        page_bytes = 4096

        def __init__(self) -> None:
            self.mapped: list[list[int]] = []

        def map_pages(self, page_ids):
            self.mapped.append(list(page_ids))

        def unmap_pages(self, page_ids):
            pass

    class Pages:
        def stats(self):
            return SimpleNamespace(in_use=0, reserved=0, page_bytes=4096, mapped_bytes=0)

    class Segment:
        def __init__(self) -> None:
            self.observed: list[tuple] = []

        def observe(self, *observed) -> None:
            self.observed.append(observed)

        def update(self, **_figures) -> None:
            pass

    backing, first, second = Backing(), Segment(), Segment()
    publish_pool(backing, Pages(), first)
    publish_pool(backing, Pages(), second)
    backing.map_pages([1, 2])
    assert backing.mapped == [[1, 2]]
    assert first.observed == []
    assert [(kind, size) for kind, _seconds, size in second.observed] == [("map", 2 * 4096)]
