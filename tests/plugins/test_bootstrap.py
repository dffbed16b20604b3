"""bootstrap(): once per process, fork- and spawn-safe, a no-op when disabled, loud when vanilla."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import pytest

from kvcached_core import hookimpl
from kvcached_core.errors import KVCachedConfigError, PatchError, PluginError
from kvcached_core.plugins import (
    EngineAdapter,
    Patch,
    bootstrap,
    bootstrap_results,
    engine_patch_set,
    get_plugin_manager,
    teardown,
)
from kvcached_core.plugins import manager as manager_module
from kvcached_core.plugins._process import process_lock

if TYPE_CHECKING:
    from tests.plugins.conftest import FakeSite


def _engine() -> Any:
    from kvt_engine.core import Engine

    return Engine()


def test_bootstrap_applies_once_and_logs_one_line(
    engine_site: FakeSite, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvcached"):
        first = bootstrap("kvt")
        second = bootstrap("kvt")
    assert first.status == "applied" and first.active and not first.repeated
    assert first.version == "1.2.0+cpu" and first.version_source == "distribution kvt-engine-cpu"
    assert (first.plugin, first.distribution) == ("kvt", "kvcached-kvt")
    assert first.patch_set is not None
    assert first.patch_set.applied == ("elastic-step",)
    assert first.patch_set.skipped == (("elastic-allocate", "version 1.2.0+cpu not in '>=1.5'"),)
    assert second.repeated and not second.inherited and second.patch_set == first.patch_set
    assert _engine().step() == ("kvcached", "vanilla")
    assert [r.getMessage() for r in caplog.records] == [
        "kvcached: kvt 1.2.0+cpu patch set: 1 applied, 1 skipped, 0 failed"
    ]
    assert bootstrap_results()["kvt"] == first
    assert engine_patch_set("kvt") is not None


def test_teardown_reverts_and_forgets(engine_site: FakeSite) -> None:
    bootstrap("kvt")
    reverted = teardown("kvt")
    assert reverted is not None and reverted.restored == ("elastic-step",)
    assert _engine().step() == "vanilla"
    assert bootstrap_results() == {}
    assert teardown("kvt") is None
    assert bootstrap("kvt").status == "applied"


def test_disabled_is_a_no_op(engine_site: FakeSite, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_ENABLED", "0")
    result = bootstrap("kvt")
    assert result.status == "disabled" and not result.active
    assert manager_module._manager is None  # plugins were not even looked up
    assert _engine().step() == "vanilla"
    monkeypatch.setenv("KVCACHED_ENABLED", "maybe")
    with pytest.raises(KVCachedConfigError, match=r"KVCACHED_ENABLED='maybe' is not a boolean"):
        bootstrap("kvt")


def test_bootstrap_starts_no_thread_and_opens_no_socket(engine_site: FakeSite) -> None:
    def sockets() -> int:
        fds = os.listdir("/proc/self/fd")
        count = 0
        for fd in fds:
            try:
                count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
            except OSError:
                pass
        return count

    threads = threading.active_count()
    before = sockets() if os.path.isdir("/proc/self/fd") else 0
    bootstrap("kvt")
    assert threading.active_count() == threads
    if os.path.isdir("/proc/self/fd"):
        assert sockets() == before


def _in_fork(child: Any) -> dict[str, Any]:
    """Run ``child()`` in a forked process and return the JSON it produced."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        status = 1
        try:
            os.close(read_fd)
            os.write(write_fd, json.dumps(child()).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.01)
    with os.fdopen(read_fd) as pipe:
        data = pipe.read()
    assert os.waitstatus_to_exitcode(status) == 0, data
    return json.loads(data)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_child_does_not_reapply(engine_site: FakeSite) -> None:
    parent = bootstrap("kvt")

    def child() -> dict[str, Any]:
        result = bootstrap("kvt")
        return {
            "status": result.status,
            "inherited": result.inherited,
            "repeated": result.repeated,
            "pid": result.pid,
            "step": _engine().step(),
        }

    seen = _in_fork(child)
    assert seen == {
        "status": "applied",
        "inherited": True,
        "repeated": True,
        "pid": parent.pid,
        "step": ["kvcached", "vanilla"],
    }  # wrapped once


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_while_another_thread_holds_the_lock(engine_site: FakeSite) -> None:
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with process_lock():
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(10)
    try:
        seen = _in_fork(lambda: {"status": bootstrap("kvt").status, "step": _engine().step()})
    finally:
        release.set()
        thread.join()
    assert seen == {"status": "applied", "step": ["kvcached", "vanilla"]}
    assert _engine().step() == "vanilla"  # the parent was not touched


def test_spawned_process_bootstraps_itself(engine_site: FakeSite) -> None:
    bootstrap("kvt")
    code = (
        "import json\n"
        "from kvcached_core.plugins import bootstrap\n"
        "first, second = bootstrap('kvt'), bootstrap('kvt')\n"
        "from kvt_engine.core import Engine\n"
        "print(json.dumps([first.status, first.inherited, second.repeated, Engine().step()]))\n"
    )
    done = engine_site.python("-c", code)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["applied", False, True, ["kvcached", "vanilla"]]


