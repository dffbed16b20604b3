"""One test (at least) per hook specification, and a meta-test that keeps it so."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sys

import pytest
from packaging.version import Version

from kvcached_core import hookimpl
from kvcached_core.errors import PluginError
from kvcached_core.plugins import (
    BackendRecord,
    EngineAdapter,
    KVCachedPluginManager,
    Patch,
    available_backends,
    bootstrap,
    get_plugin_manager,
    hookspecs,
    reset_plugin_manager,
    select_backend,
)

if TYPE_CHECKING:
    from tests.plugins.conftest import FakeSite

REPO = Path(__file__).resolve().parents[2]


def _hook_names() -> list[str]:
    return sorted(
        name
        for name, obj in vars(hookspecs).items()
        if name.startswith("kvcached_") and hasattr(obj, f"{hookspecs.PROJECT_NAME}_spec")
    )


def _manager(*plugins: tuple[str, Any]) -> KVCachedPluginManager:
    manager = KVCachedPluginManager()
    for name, plugin in plugins:
        info = manager.add_plugin(plugin, name, f"dist-{name}")
        assert info.status == "loaded", info
    reset_plugin_manager(manager)
    return manager


def _adapter(name: str) -> EngineAdapter:
    return EngineAdapter(
        name=name, distributions=(name,), module=name, versions=">=1", patch_sets=lambda version: []
    )


# -- kvcached_engine_adapters ------------------------------------------------


def test_kvcached_engine_adapters_register_typed_records() -> None:
    class One:
        @hookimpl
        def kvcached_engine_adapters(self) -> EngineAdapter:
            return _adapter("alpha")

    class Many:
        @hookimpl
        def kvcached_engine_adapters(self) -> Any:
            return (a for a in [_adapter("beta"), _adapter("gamma")])

    class Nothing:
        @hookimpl
        def kvcached_engine_adapters(self) -> None:
            return None

    manager = _manager(("one", One()), ("many", Many()), ("nothing", Nothing()))
    adapters = manager.engine_adapters()
    assert sorted(adapters) == ["alpha", "beta", "gamma"]
    assert adapters["alpha"].plugin == "one" and adapters["alpha"].distribution == "dist-one"
    assert adapters["gamma"].owner == "plugin 'many' (distribution 'dist-many')"
    assert str(adapters["beta"].versions) == ">=1"


def test_kvcached_engine_adapters_duplicates_and_wrong_types() -> None:
    class First:
        @hookimpl
        def kvcached_engine_adapters(self) -> EngineAdapter:
            return _adapter("alpha")

    class Second(First):
        pass

    class Wrong:
        @hookimpl
        def kvcached_engine_adapters(self) -> Any:
            return ["not an adapter"]

    manager = _manager(("wrong", Wrong()), ("first", First()))
    assert list(manager.engine_adapters()) == ["alpha"]
    assert manager.problems == (
        "plugin 'wrong' (distribution 'dist-wrong'): kvcached_engine_adapters returned a str, "
        "expected EngineAdapter",
    )
    manager.add_plugin(Second(), "second", "dist-second")
    with pytest.raises(PluginError, match=r"^engine 'alpha' is claimed twice: by plugin") as info:
        manager.engine_adapters()
    assert "plugin 'first' (distribution 'dist-first')" in str(info.value)
    assert "plugin 'second' (distribution 'dist-second')" in str(info.value)


# -- kvcached_extra_patches --------------------------------------------------


def test_kvcached_extra_patches_join_the_engine_patch_set(engine_site: FakeSite) -> None:
    seen: list[tuple[str, Version]] = []

    class Extra:
        @hookimpl
        def kvcached_extra_patches(self, engine: str, version: Version) -> list[Patch]:
            seen.append((engine, version))
            return [
                Patch(
                    "kvt_engine.core:Engine.allocate",
                    versions=">=1.2",
                    wrapper=lambda orig: lambda self, n: orig(self, n) + ["extra"],
                    name="extra-allocate",
                )
            ]

    class Optional:
        @hookimpl
        def kvcached_extra_patches(self, engine: str, version: Version | None = None) -> None:
            seen.append((f"optional {engine}", version))  # type: ignore[arg-type]

    get_plugin_manager().add_plugin(Extra(), "extra", "kvcached-extra")
    get_plugin_manager().add_plugin(Optional(), "optional", "kvcached-optional")
    result = bootstrap("kvt")
    assert sorted(seen) == [("kvt", Version("1.2.0+cpu")), ("optional kvt", Version("1.2.0+cpu"))]
    assert result.patch_set is not None
    assert result.patch_set.applied == ("elastic-step", "extra-allocate")
    from kvt_engine.core import Engine

    assert Engine().allocate(1) == ["block", "extra"]


def test_kvcached_extra_patches_failure_rolls_back_the_whole_engine(engine_site: FakeSite) -> None:
    class Extra:
        @hookimpl
        def kvcached_extra_patches(self, engine: str) -> Patch:
            return Patch("kvt_engine.core:Engine.missing", replacement=1, name="extra-missing")

    get_plugin_manager().add_plugin(Extra(), "extra", "kvcached-extra")
    result = bootstrap("kvt")
    assert result.status == "failed"
    assert result.patch_set is not None and result.patch_set.rolled_back == ("elastic-step",)
    assert "plugin 'extra' (distribution 'kvcached-extra')" in result.reason
    from kvt_engine.core import Engine

    assert Engine().step() == "vanilla"


# -- kvcached_backends -------------------------------------------------------


def test_kvcached_backends_contribute_records() -> None:
    def make_xpu() -> str:
        return "xpu-backend"

    class Xpu:
        @hookimpl
        def kvcached_backends(self) -> BackendRecord:
            return BackendRecord(
                name="xpu", devices="xpu", description="Level Zero", factory=make_xpu
            )

    _manager(("xpu", Xpu()))
    backends = available_backends()
    assert list(backends) == ["xpu"]
    assert backends["xpu"].devices == ("xpu",)
    assert backends["xpu"].factory is make_xpu
    assert backends["xpu"].to_dict()["distribution"] == "dist-xpu"


def test_kvcached_backends_duplicate_names_raise() -> None:
    class A:
        @hookimpl
        def kvcached_backends(self) -> list[BackendRecord]:
            return [BackendRecord(name="xpu")]

    class B(A):
        pass

    manager = _manager(("a", A()), ("b", B()))
    with pytest.raises(PluginError, match=r"backend 'xpu' is claimed twice"):
        manager.backends()


# -- kvcached_select_backend -------------------------------------------------


def test_kvcached_select_backend_first_answer_wins() -> None:
    calls: list[str] = []

    class NoOpinion:
        @hookimpl
        def kvcached_select_backend(self, device: str, compiled: tuple[str, ...]) -> None:
            calls.append("none")
            return None

    class Hip:
        @hookimpl
        def kvcached_select_backend(self, device: str, compiled: tuple[str, ...]) -> str | None:
            calls.append("hip")
            return "hip" if device.startswith("cuda") and "hip" in compiled else None

    class Later:
        @hookimpl(trylast=True)
        def kvcached_select_backend(self, device: str) -> str:
            calls.append("later")
            return "host"

    _manager(("later", Later()), ("hip", Hip()), ("none", NoOpinion()))
    assert select_backend("cuda:0", ("cuda", "hip", "host")) == "hip"
    assert calls == ["none", "hip"]
    assert select_backend("cpu", ["host"]) == "host"  # type: ignore[arg-type]


def test_kvcached_select_backend_errors_are_isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        @hookimpl(tryfirst=True)
        def kvcached_select_backend(self, device: str) -> str:
            raise RuntimeError("no driver")

    class Wrong:
        @hookimpl
        def kvcached_select_backend(self, device: str) -> int:
            return 3

    class Host:
        @hookimpl(trylast=True)
        def kvcached_select_backend(self, device: str) -> str:
            return "host"

    manager = _manager(("host", Host()), ("wrong", Wrong()), ("broken", Broken()))
    assert select_backend("cpu", ("host",)) == "host"
    assert manager.problems == (
        "plugin 'broken' (distribution 'dist-broken'): kvcached_select_backend raised "
        "RuntimeError: no driver",
        "plugin 'wrong' (distribution 'dist-wrong'): kvcached_select_backend returned 3, "
        "expected a backend name or None",
    )
    monkeypatch.setenv("KVCACHED_STRICT", "1")
    with pytest.raises(PluginError, match="no driver"):
        select_backend("cpu", ("host",))


def test_kvcached_select_backend_without_plugins_is_none() -> None:
    assert select_backend("cuda:0", ("cuda", "host")) is None
    assert available_backends() == {}


# -- the meta-test -----------------------------------------------------------


def test_every_hook_has_a_test_and_a_documented_example() -> None:
    hooks = _hook_names()
    assert {
        "kvcached_engine_adapters",
        "kvcached_extra_patches",
        "kvcached_backends",
        "kvcached_select_backend",
    } <= set(hooks)
    tests: set[str] = set()
    for path in Path(__file__).parent.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        tests |= {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
        }
    untested = [hook for hook in hooks if not any(hook in test for test in tests)]
    assert not untested, f"hooks without a test named after them: {untested}"

    docs = (REPO / "docs" / "plugins.md").read_text()
    sections = re.split(r"^### ", docs, flags=re.M)
    for hook in hooks:
        section = next((s for s in sections if s.startswith(f"`{hook}")), None)
        assert section is not None, f"docs/plugins.md has no '### `{hook}`' section"
        assert "@hookimpl" in section, f"the section on {hook} has no example"
        assert (hookspecs.__dict__[hook].__doc__ or "").strip(), f"{hook} has no docstring"


def test_kvcached_engine_adapters_patch_sets_by_import_path(tmp_path, monkeypatch) -> None:
    """A ``"module:function"`` factory is imported on first call, not when the record is made."""
    (tmp_path / "kvt_lazy_patches.py").write_text(
        "CALLS = []\n"
        "def build(version):\n"
        "    CALLS.append(str(version))\n"
        "    return []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    adapter = EngineAdapter(name="lazy", distributions=("lazy",), module="lazy", versions=">=1",
                            patch_sets="kvt_lazy_patches:build")
    assert "kvt_lazy_patches" not in sys.modules
    assert adapter.patch_sets(Version("1.2")) == []
    assert sys.modules["kvt_lazy_patches"].CALLS == ["1.2"]
    with pytest.raises(PluginError, match="patch_sets 'no colon' is not 'module:function'"):
        EngineAdapter(name="bad", distributions=("bad",), module="bad", versions=">=1",
                      patch_sets="no colon")
