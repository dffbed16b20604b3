"""The plugin manager: entry-point discovery, selection and typed hook calls.

Plugins are the objects named by entry points of the ``kvcached.engines``
group::

    [project.entry-points."kvcached.engines"]
    vllm = "kvcached_vllm.plugin"

Two variables select them, matching either the entry-point name or the
distribution name (``vllm`` or ``kvcached-vllm``):

* ``KVCACHED_PLUGINS``: comma-separated allow-list; unset loads every plugin.
  A name that matches no installed plugin is an error.
* ``KVCACHED_DISABLE_PLUGINS``: comma-separated block-list; it wins over the
  allow-list.

A plugin that fails to import or to validate is logged and skipped; the others
load normally. The manager is created lazily, once per process, by
:func:`get_plugin_manager`.

Importing this module installs :func:`backend_for` as the device code's
backend selector (:func:`kvcached_core.device.set_backend_selector`): the
memory stack asks plugins through it and never imports them itself.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import pluggy
from packaging.version import Version

from kvcached_core.plugins import hookspecs
from kvcached_core.device import NATIVE_BACKENDS, NATIVE_DEVICE_TYPES, set_backend_selector
from kvcached_core.env import env_bool, env_list
from kvcached_core.errors import BackendUnavailableError, KVCachedConfigError, PluginError
from kvcached_core.plugins._process import process_lock
from kvcached_core.plugins.patching import Patch
from kvcached_core.plugins.records import (
    BackendRecord,
    EngineAdapter,
    PluginInfo,
    describe_owner,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "KVCachedPluginManager",
    "available_backends",
    "backend_for",
    "get_plugin_manager",
    "reset_plugin_manager",
    "select_backend",
]

#: The entry-point group kvcached plugins register in.
ENTRY_POINT_GROUP = "kvcached.engines"

_log = logging.getLogger("kvcached")

_R = TypeVar("_R", EngineAdapter, BackendRecord, Patch)


def _normalize(name: str) -> str:
    """PEP 503 normalisation, so ``kvcached_vllm`` matches ``kvcached-vllm``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _dist_of(ep: importlib.metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    try:
        return dist.name, dist.version
    except (KeyError, AttributeError):  # a distribution without a Name/Version field
        return None, None


class KVCachedPluginManager(pluggy.PluginManager):
    """A pluggy manager for the ``kvcached`` hooks that knows where each plugin came from.

    Besides pluggy's API it offers typed access to every hook: each plugin's
    implementation is called separately so that any error names the plugin
    and its distribution.
    """

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self._infos: list[PluginInfo] = []
        self._dist_by_name: dict[str, str | None] = {}
        self._problems: dict[str, None] = {}
        self._adapters: dict[str, EngineAdapter] | None = None
        self._backends: dict[str, BackendRecord] | None = None

    # -- registration -----------------------------------------------------

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        """Register a plugin (see :meth:`pluggy.PluginManager.register`)."""
        self._adapters = self._backends = None
        return super().register(plugin, name)

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        """Unregister a plugin (see :meth:`pluggy.PluginManager.unregister`)."""
        self._adapters = self._backends = None
        return super().unregister(plugin, name)

    def add_plugin(
        self,
        plugin: Any,
        name: str,
        distribution: str | None = None,
        *,
        distribution_version: str | None = None,
        value: str | None = None,
    ) -> PluginInfo:
        """Register ``plugin`` under ``name`` and remember its distribution.

        A registration error (a name already taken, a hook implementation whose
        arguments do not match the spec) is logged and recorded, not raised.

        Returns:
            The plugin's record, with status ``"loaded"``, ``"blocked"`` or ``"failed"``.
        """
        info = PluginInfo(name, distribution, distribution_version, value)
        if self.has_plugin(name):
            other = self.distribution_of(name)
            return self._add_failure(
                info, f"reuses the plugin name {name!r} of distribution {other!r}"
            )
        if self.is_registered(plugin):
            other = self.get_name(plugin)
            return self._add_failure(info, f"names the same object as plugin {other!r}")
        try:
            registered = self.register(plugin, name=name)
        except Exception as exc:
            text = "; ".join(line for line in str(exc).splitlines() if line.strip())
            return self._add_failure(info, f"cannot be registered: {text or type(exc).__name__}")
        if registered is None:
            info = dataclasses.replace(info, status="blocked")
        else:
            self._dist_by_name[name] = distribution
            hooks = sorted(c.name for c in self.get_hookcallers(plugin) or ())
            info = dataclasses.replace(info, hooks=tuple(hooks))
        self._infos.append(info)
        return info

    def _add_failure(self, info: PluginInfo, error: str, index: int | None = None) -> PluginInfo:
        """Record ``info`` as failed (appended, or in place of the record at ``index``)."""
        info = dataclasses.replace(info, status="failed", error=error)
        if index is None:
            self._infos.append(info)
        else:
            self._infos[index] = info
        self._problem(f"{describe_owner(info.name, info.distribution)} {error}")
        return info

    def _problem(self, message: str) -> None:
        if message not in self._problems:
            self._problems[message] = None
            _log.warning("kvcached: %s", message)

    @property
    def problems(self) -> tuple[str, ...]:
        """Every plugin problem met so far (each was logged once as a warning)."""
        return tuple(self._problems)

    def plugin_infos(self) -> list[PluginInfo]:
        """The record of every plugin seen, in discovery order."""
        return list(self._infos)

    def distribution_of(self, name: str) -> str | None:
        """The distribution that ships the registered plugin ``name`` (``None`` if unknown)."""
        return self._dist_by_name.get(name)

    def load_entry_points(
        self,
        group: str = ENTRY_POINT_GROUP,
        *,
        allow: Sequence[str] | None = None,
        block: Sequence[str] = (),
    ) -> list[PluginInfo]:
        """Load and register the plugins of an entry-point group.

        Args:
            group: The entry-point group.
            allow: Names (entry point or distribution) to load; ``None`` loads all.
            block: Names never to load; wins over ``allow``.

        Returns:
            The records of this group's plugins, in discovery order.

        Raises:
            KVCachedConfigError: ``allow`` names something that is not installed.
        """
        found = []
        for ep in importlib.metadata.entry_points(group=group):
            dist, dist_version = _dist_of(ep)
            found.append((ep, dist, dist_version, {ep.name, _normalize(dist or ep.name)}))

        def matches(names: set[str], wanted: Iterable[str]) -> bool:
            return any(w in names or _normalize(w) in names for w in wanted)

        if allow is not None:
            unknown = [a for a in allow if not any(matches(n, [a]) for *_, n in found)]
            if unknown:
                installed = ", ".join(f"{ep.name} ({dist})" for ep, dist, _, _ in found)
                raise KVCachedConfigError(
                    f"KVCACHED_PLUGINS names {', '.join(map(repr, unknown))}, which "
                    f"{'is' if len(unknown) == 1 else 'are'} not installed in group "
                    f"{group!r} (installed: {installed or 'none'})"
                )
        for wanted in block:
            if not any(matches(n, [wanted]) for *_, n in found):
                _log.warning(
                    "kvcached: KVCACHED_DISABLE_PLUGINS names %r, which is not installed", wanted
                )

        first = len(self._infos)
        for ep, dist, dist_version, names in found:
            info = PluginInfo(ep.name, dist, dist_version, ep.value)
            if matches(names, block):
                self.set_blocked(ep.name)
                self._infos.append(dataclasses.replace(info, status="blocked"))
            elif allow is not None and not matches(names, allow):
                self._infos.append(dataclasses.replace(info, status="not-selected"))
            else:
                try:
                    plugin = ep.load()
                except Exception as exc:
                    self._add_failure(
                        info, f"failed to load {ep.value!r}: {type(exc).__name__}: {exc}"
                    )
                    continue
                self.add_plugin(
                    plugin, ep.name, dist, distribution_version=dist_version, value=ep.value
                )
        self._check_pending()
        return self._infos[first:]

    def _check_pending(self) -> None:
        """Run pluggy's ``check_pending``, unregistering each plugin it rejects."""
        while True:
            try:
                self.check_pending()
                return
            except pluggy.PluginValidationError as exc:
                plugin = exc.plugin
            name = self.get_name(plugin) or repr(plugin)
            unknown = sorted(c.name for c in self.get_hookcallers(plugin) or () if not c.has_spec())
            self.unregister(plugin)
            self._dist_by_name.pop(name, None)
            error = (
                f"implements unknown hook(s) {', '.join(map(repr, unknown))} "
                f"(kvcached defines: {', '.join(_hook_names())})"
            )
            for index, info in enumerate(self._infos):
                if info.name == name and info.status == "loaded":
                    self._add_failure(info, error, index)
                    break
            else:
                self._add_failure(PluginInfo(name, None), error)

    # -- typed hook calls -------------------------------------------------

    def _implementations(self, hook_name: str) -> list[tuple[Any, str | None]]:
        """``(HookImpl, distribution)`` of a hook, in pluggy's call order (wrappers left out)."""
        caller: pluggy.HookCaller = getattr(self.hook, hook_name)
        return [
            (impl, self.distribution_of(impl.plugin_name))
            for impl in reversed(caller.get_hookimpls())
            if not (impl.hookwrapper or impl.wrapper)
        ]

    @staticmethod
    def _call(impl: Any, dist: str | None, hook_name: str, kwargs: dict[str, Any]) -> Any:
        """Call one implementation.

        Raises:
            PluginError: It raised; the message names its plugin and distribution.
        """
        optional = {k: kwargs[k] for k in impl.kwargnames if k in kwargs}
        try:
            return impl.function(*(kwargs[a] for a in impl.argnames), **optional)
        except Exception as exc:
            raise PluginError(
                f"{describe_owner(impl.plugin_name, dist)}: {hook_name} raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _collect(
        self, hook_name: str, kind: type[_R], **kwargs: Any
    ) -> tuple[list[_R], list[PluginError]]:
        """Gather the records of a collecting hook, plugin by plugin.

        Returns:
            The records (attributed to their plugins) and one error per plugin
            whose implementation raised or returned something else than ``kind``
            records; such a plugin contributes nothing.
        """
        records: list[_R] = []
        errors: list[PluginError] = []
        for impl, dist in self._implementations(hook_name):
            try:
                result = self._call(impl, dist, hook_name, kwargs)
            except PluginError as exc:
                errors.append(exc)
                continue
            owner = describe_owner(impl.plugin_name, dist)
            try:  # a generator runs the plugin's code here
                items = _as_records(result, kind)
            except TypeError as exc:
                errors.append(PluginError(f"{owner}: {hook_name} {exc}"))
                continue
            except Exception as exc:
                errors.append(PluginError(
                    f"{owner}: {hook_name} raised {type(exc).__name__}: {exc}"))
                continue
            records.extend(_attribute(r, impl.plugin_name, dist) for r in items)
        return records, errors

    def _by_name(self, hook_name: str, kind: type[_R], what: str) -> dict[str, Any]:
        """Collect a hook's records by name, reporting bad plugins and raising on duplicates."""
        records, errors = self._collect(hook_name, kind)
        for error in errors:
            self._problem(str(error))
        by_name: dict[str, Any] = {}
        for record in records:
            if record.name in by_name:
                raise PluginError(
                    f"{what} {record.name!r} is claimed twice: by {by_name[record.name].owner} "
                    f"and by {record.owner}"
                )
            by_name[record.name] = record
        return by_name

    def engine_adapters(self) -> dict[str, EngineAdapter]:
        """Every registered engine adapter, by engine name.

        A plugin whose hook raises or returns something that is not an
        :class:`EngineAdapter` is reported in :attr:`problems` and skipped.

        Raises:
            PluginError: Two adapters claim the same engine; the message names
                both plugins and their distributions.
        """
        if self._adapters is None:
            self._adapters = self._by_name("kvcached_engine_adapters", EngineAdapter, "engine")
        return dict(self._adapters)

    def engine_adapter(self, engine: str) -> EngineAdapter | None:
        """The adapter for ``engine``, or ``None`` (see :meth:`engine_adapters`)."""
        return self.engine_adapters().get(engine)

    def extra_patches(self, engine: str, version: Version) -> list[Patch]:
        """The patches plugins contribute for ``engine`` at ``version``.

        Raises:
            PluginError: A plugin's hook raised or returned something that is not
                a :class:`Patch`. These patches join the engine's patch set, so a
                broken contribution is an error rather than silently dropped.
        """
        patches, errors = self._collect(
            "kvcached_extra_patches", Patch, engine=engine, version=version
        )
        if errors:
            raise errors[0]
        return patches

    def backends(self) -> dict[str, BackendRecord]:
        """Every contributed backend, by name.

        A plugin whose hook raises or returns something that is not a
        :class:`BackendRecord` is reported in :attr:`problems` and skipped.

        Raises:
            PluginError: Two backends share a name or a device type.
        """
        if self._backends is None:
            backends = self._by_name("kvcached_backends", BackendRecord, "backend")
            claimed: dict[str, BackendRecord] = {}
            for record in backends.values():
                for kind in record.devices:
                    other = claimed.setdefault(kind, record)
                    if other is not record:
                        raise PluginError(
                            f"device type {kind!r} is claimed twice: by backend {other.name!r} "
                            f"of {other.owner} and by backend {record.name!r} of {record.owner}"
                        )
            self._backends = backends
        return dict(self._backends)

    def backend_for(self, device: str, compiled: tuple[str, ...]) -> str | BackendRecord | None:
        """What serves ``device``: the answer the device code's selector gives.

        A ``kvcached_select_backend`` answer first: one of kvcached's own
        backends that serves this device type (``host`` for ``cpu``, ``cuda`` or
        ``hip`` for GPUs; the device code reports one this build lacks), or the
        contributed backend of that name. An answer that is neither is reported
        and passed over (an error with ``KVCACHED_STRICT=1``). Else, for a
        device type kvcached does not serve itself, the backend that lists it in
        its ``devices``. Else ``None``: kvcached's own rule.

        Raises:
            PluginError: Two backends share a name or a device type; with
                ``KVCACHED_STRICT=1``, a selection that serves nothing here.
            BackendUnavailableError: The backend found has no factory.
            KVCachedConfigError: No backend serves the device type while some
                plugin's ``kvcached_backends`` failed (the message lists them).
        """
        kind = device.partition(":")[0]
        selected = self._select(device, compiled)
        if selected is not None:
            name, owner = selected
            if name in NATIVE_BACKENDS and name in _NATIVE_FITS.get(kind, ()):
                return name
            record = self.backends().get(name)
            if record is not None:
                return self._with_factory(record, device)
            fits = _NATIVE_FITS.get(kind)
            error = PluginError(
                f"{owner}: kvcached_select_backend chose backend {name!r} for device {device!r}, "
                + (f"which takes {' or '.join(map(repr, fits))} or a plugin's backend"
                   if fits else "which no installed plugin contributes")
                + f" (contributed: {', '.join(sorted(self.backends())) or 'none'})"
            )
            if env_bool("KVCACHED_STRICT", False):
                raise error
            self._problem(str(error))
        if kind in NATIVE_DEVICE_TYPES:
            return None
        found = [r for r in self.backends().values() if kind in r.devices]
        if found:
            return self._with_factory(found[0], device)
        failed = [p for p in self.problems if "kvcached_backends" in p]
        if failed:
            raise KVCachedConfigError(
                f"device {device!r}: no installed plugin serves {kind!r} devices; these "
                f"plugins' backends could not be read: {'; '.join(failed)}"
            )
        return None

    @staticmethod
    def _with_factory(record: BackendRecord, device: str) -> BackendRecord:
        if record.factory is None:
            raise BackendUnavailableError(
                f"device {device!r} would be served by backend {record.name!r} of "
                f"{record.owner}, which has no factory to open a page mapper"
            )
        return record

    def select_backend(self, device: str, compiled: tuple[str, ...]) -> str | None:
        """The first plugin answer to ``kvcached_select_backend``, or ``None``.

        A plugin that raises or answers something other than a name is
        reported and passed over; with ``KVCACHED_STRICT=1`` that is an error.
        """
        selected = self._select(device, compiled)
        return None if selected is None else selected[0]

    def _select(self, device: str, compiled: tuple[str, ...]) -> tuple[str, str] | None:
        """:meth:`select_backend`'s answer and the plugin that gave it."""
        kwargs = {"device": device, "compiled": compiled}
        for impl, dist in self._implementations("kvcached_select_backend"):
            try:
                answer = self._call(impl, dist, "kvcached_select_backend", kwargs)
                if answer is None:
                    continue
                if isinstance(answer, str) and answer:
                    return answer, describe_owner(impl.plugin_name, dist)
                raise PluginError(
                    f"{describe_owner(impl.plugin_name, dist)}: kvcached_select_backend "
                    f"returned {answer!r}, expected a backend name or None"
                )
            except PluginError as exc:
                if env_bool("KVCACHED_STRICT", False):
                    raise
                self._problem(str(exc))
        return None


#: Which of kvcached's own backends serve each of its device types.
_NATIVE_FITS = {"cpu": ("host",), "cuda": ("cuda", "hip"), "hip": ("cuda", "hip")}


def _hook_names() -> list[str]:
    return sorted(n for n in dir(hookspecs) if n.startswith("kvcached_"))


def _as_records(result: Any, kind: type[_R]) -> list[_R]:
    """Accept ``None``, one record or an iterable of records.

    Raises:
        TypeError: Anything else; the message says what was returned.
    """
    if result is None:
        return []
    if isinstance(result, kind):
        return [result]
    if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
        raise TypeError(f"returned {type(result).__name__}, expected {kind.__name__} records")
    items = list(result)
    for item in items:
        if not isinstance(item, kind):
            raise TypeError(f"returned a {type(item).__name__}, expected {kind.__name__}")
    return items


def _attribute(record: _R, plugin: str, dist: str | None) -> _R:
    """``record`` attributed to the plugin whose hook returned it, whatever it named."""
    return dataclasses.replace(record, plugin=plugin, distribution=dist)


_manager: KVCachedPluginManager | None = None


def get_plugin_manager() -> KVCachedPluginManager:
    """The process's plugin manager, created and loaded on first use.

    Reads ``KVCACHED_PLUGINS`` and ``KVCACHED_DISABLE_PLUGINS`` when it is
    created.

    Raises:
        KVCachedConfigError: A selection variable is malformed or names a
            plugin that is not installed.
    """
    global _manager
    manager = _manager
    if manager is not None:
        return manager
    with process_lock():
        if _manager is None:
            allow = env_list("KVCACHED_PLUGINS")
            block = env_list("KVCACHED_DISABLE_PLUGINS")
            manager = KVCachedPluginManager()
            manager.load_entry_points(allow=allow or None, block=block)
            _manager = manager
        return _manager


def reset_plugin_manager(manager: KVCachedPluginManager | None = None) -> None:
    """Drop the process's manager (the next use reloads), or install ``manager``.

    Meant for tests and for hosts that assemble plugins themselves.
    """
    global _manager
    with process_lock():
        _manager = manager


def select_backend(device: str, compiled: tuple[str, ...]) -> str | None:
    """The backend a plugin selects for ``device``, or ``None`` when no plugin answers.

    Cheap after the first call, and ``None`` (never an error) when no plugin
    is installed.

    Args:
        device: The device string, e.g. ``"cuda:0"``.
        compiled: The backends compiled into this build, e.g. ``("cuda", "host")``.
    """
    return get_plugin_manager().select_backend(device, tuple(compiled))


def available_backends() -> dict[str, BackendRecord]:
    """Every backend contributed by a plugin, by name (see :meth:`KVCachedPluginManager.backends`)."""
    return get_plugin_manager().backends()


def backend_for(device: str, compiled: tuple[str, ...]) -> str | BackendRecord | None:
    """What serves ``device`` by the plugins' answers: the device code's backend selector.

    See :meth:`KVCachedPluginManager.backend_for`; ``None`` (never an error)
    when no plugin is installed.
    """
    return get_plugin_manager().backend_for(device, tuple(compiled))


# The device code asks plugins for backends through this, without importing them.
set_backend_selector(backend_for)
