"""``kvcached_backends``: a plugin's backend serves a device type kvcached does not know.

The plugin is :mod:`tests.plugins.pymem_backend` (pages of host memory mapped
from Python, for ``pymem:N`` devices); the allocator runs over it unchanged.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvcached_core import hookimpl
from kvcached_core.allocator import K, V, KVBlockManager, KVLayout, KVTensors, PageAllocator
from kvcached_core.config import Settings
from kvcached_core.device import Device, parse_device
from kvcached_core.errors import (
    BackendUnavailableError,
    DeviceOutOfMemoryError,
    KVCachedConfigError,
    MappingError,
    PluginError,
)
from kvcached_core.plugins import BackendRecord, KVCachedPluginManager, reset_plugin_manager
from kvcached_core.vmm import as_tensor, open_mapper
from tests.plugins import pymem_backend
from tests.plugins.pymem_backend import CAPACITY, PyMemMapper

if TYPE_CHECKING:
    from tests.plugins.conftest import FakeSite

PAGE = 64 << 10
BLOCK = 16 << 10
QUIET = Settings(page_size=PAGE, contiguous_layout=None, prealloc=False, min_reserved_pages=0,
                 max_reserved_pages=2, idle_trim_s=0.0, memory_limit=None, gpu_utilization=1.0)


def _manager(*plugins: tuple[str, Any]) -> KVCachedPluginManager:
    manager = KVCachedPluginManager()
    for name, plugin in plugins:
        assert manager.add_plugin(plugin, name, f"dist-{name}").status == "loaded"
    reset_plugin_manager(manager)
    return manager


def _record(**fields: Any) -> Any:
    class Plugin:
        @hookimpl
        def kvcached_backends(self) -> BackendRecord:
            return BackendRecord(**fields)

    return Plugin()


def test_kvcached_backends_serve_a_new_device_type_through_entry_points(site: FakeSite) -> None:
    site.plugin("kvcached-pymem", "pymem", "kvt_pymem", "from tests.plugins.pymem_backend import *")
    dev = parse_device(" PyMem:3 ")
    assert (dev.backend, dev.index, dev.torch_device) == ("pymem-mmap", 3, "cpu")
    mapper = open_mapper("pymem:3", PAGE)
    assert isinstance(mapper, PyMemMapper) and (mapper.backend, mapper.device) == ("pymem-mmap", 3)


def test_kvcached_backends_carry_the_allocator_unchanged() -> None:
    _manager(("pymem", pymem_backend))
    for contiguous in (False, True):
        layout = KVLayout(2, 16 * PAGE, PAGE, contiguous=contiguous)
        kv = KVTensors.open("pymem:0", layout)
        assert kv.device == Device("pymem-mmap", 0, "cpu") and kv.device.is_gpu
        assert repr(kv).startswith(f"<KVTensors {'contiguous' if contiguous else 'per-layer'} cpu")
        pages = PageAllocator(kv, settings=QUIET)
        blocks = KVBlockManager(pages, BLOCK)
        try:
            ids = blocks.alloc(20)  # 5 pages of 4 blocks, one more for the null block
            assert ids is not None and kv.mapped_pages == 6
            for kind in (K, V):
                rows = kv.block_view(1, kind, BLOCK, torch.uint8)
                for b in ids:
                    rows[b].fill_(b + kind)
            for kind in (K, V):
                rows = kv.block_view(1, kind, BLOCK, torch.uint8)
                assert all(int(rows[b][-1]) == b + kind for b in ids)
            blocks.free(ids)
            pages.trim()
            assert kv.mapped_pages == 1 and kv.mapper.stats().mapped_pages == kv.handles_per_page
            assert kv.device_total() == CAPACITY
        finally:
            pages.close()


def test_kvcached_backends_mappers_keep_the_mapper_contract() -> None:
    _manager(("pymem", pymem_backend))
    mapper = open_mapper("pymem:0", PAGE)
    with pytest.raises(MappingError, match=r"^plugin 'pymem' \(distribution 'dist-pymem'\): "
                       r"backend 'pymem-mmap': .*not a multiple of the granularity"):
        open_mapper("pymem:0", 1000)  # a kvcached error from the factory keeps its kind
    vt = mapper.reserve(4 * PAGE)
    mapper.map([vt], [0, 2])
    view = as_tensor(vt)
    view[2 * PAGE] = 7
    assert vt.mapped_pages == 2 and int(view[2 * PAGE]) == 7
    with pytest.raises(MappingError, match="page 2 is already mapped"):
        mapper.map([vt], [1, 2])
    assert not vt.is_mapped(1)  # all or nothing
    mapper.unmap([vt], [2])
    assert int(view[2 * PAGE]) == 0  # the memory went back
    big = mapper.reserve(CAPACITY)
    with pytest.raises(DeviceOutOfMemoryError, match="pymem:0"):
        mapper.map([big], list(range(CAPACITY // PAGE)))


def test_kvcached_backends_serve_a_native_device_when_selected() -> None:
    class OnCpu:
        @hookimpl
        def kvcached_select_backend(self, device: str) -> str | None:
            return "pymem-mmap" if device == "cpu" else None

    _manager(("pymem", pymem_backend), ("oncpu", OnCpu()))
    assert parse_device("cpu") == Device("pymem-mmap", 0, "cpu")
    assert isinstance(open_mapper("cpu", PAGE), PyMemMapper)
    assert parse_device("cuda:1").backend in ("cuda", "hip")  # the plugin left it alone


def test_kvcached_backends_unclaimed_device_types_stay_errors() -> None:
    _manager(("pymem", pymem_backend))
    with pytest.raises(KVCachedConfigError, match=r"device 'tpu:0' is not a device string "
                       r"kvcached understands .*no installed plugin serves 'tpu' devices"):
        parse_device("tpu:0")
    with pytest.raises(KVCachedConfigError, match="index 70000 is outside"):
        parse_device("pymem:70000")


def test_kvcached_backends_mistakes_name_the_plugin() -> None:
    _manager(("bare", _record(name="bare", devices="baredev")))
    with pytest.raises(BackendUnavailableError, match=r"backend 'bare' of plugin 'bare' "
                       r"\(distribution 'dist-bare'\), which has no factory"):
        parse_device("baredev:0")

    def broken(device: Device, page_size: int) -> None:
        raise OSError("no such device")

    _manager(("broken", _record(name="broken", devices="brokendev", factory=broken)))
    with pytest.raises(PluginError, match=r"plugin 'broken' .*: backend 'broken': its factory "
                       r"failed for device index 0 .*OSError: no such device"):
        open_mapper("brokendev:0", PAGE)

    def other(device: Device, page_size: int) -> PyMemMapper:
        return PyMemMapper(Device("pymem-mmap", device.index, "cpu"), page_size)

    _manager(("other", _record(name="other", devices="otherdev", factory=other)))
    with pytest.raises(PluginError, match=r"returned a PyMemMapper whose backend, device, page "
                       r"size and torch_device are \('pymem-mmap', 0, 65536, 'cpu'\), not "
                       r"\('other', 0, 65536, 'otherdev:0'\)"):
        open_mapper("otherdev:0", PAGE)

    def wrong_index(device: Device, page_size: int) -> PyMemMapper:
        return PyMemMapper(Device("pymem-mmap", 6, "cpu"), page_size)

    _manager(("six", _record(name="pymem-mmap", devices="pymem", torch_device="cpu",
                             factory=wrong_index)))
    with pytest.raises(PluginError, match=r"plugin 'six' .*device, page size and torch_device "
                       r"are \('pymem-mmap', 6, 65536, 'cpu'\), not \('pymem-mmap', 1, 65536, "
                       r"'cpu'\)"):
        open_mapper("pymem:1", PAGE)

    closed: list[bool] = []

    class NoGroup:  # a mapper's attributes, not its methods
        backend, device, page_size, torch_device = "nogroup", 0, PAGE, "nogroupdev:0"

        def reserve(self, size: int) -> None: ...

        def close(self) -> None:
            closed.append(True)

    _manager(("nogroup", _record(name="nogroup", devices="nogroupdev",
                                 factory=lambda device, page_size: NoGroup())))
    with pytest.raises(PluginError, match=r"plugin 'nogroup' .*returned a NoGroup without group, "
                       r"trim_pool, mem_info, stats"):
        open_mapper("nogroupdev:0", PAGE)
    assert closed == [True]  # the rejected mapper was let go

    manager = _manager(("pymem", pymem_backend),
                       ("again", _record(name="again", devices=("pymem",), factory=other)))
    with pytest.raises(PluginError, match=r"device type 'pymem' is claimed twice: by backend "
                       r"'again' of plugin 'again' .* and by backend 'pymem-mmap' of plugin "
                       r"'pymem'"):
        manager.backends()


@pytest.mark.parametrize("devices, message", [
    (("cuda",), "kvcached serves 'cuda' devices itself"),
    (("Pymem",), "device type 'Pymem' is invalid"),
    (("py:mem",), "device type 'py:mem' is invalid"),
])
def test_kvcached_backends_device_types_are_checked(devices: tuple[str, ...], message: str) -> None:
    with pytest.raises(PluginError, match=message):
        BackendRecord(name="x", devices=devices)


@pytest.mark.parametrize("name", ["cuda", "hip", "host", "CUDA", "cpu"])
def test_kvcached_backends_names_of_compiled_backends_are_taken(name: str) -> None:
    with pytest.raises(PluginError, match=f"backend name '{name}' is taken by kvcached's own"):
        BackendRecord(name=name, devices="xdev")


@pytest.mark.parametrize("fields, message", [
    ({"devices": 5}, "devices must be a device type or a sequence of them, not int"),
    ({"description": ["x"]}, "description must be a string, not list"),
])
def test_kvcached_backends_record_fields_are_checked(fields: dict, message: str) -> None:
    with pytest.raises(PluginError, match=message):
        BackendRecord(name="x", **fields)


def test_kvcached_backends_records_name_the_plugin_that_returned_them() -> None:
    class Impostor:
        @hookimpl
        def kvcached_backends(self) -> BackendRecord:
            return BackendRecord(name="imp", devices="impdev", plugin="pymem",
                                 distribution="dist-pymem")

    manager = _manager(("imp", Impostor()))
    assert manager.backends()["imp"].owner == "plugin 'imp' (distribution 'dist-imp')"


def test_kvcached_backends_generator_hooks_that_fail_name_the_plugin() -> None:
    class Yields:
        @hookimpl
        def kvcached_backends(self) -> Any:
            yield BackendRecord(name="cuda", devices="ydev")

    manager = _manager(("yields", Yields()), ("pymem", pymem_backend))
    assert list(manager.backends()) == ["pymem-mmap"]  # the other plugin still serves
    assert parse_device("pymem:0").backend == "pymem-mmap"
    assert any(p.startswith("plugin 'yields' (distribution 'dist-yields'): kvcached_backends "
                            "raised PluginError: backend name 'cuda' is taken")
               for p in manager.problems), manager.problems
    with pytest.raises(KVCachedConfigError, match=r"device 'ydev:0': no installed plugin serves "
                       r"'ydev' devices; these plugins' backends could not be read: plugin "
                       r"'yields'"):
        parse_device("ydev:0")


@pytest.mark.parametrize("device, choice, fits", [
    ("cpu", "cuda", "which takes 'host' or a plugin's backend"),
    ("cuda:1", "host", "which takes 'cuda' or 'hip' or a plugin's backend"),
    ("cuda:0", "nosuch", "which takes 'cuda' or 'hip' or a plugin's backend"),
    ("pymem:0", "host", "which no installed plugin contributes"),
])
def test_kvcached_backends_a_selection_that_serves_nothing_is_passed_over(
        monkeypatch: pytest.MonkeyPatch, device: str, choice: str, fits: str) -> None:
    class Chooser:
        @hookimpl
        def kvcached_select_backend(self, device: str) -> str:
            return choice

    manager = _manager(("pymem", pymem_backend), ("chooser", Chooser()))
    expected = (rf"plugin 'chooser' \(distribution 'dist-chooser'\): kvcached_select_backend "
                rf"chose backend '{choice}' for device '{device}', {fits} \(contributed: "
                rf"pymem-mmap\)")
    own = {"cpu": "host", "cuda:1": "cuda", "cuda:0": "cuda", "pymem:0": "pymem-mmap"}[device]
    assert parse_device(device).backend == own  # reported, then kvcached's own rule
    assert any(re.fullmatch(expected, p) for p in manager.problems), manager.problems
    monkeypatch.setenv("KVCACHED_STRICT", "1")
    with pytest.raises(PluginError, match=expected):
        parse_device(device)


@pytest.mark.parametrize("template", ["{type}:{index}", "{", 3])
def test_kvcached_backends_torch_device_templates_are_checked(template: Any) -> None:
    with pytest.raises(PluginError, match="is not a device name or a template with '{index}'"):
        BackendRecord(name="x", devices="xdev", torch_device=template)
    assert BackendRecord(name="x", torch_device="xpu:{index}").torch_device_of("x:3", 3) == "xpu:3"


def test_kvcached_backends_reach_a_process_through_the_plugin_framework(site: FakeSite) -> None:
    """The memory stack alone serves no plugin device; importing the framework wires it in."""
    site.plugin("kvcached-pymem", "pymem", "kvt_pymem", "from tests.plugins.pymem_backend import *")
    code = (
        "import json, sys\n"
        "from kvcached_core.errors import KVCachedConfigError\n"
        "from kvcached_core.vmm import open_mapper\n"
        "try:\n"
        "    open_mapper('pymem:0', 1 << 16)\n"
        "    alone = 'served'\n"
        "except KVCachedConfigError as exc:\n"
        "    alone = str(exc)\n"
        "import kvcached_core.plugins\n"
        "mapper = open_mapper('pymem:0', 1 << 16)\n"
        "print(json.dumps([alone, type(mapper).__name__]))\n"
    )
    done = site.python("-c", code)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [
        "device 'pymem:0' is not a device string kvcached understands (use 'cpu', 'cuda:N' or "
        "'hip:N')",
        "PyMemMapper",
    ]


def test_kvcached_backends_share_the_budget_of_the_memory_they_serve(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin backend's pools join the budget record of the memory torch names, so they
    share it with the engines kvcached's own backends run on that memory."""
    from kvcached_core.config import load_settings
    from kvcached_core.pool import budget_device, join_device_budget

    plugin = pymem_backend.kvcached_backends()
    assert budget_device(Device("host", 0, "cpu")) == ("host", 0)
    assert budget_device(Device("cuda", 2, "cuda:2")) == ("cuda", 2)
    assert budget_device(Device("pymem-mmap", 3, "cpu", provider=plugin)) == ("host", 0)
    assert budget_device(Device("mygpu", 1, "cuda:1", provider=plugin)) == ("cuda", 1)
    assert budget_device(Device("level-zero", 1, "xpu:1", provider=plugin)) == ("xpu", 1)

    tmp_path.chmod(0o700)
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(tmp_path))
    monkeypatch.delenv("KVCACHED_BUDGET_DEVICE", raising=False)
    _manager(("pymem", pymem_backend))
    monkeypatch.setenv("KVCACHED_DEVICE_BUDGET", "64M")
    settings = load_settings()
    native = join_device_budget(parse_device("cpu"), settings, CAPACITY, "native/kv0")
    plugged = join_device_budget(parse_device("pymem:0"), settings, CAPACITY, "pymem/kv0")
    assert native is not None and plugged is not None
    assert plugged.record.path == native.record.path  # one record: the host's
    assert {s.name for s in native.record.read().slots if s.alive} == {"native/kv0",
                                                                        "pymem/kv0"}
