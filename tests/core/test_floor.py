"""The floors every layer stands on.

* One "no value" marker and one fork-hook mechanism, shared by every layer.
* The memory stack (device, vmm, allocator) never imports the plugin
  framework: plugins reach it only through the selector that
  :func:`kvcached_core.device.set_backend_selector` installs.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

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


# -- the memory stack stands below the plugin framework ------------------------

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "kvcached_core"
#: The memory stack: device strings, page mappers, the allocator.
MEMORY_STACK = ("kvcached_core.device", "kvcached_core.vmm", "kvcached_core.allocator")
PLUGINS = "kvcached_core.plugins"


def _source(module: str) -> Path | None:
    """The ``.py`` file of a kvcached_core module or package (``None``: not Python source)."""
    base = REPO.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _imported(path: Path, module: str, top_level_only: bool = False) -> set[str]:
    """Every module ``path`` imports: ``import``/``from`` statements anywhere in it
    (with ``top_level_only``, those that run when it is imported), ``from X import
    name`` counting as both ``X`` and ``X.name``, and ``import_module("...")``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _runs_at_import(tree) if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def _runs_at_import(tree: ast.Module):
    """The nodes that run when the module is imported: not function bodies, not
    ``if TYPE_CHECKING:`` blocks."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        yield node
        todo += list(ast.iter_child_nodes(node))


def _is_plugins(module: str) -> bool:
    return module == PLUGINS or module.startswith(PLUGINS + ".")


def test_the_memory_stack_sources_never_import_the_plugin_framework():
    """Static: no import of kvcached_core.plugins anywhere in the modules the stack reaches."""
    start = list(MEMORY_STACK)
    start += [f"kvcached_core.allocator.{p.stem}" for p in (CORE / "allocator").glob("*.py")]
    seen: dict[str, set[str]] = {}
    todo = list(start)
    while todo:
        module = todo.pop()
        path = _source(module)
        if module in seen or path is None:
            continue
        seen[module] = _imported(path, module)
        todo += [m for m in seen[module] if m.startswith("kvcached_core.") and m not in seen]
    assert {"kvcached_core.device", "kvcached_core.vmm", "kvcached_core.config",
            "kvcached_core.allocator.page_allocator"} <= set(seen)
    offenders = {m: sorted(filter(_is_plugins, names)) for m, names in seen.items()}
    assert not {m: names for m, names in offenders.items() if names}
    # The package root runs before any of them: at import it loads nothing of
    # the plugin framework (``kvcached_core.hookimpl`` is resolved on first use).
    assert not any(map(_is_plugins, _imported(CORE / "__init__.py", "kvcached_core", True)))


_STACK_IN_USE = """
import json, sys
from kvcached_core import device, vmm
from kvcached_core.allocator import KVBlockManager, KVLayout, KVTensors, PageAllocator
from kvcached_core.errors import KVCachedConfigError

assert device.parse_device("cpu").backend == "host"
assert device.parse_device("cuda:3").torch_device == "cuda:3"
try:
    device.parse_device("gpu:0")
except KVCachedConfigError:
    pass
page = 64 << 10
kv = KVTensors(vmm.open_mapper("cpu", page), KVLayout(2, 8 * page, page))
pages = PageAllocator(kv, prealloc=False, idle_trim_s=0)
blocks = KVBlockManager(pages, 16 << 10)
ids = blocks.alloc(9)
assert ids is not None and kv.mapped_pages >= 3
blocks.free(ids)
pages.close()
print(json.dumps(sorted(m for m in sys.modules
                        if m.startswith("kvcached_core.plugins") or m == "pluggy")))
"""


def test_using_the_memory_stack_loads_no_plugin_framework():
    """Dynamic: parse devices, map pages, allocate blocks; the plugin framework
    (and pluggy under it) stays unloaded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _STACK_IN_USE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_plugins_reach_the_device_code_through_the_installed_selector(monkeypatch):
    from kvcached_core import device
    from kvcached_core.plugins import manager

    assert device._selector is manager.backend_for  # installed by importing the framework
    asked: list[tuple[str, tuple[str, ...]]] = []

    def hip_for_gpus(text: str, compiled: tuple[str, ...]) -> str | None:
        asked.append((text, compiled))
        return "hip" if text.startswith("cuda") else None

    monkeypatch.setattr(device, "_selector", None)
    assert device.set_backend_selector(hip_for_gpus) is None
    dev = device.parse_device(" CUDA:2 ")
    assert (dev.backend, dev.index, dev.torch_device) == ("hip", 2, "cuda:2")
    assert asked == [("cuda:2", device.compiled_backends())]
    assert device.set_backend_selector(None) is hip_for_gpus
    assert device.parse_device("cuda:2").backend == "cuda"  # the compiled rule alone (no ROCm)
