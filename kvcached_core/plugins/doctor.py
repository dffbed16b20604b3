"""The report behind ``kvctl doctor``: plugins, engines, patches and settings.

:func:`build_report` returns a JSON-ready dictionary whose layout is versioned
by its ``schema`` key (:data:`SCHEMA`); ``docs/plugins.md`` documents it. Run
from a separate process (``kvctl doctor``) it tells what *would* happen; called
inside an engine process it also shows what bootstrap *did* there.

The report never patches anything. It imports engines (and patch targets) only
when asked to, since importing an engine can take seconds.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from typing import Any

from kvcached_core import __version__
from kvcached_core.env import env_bool, env_list
from kvcached_core.errors import KVCachedConfigError, PluginError
from kvcached_core.plugins.bootstrap import bootstrap_results, build_patch_set, engine_patch_set
from kvcached_core.plugins.manager import (
    ENTRY_POINT_GROUP,
    KVCachedPluginManager,
    get_plugin_manager,
)
from kvcached_core.plugins.records import EngineAdapter
from kvcached_core.plugins.versions import detect_engine_version

__all__ = ["SCHEMA", "build_report"]

#: Version of the report layout; bumped when a key changes meaning or goes away.
SCHEMA = "kvcached.doctor/1"

#: Variables shown in the report's ``env`` section (besides ``KVCACHED_*_VERSION``).
_VARIABLES = ("KVCACHED_ENABLED", "KVCACHED_STRICT", "KVCACHED_PLUGINS", "KVCACHED_DISABLE_PLUGINS")


#: An ``engines`` entry for an engine bootstrapped here without an adapter.
_NO_ADAPTER: dict[str, Any] = {
    "name": None,
    "distributions": [],
    "module": None,
    "versions": None,
    "description": "",
    "covered": [],
    "plugin": None,
    "distribution": None,
    "installed": None,
    "version": None,
    "in_range": None,
    "nearest_covered": None,
    "patches": [],
    "bootstrap": None,
}


def _setting(name: str, problems: list[str]) -> bool | None:
    try:
        return env_bool(name, name == "KVCACHED_ENABLED")
    except KVCachedConfigError as exc:
        problems.append(str(exc))
        return None


def _manager(problems: list[str]) -> KVCachedPluginManager:
    try:
        return get_plugin_manager()
    except KVCachedConfigError as exc:
        # Still show what is installed: load every plugin but the blocked ones.
        problems.append(str(exc))
        manager = KVCachedPluginManager()
        manager.load_entry_points(block=env_list("KVCACHED_DISABLE_PLUGINS"))
        return manager


def _installed(adapter: EngineAdapter, found_version: bool) -> bool:
    if found_version:
        return True
    try:
        return importlib.util.find_spec(adapter.module) is not None
    except (ImportError, ValueError):
        return False


def _engine_entry(
    manager: KVCachedPluginManager,
    adapter: EngineAdapter,
    import_engines: bool,
    problems: list[str],
) -> dict[str, Any]:
    found = detect_engine_version(
        adapter.name, adapter.module, adapter.distributions, import_module=import_engines
    )
    installed = _installed(adapter, found.raw is not None)
    entry: dict[str, Any] = {
        **adapter.to_dict(),
        "installed": installed,
        "version": found.to_dict(),
        "in_range": None,
        "nearest_covered": None,
        "patches": [],
        "bootstrap": None,
    }
    result = bootstrap_results().get(adapter.name)
    if result is not None:
        entry["bootstrap"] = result.to_dict()
    if found.version is None:
        if installed:
            problems.append(f"cannot tell which {adapter.name} version is installed ({found.note})")
        return entry
    entry["in_range"] = adapter.supports(found.version)
    if not entry["in_range"]:
        entry["nearest_covered"] = adapter.nearest_covered(found.version)
        problems.append(adapter.outside_note(found.version, found))
        return entry
    patch_set = engine_patch_set(adapter.name)
    try:
        if patch_set is None:
            patch_set = build_patch_set(manager, adapter, found.version)
    except PluginError as exc:
        problems.append(str(exc))
        return entry
    plans = patch_set.plan(found.version, resolve=import_engines)
    entry["patches"] = [plan.to_dict() for plan in plans]
    for plan in plans:
        if plan.verdict == "unresolvable" and plan.required:
            problems.append(f"patch {plan.name!r} of {adapter.name}: {plan.reason}")
    return entry


def build_report(*, import_engines: bool = False) -> dict[str, Any]:
    """Describe kvcached's plugin set-up in this process.

    Args:
        import_engines: Import each engine (to read ``__version__`` when no
            distribution metadata is found) and each patch target (to check it
            exists).

    Returns:
        A JSON-ready dictionary with the keys ``schema``, ``kvcached_core``,
        ``python``, ``pid``, ``enabled``, ``strict``, ``env``,
        ``entry_point_group``, ``plugins``, ``engines``, ``backends``,
        ``problems`` and ``ok`` (see ``docs/plugins.md``).
    """
    problems: list[str] = []
    enabled = _setting("KVCACHED_ENABLED", problems)
    strict = _setting("KVCACHED_STRICT", problems)
    env = {name: os.environ.get(name) for name in _VARIABLES}
    env.update(
        {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith("KVCACHED_") and k.endswith("_VERSION")
        }
    )
    manager = _manager(problems)

    engines: list[dict[str, Any]] = []
    try:
        adapters = manager.engine_adapters()
    except PluginError as exc:
        problems.append(str(exc))
        adapters = {}
    for adapter in adapters.values():
        try:
            engines.append(_engine_entry(manager, adapter, import_engines, problems))
        except KVCachedConfigError as exc:
            problems.append(str(exc))
    for name, result in sorted(bootstrap_results().items()):
        if name not in adapters:
            engines.append({**_NO_ADAPTER, "name": name, "bootstrap": result.to_dict()})

    try:
        backends = [b.to_dict() for b in manager.backends().values()]
    except PluginError as exc:
        problems.append(str(exc))
        backends = []

    problems = list(dict.fromkeys([*manager.problems, *problems]))
    return {
        "schema": SCHEMA,
        "kvcached_core": {
            "version": __version__,
            "path": os.path.dirname(os.path.dirname(__file__)),
        },
        "python": platform.python_version(),
        "pid": os.getpid(),
        "enabled": enabled,
        "strict": strict,
        "env": env,
        "entry_point_group": ENTRY_POINT_GROUP,
        "plugins": [info.to_dict() for info in manager.plugin_infos()],
        "engines": engines,
        "backends": backends,
        "problems": problems,
        "ok": not problems,
    }
