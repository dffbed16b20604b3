"""Auto-load for SGLang releases without a plugin entry point (< 0.5.11).

Why a ``.pth`` here, when the design avoids them where an entry point exists:
SGLang gained its ``sglang.srt.plugins`` group in 0.5.11. Before that nothing in
SGLang calls out to installed packages, and SGLang starts its scheduler
processes with ``spawn``, so a patch applied in the launching process does not
reach them. The only hook that every fresh interpreter runs is ``site``'s
``.pth`` processing.

The ``.pth`` line (``kvcached_sglang_autoload.pth``) calls :func:`install`, which
costs one environment lookup and, when kvcached is enabled, one entry on
``sys.meta_path``. The finder is inert: it answers ``None`` for every module
except ``sglang.srt.managers.scheduler`` (the module every engine process that
owns a KV pool imports before it builds one). When that module has finished
executing, the hook reads ``sglang.__version__``:

* SGLang >= 0.5.11: nothing (SGLang's own ``load_plugins()`` calls
  :func:`kvcached_sglang.entry.register`, honouring ``SGLANG_PLUGINS``);
* older: :func:`kvcached_sglang.entry.register` unless ``SGLANG_PLUGINS`` is set
  without ``kvcached``.

It never imports SGLang itself, starts no thread and leaves no finder behind
after it fired. ``KVCACHED_ENABLED=0`` at interpreter start installs nothing.
A failure inside the hook is logged and never breaks SGLang's import (unless
``KVCACHED_STRICT=1``, which makes kvcached refuse to run SGLang without it).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
from types import ModuleType
from typing import Any

__all__ = ["FIRST_ENTRY_POINT_RELEASE", "TRIGGER", "install", "installed", "uninstall"]

_log = logging.getLogger("kvcached")

#: The module whose import completes the trigger.
TRIGGER = "sglang.srt.managers.scheduler"
#: The first SGLang release that loads ``sglang.srt.plugins`` entry points itself.
FIRST_ENTRY_POINT_RELEASE = "0.5.11"
_OFF = {"0", "false", "no", "off"}


def _enabled() -> bool:
    return os.environ.get("KVCACHED_ENABLED", "").strip().lower() not in _OFF


class _SchedulerImportHook(importlib.abc.MetaPathFinder):
    """Wraps the loader of :data:`TRIGGER` so :func:`_on_import` runs after it executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname != TRIGGER:
            return None
        uninstall()  # fire once; also lets find_spec below skip this finder
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_bootstrap(module: ModuleType) -> None:
            exec_module(module)
            _on_import(module)

        loader.exec_module = exec_then_bootstrap  # type: ignore[union-attr]
        return spec


def _needs_hook(version_text: str | None) -> bool:
    """Whether this SGLang release predates its plugin entry points (unknown: yes)."""
    if not version_text:
        return True
    try:
        from packaging.version import Version

        return Version(version_text) < Version(FIRST_ENTRY_POINT_RELEASE + ".dev0")
    except Exception:  # a malformed version: let bootstrap report it
        return True


def _on_import(_module: ModuleType) -> None:
    from kvcached_sglang.entry import allowed_by_sglang, register

    sglang = sys.modules.get("sglang")
    if not _needs_hook(getattr(sglang, "__version__", None)):
        return
    if not allowed_by_sglang():
        _log.info("kvcached: SGLANG_PLUGINS=%r does not list 'kvcached'; SGLang stays vanilla",
                  os.environ.get("SGLANG_PLUGINS"))
        return
    try:
        register()
    except Exception:
        if os.environ.get("KVCACHED_STRICT", "").strip().lower() in {"1", "true", "yes", "on"}:
            raise
        _log.exception("kvcached: loading the SGLang adapter failed; SGLang stays vanilla")


def installed() -> bool:
    """Whether the finder is waiting on ``sys.meta_path``."""
    return any(isinstance(f, _SchedulerImportHook) for f in sys.meta_path)


def install() -> None:
    """Called by the ``.pth`` line: arm the hook (no-op when disabled or already armed).

    When the trigger module is already imported (a late call), the hook runs now.
    """
    if not _enabled() or installed():
        return
    module = sys.modules.get(TRIGGER)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        _on_import(module)
        return
    sys.meta_path.insert(0, _SchedulerImportHook())


def uninstall() -> None:
    """Remove the finder (idempotent)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _SchedulerImportHook)]
