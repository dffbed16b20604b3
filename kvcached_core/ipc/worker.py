"""The worker side: a Unix-socket listener that applies map/unmap requests.

A worker process (one per GPU, or the separate worker of a CPU engine) starts
one :class:`WorkerListener` after it has created its KV tensors::

    def apply(op: str, group: int, pages: list[int]) -> None:
        if op == "map":
            mapper.map(tensors[group], pages)
        elif op == "unmap":
            mapper.unmap(tensors[group], pages)

    listener = WorkerListener.for_namespace(ns, rank=tp_rank, pp_stage=pp_rank,
                                            handler=apply).start()
    ...
    listener.close()

A daemon thread accepts any number of persistent connections; each
connection gets a daemon thread of its own that blocks in ``recv`` (one
system call per request, no polling), and handler calls are serialised by one
lock, so the handler never runs concurrently with itself. ``hello`` and
``ping`` are answered by the listener itself; ``map``, ``unmap``, ``query`` and
``meminfo`` go to the handler. Whatever the handler raises becomes an error reply carrying
the exception's type and message (with status ``OUT_OF_MEMORY`` for a
``MemoryError``, such as the mapper's ``DeviceOutOfMemoryError``), and the
listener carries on. A connection that sends a malformed frame is answered with
``BAD_REQUEST`` and dropped; only peers running as the same user (or root) are
accepted.

A worker can add a native :class:`~kvcached_core._native.PageServer`
(``server=``): the connection threads then wait in it, outside the GIL, and it
answers page requests itself, failed ones included; everything else still
comes here.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import selectors
import socket
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from pathlib import Path

from kvcached_core.errors import IPCError, ProtocolError
from kvcached_core.ipc import paths
from kvcached_core.ipc.protocol import (OPS, Message, MsgType, Status, decode, encode_reply,
                                         read_message)

__all__ = ["Handler", "MapperHandler", "WorkerListener", "peer_credentials"]

log = logging.getLogger("kvcached.ipc")

#: ``handler(op, group, pages)``: ``op`` is ``"map"``, ``"unmap"``, ``"query"`` or
#: ``"meminfo"``. It returns ``None``, or for ``query`` (the mapped pages) and
#: ``meminfo`` (``[free bytes, total bytes, spare handles]`` of the device)
#: the int64 values to send back.
Handler = Callable[[str, int, list[int]], "Iterable[int] | None"]

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class MapperHandler:
    """The standard :data:`Handler`: applies requests to a page mapper.

    Args:
        mapper: A ``kvcached_core._native.PageMapper`` (see :func:`kvcached_core.vmm.open_mapper`).
        tensors: KV group id -> the virtual tensors of that group (every layer's
            K and V buffers); a map or unmap covers all of them. The mapping may
            be a dict the worker fills in as it creates groups.

    ``query`` answers which of the given pages (all pages if none are given)
    are mapped in the group's first tensor; ``meminfo`` the device's free and
    total bytes and the mapper's spare handles.
    """

    def __init__(self, mapper: Any, tensors: Mapping[int, Sequence[Any]]) -> None:
        self.mapper = mapper
        self.tensors = tensors

    def _group(self, group: int) -> Sequence[Any]:
        try:
            return self.tensors[group]
        except KeyError:
            known = ", ".join(map(str, sorted(self.tensors))) or "none"
            raise LookupError(f"no KV tensors for group {group} in this worker (groups: {known})") from None

    def __call__(self, op: str, group: int, pages: list[int]) -> list[int] | None:
        tensors = self._group(group)
        if op == "map":
            self.mapper.map(tensors, pages)
        elif op == "unmap":
            self.mapper.unmap(tensors, pages)
        elif op == "query":
            first = tensors[0]
            return [p for p in (pages or range(first.num_pages)) if first.is_mapped(p)]
        elif op == "meminfo":
            free, total = self.mapper.mem_info()
            return [free, total, self.mapper.stats().pooled_handles]
        else:
            raise ValueError(f"unknown operation {op!r}")
        return None


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket.

    The pid is as seen from this process's pid namespace (0 if unknown).
    """
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    return _CRED.unpack(data)


def _trusted(uid: int) -> bool:
    return uid == os.getuid() or uid == 0