def test_importing_kvcached_has_no_side_effects(engine_site: FakeSite) -> None:
    code = (
        "import sys, threading\n"
        "import kvcached_core\n"
        "assert 'kvcached_core.plugins' not in sys.modules\n"
        "import kvcached_core.plugins, kvcached_core.cli.kvctl, kvcached_core.plugins.doctor\n"
        "from kvcached_core.plugins import manager, patching\n"
        "assert manager._manager is None and not patching._ACTIVE\n"
        "assert 'kvt_plugin' not in sys.modules and 'kvt_engine' not in sys.modules\n"
        "assert threading.active_count() == 1\n"
        "print('clean')\n"
    )
    done = engine_site.python("-c", code)
    assert done.stdout.strip() == "clean", done.stderr


def test_unknown_version_is_loud_and_can_be_stated(
    site: FakeSite, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    site.install_engine(dist=None, module_version="0.0.0.dev0")  # a source tree without metadata
    site.install_adapter()
    with caplog.at_level(logging.WARNING, logger="kvcached"):
        result = bootstrap("kvt")
    assert result.status == "unknown-version"
    assert "cannot tell which kvt version is running" in caplog.text
    assert "'0.0.0.dev0', a placeholder" in caplog.text
    assert "set KVCACHED_KVT_VERSION=<version>" in caplog.text
    assert _engine().step() == "vanilla"

    teardown("kvt")
    with pytest.raises(PluginError, match="KVCACHED_STRICT=1 refuses"):
        bootstrap("kvt", strict=True)

    monkeypatch.setenv("KVCACHED_KVT_VERSION", "1.4")
    result = bootstrap("kvt")
    assert result.status == "applied" and result.version_source == "env KVCACHED_KVT_VERSION"


def test_unsupported_version(site: FakeSite, monkeypatch: pytest.MonkeyPatch) -> None:
    site.install_engine(version="2.1.0", dist="kvt-engine")
    site.install_adapter()
    result = bootstrap("kvt")
    assert result.status == "unsupported"
    assert result.reason == (
        "kvt 2.1.0 (distribution kvt-engine) is outside the versions plugin 'kvt' "
        "(distribution 'kvcached-kvt') supports (<2,>=1.0); the nearest covered release is "
        "kvt 1.5.0: pip install 'kvt-engine==1.5.0', or a kvcached-kvt release that covers "
        "2.1.0; engine left vanilla"
    )
    teardown("kvt")
    monkeypatch.setenv("KVCACHED_STRICT", "yes")
    with pytest.raises(PluginError, match="outside the versions"):
        bootstrap("kvt")


def test_no_adapter(engine_site: FakeSite, caplog: pytest.LogCaptureFixture) -> None:
    engine_site.plugin("kvcached-broken", "broken", "kvt_broken", "raise ImportError('x')\n")
    with caplog.at_level(logging.WARNING, logger="kvcached"):
        result = bootstrap("other")
    assert result.status == "no-adapter"
    assert "no installed plugin provides an adapter for engine 'other'" in result.reason
    assert "plugin 'broken' (distribution 'kvcached-broken') failed to load" in result.reason
    with pytest.raises(
        PluginError, match="no installed plugin provides an adapter for engine 'missing'"
    ):
        bootstrap("missing", strict=True)


def _register(patch_sets: Any) -> None:
    """Register a plugin "inline" with an adapter "inline" for the test engine, versions >=1."""
    adapter = EngineAdapter(
        name="inline",
        distributions=("kvt-engine-cpu",),
        module="kvt_engine",
        versions=">=1",
        patch_sets=patch_sets,
    )

    class Plugin:
        @hookimpl
        def kvcached_engine_adapters(self) -> EngineAdapter:
            return adapter

    get_plugin_manager().add_plugin(Plugin(), "inline", "kvcached-inline")


def test_failing_patch_leaves_the_engine_vanilla_or_refuses_when_strict(
    engine_site: FakeSite,
) -> None:
    def patches(version: Any) -> list[Patch]:
        return [
            Patch("kvt_engine.core:Engine.step", wrapper=lambda o: lambda self: "x", name="ok"),
            Patch("kvt_engine.core:Engine.gone", replacement=1, name="gone"),
        ]

    _register(patches)
    result = bootstrap("inline")
    assert result.status == "failed" and not result.active
    assert result.reason.startswith(
        "patch 'gone' failed: 'kvt_engine.core:Engine.gone' does not exist"
    )
    assert _engine().step() == "vanilla"
    teardown("inline")
    with pytest.raises(PatchError) as info:
        bootstrap("inline", strict=True)
    assert "plugin 'inline' (distribution 'kvcached-inline')" in str(info.value)
    assert _engine().step() == "vanilla"


def test_factory_errors_and_empty_sets(engine_site: FakeSite) -> None:
    def explode(version: Any) -> None:
        raise RuntimeError("no table for this version")

    _register(explode)
    result = bootstrap("inline")
    assert result.status == "failed"
    assert (
        "plugin 'inline' (distribution 'kvcached-inline'): the patch-set factory" in result.reason
    )
    assert "RuntimeError: no table for this version" in result.reason


def test_nothing_matching_is_skipped(engine_site: FakeSite) -> None:
    _register(lambda v: Patch("kvt_engine.core:Engine.step", versions="<1", replacement=None))
    result = bootstrap("inline")
    assert result.status == "skipped" and "no patch of plugin 'inline'" in result.reason
    with pytest.raises(PluginError, match="no patch of plugin 'inline'"):
        teardown("inline") or bootstrap("inline", strict=True)
