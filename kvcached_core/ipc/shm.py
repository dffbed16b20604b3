"""Per-pool shared-memory segments: limit / used / reserved bytes for ``kvctl`` and ``kvtop``.

Every KV pool (one per engine instance and KV cache group) owns one small
file ``kvcached.<namespace>.<pool>`` in ``/dev/shm`` (or ``$KVCACHED_SHM_DIR``,
or the IPC base directory where there is no ``/dev/shm``), mode 0600. The
owner creates it, updates it without a system call, and unlinks it on
:meth:`PoolSegment.close`. ``kvctl`` and ``kvtop`` find segments by listing the
directory and keeping the files whose magic and version check out.

Layout (native byte order; the file never leaves the machine)::

    offset field        written by
         0 magic        owner, last, once the rest is in place: b"KVCPOOL\\0"
         8 version u32  owner
        12 size u32     owner (bytes of the layout, for forward compatibility)
        16 pid i64      owner
        24 created_ns   owner (CLOCK_REALTIME)
        32 seq u64      owner: seqlock over used..updated_ns (odd while writing)
        40 used i64     owner: bytes of pages in use
        48 reserved i64 owner: bytes mapped ahead of demand
        56 capacity i64 owner: virtual bytes of the pool
        64 updated_ns   owner (CLOCK_REALTIME)
        72 limit i64    kvctl: bytes the pool may map, -1 for none
        80 limit_gen    kvctl: bumped on every limit write
        88 device_total owner: bytes of the pool's device (0: unknown; for kvctl's
                        percentages)
        96 namespace    owner, 64 bytes, NUL padded
       160 pool         owner, 64 bytes, NUL padded
       224 mapped i64   owner: bytes backed now (in use, reserve, in flight), under the
                        seqlock with used..updated_ns
       232 map_bytes    owner: bytes mapped since creation (kvtop's map rate)
       240 unmap_bytes  owner: bytes unmapped since creation
       256 map latency histogram: LATENCY_BUCKETS counts (per bucket, not
           cumulative; the last is +Inf), then sum_ns and count
       384 unmap latency histogram, the same
       512 end (a segment of 256 bytes, from before the histograms, reads as
           mapped = used + reserved and empty histograms)

The histograms time every map and unmap call the pool's allocator makes (a
batch of pages on every worker, measured by the process that maps: the
scheduler of a vLLM engine, the scheduler of each SGLang rank); the owner
writes a bucket, then the sum, then the count, so a reader never sees a count
ahead of its buckets.

Concurrency: the owner is the only writer of the stats block and publishes it
under the seqlock, so a reader gets a consistent (used, reserved, capacity,
updated) snapshot. Limit writers (``kvctl``; rare, maybe concurrent) take an
``flock`` on the file, store the limit then bump ``limit_gen``; the owner
reads them without any lock. Every field is an aligned 8-byte word, read and
written through an int64 ``memoryview`` (one 8-byte copy per access), so no
single value is ever torn. ``struct.pack_into`` is not used on shared words:
it zero-fills its target before writing, so a reader could see a transient 0.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import struct
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcached_core.config import MAX_SIZE
from kvcached_core.env import shown
from kvcached_core.errors import IPCError, KVCachedConfigError
from kvcached_core.ipc import paths

__all__ = [
    "LATENCY_BUCKETS",
    "NO_LIMIT",
    "PREFIX",
    "Latency",
    "PoolStats",
    "PoolView",
    "PoolSegment",
    "shm_dir",
    "segment_path",
    "list_pools",
    "open_pool",
    "set_limit",
    "remove_stale",
]

MAGIC = b"KVCPOOL\0"
VERSION = 1
SIZE = 512
_BASE_SIZE = 256  # segments written before the histograms (same version)
#: Upper bounds (seconds) of the map / unmap latency histogram buckets; +Inf follows.
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0)
_NB = len(LATENCY_BUCKETS) + 1
_MAPPED, _MAP_BYTES, _UNMAP_BYTES = 28, 29, 30
_HIST_MAP, _HIST_UNMAP = 32, 48  # word index of each histogram: _NB buckets, sum_ns, count
assert _HIST_UNMAP + _NB + 2 == SIZE // 8 and _HIST_MAP + _NB + 2 == _HIST_UNMAP
NO_LIMIT = -1
PREFIX = "kvcached."

_HEAD = struct.Struct("=8sII")  # magic, version, size: written once, before publication
# int64 word indices
_PID, _CREATED, _SEQ, _USED, _RESERVED, _CAPACITY, _UPDATED, _LIMIT, _GEN, _DEV_TOTAL = range(
    2, 12)
_OFF_NS, _OFF_POOL, _NAME = 96, 160, 64
_STUCK_S = 0.05  # after this long, check whether the writer is still alive
_STUCK_ALIVE_S = 2.0  # the bound for a live owner that is merely slow


def shm_dir() -> Path:
    """Where segments live: ``$KVCACHED_SHM_DIR``, ``/dev/shm``, or the IPC base directory."""
    explicit = os.environ.get("KVCACHED_SHM_DIR", "").strip()
    if explicit:
        return paths.private_dir(os.path.abspath(explicit), "KVCACHED_SHM_DIR")
    if os.path.isdir("/dev/shm"):
        return Path("/dev/shm")
    return paths.base_dir()


def segment_path(namespace: str, pool: str, directory: str | os.PathLike[str] | None = None) -> Path:
    """The file of pool ``pool`` in namespace ``namespace``."""
    paths.check_name(namespace, "IPC namespace")
    paths.check_name(pool, "pool name")
    root = Path(directory) if directory is not None else shm_dir()
    return root / f"{PREFIX}{namespace}.{pool}"


@dataclass(frozen=True)
class Latency:
    """A latency histogram: per-bucket counts (bounds :data:`LATENCY_BUCKETS`, then +Inf)."""

    buckets: tuple[int, ...] = (0,) * _NB
    sum_ns: int = 0
    count: int = 0

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound in seconds, count <= bound)`` pairs, ending with ``inf``."""
        out, total = [], 0
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), self.buckets):
            total += n
            out.append((bound, total))
        return out


