"""The bottom floor shared by every layer: one "no value" marker, one fork-hook mechanism."""

from __future__ import annotations

import copy
import os
import pickle
import threading

import pytest

from kvcached_core import forks
from kvcached_core.sentinel import UNSET


def test_one_unset_marker_everywhere():
    from kvcached_core.allocator import page_allocator
    from kvcached_core.plugins import UNSET as plugins_unset
    from kvcached_core.plugins.patching import Patch

    assert plugins_unset is UNSET and page_allocator._UNSET is UNSET
    assert Patch("m:a.b", replacement=1).wrapper is None  # UNSET default still means "not given"
    assert Patch.__dataclass_fields__["replacement"].default is UNSET
    assert type(UNSET)() is UNSET  # a singleton, however it is made
    assert copy.copy(UNSET) is UNSET and copy.deepcopy(UNSET) is UNSET
    assert pickle.loads(pickle.dumps(UNSET)) is UNSET
    assert not UNSET and repr(UNSET) == "UNSET" and UNSET is not None


def _in_child(body) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if body() else 3)
        except BaseException:  # noqa: BLE001 - reported through the status
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_callbacks_run_once_each_in_the_child_in_order_and_never_in_the_parent(monkeypatch):
    monkeypatch.setattr(forks, "_CALLBACKS", {})
    ran: list[str] = []

    def first() -> None:
        ran.append("first")

    def broken() -> None:
        raise RuntimeError("boom")

    def last() -> None:
        ran.append("last")

    for cb in (first, broken, last, first):  # registering again changes nothing
        forks.at_fork_in_child(cb)
    assert list(forks._CALLBACKS) == [first, broken, last]
    assert _in_child(lambda: ran == ["first", "last"]) == 0  # the broken one did not stop "last"
    assert ran == []  # the parent runs none


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_lock_held_by_a_parent_thread_is_fresh_in_the_child():
    from kvcached_core.ipc import WorkerGroup
    from kvcached_core.plugins._process import process_lock

    group = WorkerGroup(["/tmp/kvcached-floor-test.sock"])
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with process_lock(), group._lock:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(10)

        def child() -> bool:  # both locks are held by a thread that does not exist here
            with process_lock():
                pass
            return group._lock.acquire(timeout=5)

        assert _in_child(child) == 0
    finally:
        release.set()
        thread.join()
        group.close()
