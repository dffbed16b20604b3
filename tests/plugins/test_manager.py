"""Entry-point discovery through real distributions, selection, isolation and bad input."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import pytest

from kvcached_core.errors import KVCachedConfigError, PluginError
from kvcached_core.plugins import (
    ENTRY_POINT_GROUP,
    KVCachedPluginManager,
    get_plugin_manager,
    reset_plugin_manager,
)
from kvcached_core.plugins.versions import parse_version

if TYPE_CHECKING:
    from tests.plugins.conftest import FakeSite

BROKEN = "raise ImportError('needs a GPU driver')\n"

ADAPTER_WITH_BAD_SPECIFIER = """
    from kvcached_core import hookimpl
    from kvcached_core.plugins import EngineAdapter

    @hookimpl
    def kvcached_engine_adapters():
        return EngineAdapter(name="bad", distributions=("bad",), module="bad",
                             versions=">=1.0,<<2", patch_sets=lambda v: None)
"""

EXTRA_WITH_BAD_TARGET = """
    from kvcached_core import hookimpl
    from kvcached_core.plugins import Patch

    @hookimpl
    def kvcached_extra_patches(engine, version):
        return [Patch("kvt_engine.core.Engine.step", replacement=None)]
"""


def _statuses(manager: KVCachedPluginManager) -> dict[str, tuple[str, str | None]]:
    return {i.name: (i.status, i.distribution) for i in manager.plugin_infos()}


def test_loads_plugins_from_real_entry_points(engine_site: FakeSite) -> None:
    manager = get_plugin_manager()
    assert manager is get_plugin_manager()  # one per process
    [info] = manager.plugin_infos()
    assert info.name == "kvt" and info.status == "loaded"
    assert info.distribution == "kvcached-kvt" and info.distribution_version == "0.1.0"
    assert info.value == "kvt_plugin"
    assert info.hooks == ("kvcached_engine_adapters",)
    assert manager.distribution_of("kvt") == "kvcached-kvt"
    adapter = manager.engine_adapter("kvt")
    assert (
        adapter is not None and adapter.plugin == "kvt" and adapter.distribution == "kvcached-kvt"
    )
    reset_plugin_manager()
    assert get_plugin_manager() is not manager


def test_a_plugin_that_fails_to_load_is_isolated(
    engine_site: FakeSite, caplog: pytest.LogCaptureFixture
) -> None:
    engine_site.plugin("kvcached-broken", "broken", "kvt_broken", BROKEN)
    with caplog.at_level(logging.WARNING, logger="kvcached"):
        manager = get_plugin_manager()
    statuses = _statuses(manager)
    assert statuses == {"kvt": ("loaded", "kvcached-kvt"), "broken": ("failed", "kvcached-broken")}
    broken = next(i for i in manager.plugin_infos() if i.name == "broken")
    assert broken.error == "failed to load 'kvt_broken': ImportError: needs a GPU driver"
    assert "plugin 'broken' (distribution 'kvcached-broken') failed to load" in caplog.text
    assert manager.engine_adapter("kvt") is not None
    assert manager.problems == (
        "plugin 'broken' (distribution 'kvcached-broken') failed to load 'kvt_broken': "
        "ImportError: needs a GPU driver",
    )


@pytest.mark.parametrize("selector", ["kvt", "kvcached-kvt", "kvcached_kvt", "KVCACHED-KVT"])
def test_allow_list_by_entry_point_or_distribution(
    engine_site: FakeSite, monkeypatch: pytest.MonkeyPatch, selector: str
) -> None:
    engine_site.plugin("kvcached-broken", "broken", "kvt_broken", BROKEN)
    monkeypatch.setenv("KVCACHED_PLUGINS", selector)
    manager = get_plugin_manager()
    assert _statuses(manager) == {
        "kvt": ("loaded", "kvcached-kvt"),
        "broken": ("not-selected", "kvcached-broken"),
    }
    assert manager.problems == ()


def test_block_list_wins_over_allow_list(
    engine_site: FakeSite, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCACHED_PLUGINS", "kvt")
    monkeypatch.setenv("KVCACHED_DISABLE_PLUGINS", "kvcached-kvt")
    manager = get_plugin_manager()
    assert _statuses(manager) == {"kvt": ("blocked", "kvcached-kvt")}
    assert manager.engine_adapters() == {}
    assert manager.is_blocked("kvt")


def test_unknown_name_in_allow_list_is_an_error(
    engine_site: FakeSite, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCACHED_PLUGINS", "kvt,kvcached-vlm")
    with pytest.raises(KVCachedConfigError) as info:
        get_plugin_manager()
    assert str(info.value) == (
        "KVCACHED_PLUGINS names 'kvcached-vlm', which is not installed in group "
        f"'{ENTRY_POINT_GROUP}' (installed: kvt (kvcached-kvt))"
    )


def test_unknown_name_in_block_list_warns(
    engine_site: FakeSite, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVCACHED_DISABLE_PLUGINS", "nothing-like-this")
    with caplog.at_level(logging.WARNING, logger="kvcached"):
        manager = get_plugin_manager()
    assert (
        "KVCACHED_DISABLE_PLUGINS names 'nothing-like-this', which is not installed" in caplog.text
    )
    assert _statuses(manager)["kvt"][0] == "loaded"


def test_check_pending_rejects_unknown_hooks(engine_site: FakeSite) -> None:
    engine_site.plugin(
        "kvcached-typo",
        "typo",
        "kvt_typo",
        "from kvcached_core import hookimpl\n\n@hookimpl\ndef kvcached_engine_adapter():\n    return []\n",
    )
    manager = get_plugin_manager()
    typo = next(i for i in manager.plugin_infos() if i.name == "typo")
    assert typo.status == "failed" and typo.distribution == "kvcached-typo"
    assert "implements unknown hook(s) 'kvcached_engine_adapter'" in (typo.error or "")
    assert not manager.has_plugin("typo")
    assert manager.engine_adapter("kvt") is not None


def test_mismatched_hook_arguments_fail_registration(engine_site: FakeSite) -> None:
    engine_site.plugin(
        "kvcached-args",
        "args",
        "kvt_args",
        "from kvcached_core import hookimpl\n\n"
        "@hookimpl\ndef kvcached_extra_patches(engine, release):\n    return []\n",
    )
    manager = get_plugin_manager()
    args = next(i for i in manager.plugin_infos() if i.name == "args")
    assert args.status == "failed"
    assert "cannot be registered" in (args.error or "") and "release" in (args.error or "")


def test_two_adapters_for_one_engine_raise_naming_both(engine_site: FakeSite) -> None:
    engine_site.install_adapter(dist="kvcached-kvt-fork", name="kvt-fork", module="kvt_plugin_fork")
    manager = get_plugin_manager()
    with pytest.raises(PluginError) as info:
        manager.engine_adapters()
    message = str(info.value)
    assert message.startswith("engine 'kvt' is claimed twice: by plugin '")
    assert "plugin 'kvt' (distribution 'kvcached-kvt')" in message
    assert "plugin 'kvt-fork' (distribution 'kvcached-kvt-fork')" in message


def test_malformed_specifier_in_a_plugin_names_the_plugin(engine_site: FakeSite) -> None:
    engine_site.plugin("kvcached-bad", "bad", "kvt_bad", ADAPTER_WITH_BAD_SPECIFIER)
    manager = get_plugin_manager()
    adapters = manager.engine_adapters()
    assert list(adapters) == ["kvt"]  # the good plugin is unaffected
    [problem] = manager.problems
    assert problem.startswith(
        "plugin 'bad' (distribution 'kvcached-bad'): kvcached_engine_adapters raised"
    )
    assert "invalid version specifier '>=1.0,<<2'" in problem


def test_covered_releases_must_be_versions() -> None:
    from kvcached_core.plugins import EngineAdapter

    with pytest.raises(PluginError, match=r"engine adapter 'kvt': covered must be release "
                                          r"versions, got \('1.0', 'latest'\)"):
        EngineAdapter(name="kvt", distributions=("kvt-engine",), module="kvt_engine",
                      versions=">=1.0", patch_sets=lambda v: [], covered=("1.0", "latest"))


def test_malformed_target_in_a_plugin_names_the_plugin(engine_site: FakeSite) -> None:
    engine_site.plugin("kvcached-extra", "extra", "kvt_extra", EXTRA_WITH_BAD_TARGET)
    manager = get_plugin_manager()
    with pytest.raises(PluginError) as info:
        manager.extra_patches("kvt", parse_version("1.2"))
    message = str(info.value)
    assert message.startswith(
        "plugin 'extra' (distribution 'kvcached-extra'): kvcached_extra_patches raised"
    )
    assert "invalid target 'kvt_engine.core.Engine.step'" in message


def test_duplicate_entry_point_name_from_another_distribution(engine_site: FakeSite) -> None:
    engine_site.plugin("kvcached-kvt-copy", "kvt", "kvt_plugin_copy", "")
    manager = get_plugin_manager()
    infos = [(i.distribution, i.status) for i in manager.plugin_infos()]
    assert sorted(infos) == [("kvcached-kvt", "loaded"), ("kvcached-kvt-copy", "failed")] or sorted(
        infos
    ) == [("kvcached-kvt", "failed"), ("kvcached-kvt-copy", "loaded")]
    [problem] = manager.problems
    assert "reuses the plugin name 'kvt' of distribution" in problem


def test_no_plugins_installed() -> None:
    manager = get_plugin_manager()
    assert manager.engine_adapters() == {} and manager.backends() == {}
    assert manager.problems == ()