@dataclass(frozen=True)
class PoolStats:
    """One reading of a pool's segment."""

    namespace: str
    pool: str
    pid: int
    limit: int
    limit_gen: int
    used: int
    reserved: int
    capacity: int
    created_ns: int
    updated_ns: int
    path: str
    alive: bool
    device_total: int = 0
    mapped: int = 0
    map_bytes: int = 0
    unmap_bytes: int = 0
    map_latency: Latency = Latency()
    unmap_latency: Latency = Latency()

    @property
    def has_limit(self) -> bool:
        """Whether a limit is set (``limit != NO_LIMIT``)."""
        return self.limit != NO_LIMIT


def _pid_alive(pid: int) -> bool:
    return paths.process_start(pid) is not None


def text_field(raw: bytes) -> str:
    """A NUL-padded name field of a record as text."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


class MappedRecord:
    """A record file mapped into this process: ``close`` and the context manager.

    Subclasses set ``_fd`` (``-1`` once closed), ``_mm`` (the mapping) and
    ``_w`` (its int64 ``memoryview``).
    """

    _fd = -1

    def close(self) -> None:
        """Unmap and close (idempotent)."""
        if self._fd >= 0:
            self._w.release()
            self._mm.close()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PoolView(MappedRecord):
    """An open segment: read it, or set its limit. Use :func:`open_pool` to get one.

    Raises:
        IPCError: the file is not a kvcached segment (too small, bad magic or
            version), is a link, or belongs to another user.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise IPCError(f"cannot open segment {self.path}: {exc.strerror or exc}") from exc
        try:
            self._attach(fd, check=True)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _attach(self, fd: int, check: bool) -> None:
        if check:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.getuid(), 0):
                raise IPCError(f"{self.path} is not a regular file of this user")
            if st.st_size < _BASE_SIZE:
                raise IPCError(f"{self.path} is {st.st_size} bytes, not a kvcached segment")
            length = SIZE if st.st_size >= SIZE else _BASE_SIZE
        else:
            length = SIZE
        mm = mmap.mmap(fd, length)
        if check:
            magic, version, size = _HEAD.unpack_from(mm)
            if magic != MAGIC or version != VERSION:
                mm.close()
                raise IPCError(
                    f"{self.path} is not a kvcached pool segment of version {VERSION} "
                    f"(magic {magic!r}, version {version})"
                )
            if size < SIZE:
                length = _BASE_SIZE
        self._full = length >= SIZE
        self._mm = mm
        self._w = memoryview(mm).cast("q")  # int64 words: one 8-byte copy per access

    def read(self) -> PoolStats:
        """A consistent snapshot of the segment."""
        w = self._w
        give_up = hard_stop = 0.0
        while True:
            s1 = w[_SEQ]
            stats = w[_USED:_UPDATED + 1].tolist()
            mapped = w[_MAPPED] if self._full else stats[0] + stats[1]
            if not s1 & 1 and w[_SEQ] == s1:
                break
            now = time.monotonic()
            if not give_up:
                give_up = now + _STUCK_S
                hard_stop = now + _STUCK_ALIVE_S
            elif now > give_up:
                # A live owner may just be descheduled mid-update on a loaded machine:
                # keep waiting for it (up to a bound). A dead one never finishes;
                # each word is still whole.
                if now > hard_stop or not _pid_alive(w[_PID]):
                    break
            time.sleep(0)  # let the writer finish
        used, reserved, capacity, updated = stats
        mm = self._mm
        return PoolStats(
            namespace=text_field(mm[_OFF_NS:_OFF_NS + _NAME]),
            pool=text_field(mm[_OFF_POOL:_OFF_POOL + _NAME]),
            pid=w[_PID],
            limit=w[_LIMIT],
            limit_gen=w[_GEN],
            used=used,
            reserved=reserved,
            capacity=capacity,
            created_ns=w[_CREATED],
            updated_ns=updated,
            path=os.fspath(self.path),
            alive=_pid_alive(w[_PID]),
            device_total=w[_DEV_TOTAL],
            mapped=mapped,
            map_bytes=w[_MAP_BYTES] if self._full else 0,
            unmap_bytes=w[_UNMAP_BYTES] if self._full else 0,
            map_latency=self._latency(_HIST_MAP),
            unmap_latency=self._latency(_HIST_UNMAP),
        )

    def _latency(self, base: int) -> Latency:
        if not self._full:
            return Latency()
        w = self._w
        count = w[base + _NB + 1]  # the count first: buckets are written before it
        return Latency(tuple(w[base:base + _NB].tolist()), w[base + _NB], count)

    @property
    def limit(self) -> int:
        """The current limit in bytes, or :data:`NO_LIMIT`."""
        return self._w[_LIMIT]

    def set_limit(self, limit: int) -> None:
        """Set the pool's limit (bytes, or :data:`NO_LIMIT`); the owner picks it up.

        Raises:
            KVCachedConfigError: ``limit`` is negative (other than
                :data:`NO_LIMIT`) or above :data:`~kvcached_core.config.MAX_SIZE`
                (the segment holds a signed 64-bit word).
        """
        if limit < 0 and limit != NO_LIMIT:
            raise KVCachedConfigError(
                f"limit {limit} is negative; use NO_LIMIT (-1) to lift the limit")
        if limit > MAX_SIZE:
            raise KVCachedConfigError(
                f"limit {shown(str(limit))} is above the maximum {MAX_SIZE} bytes (1 EiB)")
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            self._w[_LIMIT] = limit
            self._w[_GEN] += 1
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

