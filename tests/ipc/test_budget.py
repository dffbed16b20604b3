"""The device budget record: atomic claims across processes, dead pools' bytes, bad files."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat

import pytest

from kvcached_core.errors import IPCError, KVCachedConfigError
from kvcached_core.ipc import budget as bud

_CTX = mp.get_context("spawn")
MiB = 1 << 20


def _racer(directory: str, name: str, chunk: int, tries: int, go, out) -> None:
    """Claim ``chunk`` bytes ``tries`` times as fast as possible; report (granted, missed)."""
    rec = bud.BudgetRecord.open("host", directory)
    slot = rec.join(name)
    go.wait(timeout=60)
    granted = missed = 0
    for _ in range(tries):
        if slot.claim(chunk):
            granted += 1
        else:
            missed += 1
    out.put((name, granted, missed))
    go.wait(timeout=60)  # hold the slot until the parent has read the record


def test_two_processes_racing_for_the_last_pages_never_overdraw(shm_base):
    rec = bud.BudgetRecord.open("host", shm_base)
    rec.set_capacity(10 * MiB)
    go, out = _CTX.Barrier(3), _CTX.Queue()
    procs = [_CTX.Process(target=_racer, args=(str(shm_base), n, 2 * MiB, 4, go, out))
             for n in ("a/kv0", "b/kv0")]
    for p in procs:
        p.start()
    try:  # a child that dies breaks the barrier (timeout) instead of hanging the suite
        go.wait(timeout=60)
        results = sorted(out.get(timeout=60) for _ in procs)
        reading = rec.read()
        go.wait(timeout=60)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert [p.exitcode for p in procs] == [0, 0]
    granted = sum(r[1] for r in results)
    missed = sum(r[2] for r in results)
    assert granted == 5 and missed == 3  # 10 MiB / 2 MiB, the other claims miss
    assert reading.mapped == 10 * MiB == sum(s.mapped for s in reading.slots)
    assert reading.pressure_gen >= 1 and reading.pressure_bytes == 2 * MiB
    assert sum(s.misses for s in reading.slots) == 3
    assert rec.read().slots == ()  # both left (their finalizers freed the slots)
    rec.close()


def _claim_and_die(directory: str, nbytes: int, ready) -> None:
    slot = bud.BudgetRecord.open("host", directory).join("dead/kv0")
    assert slot.claim(nbytes)
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_pools_bytes_are_reclaimed(shm_base):
    rec = bud.BudgetRecord.open("host", shm_base)
    rec.set_capacity(8 * MiB)
    ready = _CTX.Event()
    p = _CTX.Process(target=_claim_and_die, args=(str(shm_base), 6 * MiB, ready))
    p.start()
    assert ready.wait(60)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    (dead,) = rec.read().slots
    assert dead.mapped == 6 * MiB and not dead.alive
    live = rec.join("live/kv0")
    assert live.claim(8 * MiB)  # only possible with the dead slot's 6 MiB back
    (only,) = rec.read().slots
    assert only.name == "live/kv0" and only.mapped == 8 * MiB
    live.close()
    rec.close()


def test_release_pressure_and_own_asks(shm_base):
    rec = bud.BudgetRecord.open("host", shm_base)
    a, b = rec.join("a/kv0"), rec.join("b/kv0")
    assert a.claim(100 * MiB)  # no budget: everything is granted and counted
    rec.set_capacity(104 * MiB)
    assert not b.claim(8 * MiB)
    gen, wanted, slot, raised = b.pressure()
    assert (wanted, slot) == (8 * MiB, b.slot) and raised > 0
    assert a.pending_pressure() == gen and b.pending_pressure() == 0  # never one's own
    a.release(100 * MiB)
    a.answered(gen, 100 * MiB, raised)
    assert a.pending_pressure() == 0 and b.claim(8 * MiB) and b.room() == 96 * MiB
    sa = {s.name: s for s in rec.read().slots}["a/kv0"]
    assert sa.given_bytes == 100 * MiB and sa.givebacks == 1 and sa.max_giveback_ns > 0
    assert not b.claim(1 << 40, pressure=False) and b.pressure()[0] == gen
    a.close(), b.close()
    assert rec.read().mapped == 0
    rec.close()


def test_a_fruitless_wait_is_not_repeated_at_once(shm_base, monkeypatch):
    """Another pool holds memory it does not give back: the first waiting claim waits its
    timeout, the next ones miss at once until the pause is over; a claim with room is
    granted at once throughout."""
    import time

    monkeypatch.setattr(bud, "FRUITLESS_WAIT_PAUSE_S", 0.5)
    rec = bud.BudgetRecord.open("host", shm_base)
    a, b = rec.join("a/kv0"), rec.join("b/kv0")
    rec.set_capacity(16 * MiB)
    assert a.claim(12 * MiB)

    def timed(nbytes: int) -> tuple[bool, float]:
        t0 = time.monotonic()
        got = b.claim_waiting(nbytes, 0.2)
        return got, time.monotonic() - t0

    got, waited = timed(8 * MiB)
    assert not got and waited >= 0.2
    got, waited = timed(8 * MiB)
    assert not got and waited < 0.1
    assert timed(4 * MiB)[0]  # room left: no wait needed
    b.release(4 * MiB)
    time.sleep(0.5)
    got, waited = timed(8 * MiB)
    assert not got and waited >= 0.2  # the pause is over: it waits again
    a.release(12 * MiB)
    assert timed(8 * MiB)[0]
    a.close(), b.close()
    rec.close()


def test_record_is_owner_only_and_bad_files_are_refused(shm_base):
    rec = bud.BudgetRecord.open("cuda0", shm_base)
    path = rec.path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and path.name.endswith(".cuda0")
    with pytest.raises(KVCachedConfigError):
        rec.set_capacity(-5)
    rec.close()
    corrupt = bud.budget_path("host", shm_base)
    corrupt.write_bytes(b"\0" * 100)
    with pytest.raises(IPCError, match="corrupt or foreign"):
        bud.BudgetRecord.open("host", shm_base)
    corrupt.write_bytes(b"X" * bud.SIZE)
    with pytest.raises(IPCError, match="not a kvcached budget record"):
        bud.BudgetRecord.open("host", shm_base)
    link = bud.budget_path("link", shm_base)
    os.symlink(path, link)
    with pytest.raises(IPCError):
        bud.BudgetRecord.open("link", shm_base)
    assert [r.device for r in bud.list_budgets(shm_base)] == ["cuda0"]  # bad ones skipped


def test_device_keys(monkeypatch):
    monkeypatch.delenv("KVCACHED_BUDGET_DEVICE", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert bud.device_key("host") == "host"
    assert bud.device_key("cuda", 1) == "cuda1" and bud.device_key("cuda", 0) == "cuda3"
    monkeypatch.setenv("KVCACHED_BUDGET_DEVICE", "GPU-abc")
    assert bud.device_key("cuda", 0) == "GPU-abc"
