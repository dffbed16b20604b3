"""Scheduler-to-worker broadcast against real worker processes and real page mappers."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from kvcached_core.errors import IPCError, WorkerError, WorkerOutOfMemoryError
from kvcached_core.ipc import Endpoint, WorkerGroup, WorkerListener
from kvcached_core.ipc.protocol import HEADER_SIZE, MsgType, Status, encode_request, read_message


@pytest.fixture
def group(two_workers):
    with WorkerGroup(two_workers.paths, timeout=10, connect_timeout=10) as g:
        yield g


def test_map_reaches_every_worker_and_unmap_undoes_it(group):
    group.map(0, [1, 3])
    group.map(1, [2])
    assert group.query(0) == [[1, 3], [1, 3]]
    assert group.query(1) == [[2], [2]]
    group.unmap(0, [1])
    assert group.query(0) == [[3], [3]]
    group.unmap(0, [3])
    group.unmap(1, [2])
    assert group.query(0) == [[], []] and group.query(1) == [[], []]


def test_broadcaster_is_bound_to_its_group(group):
    kv1 = group.broadcaster(1)
    kv1.map([4, 5])
    assert group.query(1, [4, 5, 6]) == [[4, 5], [4, 5]]
    assert group.query(0, [4, 5]) == [[], []]
    kv1.unmap([4, 5])
    kv1.map([])  # nothing to do, nothing sent


def test_error_reply_names_the_rank_and_keeps_the_group_usable(group):
    with pytest.raises(WorkerError) as info:
        group.map(0, [13])  # rank 1 refuses page 13
    err = info.value
    assert err.rank == 1 and err.path == group.endpoints[1].path
    assert "rank 1" in str(err) and "injected failure on rank 1" in str(err)
    assert err.succeeded == ((0, 0),)  # so the caller knows what to roll back
    assert group.failed is None  # an error reply is not a broken connection
    assert group.query(0, [13]) == [[13], []]
    group.map(0, [14])  # the listener survived the handler's exception
    assert group.query(0, [13, 14]) == [[13, 14], [14]]
    # roll back rank 0 alone, as an allocator would
    with WorkerGroup([group.endpoints[0]], timeout=10) as rank0:
        rank0.unmap(0, [13])
    group.unmap(0, [14])


def test_mapper_errors_from_every_rank_are_listed(group):
    group.map(0, [20])
    with pytest.raises(WorkerError) as info:
        group.map(0, [20])
    err = info.value
    assert [f[0] for f in err.failures] == [0, 1] and err.succeeded == ()
    assert "already mapped" in str(err) and "also rank 1" in str(err)
    with pytest.raises(WorkerError, match="no KV tensors for group 7"):
        group.map(7, [0])
    group.unmap(0, [20])


def test_out_of_memory_in_every_worker_is_a_memory_error(group):
    with pytest.raises(MemoryError) as info:
        group.map(1, [15])
    err = info.value
    assert isinstance(err, WorkerOutOfMemoryError) and len(err.failures) == 2
    assert "DeviceOutOfMemoryError: no memory for page 15 on rank 0" in str(err)
    with pytest.raises(WorkerError) as info:  # one rank OOM, one other failure: not OOM
        group.map(1, [13, 15])
    assert not isinstance(info.value, MemoryError)
    assert group.query(1) == [[], []]


def test_sigkilled_worker_is_reported_within_the_timeout(spawn_workers):
    workers = spawn_workers(2)
    g = WorkerGroup(workers.paths, timeout=2, connect_timeout=5)
    g.map(0, [0])
    workers.procs[1].kill()  # SIGKILL, by pid
    workers.procs[1].join(5)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        g.map(0, [1])
    assert time.monotonic() - t0 < 2.5
    err = info.value
    assert err.rank == 1 and err.succeeded == ((0, 0),)
    assert "has exited" in str(err) or "closed the connection" in str(err)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="failed earlier"):
        g.ping()  # fails fast, no second wait
    assert time.monotonic() - t0 < 0.5
    g.close()


def test_hung_worker_times_out_instead_of_hanging(spawn_workers):
    workers = spawn_workers(2, {0: {"hang_page": 9}})
    g = WorkerGroup(workers.paths, timeout=1, connect_timeout=5)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        g.map(0, [9])
    elapsed = time.monotonic() - t0
    assert 0.9 < elapsed < 2.0
    assert info.value.rank == 0 and "no reply within 1 s" in str(info.value)
    assert "is still running" in str(info.value)
    assert info.value.succeeded == ((1, 0),)  # the other worker answered in time
    g.reset()
    g.ping()  # the listener itself still answers on fresh connections
    with WorkerGroup([g.endpoints[1]], timeout=1) as rank1:
        assert rank1.query(0, [9]) == [[9]]
    g.close()


def test_worker_that_dies_mid_call_is_reported(spawn_workers):
    workers = spawn_workers(1, {0: {"hang_page": 2}})
    g = WorkerGroup(workers.paths, timeout=20, connect_timeout=5)
    threading.Timer(0.3, lambda: os.kill(workers.procs[0].pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="rank 0"):
        g.map(0, [2])
    assert time.monotonic() - t0 < 5
    g.close()


def _recording_listener(path, rank, pp_stage=0, calls=None, fail=False):
    def handler(op, group, pages):
        if fail:
            raise ValueError(f"boom {op} {pages}")
        if calls is not None:
            calls.append((rank, pp_stage, op, group, list(pages)))
    return WorkerListener(path, handler, rank=rank, pp_stage=pp_stage).start()


def test_every_pipeline_stage_gets_every_map(ipc_base):
    calls: list = []
    group = WorkerGroup.for_namespace("pp", tp_size=2, pp_size=2, timeout=5, connect_timeout=5)
    listeners = [_recording_listener(ep.path, ep.rank, ep.pp_stage, calls)
                 for ep in group.endpoints]
    try:
        assert [os.path.basename(ep.path) for ep in group.endpoints] == [
            "pp0-tp0.sock", "pp0-tp1.sock", "pp1-tp0.sock", "pp1-tp1.sock"]
        group.map(3, [5, 6])
        assert sorted(calls) == [(r, s, "map", 3, [5, 6]) for r in (0, 1) for s in (0, 1)]
    finally:
        group.close()
        for listener in listeners:
            listener.close()


def test_connect_waits_for_a_late_worker(ipc_base):
    path = os.fspath(ipc_base / "late.sock")
    group = WorkerGroup([path], timeout=5, connect_timeout=5)
    listeners: list = []
    timer = threading.Timer(0.3, lambda: listeners.append(_recording_listener(path, 0)))
    timer.start()
    try:
        group.ping()
    finally:
        timer.join()
        group.close()
        for listener in listeners:
            listener.close()


def test_connect_gives_up_after_the_connect_timeout(ipc_base):
    path = os.fspath(ipc_base / "nobody.sock")
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"no worker listening after 0.3 s") as info:
        WorkerGroup([path], connect_timeout=0.3).connect()
    assert time.monotonic() - t0 < 1.5 and info.value.path == path


def test_handshake_checks_the_rank(ipc_base):
    path = os.fspath(ipc_base / "r.sock")
    with _recording_listener(path, rank=0):
        with pytest.raises(WorkerError, match="expected rank 1"):
            WorkerGroup([Endpoint(1, path)], connect_timeout=2).connect()


def test_listener_survives_handler_exceptions_and_garbage(ipc_base):
    path = os.fspath(ipc_base / "g.sock")
    with _recording_listener(path, rank=0, fail=True) as listener:
        group = WorkerGroup([path], timeout=5, connect_timeout=2)
        for _ in range(3):
            with pytest.raises(WorkerError, match=r"ValueError: boom map \[1\]"):
                group.map(0, [1])
        assert listener.handler_errors == 3
        # a peer speaking something else gets a clear refusal and is dropped
        raw = socket.socket(socket.AF_UNIX)
        raw.settimeout(5)
        raw.connect(path)
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * HEADER_SIZE)
        reply = read_message(raw)
        assert reply.status == Status.BAD_REQUEST and "bad magic" in reply.text
        try:  # and then dropped (reset, since its garbage was never read)
            assert raw.recv(1) == b""
        except ConnectionResetError:
            pass
        raw.close()
        group.ping()  # still serving the scheduler
        group.close()
    assert not os.path.exists(path)  # close() removed the socket file


@pytest.mark.parametrize("want", ["one allowed CPU", "no usable CPU"])
def test_listener_threads_run_on_the_cpus_given(ipc_base, want):
    allowed = sorted(os.sched_getaffinity(0))
    cpus = {allowed[-1]} if want == "one allowed CPU" else {4095}  # 4095: no such CPU here
    seen: list = []

    def handler(op, group, pages):  # runs on a connection thread
        seen.append(os.sched_getaffinity(0))

    path = os.fspath(ipc_base / "cpu.sock")
    with WorkerListener(path, handler, rank=0, cpus=cpus):
        with WorkerGroup([path], timeout=5, connect_timeout=2) as group:
            group.map(0, [1])
    assert seen == [cpus if want == "one allowed CPU" else set(allowed)]
    assert os.sched_getaffinity(0) == set(allowed)  # the starting thread is left alone


def test_replies_out_of_sequence_are_not_trusted(ipc_base):
    path = os.fspath(ipc_base / "s.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)

    def fake_worker():
        conn, _ = server.accept()
        hello = read_message(conn)
        from kvcached_core.ipc.protocol import encode_reply
        conn.sendall(encode_reply(MsgType.HELLO, hello.request_id, values=(0, 0, os.getpid())))
        req = read_message(conn)
        conn.sendall(encode_reply(MsgType.MAP, req.request_id + 5))
        conn.recv(1)
        conn.close()

    thread = threading.Thread(target=fake_worker, daemon=True)
    thread.start()
    group = WorkerGroup([path], timeout=5, connect_timeout=2)
    with pytest.raises(WorkerError, match="out-of-sequence reply"):
        group.map(0, [1])
    assert group.failed is not None
    group.close()
    thread.join(5)
    server.close()


def test_forked_child_opens_its_own_connection(ipc_base):
    path = os.fspath(ipc_base / "f.sock")
    calls: list = []
    with _recording_listener(path, rank=0, calls=calls) as listener:
        group = WorkerGroup([path], timeout=5, connect_timeout=2)
        group.map(0, [1])
        pid = os.fork()
        if pid == 0:  # child: must not share the parent's stream
            try:
                group.map(0, [2])
                os._exit(0)
            except BaseException:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        group.map(0, [3])  # the parent's connection is intact
        assert [c[4] for c in calls] == [[1], [2], [3]]
        assert listener.connections >= 1
        group.close()
        with pytest.raises(IPCError, match="closed"):
            group.ping()


def test_two_threads_share_one_group(group):
    errors: list = []

    def run(base):
        try:
            for i in range(20):
                group.map(0, [base + i % 4])
                group.unmap(0, [base + i % 4])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(b,)) for b in (24, 28)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert group.query(0) == [[], []]


def test_request_frames_are_checked_before_sending(group):
    from kvcached_core.errors import ProtocolError
    with pytest.raises(ProtocolError):
        group.map(-1, [0])
    with pytest.raises(ProtocolError):
        group.request(MsgType.MAP, 0, [1 << 63])
    group.ping()
    assert encode_request(MsgType.PING, 1)[:4] == b"KVCI"


def test_worker_errors_survive_pickling():
    import pickle

    err = WorkerOutOfMemoryError(2, "/x.sock", "no memory", pp_stage=1,
                                 failures=((2, 1, "no memory"),), succeeded=((0, 1),))
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is WorkerOutOfMemoryError and str(back) == str(err)
    assert (back.rank, back.pp_stage, back.path, back.succeeded) == (2, 1, "/x.sock", ((0, 1),))


def test_connect_retries_while_the_listen_backlog_is_full(ipc_base):
    path = os.fspath(ipc_base / "busy.sock")
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    busy.bind(path)
    busy.listen(0)  # accepts nothing: the queue fills at once
    fillers = []
    for _ in range(4):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            break
        fillers.append(s)
    listeners: list = []

    def worker_starts_answering() -> None:
        busy.close()
        for s in fillers:
            s.close()
        os.unlink(path)
        listeners.append(_recording_listener(path, 0))

    group = WorkerGroup([path], timeout=5, connect_timeout=5)
    timer = threading.Timer(0.4, worker_starts_answering)
    timer.start()
    try:
        group.ping()  # EAGAIN while the backlog is full: retried, not an error
    finally:
        timer.join()
        group.close()
        for listener in listeners:
            listener.close()


def test_a_full_backlog_until_the_connect_timeout_names_it(ipc_base):
    path = os.fspath(ipc_base / "full.sock")
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    busy.bind(path)
    busy.listen(0)
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            fillers.append(s)
            try:
                s.connect(path)
            except BlockingIOError:
                break
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"after 0.3 s \(KVCACHED_IPC_CONNECT_TIMEOUT_S\)"):
            WorkerGroup([path], connect_timeout=0.3).connect()
        assert 0.25 < time.monotonic() - t0 < 2.0
    finally:
        busy.close()
        for s in fillers:
            s.close()