def _unlink_if_owner(path: Path, pid: int, inode: int) -> None:
    if os.getpid() != pid:  # a forked child never removes its parent's segment
        return
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


class PoolSegment(PoolView):
    """The owner's side of a pool segment: created here, unlinked on :meth:`close`.

    Use :meth:`create`. :meth:`update` costs no system call (a few µs), so an
    allocator can call it on every page it allocates or frees.
    """

    _seq: int

    @classmethod
    def create(
        cls,
        namespace: str,
        pool: str,
        *,
        capacity: int = 0,
        limit: int = NO_LIMIT,
        directory: str | os.PathLike[str] | None = None,
    ) -> PoolSegment:
        """Create the segment of ``(namespace, pool)``.

        A segment left behind by a dead owner is replaced.

        Raises:
            IPCError: a live process already owns this pool, or the file cannot
                be created.
            KVCachedConfigError: the namespace or pool name is invalid.
        """
        path = segment_path(namespace, pool, directory)
        fd = cls._create_file(path)
        self = cls.__new__(cls)
        self.path = path
        self._fd = fd
        try:
            os.ftruncate(fd, SIZE)
            self._attach(fd, check=False)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise IPCError(f"cannot size segment {path}: {exc.strerror or exc}") from exc
        now = time.time_ns()
        pid = os.getpid()
        mm, w = self._mm, self._w
        mm[_OFF_NS:_OFF_NS + _NAME] = namespace.encode().ljust(_NAME, b"\0")
        mm[_OFF_POOL:_OFF_POOL + _NAME] = pool.encode().ljust(_NAME, b"\0")
        w[_PID], w[_CREATED] = pid, now
        w[_CAPACITY], w[_UPDATED], w[_LIMIT] = capacity, now, limit
        _HEAD.pack_into(mm, 0, b"\0" * 8, VERSION, SIZE)
        mm[0:8] = MAGIC  # published last: readers skip the file until now
        self._seq = 0
        self._seen_gen = 0
        self._stats = [0, 0, capacity]
        self._finalizer = weakref.finalize(self, _unlink_if_owner, path, pid,
                                           os.fstat(fd).st_ino)
        return self

    @staticmethod
    def _create_file(path: Path) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(2):
            try:
                return os.open(path, flags, 0o600)
            except FileExistsError:
                try:
                    with PoolView(path) as old:
                        stats = old.read()
                except IPCError:
                    stats = None
                if stats is not None and stats.alive:
                    raise IPCError(
                        f"pool {stats.pool!r} of namespace {stats.namespace!r} is already owned "
                        f"by the live process {stats.pid} ({path})"
                    ) from None
                if stats is None and os.stat(path).st_uid != os.getuid():
                    raise IPCError(f"{path} exists and belongs to another user") from None
                os.unlink(path)  # stale, or garbage under our name
            except OSError as exc:
                raise IPCError(f"cannot create segment {path}: {exc.strerror or exc}") from exc
        raise IPCError(f"cannot create segment {path}: it keeps reappearing")

    def update(
        self, *, used: int | None = None, reserved: int | None = None,
        capacity: int | None = None, mapped: int | None = None,
    ) -> None:
        """Publish new byte counts (fields left ``None`` keep their value; ``mapped``
        defaults to ``used + reserved``).

        Not thread-safe: call it from one thread, or under the allocator's lock.
        """
        stats = self._stats
        if used is not None:
            stats[0] = used
        if reserved is not None:
            stats[1] = reserved
        if capacity is not None:
            stats[2] = capacity
        w = self._w
        seq = self._seq + 1
        w[_SEQ] = seq  # odd: writing
        w[_USED], w[_RESERVED], w[_CAPACITY] = stats
        w[_MAPPED] = stats[0] + stats[1] if mapped is None else mapped
        w[_UPDATED] = time.time_ns()
        self._seq = seq + 1
        w[_SEQ] = seq + 1  # even: published

    def observe(self, kind: str, seconds: float, nbytes: int) -> None:
        """Count one map (``kind="map"``) or unmap call of ``nbytes`` that took ``seconds``.

        Not thread-safe, like :meth:`update`.
        """
        base, total = (_HIST_MAP, _MAP_BYTES) if kind == "map" else (_HIST_UNMAP, _UNMAP_BYTES)
        w = self._w
        i = 0
        while i < _NB - 1 and seconds > LATENCY_BUCKETS[i]:
            i += 1
        w[base + i] += 1
        w[base + _NB] += max(0, int(seconds * 1e9))
        w[base + _NB + 1] += 1
        w[total] += max(0, int(nbytes))

    def set_device_total(self, total: int) -> None:
        """Record the size of the pool's device (``kvctl limit 40%`` takes a share of it)."""
        self._w[_DEV_TOTAL] = max(0, int(total))

    def poll_limit(self) -> int | None:
        """The limit if ``kvctl`` wrote one since the last poll, else ``None``.

        Writing the same value again counts as a new limit, so "set the limit
        back to where it was" is never missed.
        """
        gen = self._w[_GEN]
        if gen == self._seen_gen:
            return None
        self._seen_gen = gen
        return self.limit

    def close(self, unlink: bool = True) -> None:
        """Unmap the segment and (by default, and only in the creating process) unlink it."""
        if unlink:
            self._finalizer()
        else:
            self._finalizer.detach()
        super().close()


