"""Bootstrapping kvcached into a running engine.

An adapter distribution registers a function in the engine's own plugin
entry-point group (``vllm.general_plugins``, ``sglang.srt.plugins``) that
calls :func:`bootstrap`::

    def register() -> None:
        from kvcached_core.plugins import bootstrap
        bootstrap("vllm")

Engines call such functions in every process they start, sometimes several
times. :func:`bootstrap` is therefore:

* cheap and idempotent per process: the first call does the work, later calls
  return the recorded :class:`~kvcached_core.plugins.records.BootstrapResult`
  with ``repeated=True``;
* fork-safe: a child forked after the parent bootstrapped inherits the patched
  engine and the record of it, and returns that record with ``inherited=True``
  instead of patching a second time (a spawned child starts clean and
  bootstraps itself);
* free of threads and sockets;
* a no-op when ``KVCACHED_ENABLED`` is off.

Whenever the engine ends up vanilla (no adapter, unknown or unsupported
version, a failing patch), it logs a warning saying why; with
``KVCACHED_STRICT=1`` it raises instead, so the engine refuses to start.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from typing import Any

from packaging.version import Version

from kvcached_core import legacy_env
from kvcached_core.env import env_bool
from kvcached_core.errors import PluginError
from kvcached_core.plugins._process import process_lock
from kvcached_core.plugins.manager import KVCachedPluginManager, get_plugin_manager
from kvcached_core.plugins.patching import Patch, PatchSet
from kvcached_core.plugins.records import (
    BootstrapResult,
    BootstrapStatus,
    EngineAdapter,
    RevertResult,
)
from kvcached_core.plugins.versions import detect_engine_version

__all__ = [
    "bootstrap",
    "bootstrap_results",
    "build_patch_set",
    "engine_patch_set",
    "reset_bootstrap",
    "teardown",
]

_log = logging.getLogger("kvcached")

_results: dict[str, BootstrapResult] = {}
_patch_sets: dict[str, PatchSet] = {}

_STRICT_NOTE = " (KVCACHED_STRICT=1 refuses to run the engine without kvcached)"


def _flatten(produced: Any) -> list[Patch]:
    """Patches from what a patch-set factory returned.

    Raises:
        TypeError: Something that is not a Patch, a PatchSet or an iterable of them.
    """
    if produced is None:
        return []
    if isinstance(produced, Patch):
        return [produced]
    if isinstance(produced, PatchSet):
        return list(produced.patches)
    if isinstance(produced, (str, bytes)) or not isinstance(produced, Iterable):
        raise TypeError(f"returned {type(produced).__name__}, expected patch sets or patches")
    patches: list[Patch] = []
    for item in produced:
        if not isinstance(item, (Patch, PatchSet)):
            raise TypeError(f"returned a {type(item).__name__}, expected PatchSet or Patch")
        patches.extend(_flatten(item))
    return patches


def build_patch_set(
    manager: KVCachedPluginManager, adapter: EngineAdapter, version: Version
) -> PatchSet:
    """The one patch set for ``adapter``'s engine at ``version``.

    It holds the adapter's patches followed by the patches other plugins
    contribute through ``kvcached_extra_patches``; nothing is applied.

    Raises:
        PluginError: The adapter's factory or a contributing plugin failed, or
            returned something else than patches; the message names the plugin
            and its distribution.
    """
    try:
        patches = _flatten(adapter.patch_sets(version))
    except Exception as exc:
        raise PluginError(
            f"{adapter.owner}: the patch-set factory of engine adapter {adapter.name!r} failed "
            f"for {adapter.name} {version}: {type(exc).__name__}: {exc}"
        ) from exc
    patches = [p.owned_by(adapter.plugin, adapter.distribution) for p in patches]
    patches += manager.extra_patches(adapter.name, version)
    return PatchSet(
        adapter.name,
        patches,
        plugin=adapter.plugin,
        distribution=adapter.distribution,
    )


def bootstrap(engine: str, *, strict: bool | None = None) -> BootstrapResult:
    """Apply kvcached's patch set for ``engine`` in this process, once.

    Args:
        engine: The adapter name, e.g. ``"vllm"``.
        strict: Raise instead of leaving the engine vanilla; ``None`` reads
            ``KVCACHED_STRICT`` (default off).

    Returns:
        What happened; ``result.active`` tells whether kvcached is in place.

    Raises:
        KVCachedConfigError: A ``KVCACHED_*`` variable is malformed, or a
            variable of the original kvcached has no equivalent here
            (:mod:`kvcached_core.legacy_env`).
        PluginError: ``strict`` is on and the engine would run without kvcached
            (:class:`~kvcached_core.errors.PatchError` when a patch failed).
    """
    legacy_env.check_environment()
    if not env_bool("KVCACHED_ENABLED", True):
        # Names the variable that turned it off (the original's ENABLE_KVCACHED=false counts).
        label = (legacy_env.lookup("KVCACHED_ENABLED") or ("KVCACHED_ENABLED",))[0]
        return BootstrapResult(
            engine, "disabled", f"{label} is off; engine left vanilla", pid=os.getpid()
        )
    if strict is None:
        strict = env_bool("KVCACHED_STRICT", False)
    with process_lock():
        previous = _results.get(engine)
        if previous is not None:
            previous = _current(previous)
            return dataclasses.replace(
                previous, repeated=True, inherited=previous.pid != os.getpid()
            )
        result = _bootstrap(engine, strict)
        _results[engine] = result
        return result


def _vanilla(
    engine: str, status: BootstrapStatus, reason: str, strict: bool, **fields: Any
) -> BootstrapResult:
    """Report that ``engine`` stays vanilla: log a warning, or raise when strict."""
    message = f"kvcached: {engine}: {reason}"
    if strict:
        raise PluginError(message + _STRICT_NOTE)
    _log.warning(message)
    return BootstrapResult(engine, status, reason, pid=os.getpid(), **fields)


def _bootstrap(engine: str, strict: bool) -> BootstrapResult:
    manager = get_plugin_manager()
    try:
        adapter = manager.engine_adapter(engine)
    except PluginError as exc:
        return _vanilla(engine, "failed", f"{exc}; engine left vanilla", strict)
    if adapter is None:
        reason = f"no installed plugin provides an adapter for engine {engine!r}"
        if manager.problems:
            reason += " (plugin problems: " + "; ".join(manager.problems) + ")"
        return _vanilla(engine, "no-adapter", reason + "; engine left vanilla", strict)

    owner: dict[str, Any] = {"plugin": adapter.plugin, "distribution": adapter.distribution}
    found = detect_engine_version(engine, adapter.module, adapter.distributions)
    if found.version is None:
        return _vanilla(
            engine,
            "unknown-version",
            f"cannot tell which {engine} version is running ({found.note}); engine left vanilla",
            strict,
            **owner,
        )
    version = found.version
    fields: dict[str, Any] = {**owner, "version": str(version), "version_source": found.source}
    if not adapter.supports(version):
        return _vanilla(
            engine,
            "unsupported",
            f"{adapter.outside_note(version, found)}; engine left vanilla",
            strict,
            **fields,
        )
    try:
        patch_set = build_patch_set(manager, adapter, version)
    except PluginError as exc:
        return _vanilla(engine, "failed", f"{exc}; engine left vanilla", strict, **fields)

    applied = patch_set.apply(version, strict=strict)
    if applied.status == "failed":
        name, why = applied.failed[0]
        reason = f"patch {name!r} failed: {why}; the patch set was rolled back"
        return BootstrapResult(
            engine, "failed", reason, pid=os.getpid(), patch_set=applied, **fields
        )
    if applied.status == "skipped":
        return _vanilla(
            engine,
            "skipped",
            f"no patch of {adapter.owner} applies to {engine} {version}; engine left vanilla",
            strict,
            patch_set=applied,
            **fields,
        )
    _patch_sets[engine] = patch_set
    return BootstrapResult(engine, "applied", pid=os.getpid(), patch_set=applied, **fields)


def _current(result: BootstrapResult) -> BootstrapResult:
    """``result`` with its patch set's state now (deferred patches land or fail later)."""
    patch_set = _patch_sets.get(result.engine)
    now = None if patch_set is None else patch_set.result
    if now is None or now == result.patch_set:
        return result
    if now.status == "failed":
        name, why = now.failed[0]
        reason = f"patch {name!r} failed: {why}; the patch set was rolled back"
        return dataclasses.replace(result, status="failed", reason=reason, patch_set=now)
    return dataclasses.replace(result, patch_set=now)


def bootstrap_results() -> dict[str, BootstrapResult]:
    """The bootstrap outcome of each engine in this process (or inherited from a parent).

    Deferred patches count as they stand now: applied once their module was
    imported, or the set failed and was rolled back.
    """
    with process_lock():
        return {engine: _current(result) for engine, result in _results.items()}


def engine_patch_set(engine: str) -> PatchSet | None:
    """The patch set :func:`bootstrap` applied for ``engine`` in this process, if any."""
    with process_lock():
        return _patch_sets.get(engine)


def teardown(engine: str) -> RevertResult | None:
    """Revert ``engine``'s patch set and forget its bootstrap, so a later call starts over.

    Returns:
        The revert result, or ``None`` when no patch set was applied.
    """
    with process_lock():
        _results.pop(engine, None)
        patch_set = _patch_sets.pop(engine, None)
        return None if patch_set is None else patch_set.revert()


def reset_bootstrap() -> None:
    """Revert every engine's patch set and forget all bootstrap results."""
    with process_lock():
        for engine in list(_results) + list(_patch_sets):
            teardown(engine)
