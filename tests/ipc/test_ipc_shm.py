"""Per-pool shared-memory segments: owner, readers, limit writers, discovery."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import time

import pytest

from kvcached_core.errors import IPCError, KVCachedConfigError
from kvcached_core.ipc import shm

_CTX = mp.get_context("spawn")


def _set_limit_elsewhere(directory: str, namespace: str, pool: str, limit: int) -> None:
    shm.set_limit(namespace, pool, limit, directory)


def _orphan(directory: str, namespace: str, pool: str) -> None:
    seg = shm.PoolSegment.create(namespace, pool, capacity=1, directory=directory)
    os._exit(0 if seg else 1)  # no close, no finalizer: the segment is left behind


def _hammer(directory: str, namespace: str, pool: str, seconds: float) -> None:
    seg = shm.PoolSegment.create(namespace, pool, directory=directory)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
        seg.update(used=i, reserved=i, capacity=i)
    seg.close()


def _run(target, *args) -> int:
    proc = _CTX.Process(target=target, args=args)
    proc.start()
    proc.join(30)
    return proc.exitcode


def test_create_update_read_close(shm_base):
    seg = shm.PoolSegment.create("eng", "g0", capacity=1 << 30, limit=512 << 20)
    path = shm_base / "kvcached.eng.g0"
    assert seg.path == path and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    seg.update(used=4 << 20, reserved=2 << 20)
    with shm.open_pool("eng", "g0") as view:
        s = view.read()
    assert (s.namespace, s.pool, s.pid, s.alive) == ("eng", "g0", os.getpid(), True)
    assert (s.used, s.reserved, s.capacity, s.limit) == (4 << 20, 2 << 20, 1 << 30, 512 << 20)
    assert s.has_limit and s.updated_ns >= s.created_ns
    seg.update(used=0)
    assert seg.read().used == 0 and seg.read().reserved == 2 << 20
    seg.close()
    assert not path.exists()
    seg.close()  # idempotent
    with pytest.raises(IPCError, match="cannot open segment"):
        shm.open_pool("eng", "g0")


def test_one_segment_per_pool_and_discovery(shm_base):
    a0 = shm.PoolSegment.create("a", "g0")
    a1 = shm.PoolSegment.create("a", "g1")
    b0 = shm.PoolSegment.create("b", "g0")
    (shm_base / "kvcached.junk.x").write_bytes(b"\0" * 300)  # no magic
    (shm_base / "kvcached.short.x").write_bytes(b"KVCPOOL\0")  # too small
    (shm_base / "unrelated").write_bytes(b"x" * 300)
    try:
        assert [(s.namespace, s.pool) for s in shm.list_pools()] == [
            ("a", "g0"), ("a", "g1"), ("b", "g0")]
        assert [s.pool for s in shm.list_pools("a")] == ["g0", "g1"]
        a1.update(used=7)
        assert [s.used for s in shm.list_pools("a")] == [0, 7]  # pools do not share fields
        with pytest.raises(IPCError, match="already owned by the live process"):
            shm.PoolSegment.create("a", "g0")
        with pytest.raises(IPCError, match="not a kvcached pool segment"):
            shm.PoolView(shm_base / "kvcached.junk.x")
    finally:
        for seg in (a0, a1, b0):
            seg.close()
    assert shm.list_pools() == []


def test_limit_written_by_another_process_reaches_the_owner(shm_base):
    seg = shm.PoolSegment.create("eng", "g0")
    assert seg.limit == shm.NO_LIMIT and seg.poll_limit() is None
    assert _run(_set_limit_elsewhere, str(shm_base), "eng", "g0", 256 << 20) == 0
    assert seg.poll_limit() == 256 << 20
    assert seg.poll_limit() is None  # seen once
    assert _run(_set_limit_elsewhere, str(shm_base), "eng", "g0", 256 << 20) == 0
    assert seg.poll_limit() == 256 << 20  # the same value again is a new limit
    shm.set_limit("eng", "g0", shm.NO_LIMIT)
    assert seg.poll_limit() == shm.NO_LIMIT and seg.read().limit_gen == 3
    with pytest.raises(ValueError, match="negative"):
        shm.set_limit("eng", "g0", -5)
    seg.close()


def test_segment_of_a_dead_owner_is_stale_and_replaceable(shm_base):
    assert _run(_orphan, str(shm_base), "eng", "old") == 0
    (stale,) = shm.list_pools()
    assert not stale.alive and stale.capacity == 1
    seg = shm.PoolSegment.create("eng", "old", capacity=2)
    assert [s.capacity for s in shm.list_pools()] == [2]
    seg.close()
    assert _run(_orphan, str(shm_base), "eng", "old") == 0
    assert shm.remove_stale() == [str(shm_base / "kvcached.eng.old")]
    assert shm.list_pools() == []


def test_readers_never_see_a_torn_snapshot(shm_base):
    proc = _CTX.Process(target=_hammer, args=(str(shm_base), "eng", "hot", 1.0))
    proc.start()
    deadline = time.monotonic() + 20
    while not shm.list_pools() and time.monotonic() < deadline:
        time.sleep(0.01)
    reads = 0
    with shm.open_pool("eng", "hot") as view:
        while proc.is_alive() and reads < 200_000:
            s = view.read()
            assert s.used == s.reserved == s.capacity
            reads += 1
    proc.join(30)
    assert proc.exitcode == 0 and reads > 100


def test_forked_child_does_not_unlink_the_parents_segment(shm_base):
    seg = shm.PoolSegment.create("eng", "g0")
    pid = os.fork()
    if pid == 0:
        seg.close()
        os._exit(0)
    os.waitpid(pid, 0)
    assert seg.path.exists()
    seg.close()
    assert not seg.path.exists()


def test_names_are_checked(shm_base):
    with pytest.raises(KVCachedConfigError, match="pool name"):
        shm.PoolSegment.create("eng", "../x")
    with pytest.raises(KVCachedConfigError, match="longer than 64"):
        shm.PoolSegment.create("e" * 65, "g0")


def test_default_directory_is_dev_shm(monkeypatch):
    monkeypatch.delenv("KVCACHED_SHM_DIR", raising=False)
    if os.path.isdir("/dev/shm"):
        assert str(shm.shm_dir()) == "/dev/shm"