def list_pools(
    namespace: str | None = None, directory: str | os.PathLike[str] | None = None
) -> list[PoolStats]:
    """Every readable pool segment (of one namespace if given), sorted by name.

    Files that are not kvcached segments, belong to other users or vanish
    while being read are skipped.
    """
    prefix = PREFIX if namespace is None else f"{PREFIX}{paths.check_name(namespace)}."
    return [stats for stats in read_records(directory, prefix, PoolView)
            if namespace is None or stats.namespace == namespace]


def read_records(directory: str | os.PathLike[str] | None, prefix: str,
                 opener: Any) -> list[Any]:
    """``opener(path).read()`` of every file named ``prefix...`` in ``directory``
    (default :func:`shm_dir`), sorted by name; files it refuses are skipped."""
    root = Path(directory) if directory is not None else shm_dir()
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith(prefix))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        try:
            with opener(root / name) as record:
                found.append(record.read())
        except IPCError:
            continue
    return found


def open_pool(
    namespace: str, pool: str, directory: str | os.PathLike[str] | None = None
) -> PoolView:
    """Open an existing pool's segment (raises :class:`IPCError` if there is none)."""
    path = segment_path(namespace, pool, directory)
    if not os.path.lexists(path):
        raise IPCError(f"cannot open segment {path}: no pool {pool} in namespace {namespace} "
                       "(kvctl list shows the live pools)")
    return PoolView(path)


def set_limit(
    namespace: str, pool: str, limit: int, directory: str | os.PathLike[str] | None = None
) -> PoolStats:
    """Set a pool's limit in bytes (:data:`NO_LIMIT` lifts it); returns the new reading."""
    with open_pool(namespace, pool, directory) as view:
        view.set_limit(limit)
        return view.read()


def remove_stale(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """Unlink the segments whose owner process is gone; returns their paths."""
    removed = []
    for stats in list_pools(directory=directory):
        if stats.alive:
            continue
        try:
            with PoolView(stats.path) as view:  # not replaced by a new owner meanwhile?
                if view.read().pid != stats.pid:
                    continue
            os.unlink(stats.path)
            removed.append(stats.path)
        except (IPCError, OSError):
            pass
    return removed
