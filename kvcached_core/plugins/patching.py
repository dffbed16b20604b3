"""Version-gated, reversible patches and all-or-nothing patch sets.

A :class:`Patch` names one attribute to change, ``"package.module:Qualname.attr"``,
the engine versions it applies to, and either a ``replacement`` object or a
``wrapper`` that receives the original and returns the new value::

    Patch(
        "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
        versions=">=0.25.0",
        wrapper=wrap_allocate_slots,
        name="exhaustion-is-a-miss",
    )

A :class:`PatchSet` applies its patches in order, all or nothing: when a
required patch fails, the patches already applied are undone in reverse order
and the engine is left vanilla (``KVCACHED_STRICT=1`` raises
:class:`~kvcached_core.errors.PatchError` instead of continuing). Applying an
applied set does nothing; :meth:`PatchSet.revert` restores exactly what the set
replaced, and only where kvcached's value is still in place.

Rules that make revert exact:

* On a class, an attribute defined on the class itself is restored; one that
  was inherited (or created with ``create=True``) is deleted again, so the
  inherited value shows through.
* ``staticmethod`` and ``classmethod`` keep their kind: a wrapper receives the
  plain function and its result is re-wrapped; a plain replacement function is
  wrapped the same way.
* ``from X import Y`` copies of a module-level name are separate bindings. List
  them in ``also_rebind`` to patch them too; kvcached warns about copies it
  finds but was not told about, at apply time (when patching a name where it is
  defined) and at revert time (copies that still hold the replacement).

Which patches are in place is asked of the record kvcached keeps of every
applied patch, from any set: :func:`is_applied` (by name), :func:`patch_of`
(by the value at hand: which patch installed it) and :func:`active_patches`
(all of them). Patched objects carry no marker attribute to be asked instead.

A ``deferred`` patch whose module is not imported yet when the set is applied
waits for that import (:mod:`~kvcached_core.plugins.import_hooks`) and is applied
right after the module's body has run, before anything can call into it. A
process that never imports the module never pays for importing it. The set
stays all or nothing: a deferred patch that fails then rolls the whole set back
(strict: the import raises :class:`~kvcached_core.errors.PatchError`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kvcached_core.env import env_bool
from kvcached_core.errors import PatchError
from kvcached_core.plugins import import_hooks
from kvcached_core.plugins._process import process_lock
from kvcached_core.plugins.records import (
    PatchPlan,
    PatchSetResult,
    RevertResult,
    describe_owner,
)
from kvcached_core.plugins.versions import parse_specifier, parse_version, version_matches
from kvcached_core.sentinel import UNSET  # re-exported: Patch(replacement=...)'s default

__all__ = [
    "UNSET",
    "Patch",
    "PatchSet",
    "active_patches",
    "is_applied",
    "parse_target",
    "patch_of",
]

_log = logging.getLogger("kvcached")

_METHOD_KINDS = (staticmethod, classmethod)


def parse_target(target: str) -> tuple[str, tuple[str, ...]]:
    """Split ``"package.module:Qualname.attr"`` into ``("package.module", ("Qualname", "attr"))``.

    Raises:
        ValueError: The text is not a module path, a colon and a dotted
            attribute path of Python identifiers.
    """
    if not isinstance(target, str):
        raise ValueError(f"target must be a string, not {type(target).__name__}")
    module, sep, qualname = target.partition(":")
    parts = tuple(qualname.split("."))
    if (
        not sep
        or not module
        or not all(p.isidentifier() for p in module.split("."))
        or not all(p.isidentifier() for p in parts)
    ):
        raise ValueError(
            f"invalid target {target!r} (expected 'package.module:Qualname.attr', "
            "e.g. 'vllm.v1.core.block_pool:BlockPool.get_new_blocks')"
        )
    return module, parts


@dataclass(frozen=True)
class Patch:
    """One version-gated change to one attribute.

    Attributes:
        target: ``"package.module:Qualname.attr"``; the last component is the
            attribute set, everything before it is looked up from the module.
        versions: Engine versions the patch applies to (a PEP 440 specifier
            set; ``""`` means every version; pre-releases are included).
        replacement: The new value. Exactly one of ``replacement`` and
            ``wrapper`` is given.
        wrapper: Called with the original value (the plain function for a
            ``staticmethod``/``classmethod``), returns the new value.
        name: Unique within a patch set; defaults to ``target``.
        required: When ``False``, a failure skips this patch instead of
            failing (and rolling back) the whole set.
        create: Allow setting an attribute that does not exist yet (only with
            ``replacement``); revert deletes it again.
        also_rebind: Further ``"module:name"`` bindings that hold the original
            (``from X import Y`` copies) and must receive the new value too.
        deferred: When the target module is not imported yet, apply the patch
            right after it is (see the module docs) instead of importing it.
        description: One line for ``kvctl doctor``.
        plugin: The contributing plugin (filled in by kvcached).
        distribution: The plugin's distribution (filled in by kvcached).

    Raises:
        PatchError: A field is malformed; the message names the patch.
    """

    target: str
    versions: SpecifierSet | str = ""
    replacement: Any = UNSET
    wrapper: Callable[[Any], Any] | None = None
    name: str = ""
    required: bool = True
    create: bool = False
    also_rebind: Sequence[str] = ()
    deferred: bool = False
    description: str = ""
    plugin: str | None = field(default=None, compare=False)
    distribution: str | None = field(default=None, compare=False)
    _module: str = field(default="", init=False, repr=False, compare=False)
    _path: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        label = self.name or self.target
        try:
            module, path = parse_target(self.target)
            rebinds = (self.also_rebind,) if isinstance(self.also_rebind, str) else self.also_rebind
            rebinds = tuple(rebinds)
            for alias in rebinds:
                parse_target(alias)
            versions = parse_specifier(self.versions)
        except ValueError as exc:
            raise PatchError(f"patch {label!r}: {exc}") from None
        if (self.replacement is UNSET) == (self.wrapper is None):
            raise PatchError(f"patch {label!r}: give exactly one of replacement= and wrapper=")
        if self.wrapper is not None and not callable(self.wrapper):
            raise PatchError(f"patch {label!r}: wrapper must be callable")
        if self.create and self.wrapper is not None:
            raise PatchError(f"patch {label!r}: create=True needs a replacement, not a wrapper")
        if not isinstance(self.name, str):
            raise PatchError(f"patch {label!r}: name must be a string")
        object.__setattr__(self, "name", self.name or self.target)
        object.__setattr__(self, "versions", versions)
        object.__setattr__(self, "also_rebind", rebinds)
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_path", path)

    @property
    def kind(self) -> str:
        """``"wrapper"`` or ``"replacement"``."""
        return "wrapper" if self.wrapper is not None else "replacement"

    @property
    def owner(self) -> str:
        """The contributing plugin, for messages."""
        return describe_owner(self.plugin, self.distribution)

    def describe(self) -> str:
        """``"patch 'x' on 'mod:A.b' from plugin 'p' (distribution 'd')"`` (no plugin part if none)."""
        text = f"patch {self.name!r} on {self.target!r}"
        return f"{text} from {self.owner}" if self.plugin is not None else text

    def matches(self, version: Version | str) -> bool:
        """Whether the patch applies to ``version`` (pre-releases included)."""
        return version_matches(self.versions, version)

    def owned_by(self, plugin: str | None, distribution: str | None) -> Patch:
        """This patch attributed to ``plugin`` (unchanged if it already names one)."""
        if self.plugin is not None or plugin is None:
            return self
        return dataclasses.replace(self, plugin=plugin, distribution=distribution)

    def plan(self, version: Version | None, *, resolve: bool = False) -> PatchPlan:
        """What applying this patch for ``version`` would do, without changing anything.

        Args:
            version: The engine version, ``None`` if unknown.
            resolve: Also import the target module and look the target up.
        """
        verdict, reason = "would-apply", ""
        if version is None:
            verdict, reason = "skip", "engine version unknown"
        elif not self.matches(version):
            verdict, reason = "skip", f"version {version} not in {_spec_text(self.versions)}"
        elif resolve:
            try:
                found = _Location.find(self._module, self._path)
                if found.raw is UNSET and not self.create:
                    raise PatchError(f"{self.target!r} does not exist")
            except PatchError as exc:
                verdict, reason = "unresolvable", str(exc)
        return PatchPlan(
            name=self.name,
            target=self.target,
            kind=self.kind,  # type: ignore[arg-type]
            versions=str(self.versions),
            required=self.required,
            plugin=self.plugin,
            distribution=self.distribution,
            verdict=verdict,  # type: ignore[arg-type]
            reason=reason,
        )


def _spec_text(spec: SpecifierSet | str) -> str:
    return f"'{spec}'" if str(spec) else "(every version)"


def _same(a: Any, b: Any) -> bool:
    """Identity, or equality for bound methods (a fresh object on every lookup)."""
    return a is b or (inspect.ismethod(a) and inspect.ismethod(b) and a == b)


def _is_findable(value: Any) -> bool:
    """Whether copies of ``value`` can be told apart by identity (functions, classes)."""
    return inspect.isroutine(value) or inspect.isclass(value)


@dataclass
class _Location:
    """A resolved attribute: where it lives and what it holds now."""

    owner: Any
    attr: str
    label: str
    own: bool  # defined on owner itself (class __dict__ / module globals)
    raw: Any  # the stored object (a staticmethod, not its function); UNSET if absent

    @classmethod
    def find(cls, module: str, path: tuple[str, ...]) -> _Location:
        label = f"{module}:{'.'.join(path)}"
        try:
            owner: Any = importlib.import_module(module)
        except Exception as exc:
            raise PatchError(
                f"cannot import module {module!r} for {label!r} ({type(exc).__name__}: {exc})"
            ) from exc
        for depth, part in enumerate(path[:-1]):
            try:
                owner = getattr(owner, part)
            except AttributeError:
                where = ".".join((module, *path[:depth]))
                raise PatchError(f"{label!r}: {where!r} has no attribute {part!r}") from None
        attr = path[-1]
        own, raw = _lookup(owner, attr)
        return cls(owner, attr, label, own, raw)

    def current(self) -> Any:
        """The object stored at the location itself now (UNSET if none)."""
        namespace = _namespace(self.owner)
        if namespace is not None:
            return namespace.get(self.attr, UNSET)
        return getattr(self.owner, self.attr, UNSET)

    def visible(self) -> Any:
        """What ``owner.attr`` evaluates to now (UNSET if nothing)."""
        return getattr(self.owner, self.attr, UNSET)

    def module_name(self) -> str | None:
        return self.owner.__name__ if isinstance(self.owner, ModuleType) else None


def _namespace(owner: Any) -> Any:
    """The mapping an attribute is stored in for classes, modules and plain instances."""
    namespace = getattr(owner, "__dict__", None)
    if isinstance(owner, type) or isinstance(namespace, dict):
        return namespace
    return None


def _lookup(owner: Any, attr: str) -> tuple[bool, Any]:
    """Return ``(defined_on_owner, stored_object)`` for ``owner.attr``."""
    namespace = _namespace(owner)
    if namespace is None:  # e.g. an instance with __slots__: restore, never delete
        value = getattr(owner, attr, UNSET)
        return value is not UNSET, value
    if attr in namespace:
        return True, namespace[attr]
    if isinstance(owner, type):
        for klass in owner.__mro__[1:]:
            if attr in klass.__dict__:
                return False, klass.__dict__[attr]
    return False, getattr(owner, attr, UNSET)


def _unwrap(raw: Any) -> tuple[type | None, Any]:
    if isinstance(raw, _METHOD_KINDS):
        return type(raw), raw.__func__
    return None, raw


def _rewrap(kind: type | None, value: Any) -> Any:
    if kind is None or isinstance(value, (*_METHOD_KINDS, property)) or not callable(value):
        return value
    return kind(value)


def _modules_holding(value: Any, name: str, skip: set[str]) -> list[str]:
    """``"module:name"`` for every imported module whose global ``name`` is ``value``."""
    if not _is_findable(value):
        return []
    skip = skip | {getattr(value, "__module__", None) or ""}
    found = []
    for modname, module in list(sys.modules.items()):
        if modname in skip:
            continue
        try:
            held = vars(module).get(name, UNSET)
        except TypeError:
            continue
        if held is not UNSET and _same(held, value):
            found.append(f"{modname}:{name}")
    return sorted(found)


@dataclass
class _Applied:
    """Everything needed to undo one applied patch."""

    patch: Patch
    main: _Location
    new_raw: Any
    new_visible: Any
    aliases: list[tuple[_Location, Any]]  # (location, what it held before)
    warnings: list[str]


# id(installed object) -> (installed object, patch key): finds a patch that
# another PatchSet already applied in this process, so it is never stacked twice.
_ACTIVE: dict[int, tuple[Any, tuple[str | None, str, str]]] = {}


def _key(patch: Patch) -> tuple[str | None, str, str]:
    return (patch.plugin, patch.name, patch.target)


def active_patches() -> list[tuple[str | None, str, str]]:
    """``(plugin, patch name, target)`` of every patch in place in this process."""
    with process_lock():
        return sorted({key for _, key in _ACTIVE.values()}, key=str)


def is_applied(name: str, *, plugin: str | None = None) -> bool:
    """Whether a patch named ``name`` is in place in this process, from any patch set.

    This (or :func:`patch_of` for a value at hand) is how kvcached, its plugins
    and their tests ask whether a patch is in place; patched objects carry no
    marker of their own. A deferred patch still waiting for its module's import
    is not in place yet.

    Args:
        name: The patch name.
        plugin: Only count a patch contributed by this plugin (``None``: any).
    """
    with process_lock():
        return any(
            key[1] == name and (plugin is None or key[0] == plugin) for _, key in _ACTIVE.values()
        )


def patch_of(value: Any) -> tuple[str | None, str, str] | None:
    """``(plugin, patch name, target)`` of the patch in place that installed ``value``.

    ``value`` may be read from anywhere: the patched attribute, a
    ``from X import Y`` copy of it, a bound method of a patched class (its
    function is looked up) or the function of a patched ``staticmethod`` /
    ``classmethod``. Values are compared by identity, so numbers and strings
    (whose identity means nothing) are never matched. ``None`` when no patch in
    place installed it (a reverted patch no longer counts).
    """
    if value is None or isinstance(value, (int, float, complex, str, bytes)):
        return None
    if inspect.ismethod(value):
        value = value.__func__
    with process_lock():
        for installed, key in _ACTIVE.values():
            if installed is value or (
                isinstance(installed, _METHOD_KINDS) and installed.__func__ is value
            ):
                return key
    return None


class _Skip(Exception):
    """A patch that is not applied, without failing the set."""


def _apply_one(patch: Patch) -> _Applied:
    """Apply one patch completely or not at all."""
    main = _Location.find(patch._module, patch._path)
    if main.raw is UNSET and not patch.create:
        raise PatchError(f"{patch.target!r} does not exist")
    active = _ACTIVE.get(id(main.current()))
    if active is not None and active[0] is main.current() and active[1] == _key(patch):
        raise _Skip("already applied in this process by another patch set")

    kind, original = _unwrap(main.raw)
    if patch.wrapper is not None:
        new = patch.wrapper(original)
        if new is None:
            raise PatchError(f"the wrapper for {patch.target!r} returned None")
    else:
        new = patch.replacement
    new_raw = _rewrap(kind, new)
    before = main.visible()

    aliases: list[tuple[_Location, Any]] = []
    for alias in patch.also_rebind:
        module, path = parse_target(alias)
        loc = _Location.find(module, path)
        if not _same(loc.visible(), before):
            raise PatchError(
                f"also_rebind {alias!r} does not hold the original of {patch.target!r} "
                f"(it holds {loc.visible()!r})"
            )
        aliases.append((loc, loc.current()))

    warnings: list[str] = []
    module_name = main.module_name()
    if module_name is not None and getattr(original, "__module__", None) == module_name:
        reached = {module_name} | {loc.module_name() or "" for loc, _ in aliases}
        for stale in _modules_holding(original, main.attr, reached):
            warnings.append(
                f"{stale} still holds the original of {patch.target!r} "
                f"(patch {patch.name!r}); add it to also_rebind"
            )

    done: list[tuple[_Location, Any]] = []
    try:
        setattr(main.owner, main.attr, new_raw)
        done.append((main, main.raw if main.own else UNSET))
        new_visible = main.visible()
        for loc, held in aliases:
            setattr(loc.owner, loc.attr, new_visible)
            done.append((loc, held if loc.own else UNSET))
    except Exception:
        for loc, held in reversed(done):
            _put_back(loc, held)
        raise
    _ACTIVE[id(new_raw)] = (new_raw, _key(patch))
    return _Applied(patch, main, new_raw, new_visible, aliases, warnings)


def _put_back(loc: _Location, held: Any) -> None:
    """Store ``held`` at ``loc`` again, or delete the attribute when it was not stored there."""
    if held is UNSET:
        delattr(loc.owner, loc.attr)
    else:
        setattr(loc.owner, loc.attr, held)


def _undo(applied: _Applied) -> list[str]:
    """Undo one applied patch where kvcached's value is still in place; return conflicts."""
    conflicts = []
    places = [(applied.main, applied.new_raw, applied.main.raw if applied.main.own else UNSET)]
    places += [
        (loc, applied.new_visible, held if loc.own else UNSET) for loc, held in applied.aliases
    ]
    for loc, ours, held in places:
        now = loc.current()
        if now is not ours:
            conflicts.append(
                f"{loc.label} holds {now!r}, not the value patch {applied.patch.name!r} set; left in place"
            )
            continue
        _put_back(loc, held)
    entry = _ACTIVE.get(id(applied.new_raw))
    if entry is not None and entry[0] is applied.new_raw:
        del _ACTIVE[id(applied.new_raw)]
    return conflicts


