"""The scheduler side: broadcast map/unmap requests to every worker and wait.

::

    workers = WorkerGroup.for_namespace(ns, tp_size=2, pp_size=1)
    kv = workers.broadcaster(group=0)
    kv.map([17, 18])      # returns once every worker has mapped both pages
    kv.unmap([17])
    workers.close()

A :class:`WorkerGroup` keeps one persistent connection per worker, opened on
first use (retrying until ``KVCACHED_IPC_CONNECT_TIMEOUT_S``, since workers may
start after the scheduler, and a busy worker's listen backlog may be full) and checked by a handshake in which each worker
states its rank and pipeline stage. A call encodes its request once, sends it
to every worker, and only then collects the replies, so the workers apply it
in parallel. The whole call is bounded by ``KVCACHED_IPC_TIMEOUT_S``.

Failures raise :class:`~kvcached_core.errors.WorkerError` naming the worker:

- an error reply (the worker's handler raised): the connection stays usable;
  if every failing worker ran out of memory the error is a
  :class:`~kvcached_core.errors.WorkerOutOfMemoryError` (also a ``MemoryError``);
- a closed or broken connection, a timeout or a garbled reply: that
  connection is closed and the group is marked failed, so later calls raise at
  once instead of waiting for the timeout again; :meth:`WorkerGroup.reset`
  clears the mark and the next call reconnects.

Calls are serialised by one lock per group. After ``fork()`` the child does
not touch the parent's connections: it opens its own on its first call.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcached_core import faults as _faults
from kvcached_core.config import DEFAULT_IPC_TIMEOUT_S, check_range, env_setting
from kvcached_core.errors import IPCError, ProtocolError, WorkerError, WorkerOutOfMemoryError
from kvcached_core.forks import at_fork_in_child
from kvcached_core.ipc import paths
from kvcached_core.ipc.protocol import Message, MsgType, Status, encode_request, read_message
from kvcached_core.ipc.worker import _trusted, peer_credentials

__all__ = ["DEFAULT_TIMEOUT_S", "Endpoint", "MapBroadcaster", "WorkerGroup",
           "namespace_endpoints"]

DEFAULT_TIMEOUT_S = DEFAULT_IPC_TIMEOUT_S
_MIN_HANDSHAKE_S = 1.0
_GRACE_S = 0.001


@dataclass(frozen=True)
class Endpoint:
    """Where one worker listens, and who it must say it is."""

    rank: int
    path: str
    pp_stage: int = 0

    @property
    def name(self) -> str:
        """``rank R`` or ``rank R / stage S``, for messages."""
        return f"rank {self.rank}" + (f" / stage {self.pp_stage}" if self.pp_stage else "")


class _Conn:
    __slots__ = ("endpoint", "sock", "pid")

    def __init__(self, endpoint: Endpoint, sock: socket.socket, pid: int) -> None:
        self.endpoint = endpoint
        self.sock = sock
        self.pid = pid


def _process_gone(pid: int) -> bool | None:
    """Whether process ``pid`` has exited (a zombie counts), ``None`` if unknown."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state in (b"Z", b"X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return None


def _process_hint(pid: int) -> str:
    gone = _process_gone(pid)
    if gone is None:
        return ""
    return f" (worker process {pid} {'has exited' if gone else 'is still running'})"


_GROUPS: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for group in list(_GROUPS):
        group._lock = threading.Lock()  # a thread of the parent may have held it


def namespace_endpoints(namespace: str, tp_size: int, pp_size: int = 1, *,
                        base: str | os.PathLike[str] | None = None) -> list[Endpoint]:
    """The ``pp_size x tp_size`` workers of a namespace, at their standard socket paths."""
    return [
        Endpoint(rank, os.fspath(paths.socket_path(namespace, rank, stage, base)), stage)
        for stage in range(pp_size)
        for rank in range(tp_size)
    ]


