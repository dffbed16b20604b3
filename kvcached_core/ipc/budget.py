"""One KV memory budget per device, shared by every pool of every engine of one user.

Every page allocator that maps KV memory on a device holds a *slot* in the
device's budget record, a small file ``kvcached-budget.u<uid>.<device>`` in the
shared-memory directory (:func:`~kvcached_core.ipc.shm.shm_dir`), mode 0600.
Before mapping fresh pages an allocator *claims* their bytes; after unmapping
it *releases* them. A claim is one ``flock``-protected read-sum-check-add, so
the bytes mapped by all slots together never exceed the capacity, whatever the
interleaving of processes and threads. A slot whose process is gone (checked by
pid and process start time) is reclaimed by the next claim that would fail or
the next attach.

A claim that fails raises *pressure*: the wanted bytes, the requesting slot and
a new pressure generation. Every other allocator's background thread reads the
generation (an 8-byte load from the mapping, no system call) at ~20 Hz, and
when it moved gives back, cheapest first, until the record has room for what
was wanted: its mapped reserve and spare handles, then whole pages of
evictable prefix cache through its engine adapter's hook. The requester
retries on its next scheduling step.

Layout (native byte order, int64 words)::

    word  0     magic b"KVCBUDG\\0"
    word  1     version u32, size u32
    word  2     capacity        bytes all slots may map; -1: no budget
    word  3     capacity_gen    bumped on every capacity write
    word  4     pressure_gen    bumped on every failed claim
    word  5     pressure_bytes  what the last failed claim asked for
    word  6     pressure_slot   the slot that raised it
    word  7     pressure_pid
    word  8     pressure_ns     CLOCK_REALTIME of the last failed claim
    word  9     device_total    bytes of the device (0: unknown)
    bytes 128..191              device key, NUL padded
    from byte 256: MAX_SLOTS slots of 192 bytes:
      word 0 pid (0: free)   1 process start time   2 mapped bytes   3 heartbeat_ns
      word 4 failed claims (a waiting retry counts too)
      word 5 bytes given back   6 givebacks   7 last giveback latency ns
      word 8 max giveback latency ns                9 pressure gen last answered
      bytes 128..191 "namespace/pool", NUL padded

Concurrency: writers of capacity, slots' pid / mapped and the pressure words
hold the file's ``flock`` (and, within one process, a thread lock: ``flock``
does not exclude two threads sharing one open file). The statistics words of
a slot are written by its owner only. Every access is one aligned 8-byte copy.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvcached_core.errors import IPCError, KVCachedConfigError
from kvcached_core.ipc import paths
from kvcached_core.ipc.shm import MappedRecord, read_records, shm_dir, text_field

__all__ = [
    "BUDGET_PREFIX",
    "FRUITLESS_WAIT_PAUSE_S",
    "NO_BUDGET",
    "BudgetReading",
    "BudgetRecord",
    "BudgetSlot",
    "SlotReading",
    "budget_path",
    "device_key",
    "list_budgets",
]

MAGIC = b"KVCBUDG\0"
VERSION = 1
MAX_SLOTS = 64
_HEAD_BYTES = 256
_SLOT_BYTES = 192
SIZE = _HEAD_BYTES + MAX_SLOTS * _SLOT_BYTES
NO_BUDGET = -1
BUDGET_PREFIX = "kvcached-budget."
#: After a :meth:`BudgetSlot.claim_waiting` that got nothing, its misses return at once
#: for this long.
FRUITLESS_WAIT_PAUSE_S = 1.0

(_CAP, _CAP_GEN, _P_GEN, _P_BYTES, _P_SLOT, _P_PID, _P_NS, _DEV_TOTAL) = range(2, 10)
_OFF_DEV, _NAME = 128, 64
# slot words
(_S_PID, _S_START, _S_MAPPED, _S_BEAT, _S_MISSES, _S_GIVEN, _S_GIVES, _S_LAST_LAT,
 _S_MAX_LAT, _S_ANSWERED) = range(10)
_S_WORDS = _SLOT_BYTES // 8
_S_NAME = 128


def device_key(backend: str, index: int = 0) -> str:
    """The budget key of a device: ``host`` for CPU memory, else backend and physical index.

    GPU indices are mapped through ``CUDA_VISIBLE_DEVICES`` / ``HIP_VISIBLE_DEVICES``
    when those list plain numbers, so engines that see the same GPU under
    different local indices share its budget. ``KVCACHED_BUDGET_DEVICE``
    overrides the key (e.g. a GPU's UUID).
    """
    explicit = os.environ.get("KVCACHED_BUDGET_DEVICE", "").strip()
    if explicit:
        return paths.check_name(explicit, "KVCACHED_BUDGET_DEVICE")
    if backend in ("host", "cpu"):
        return "host"
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        visible = [v.strip() for v in os.environ.get(var, "").split(",") if v.strip()]
        if visible and index < len(visible) and visible[index].isdigit():
            index = int(visible[index])
            break
    return f"{backend}{index}"


def budget_path(key: str, directory: str | os.PathLike[str] | None = None) -> Path:
    """The record file of device ``key`` for this user."""
    paths.check_name(key, "budget device key")
    root = Path(directory) if directory is not None else shm_dir()
    return root / f"{BUDGET_PREFIX}u{os.getuid()}.{key}"


def _alive(pid: int, start: int) -> bool:
    now = paths.process_start(pid)
    return now is not None and (start == 0 or now == 0 or now == start)


@dataclass(frozen=True)
class SlotReading:
    """One slot of a budget record."""

    slot: int
    pid: int
    name: str
    mapped: int
    alive: bool
    heartbeat_ns: int
    misses: int
    given_bytes: int
    givebacks: int
    last_giveback_ns: int
    max_giveback_ns: int


@dataclass(frozen=True)
class BudgetReading:
    """A budget record at one instant."""

    path: str
    device: str
    capacity: int
    device_total: int
    mapped: int
    pressure_gen: int
    pressure_bytes: int
    pressure_slot: int
    pressure_ns: int
    slots: tuple[SlotReading, ...]

    @property
    def has_budget(self) -> bool:
        return self.capacity != NO_BUDGET


class BudgetRecord(MappedRecord):
    """An open budget record (created if missing). Use :meth:`open`.

    Raises:
        IPCError: The file is a link, another user's, or not a budget record of
            this version.
    """

    def __init__(self, path: Path, fd: int, mm: mmap.mmap) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self._w = memoryview(mm).cast("q")
        self._tlock = threading.Lock()

    @classmethod
    def open(cls, key: str, directory: str | os.PathLike[str] | None = None, *,
             create: bool = True) -> BudgetRecord:
        """Open (and with ``create`` make) the record of device ``key``."""
        return cls._open(budget_path(key, directory), os.O_CREAT if create else 0, key)

    @classmethod
    def open_path(cls, path: str | os.PathLike[str]) -> BudgetRecord:
        """Open an existing record by its file name (``kvctl``)."""
        return cls._open(Path(path), 0, None)

    @classmethod
    def _open(cls, path: Path, flags: int, key: str | None) -> BudgetRecord:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | flags, 0o600)
        except OSError as exc:
            raise IPCError(f"cannot open budget record {path}: {exc.strerror or exc}") from exc
        try:
            return cls._attach(path, fd, key)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _attach(cls, path: Path, fd: int, key: str | None) -> BudgetRecord:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise IPCError(f"{path} is not a regular file of this user; not a budget record")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(fd).st_size
            if size == 0 and key is not None:  # new: lay it out under the lock
                os.ftruncate(fd, SIZE)
                mm = mmap.mmap(fd, SIZE)
                w = memoryview(mm).cast("q")
                w[_CAP] = NO_BUDGET
                mm[_OFF_DEV:_OFF_DEV + _NAME] = key.encode().ljust(_NAME, b"\0")
                struct.pack_into("=II", mm, 8, VERSION, SIZE)
                mm[0:8] = MAGIC
                w.release()
            elif size < SIZE:
                raise IPCError(f"{path} is {size} bytes: a corrupt or foreign budget record "
                               "(remove it when no engine runs)")
            else:
                mm = mmap.mmap(fd, SIZE)
            magic, version = bytes(mm[0:8]), struct.unpack_from("=I", mm, 8)[0]
            if magic != MAGIC or version != VERSION:
                mm.close()
                raise IPCError(f"{path} is not a kvcached budget record of version {VERSION} "
                               f"(magic {magic!r}, version {version}); remove it when no "
                               "engine runs")
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return cls(path, fd, mm)

    # ------------------------------------------------------------ locking

    @contextmanager
    def locked(self) -> Iterator[memoryview]:
        """The record's words under its lock (thread and process)."""
        with self._tlock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield self._w
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _slot_base(self, slot: int) -> int:
        return (_HEAD_BYTES + slot * _SLOT_BYTES) // 8

    def _sum_locked(self, w: memoryview, reclaim: bool) -> int:
        total = 0
        for s in range(MAX_SLOTS):
            b = self._slot_base(s)
            pid = w[b + _S_PID]
            if not pid:
                continue
            if reclaim and not _alive(pid, w[b + _S_START]):
                w[b + _S_MAPPED] = 0
                w[b + _S_PID] = 0
                continue
            total += w[b + _S_MAPPED]
        return total

    # ------------------------------------------------------------ capacity

    @property
    def capacity(self) -> int:
        """Bytes all slots together may map, or :data:`NO_BUDGET`."""
        return self._w[_CAP]

    @property
    def device_total(self) -> int:
        return self._w[_DEV_TOTAL]

    def set_capacity(self, capacity: int) -> None:
        """Set the budget (bytes, or :data:`NO_BUDGET`). Lowering it never unmaps by itself:
        pools over it can only shrink, and the next failed claim asks them to give back."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or (
                capacity < 0 and capacity != NO_BUDGET):
            raise KVCachedConfigError(f"budget {capacity!r} is not a byte count >= 0")
        with self.locked() as w:
            w[_CAP] = capacity
            w[_CAP_GEN] += 1

    def set_device_total(self, total: int) -> None:
        if total > 0:
            self._w[_DEV_TOTAL] = total

    # ------------------------------------------------------------ slots

    def join(self, name: str) -> BudgetSlot:
        """Take a slot for one pool of this process (dead processes' slots are reclaimed).

        Raises:
            IPCError: Every slot belongs to a live pool.
        """
        pid = os.getpid()
        start = paths.process_start(pid) or 0
        raw = name.encode()[:_NAME - 1].ljust(_NAME, b"\0")
        with self.locked() as w:
            self._sum_locked(w, reclaim=True)
            for s in range(MAX_SLOTS):
                b = self._slot_base(s)
                if w[b + _S_PID] == 0:
                    for i in range(_S_WORDS):
                        w[b + i] = 0
                    off = (_HEAD_BYTES + s * _SLOT_BYTES) + _S_NAME
                    self._mm[off:off + _NAME] = raw
                    w[b + _S_START] = start
                    w[b + _S_BEAT] = time.time_ns()
                    w[b + _S_ANSWERED] = w[_P_GEN]
                    w[b + _S_PID] = pid
                    return BudgetSlot(self, s, pid)
        raise IPCError(f"budget record {self.path}: all {MAX_SLOTS} slots belong to live pools")

    def read(self) -> BudgetReading:
        """A snapshot (taken under the lock, so slot sums are consistent)."""
        mm = self._mm
        with self.locked() as w:
            slots = []
            for s in range(MAX_SLOTS):
                b = self._slot_base(s)
                pid = w[b + _S_PID]
                if not pid:
                    continue
                off = _HEAD_BYTES + s * _SLOT_BYTES + _S_NAME
                slots.append(SlotReading(
                    slot=s, pid=pid, name=text_field(mm[off:off + _NAME]), mapped=w[b + _S_MAPPED],
                    alive=_alive(pid, w[b + _S_START]), heartbeat_ns=w[b + _S_BEAT],
                    misses=w[b + _S_MISSES], given_bytes=w[b + _S_GIVEN],
                    givebacks=w[b + _S_GIVES], last_giveback_ns=w[b + _S_LAST_LAT],
                    max_giveback_ns=w[b + _S_MAX_LAT]))
            return BudgetReading(
                path=os.fspath(self.path), device=text_field(mm[_OFF_DEV:_OFF_DEV + _NAME]),
                capacity=w[_CAP], device_total=w[_DEV_TOTAL],
                mapped=sum(s.mapped for s in slots if s.alive), pressure_gen=w[_P_GEN],
                pressure_bytes=w[_P_BYTES], pressure_slot=w[_P_SLOT], pressure_ns=w[_P_NS],
                slots=tuple(slots))



def _leave(record: BudgetRecord, slot: int, pid: int) -> None:
    if os.getpid() != pid or record._fd < 0:
        return
    try:
        with record.locked() as w:
            b = record._slot_base(slot)
            if w[b + _S_PID] == pid:
                w[b + _S_MAPPED] = 0
                w[b + _S_PID] = 0
    except (OSError, ValueError):
        pass


class BudgetSlot:
    """One pool's share of a device budget: what a :class:`PageAllocator` claims through.

    Thread-safe. After ``fork()`` the child must not use it (its claims would be
    the parent's).
    """

    def __init__(self, record: BudgetRecord, slot: int, pid: int) -> None:
        self.record = record
        self.slot = slot
        self._pid = pid
        self._base = record._slot_base(slot)
        self._finalizer = weakref.finalize(self, _leave, record, slot, pid)
        self._wait_again_at = 0.0  # claim_waiting: no wait before (monotonic seconds)

    def __repr__(self) -> str:
        return f"<BudgetSlot {self.record.path.name}#{self.slot} mapped={self.mapped}>"

    @property
    def mapped(self) -> int:
        return self.record._w[self._base + _S_MAPPED]

    @property
    def capacity(self) -> int:
        return self.record.capacity

    def claim(self, nbytes: int, *, pressure: bool = True) -> bool:
        """Count ``nbytes`` more as mapped by this slot, if the budget has room.

        On ``False`` (and with ``pressure``) the shortfall is announced to the
        other pools, which give memory back.
        """
        if nbytes <= 0:
            return True
        rec = self.record
        with rec.locked() as w:
            cap = w[_CAP]
            if cap == NO_BUDGET:
                w[self._base + _S_MAPPED] += nbytes
                return True
            used = rec._sum_locked(w, reclaim=False)
            if used + nbytes > cap:
                used = rec._sum_locked(w, reclaim=True)  # a dead pool's bytes come back
            if used + nbytes <= cap:
                w[self._base + _S_MAPPED] += nbytes
                return True
            w[self._base + _S_MISSES] += 1
            if pressure:
                w[_P_BYTES] = nbytes
                w[_P_SLOT] = self.slot
                w[_P_PID] = self._pid
                w[_P_NS] = time.time_ns()
                w[_P_GEN] += 1
                w[self._base + _S_ANSWERED] = w[_P_GEN]  # never answer one's own
            return False

    def claim_waiting(self, nbytes: int, timeout: float) -> bool:
        """:meth:`claim`; on a miss while other pools hold memory, retry until they gave
        enough back or ``timeout`` passed (the ask went out with the first try).

        A wait that got nothing means the others hold memory they cannot give (pages in
        use): for :data:`FRUITLESS_WAIT_PAUSE_S` after it a miss returns at once, so an
        engine asking for a page at every scheduling step does not wait at every one.
        """
        if self.claim(nbytes):
            return True
        if (timeout <= 0 or time.monotonic() < self._wait_again_at
                or self.others_mapped() < nbytes):
            return False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.002)
            if self.claim(nbytes, pressure=False):
                return True
        self._wait_again_at = time.monotonic() + FRUITLESS_WAIT_PAUSE_S
        return False

    def others_mapped(self) -> int:
        """Bytes the other live slots have mapped (what giveback could yield at most)."""
        rec = self.record
        with rec.locked() as w:
            return rec._sum_locked(w, reclaim=True) - w[self._base + _S_MAPPED]

    def release(self, nbytes: int) -> None:
        """Count ``nbytes`` fewer as mapped (after unmapping them)."""
        if nbytes <= 0:
            return
        with self.record.locked() as w:
            b = self._base + _S_MAPPED
            w[b] = max(0, w[b] - nbytes)

    def room(self) -> int:
        """Bytes the budget can still grant (a large number when there is none)."""
        rec = self.record
        with rec.locked() as w:
            cap = w[_CAP]
            if cap == NO_BUDGET:
                return 1 << 62
            return cap - rec._sum_locked(w, reclaim=False)

    # ------------------------------------------------------------ pressure

    def pending_pressure(self) -> int:
        """A pressure generation this slot has not answered, or 0 (no system call)."""
        w = self.record._w
        gen = w[_P_GEN]
        return gen if gen != w[self._base + _S_ANSWERED] else 0

    def pressure(self) -> tuple[int, int, int, int]:
        """``(generation, wanted bytes, requesting slot, raised at ns)`` of the last miss."""
        w = self.record._w
        return w[_P_GEN], w[_P_BYTES], w[_P_SLOT], w[_P_NS]

    def answered(self, gen: int, given: int, raised_ns: int) -> None:
        """Record that this slot answered pressure ``gen`` by giving back ``given`` bytes."""
        w = self.record._w
        b = self._base
        w[b + _S_ANSWERED] = gen
        now = time.time_ns()
        w[b + _S_BEAT] = now
        if given > 0:
            lat = max(0, now - raised_ns)
            w[b + _S_GIVEN] += given
            w[b + _S_GIVES] += 1
            w[b + _S_LAST_LAT] = lat
            if lat > w[b + _S_MAX_LAT]:
                w[b + _S_MAX_LAT] = lat

    def heartbeat(self) -> None:
        self.record._w[self._base + _S_BEAT] = time.time_ns()

    def close(self) -> None:
        """Free the slot (its bytes stop counting); idempotent."""
        self._finalizer()


def list_budgets(directory: str | os.PathLike[str] | None = None) -> list[BudgetReading]:
    """Every readable budget record of this user; foreign or corrupt files are skipped."""
    return read_records(directory, f"{BUDGET_PREFIX}u{os.getuid()}.", BudgetRecord.open_path)