class WorkerListener:
    """Serves map/unmap requests from the scheduler on a Unix socket.

    Args:
        path: The socket path; its directory must be owner-only (see
            :mod:`kvcached_core.ipc.paths`).
        handler: Applies ``map`` / ``unmap`` / ``query`` requests (see :data:`Handler`).
        rank: This worker's tensor-parallel rank, reported in the handshake.
        pp_stage: This worker's pipeline stage, reported in the handshake.
        label: Free text reported in the handshake (e.g. ``"vllm worker cuda:1"``).
        server: Optional ``kvcached_core._native.PageServer`` doing what
            ``handler`` does for its KV groups: it then reads the connections
            and answers their map / unmap / query / meminfo requests without
            the GIL (a worker computing in Python holds the GIL most of the
            time, which delayed each request by milliseconds), failed ones
            included: the error reply carries the native error's type and
            text, with status ``OUT_OF_MEMORY`` when the device had no memory,
            as this listener's own replies do. Frames it leaves (handshake,
            ping, groups it does not hold, malformed frames) reach this
            listener and ``handler`` as without it.
        cpus: CPUs the listener's threads (and threads they start, such as
            the host backend's page populator) run on; ``None`` keeps the
            starting thread's. An engine that pins its compute threads to
            cores passes the others, so that answering a request does not
            wait for a compute (or busy-polling) thread's time slice on the
            same core. CPUs the process may not use are ignored; if none is
            left the threads stay where they are.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        handler: Handler,
        *,
        rank: int,
        pp_stage: int = 0,
        label: str = "",
        server: Any = None,
        cpus: Iterable[int] | None = None,
    ) -> None:
        self._path = paths.check_socket_path(path)
        self._handler = handler
        self._server = server
        self._cpus = None if cpus is None else frozenset(cpus)
        self.rank = rank
        self.pp_stage = pp_stage
        self.label = label
        self._pid = 0
        self._inode = 0
        self._sock: socket.socket | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conns_lock = threading.Lock()
        self._handler_lock = threading.Lock()
        self._stopping = False
        self._handled = 0
        self.handler_errors = 0

    @classmethod
    def for_namespace(
        cls,
        namespace: str,
        *,
        rank: int,
        handler: Handler,
        pp_stage: int = 0,
        base: str | os.PathLike[str] | None = None,
        label: str = "",
        server: Any = None,
        cpus: Iterable[int] | None = None,
    ) -> WorkerListener:
        """A listener at the standard socket path of ``(namespace, pp_stage, rank)``."""
        path = paths.socket_path(namespace, rank, pp_stage, base)
        return cls(path, handler, rank=rank, pp_stage=pp_stage, label=label, server=server,
                   cpus=cpus)

    @property
    def requests_served(self) -> int:
        """Map / unmap / query requests handled (by the handler or the native server)."""
        return self._handled + (self._server.served if self._server is not None else 0)

    @property
    def path(self) -> Path:
        """The socket path."""
        return self._path

    @property
    def running(self) -> bool:
        """Whether the accepting thread is alive in this process."""
        return (self._thread is not None and self._thread.is_alive()
                and self._pid == os.getpid())

    @property
    def connections(self) -> int:
        """Number of open connections."""
        with self._conns_lock:
            return len(self._conns)

    def __enter__(self) -> WorkerListener:
        if self._sock is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<WorkerListener rank={self.rank} pp_stage={self.pp_stage} {self._path} {state}>"

    # ------------------------------------------------------------------ life cycle

    def start(self) -> WorkerListener:
        """Bind the socket and start accepting on a daemon thread.

        A stale socket file left by a dead worker is replaced; a live one is not.

        Raises:
            IPCError: the directory is unsafe, the path is taken by a live
                listener or by something that is not a socket, or binding failed.
        """
        if self._sock is not None:
            raise IPCError(f"{self!r} was already started")
        paths.check_private_dir(self._path.parent)
        self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(os.fspath(self._path))
            os.chmod(self._path, 0o600)
            sock.listen(64)
            self._inode = os.stat(self._path).st_ino
        except OSError as exc:
            sock.close()
            raise IPCError(f"cannot listen on {self._path}: {exc.strerror or exc}") from exc
        self._sock = sock
        self._wake = socket.socketpair()
        self._pid = os.getpid()
        self._stopping = False
        self._thread = threading.Thread(
            target=self._accept_loop, args=(sock, self._wake[0]),
            name=f"kvcached-ipc-pp{self.pp_stage}-tp{self.rank}", daemon=True,
        )
        self._thread.start()
        _close_at_exit(self)
        return self

    def _remove_stale(self) -> None:
        try:
            st = os.lstat(self._path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise IPCError(f"{self._path} exists and is not a socket; refusing to replace it")
        if not paths.accepts_connections(self._path):
            os.unlink(self._path)  # nobody listens: left by a dead worker
            return
        raise IPCError(f"another worker is already listening on {self._path}")

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving, close every connection and remove the socket file.

        Waits up to ``timeout`` seconds in all for requests in progress to
        finish (a handler that hangs longer is left behind on its daemon
        thread). Idempotent. In a forked child it only closes the inherited
        descriptors and leaves the parent's connections and socket file alone.
        """
        if self._sock is None:
            return
        owner = self._pid == os.getpid()
        deadline = time.monotonic() + timeout
        self._stopping = True
        with self._conns_lock:
            conns = dict(self._conns)
            self._conns.clear()
        if owner:
            if self._wake is not None:
                self._wake[1].send(b"x")
            for conn in conns:  # wakes the thread blocked in recv()
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            me = threading.current_thread()
            for thread in [self._thread, *conns.values()]:
                if thread is not None and thread is not me:
                    thread.join(max(0.0, deadline - time.monotonic()))
        for conn in conns:
            conn.close()
        self._sock.close()
        self._sock = None
        if self._wake is not None:
            for s in self._wake:
                s.close()
            self._wake = None
        if owner:
            try:
                if os.stat(self._path).st_ino == self._inode:
                    os.unlink(self._path)
            except OSError:
                pass

    # ------------------------------------------------------------------ serving

    def _accept_loop(self, sock: socket.socket, wake: socket.socket) -> None:
        if self._cpus:
            try:  # this thread only; connection threads inherit it
                os.sched_setaffinity(0, self._cpus)
            except OSError as exc:  # none of them allowed here: stay put
                log.debug("kvcached IPC listener %s: CPUs %s not usable (%s)", self._path,
                          sorted(self._cpus), exc)
        with selectors.DefaultSelector() as sel:
            sel.register(sock, selectors.EVENT_READ, "accept")
            sel.register(wake, selectors.EVENT_READ, "wake")
            while not self._stopping:
                try:
                    events = sel.select()
                    if self._stopping or any(key.data == "wake" for key, _ in events):
                        return
                    self._accept(sock)
                except Exception:  # never let the accepting thread die
                    if self._stopping:
                        return
                    log.exception("kvcached IPC listener %s: accept failed", self._path)
                    time.sleep(0.01)

    def _accept(self, sock: socket.socket) -> None:
        conn, _ = sock.accept()
        pid, uid, _gid = peer_credentials(conn)
        if not _trusted(uid):
            log.warning("kvcached IPC listener %s: refused pid %d of uid %d", self._path, pid, uid)
            conn.close()
            return
        thread = threading.Thread(
            target=self._serve, args=(conn,), daemon=True,
            name=f"kvcached-ipc-pp{self.pp_stage}-tp{self.rank}-conn{pid}",
        )
        with self._conns_lock:
            if self._stopping:
                conn.close()
                return
            self._conns[conn] = thread
        thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stopping and self._serve_one(conn):
                pass
        except Exception:  # a bug here must not take the worker down
            if not self._stopping:
                log.exception("kvcached IPC listener %s: connection failed", self._path)
        finally:
            with self._conns_lock:
                mine = self._conns.pop(conn, None) is not None
            if mine:
                conn.close()

    def _serve_one(self, conn: socket.socket) -> bool:
        """Answer one request; ``False`` when the connection should be dropped.

        With a native server, it answers page requests itself (without the
        GIL) and hands back the first frame it leaves to this listener.
        """
        try:
            if self._server is not None:
                frame = self._server.serve(conn.fileno())
                if not frame:
                    return False
                msg = decode(frame)
            else:
                msg = read_message(conn)
        except EOFError:
            return False
        except ProtocolError as exc:
            self._send(conn, encode_reply(MsgType.PING, 0, 0, Status.BAD_REQUEST, text=str(exc)))
            return False
        except OSError:
            return False
        if msg.is_reply:
            self._send(conn, encode_reply(msg.type, msg.request_id, msg.group, Status.BAD_REQUEST,
                                          text="a worker accepts requests, not replies"))
            return False
        return self._send(conn, self._dispatch(msg))

    def _dispatch(self, msg: Message) -> bytes:
        if msg.type is MsgType.PING:
            return encode_reply(msg.type, msg.request_id, msg.group)
        if msg.type is MsgType.HELLO:
            return encode_reply(msg.type, msg.request_id, msg.group,
                                values=(self.rank, self.pp_stage, os.getpid()), text=self.label)
        with self._handler_lock:
            self._handled += 1
            try:
                result = self._handler(OPS[msg.type], msg.group, msg.values)  # type: ignore[arg-type]
                return encode_reply(msg.type, msg.request_id, msg.group,
                                    values=() if result is None else result)
            except Exception as exc:
                self.handler_errors += 1
                text = f"{type(exc).__name__}: {exc}"
                log.debug("kvcached IPC listener %s: %s of group %d failed: %s", self._path,
                          msg.op, msg.group, text)
                status = Status.OUT_OF_MEMORY if isinstance(exc, MemoryError) else Status.ERROR
                return encode_reply(msg.type, msg.request_id, msg.group, status, text=text)

    @staticmethod
    def _send(conn: socket.socket, frame: bytes) -> bool:
        try:
            conn.sendall(frame)
            return True
        except OSError:
            return False


def _close_at_exit(listener: WorkerListener) -> None:
    """Close ``listener`` (removing its socket file) when the process ends normally.

    Engines run their workers as multiprocessing children, whose exit runs
    multiprocessing's finalizers but, after a fork, not ``atexit``: both are
    registered. Neither keeps the listener alive; closing twice is harmless.
    """
    ref = weakref.ref(listener)

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.close(timeout=1.0)

    atexit.register(close)
    multiprocessing.util.Finalize(None, close, exitpriority=1)