class WorkerGroup:
    """Persistent connections to the workers of one engine instance.

    Args:
        endpoints: The workers, as :class:`Endpoint` records or bare socket
            paths (a bare path at index ``i`` is rank ``i`` of stage 0).
        timeout: Seconds one call may take; default ``KVCACHED_IPC_TIMEOUT_S`` (60).
        connect_timeout: Seconds to keep retrying a worker that is not
            listening yet; default ``KVCACHED_IPC_CONNECT_TIMEOUT_S`` (60).

    Raises:
        KVCachedConfigError: a timeout variable is invalid.
        IPCError: no endpoints, or two endpoints share a path.
    """

    def __init__(
        self,
        endpoints: Sequence[Endpoint | str | os.PathLike[str]],
        *,
        timeout: float | None = None,
        connect_timeout: float | None = None,
    ) -> None:
        eps = [
            e if isinstance(e, Endpoint) else Endpoint(i, os.fspath(e)) for i, e in enumerate(endpoints)
        ]
        if not eps:
            raise IPCError("a worker group needs at least one endpoint")
        if len({e.path for e in eps}) != len(eps):
            raise IPCError("two endpoints of a worker group share a socket path")
        for e in eps:
            paths.check_socket_path(e.path)
        self._endpoints: tuple[Endpoint, ...] = tuple(eps)
        self.timeout = float(
            env_setting("KVCACHED_IPC_TIMEOUT_S", DEFAULT_TIMEOUT_S) if timeout is None
            else check_range("timeout", timeout, "KVCACHED_IPC_TIMEOUT_S")
        )
        self.connect_timeout = float(
            env_setting("KVCACHED_IPC_CONNECT_TIMEOUT_S", DEFAULT_TIMEOUT_S)
            if connect_timeout is None
            else check_range("connect_timeout", connect_timeout, "KVCACHED_IPC_CONNECT_TIMEOUT_S")
        )
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self._pid = os.getpid()
        self._next_id = 1
        self._failed: WorkerError | None = None
        self._closed = False
        at_fork_in_child(_after_fork_in_child)
        _GROUPS.add(self)

    @classmethod
    def for_namespace(
        cls,
        namespace: str,
        tp_size: int,
        pp_size: int = 1,
        *,
        base: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        connect_timeout: float | None = None,
    ) -> WorkerGroup:
        """All ``pp_size x tp_size`` workers of a namespace, at their standard paths.

        Every pipeline stage is included: a KV page is mapped on every stage,
        each for its own layers.
        """
        return cls(namespace_endpoints(namespace, tp_size, pp_size, base=base), timeout=timeout,
                   connect_timeout=connect_timeout)

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        """The workers, in broadcast order."""
        return self._endpoints

    @property
    def failed(self) -> WorkerError | None:
        """The failure that made the group unusable, if any (see :meth:`reset`)."""
        return self._failed

    @property
    def connected(self) -> bool:
        """Whether this process holds a connection to every worker."""
        return len(self._conns) == len(self._endpoints) and self._pid == os.getpid()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "failed" if self._failed else ("connected" if self.connected else "idle")
        return f"<WorkerGroup {len(self._endpoints)} workers {state}>"

    # ------------------------------------------------------------------ public calls

    def connect(self) -> None:
        """Connect to every worker now instead of on the first call.

        Raises:
            WorkerError: a worker did not accept a connection within the connect
                timeout, or its handshake failed.
        """
        with self._lock:
            self._prepare()

    def map(self, group: int, pages: Sequence[int]) -> None:
        """Map ``pages`` of KV group ``group`` on every worker (no-op for no pages)."""
        if len(pages):
            self.request(MsgType.MAP, group, pages)

    def unmap(self, group: int, pages: Sequence[int]) -> None:
        """Unmap ``pages`` of KV group ``group`` on every worker (no-op for no pages)."""
        if len(pages):
            self.request(MsgType.UNMAP, group, pages)

    def query(self, group: int, pages: Sequence[int] = ()) -> list[list[int]]:
        """Ask every worker's handler a ``query``; its answers, one list per worker."""
        return [list(m.values) for m in self.request(MsgType.QUERY, group, pages)]

    def meminfo(self, group: int = 0) -> list[tuple[int, int, int]]:
        """Every worker's device memory: ``(free bytes, total bytes, spare handles)``."""
        out = []
        for m in self.request(MsgType.MEMINFO, group):
            free, total, spare = (list(m.values) + [0, 0, 0])[:3]
            out.append((int(free), int(total), int(spare)))
        return out

    def ping(self) -> None:
        """An empty round trip to every worker (answered by the listener itself)."""
        self.request(MsgType.PING)

    def broadcaster(self, group: int) -> MapBroadcaster:
        """Map/unmap callbacks bound to KV group ``group``."""
        return MapBroadcaster(self, group)

    def request(self, type: MsgType, group: int = 0, values: Sequence[int] = ()) -> list[Message]:
        """Send one request to every worker, then wait for every reply.

        Returns:
            The replies, in :attr:`endpoints` order.

        Raises:
            WorkerError: a worker failed (see the module doc); it names the
                first failing worker and lists the others and those that succeeded.
            ProtocolError: ``group`` or a value does not fit the protocol.
        """
        with self._lock:
            self._prepare()
            if _faults.ACTIVE is not None and _faults.ACTIVE.hit("call") == "fail":
                raise self._fail({0: ("injected fault (KVCACHED_FAULTS): the connection broke",
                                      True)}, False)
            request_id = self._next_id
            self._next_id += 1
            frame = encode_request(type, request_id, group, values)
            return self._exchange(frame, type, request_id)

    def reset(self) -> None:
        """Forget a failure and drop every connection; the next call reconnects."""
        with self._lock:
            self._drop_all()
            self._failed = None

    def close(self) -> None:
        """Close every connection. Later calls raise :class:`IPCError`."""
        with self._lock:
            self._drop_all()
            self._closed = True
        _GROUPS.discard(self)

    # ------------------------------------------------------------------ internals

    def _drop_all(self) -> None:
        for conn in self._conns:
            conn.sock.close()  # in a forked child this closes only the child's copy
        self._conns = []

    def _prepare(self) -> None:
        if self._closed:
            raise IPCError(f"{self!r} is closed")
        if self._pid != os.getpid():  # forked: the connections belong to the parent
            self._drop_all()
            self._failed = None
            self._pid = os.getpid()
        if self._failed is not None:
            f = self._failed
            raise WorkerError(f.rank, f.path, f"failed earlier, call reset() to retry: {f.cause}",
                              pp_stage=f.pp_stage, failures=f.failures, succeeded=f.succeeded)
        if not self._conns:
            deadline = time.monotonic() + self.connect_timeout
            conns: list[_Conn] = []
            try:
                for ep in self._endpoints:
                    conns.append(self._open(ep, deadline))
            except BaseException:
                for c in conns:
                    c.sock.close()
                raise
            self._conns = conns

    def _open(self, ep: Endpoint, deadline: float) -> _Conn:
        delay = 0.002
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(deadline - time.monotonic(), _MIN_HANDSHAKE_S))
            try:
                sock.connect(ep.path)
                break
            except (FileNotFoundError, ConnectionRefusedError, BlockingIOError) as exc:
                # Not listening yet, or (EAGAIN) listening with a full backlog: both pass.
                sock.close()
                left = deadline - time.monotonic()
                if left <= 0:
                    what = ("the worker's listen backlog stayed full"
                            if isinstance(exc, BlockingIOError) else "no worker listening")
                    raise WorkerError(
                        ep.rank, ep.path,
                        f"{what} after {self.connect_timeout:g} s "
                        f"(KVCACHED_IPC_CONNECT_TIMEOUT_S): {exc.strerror}",
                        pp_stage=ep.pp_stage,
                    ) from None
                time.sleep(min(delay, left))
                delay = min(delay * 2, 0.1)
            except OSError as exc:
                sock.close()
                raise WorkerError(ep.rank, ep.path, f"cannot connect: {exc}",
                                  pp_stage=ep.pp_stage) from exc
        try:
            return self._handshake(ep, sock, deadline)
        except BaseException:
            sock.close()
            raise

    def _handshake(self, ep: Endpoint, sock: socket.socket, deadline: float) -> _Conn:
        def fail(cause: str) -> WorkerError:
            return WorkerError(ep.rank, ep.path, cause, pp_stage=ep.pp_stage)

        try:
            paths.check_private_dir(Path(ep.path).parent)
        except IPCError as exc:
            raise fail(str(exc)) from None
        pid, uid, _gid = peer_credentials(sock)
        if not _trusted(uid):
            raise fail(f"the listening process {pid} runs as uid {uid}, not as this user")
        sock.settimeout(min(self.timeout, max(deadline - time.monotonic(), _MIN_HANDSHAKE_S)))
        try:
            sock.sendall(encode_request(MsgType.HELLO, 0, 0, (ep.rank, ep.pp_stage, os.getpid())))
            reply = read_message(sock)
        except (EOFError, ConnectionResetError, BrokenPipeError):
            raise fail(f"the worker closed the connection during the handshake"
                       f"{_process_hint(pid)}") from None
        except (OSError, ProtocolError) as exc:
            raise fail(f"handshake failed: {exc or type(exc).__name__}{_process_hint(pid)}") from None
        if not reply.is_reply or reply.type is not MsgType.HELLO or reply.status != Status.OK:
            raise fail(f"bad handshake reply: {reply.text or reply}")
        said = tuple(reply.values[:2])
        if said != (ep.rank, ep.pp_stage):
            raise fail(
                f"the worker there is rank {said[0] if said else '?'} / stage "
                f"{said[1] if len(said) > 1 else '?'}, expected rank {ep.rank} / stage {ep.pp_stage}"
            )
        return _Conn(ep, sock, pid)

    def _exchange(self, frame: bytes, type: MsgType, request_id: int) -> list[Message]:
        deadline = time.monotonic() + self.timeout
        conns = self._conns
        failures: dict[int, tuple[str, bool]] = {}  # index -> (cause, connection is broken)
        out_of_memory = 0
        for i, conn in enumerate(conns):
            try:
                conn.sock.settimeout(self.timeout)
                conn.sock.sendall(frame)
            except OSError as exc:
                failures[i] = (self._broken(conn, "sending", exc), True)
        replies: list[Message] = []
        for i, conn in enumerate(conns):
            if i in failures:
                continue
            # past the deadline, still take a reply that has already arrived
            left = max(deadline - time.monotonic(), _GRACE_S)
            try:
                conn.sock.settimeout(left)
                msg = read_message(conn.sock)
            except TimeoutError:
                failures[i] = (
                    f"no reply within {self.timeout:g} s (KVCACHED_IPC_TIMEOUT_S): the worker is "
                    f"hung or overloaded{_process_hint(conn.pid)}", True)
                continue
            except EOFError:
                failures[i] = (
                    f"the worker closed the connection{_process_hint(conn.pid)}", True)
                continue
            except (OSError, ProtocolError) as exc:
                failures[i] = (self._broken(conn, "waiting for the reply", exc), True)
                continue
            if not msg.is_reply or msg.type is not type or msg.request_id != request_id:
                failures[i] = (
                    f"out-of-sequence reply (type {msg.type.name}, request {msg.request_id}, "
                    f"expected {type.name} reply to {request_id})", True)
            elif msg.status != Status.OK:
                failures[i] = (f"{type.name.lower()} failed in the worker: {msg.text}", False)
                out_of_memory += msg.status == Status.OUT_OF_MEMORY
            else:
                replies.append(msg)
        if failures:
            raise self._fail(failures, out_of_memory == len(failures))
        return replies

    @staticmethod
    def _broken(conn: _Conn, doing: str, exc: BaseException) -> str:
        return f"connection broken while {doing} ({exc}){_process_hint(conn.pid)}"

    def _fail(self, failures: dict[int, tuple[str, bool]], out_of_memory: bool) -> WorkerError:
        conns = self._conns
        listed = tuple((conns[i].endpoint.rank, conns[i].endpoint.pp_stage, cause)
                       for i, (cause, _) in sorted(failures.items()))
        ok = tuple((c.endpoint.rank, c.endpoint.pp_stage)
                   for i, c in enumerate(conns) if i not in failures)
        first = conns[min(failures)].endpoint
        cls = WorkerOutOfMemoryError if out_of_memory else WorkerError
        error = cls(first.rank, first.path, failures[min(failures)][0],
                    pp_stage=first.pp_stage, failures=listed, succeeded=ok)
        broken = [i for i, (_, fatal) in failures.items() if fatal]
        if broken:
            for i in broken:
                conns[i].sock.close()
            self._conns = [c for i, c in enumerate(conns) if i not in broken]
            self._failed = error
        return error


class MapBroadcaster:
    """The map/unmap callbacks of one KV cache group.

    An allocator for group ``g`` holds ``workers.broadcaster(g)``: the group id
    travels with every request and cannot be dropped on the way.
    """

    __slots__ = ("workers", "group")

    def __init__(self, workers: WorkerGroup, group: int) -> None:
        self.workers = workers
        self.group = group

    def map(self, pages: Sequence[int]) -> None:
        """Map ``pages`` on every worker; raises :class:`WorkerError` on failure."""
        self.workers.map(self.group, pages)

    def unmap(self, pages: Sequence[int]) -> None:
        """Unmap ``pages`` on every worker; raises :class:`WorkerError` on failure."""
        self.workers.unmap(self.group, pages)

    def __repr__(self) -> str:
        return f"<MapBroadcaster group={self.group} {self.workers!r}>"