def _error_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, PatchError) else f"{type(exc).__name__}: {exc}"


def _apply_each(
    patches: Iterable[Patch], skipped: list[tuple[str, str]]
) -> tuple[list[_Applied], tuple[Patch, str] | None]:
    """Apply ``patches`` in order until a required one fails; note skips in ``skipped``."""
    applied: list[_Applied] = []
    for patch in patches:
        try:
            applied.append(_apply_one(patch))
        except _Skip as exc:
            skipped.append((patch.name, str(exc)))
        except Exception as exc:
            if not patch.required:
                skipped.append((patch.name, f"optional patch not applied: {_error_text(exc)}"))
                continue
            return applied, (patch, _error_text(exc))
    return applied, None


class PatchSet:
    """An ordered group of patches for one engine, applied all or nothing.

    Args:
        engine: The engine the patches target, e.g. ``"vllm"`` (used in logs).
        patches: The patches, applied in this order.
        name: A label for the set (defaults to ``engine``).
        plugin: Attributed to patches that name no plugin.
        distribution: The distribution of ``plugin``.

    Raises:
        PatchError: Two patches share a name.
    """

    def __init__(
        self,
        engine: str,
        patches: Iterable[Patch] = (),
        *,
        name: str | None = None,
        plugin: str | None = None,
        distribution: str | None = None,
    ) -> None:
        self.engine = engine
        self.name = name or engine
        self.plugin = plugin
        self.distribution = distribution
        self._patches: list[Patch] = []
        self._applied: list[_Applied] | None = None
        self._result: PatchSetResult | None = None
        self._waiting: dict[str, list[Patch]] = {}  # module -> deferred patches
        self._version: Version | None = None
        self._strict = False
        self.extend(patches)

    def __repr__(self) -> str:
        state = "applied" if self._applied is not None else "not applied"
        return f"<PatchSet {self.name!r}: {len(self._patches)} patches, {state}>"

    @property
    def patches(self) -> tuple[Patch, ...]:
        """The patches, in application order."""
        return tuple(self._patches)

    @property
    def is_applied(self) -> bool:
        """Whether the set is in place in this process."""
        return self._applied is not None

    @property
    def result(self) -> PatchSetResult | None:
        """Where the last apply stands: its result, updated as deferred patches land.

        ``None`` before any apply and after a revert; a deferred patch that
        failed leaves the failed result here (and the set rolled back).
        """
        return self._result

    def extend(self, patches: Iterable[Patch]) -> None:
        """Append patches (only while the set is not applied).

        Raises:
            PatchError: A name is already in the set, an item is not a
                :class:`Patch`, or the set is applied.
        """
        if self._applied is not None:
            raise PatchError(f"patch set {self.name!r} is applied; revert it before extending it")
        names = {p.name for p in self._patches}
        added = []
        for patch in patches:
            if not isinstance(patch, Patch):
                raise PatchError(
                    f"patch set {self.name!r}: expected a Patch, got {type(patch).__name__}"
                )
            patch = patch.owned_by(self.plugin, self.distribution)
            if patch.name in names:
                raise PatchError(
                    f"patch set {self.name!r}: two patches are named {patch.name!r} "
                    f"(the second from {patch.owner})"
                )
            names.add(patch.name)
            added.append(patch)
        self._patches.extend(added)

    def plan(self, version: Version | str | None, *, resolve: bool = False) -> list[PatchPlan]:
        """What :meth:`apply` would do for ``version``, changing nothing.

        Args:
            version: The engine version (``None`` if unknown).
            resolve: Also import target modules and check each target exists.
        """
        version = None if version is None else parse_version(version)
        applied = set() if self._applied is None else {a.patch.name for a in self._applied}
        plans = []
        waiting = {p.name: p._module for ps in self._waiting.values() for p in ps}
        for patch in self._patches:
            if patch.name in applied:
                plans.append(dataclasses.replace(patch.plan(version), verdict="applied", reason=""))
            elif patch.name in waiting:
                reason = f"applies when {waiting[patch.name]!r} is imported"
                plans.append(
                    dataclasses.replace(patch.plan(version), verdict="deferred", reason=reason)
                )
            else:
                plans.append(patch.plan(version, resolve=resolve))
        return plans

    def apply(self, version: Version | str | None, *, strict: bool | None = None) -> PatchSetResult:
        """Apply the patches whose specifier matches ``version``, all or nothing.

        Logs one line (INFO when it worked, WARNING otherwise). Calling it on an
        applied set returns the earlier result with ``repeated=True``.

        Args:
            version: The running engine's version; ``None`` (unknown) skips
                every patch, loudly.
            strict: Raise instead of leaving the engine vanilla. ``None`` reads
                ``KVCACHED_STRICT`` (default off).

        Raises:
            PatchError: ``strict`` and a required patch failed (after the
                rollback) or the version is unknown. The message names the
                patch, its target, plugin and distribution.
            KVCachedConfigError: ``KVCACHED_STRICT`` is not a boolean.
        """
        if strict is None:
            strict = env_bool("KVCACHED_STRICT", False)
        try:
            version = None if version is None else parse_version(version)
        except ValueError as exc:
            raise PatchError(f"patch set {self.name!r}: {exc}") from None
        with process_lock():
            if self._applied is not None and self._result is not None:
                return dataclasses.replace(self._result, repeated=True)
            if version is None:
                return self._unknown_version(strict)
            return self._apply(version, strict)

    def _unknown_version(self, strict: bool) -> PatchSetResult:
        result = PatchSetResult(
            engine=self.engine,
            version=None,
            status="skipped",
            skipped=tuple((p.name, "engine version unknown") for p in self._patches),
        )
        message = f"{result.summary()}; engine version unknown, engine left vanilla"
        _log.warning(message)
        if strict:
            raise PatchError(f"{message} (KVCACHED_STRICT=1)")
        return result

    def _apply(self, version: Version, strict: bool) -> PatchSetResult:
        matching: list[Patch] = []
        skipped: list[tuple[str, str]] = []
        for patch in self._patches:
            if patch.matches(version):
                matching.append(patch)
            else:
                skipped.append(
                    (patch.name, f"version {version} not in {_spec_text(patch.versions)}")
                )
        later = [p for p in matching if p.deferred and p._module not in sys.modules]
        now = [p for p in matching if p not in later]
        self._version, self._strict = version, strict
        applied, failure = _apply_each(now, skipped)
        waiting: dict[str, list[Patch]] = {}
        for patch in later if failure is None else ():
            waiting.setdefault(patch._module, []).append(patch)
        for module in list(waiting):  # a module an applied patch imported meanwhile
            if failure is None and module in sys.modules:
                done, failure = _apply_each(waiting.pop(module), skipped)
                applied.extend(done)
        if failure is not None:
            return self._fail(failure, applied, skipped)

        deferred = tuple(p.name for ps in waiting.values() for p in ps)
        result = PatchSetResult(
            engine=self.engine,
            version=str(version),
            status="applied" if applied or deferred else "skipped",
            applied=tuple(a.patch.name for a in applied),
            skipped=tuple(skipped),
            deferred=deferred,
            warnings=tuple(w for a in applied for w in a.warnings),
        )
        if applied or deferred:
            self._applied, self._result, self._waiting = applied, result, waiting
        _log.log(logging.WARNING if result.warnings else logging.INFO, result.summary())
        for module in list(waiting):
            if not import_hooks.when_imported(module, self._on_import):
                self._on_import(sys.modules[module])  # another thread imported it just now
        if not (applied or deferred):
            return result
        return self._result or result  # as it stands once a late import landed (or failed)

    def _on_import(self, module: ModuleType) -> None:
        """Apply the deferred patches of ``module``, just imported (all or nothing for the set)."""
        with process_lock():
            patches = self._waiting.pop(module.__name__, [])
            if not patches or self._applied is None or self._result is None:
                return
            skipped: list[tuple[str, str]] = []
            done, failure = _apply_each(patches, skipped)
            applied = self._applied + done
            if failure is not None:
                self._fail(failure, applied, list(self._result.skipped) + skipped)
                return
            self._applied = applied
            self._result = dataclasses.replace(
                self._result,
                applied=self._result.applied + tuple(a.patch.name for a in done),
                deferred=tuple(p.name for ps in self._waiting.values() for p in ps),
                skipped=self._result.skipped + tuple(skipped),
                warnings=self._result.warnings + tuple(w for a in done for w in a.warnings),
            )
            _log.log(
                logging.WARNING if self._result.warnings else logging.INFO,
                "%s (deferred patches applied on import of %s)",
                self._result.summary(),
                module.__name__,
            )

    def _fail(
        self,
        failure: tuple[Patch, str],
        applied: list[_Applied],
        skipped: list[tuple[str, str]],
    ) -> PatchSetResult:
        """Roll back every applied patch, forget deferred ones, record and log the failure.

        Raises:
            PatchError: The set was applied strictly.
        """
        patch, reason = failure
        failed = [(patch.name, f"{reason} ({patch.owner})" if patch.plugin else reason)]
        rolled_back = []
        for done in reversed(applied):
            try:
                conflicts = _undo(done)
            except Exception as exc:
                conflicts = [f"rollback failed: {_error_text(exc)}"]
            rolled_back.append(done.patch.name)
            failed.extend((done.patch.name, c) for c in conflicts)
        self._forget_waiting()
        result = PatchSetResult(
            engine=self.engine,
            version=str(self._version),
            status="failed",
            skipped=tuple(skipped),
            failed=tuple(failed),
            rolled_back=tuple(rolled_back),
            warnings=tuple(w for a in applied for w in a.warnings),
        )
        self._applied, self._result = None, result
        _log.warning(result.summary())
        if self._strict:
            raise PatchError(
                f"{patch.describe()} failed: {reason}; the {self.engine} {self._version} patch "
                "set was rolled back and KVCACHED_STRICT=1 refuses to run the engine without "
                "kvcached"
            )
        return result

    def _forget_waiting(self) -> None:
        for module in self._waiting:
            import_hooks.cancel(module, self._on_import)
        self._waiting = {}

    def revert(self) -> RevertResult:
        """Undo the applied patches in reverse order, exactly.

        Each place is restored only if it still holds the value this set put
        there; otherwise it is reported as a conflict and left alone. Modules
        that still hold a replacement under the patched name (a
        ``from X import Y`` made after the patch) are reported as stale aliases.
        Logs one line. Reverting a set that is not applied does nothing.
        """
        with process_lock():
            self._forget_waiting()
            if self._applied is None:
                self._result = None
                return RevertResult()
            restored: list[str] = []
            conflicts: list[tuple[str, str]] = []
            stale: list[str] = []
            for done in reversed(self._applied):
                problems = _undo(done)
                if problems:
                    conflicts.extend((done.patch.name, p) for p in problems)
                else:
                    restored.append(done.patch.name)
                reached = {loc.module_name() or "" for loc, _ in done.aliases}
                reached.add(done.main.module_name() or "")
                stale.extend(_modules_holding(done.new_visible, done.main.attr, reached))
            self._applied = self._result = None
        result = RevertResult(tuple(restored), tuple(conflicts), tuple(sorted(set(stale))))
        line = (
            f"kvcached: {self.engine} patch set reverted: {len(result.restored)} restored, "
            f"{len(result.conflicts)} conflicts"
        )
        if result.conflicts:
            line += "; " + "; ".join(reason for _, reason in result.conflicts)
        if result.stale_aliases:
            line += "; stale aliases still hold a replacement: " + ", ".join(result.stale_aliases)
        _log.log(logging.INFO if result.ok else logging.WARNING, line)
        return result
