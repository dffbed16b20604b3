"""Socket directories, namespaces and socket paths."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from kvcached_core.errors import IPCError, KVCachedConfigError
from kvcached_core.ipc import WorkerListener
from kvcached_core.ipc import paths


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_base_dir_is_created_owner_only(ipc_base, monkeypatch):
    target = ipc_base / "nested" / "kv"
    monkeypatch.setenv("KVCACHED_IPC_DIR", str(target))
    old = os.umask(0)
    try:
        assert paths.base_dir() == target
    finally:
        os.umask(old)
    assert _mode(target) == 0o700 and _mode(target.parent) == 0o700


def test_runtime_dir_is_used_without_an_explicit_dir(ipc_base, monkeypatch):
    monkeypatch.delenv("KVCACHED_IPC_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(ipc_base))
    assert paths.base_dir() == ipc_base / "kvcached"
    assert _mode(ipc_base / "kvcached") == 0o700


def test_world_accessible_dir_is_refused(ipc_base, monkeypatch):
    loose = ipc_base / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    monkeypatch.setenv("KVCACHED_IPC_DIR", str(loose))
    with pytest.raises(IPCError, match=r"has mode 0777.*chmod 700"):
        paths.base_dir()
    assert _mode(loose) == 0o777  # refused, not silently "fixed"
    with pytest.raises(IPCError, match="mode 0777"):
        WorkerListener(loose / "w.sock", lambda *a: None, rank=0).start()


def test_symlinked_dir_is_refused(ipc_base, monkeypatch):
    real = ipc_base / "real"
    real.mkdir(mode=0o700)
    link = ipc_base / "link"
    link.symlink_to(real)
    monkeypatch.setenv("KVCACHED_IPC_DIR", str(link))
    with pytest.raises(IPCError, match="symbolic link"):
        paths.base_dir()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory away")
def test_dir_of_another_user_is_refused(ipc_base, monkeypatch):
    foreign = ipc_base / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 54321, -1)
    monkeypatch.setenv("KVCACHED_IPC_DIR", str(foreign))
    with pytest.raises(IPCError, match="belongs to uid 54321"):
        paths.base_dir()


def test_namespace_from_env_or_instance_id(monkeypatch):
    monkeypatch.delenv("KVCACHED_IPC_NAME", raising=False)
    assert paths.namespace("engine-8000") == "engine-8000"
    odd = paths.namespace("host:8000/model A")
    assert odd.startswith("host_8000_model_A-") and paths.check_name(odd) == odd
    assert paths.namespace("a/b") != paths.namespace("a_b")
    assert paths.namespace("x" * 200) != paths.namespace("x" * 201)
    assert len(paths.namespace("x" * 200)) <= paths.MAX_NAME_BYTES
    with pytest.raises(KVCachedConfigError, match="set KVCACHED_IPC_NAME"):
        paths.namespace()
    monkeypatch.setenv("KVCACHED_IPC_NAME", "shared")
    assert paths.namespace("engine-8000") == "shared"
    monkeypatch.setenv("KVCACHED_IPC_NAME", "../etc")
    with pytest.raises(KVCachedConfigError, match="KVCACHED_IPC_NAME '../etc' is not valid"):
        paths.namespace()


def test_socket_paths_per_namespace_stage_and_rank(ipc_base):
    a = paths.socket_path("eng1", 3, 1)
    assert a == ipc_base / "eng1" / "pp1-tp3.sock"
    assert _mode(ipc_base / "eng1") == 0o700
    assert paths.socket_path("eng2", 3, 1) != a
    with pytest.raises(KVCachedConfigError):
        paths.socket_path("eng1", -1)


def test_socket_path_length_limit(ipc_base):
    deep = ipc_base / ("d" * 90)
    with pytest.raises(IPCError, match=r"over the 107-byte limit.*KVCACHED_IPC_DIR"):
        paths.socket_path("n" * 20, 0, base=deep)
    with pytest.raises(IPCError, match="107-byte"):
        WorkerListener(ipc_base / ("s" * 120), lambda *a: None, rank=0)


def test_listener_replaces_stale_socket_but_not_a_live_one_or_a_file(ipc_base):
    path = ipc_base / "w.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens
    with WorkerListener(path, lambda *a: None, rank=0) as live:
        assert _mode(path) == 0o600
        with pytest.raises(IPCError, match="already listening"):
            WorkerListener(path, lambda *a: None, rank=1).start()
        assert live.running
    assert not path.exists()
    path.write_text("not a socket")
    with pytest.raises(IPCError, match="not a socket"):
        WorkerListener(path, lambda *a: None, rank=0).start()


def test_unsafe_ipc_dir_error_names_the_variable(ipc_base, monkeypatch):
    loose = ipc_base / "loose-ipc"
    loose.mkdir()
    os.chmod(loose, 0o755)
    monkeypatch.setenv("KVCACHED_IPC_DIR", str(loose))
    with pytest.raises(IPCError, match=rf"KVCACHED_IPC_DIR={loose}: .*mode 0755"):
        paths.base_dir()
    monkeypatch.setenv("KVCACHED_IPC_DIR", str(loose / "sub"))  # a missing child is fine: 0700
    assert paths.base_dir() == loose / "sub"


def test_unsafe_shm_dir_error_names_the_variable(ipc_base, monkeypatch):
    from kvcached_core.ipc import shm

    loose = ipc_base / "loose-shm"
    loose.mkdir()
    os.chmod(loose, 0o777)
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(loose))
    with pytest.raises(IPCError) as err:
        shm.shm_dir()
    assert f"KVCACHED_SHM_DIR={loose}" in str(err.value) and "IPC" not in str(err.value)
    link = ipc_base / "shm-link"
    link.symlink_to(ipc_base)
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(link))
    with pytest.raises(IPCError, match=r"KVCACHED_SHM_DIR=.*symbolic link"):
        shm.shm_dir()


def _serve_and_return(path: str) -> None:
    WorkerListener(path, lambda *a: None, rank=0).start()


@pytest.mark.parametrize("how", ["interpreter", "fork", "spawn"])
def test_a_worker_that_exits_removes_its_socket(ipc_base, how):
    """Engines end their workers by letting them exit: the socket file goes with them."""
    import multiprocessing
    import subprocess
    import sys

    path = ipc_base / f"exit-{how}.sock"
    if how == "interpreter":
        code = ("from kvcached_core.ipc import WorkerListener; "
                f"WorkerListener({str(path)!r}, lambda *a: None, rank=0).start()")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    else:  # multiprocessing children skip atexit after a fork; its finalizers still run
        child = multiprocessing.get_context(how).Process(target=_serve_and_return,
                                                         args=(str(path),))
        child.start()
        child.join(60)
        assert child.exitcode == 0
    assert not path.exists()
