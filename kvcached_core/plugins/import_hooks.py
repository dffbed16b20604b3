"""Callbacks that run right after a module is first imported.

Deferred patches (``Patch(..., deferred=True)``) use this: an engine process
that never imports, say, its worker modules should not pay for importing them
just so kvcached can patch them. :func:`when_imported` registers a callback for
a module that is not imported yet; one finder at the front of
``sys.meta_path`` hands the import to the finders that would have handled it
and wraps the loader, so the callback runs once the module's body has run,
before the ``import`` statement returns. The module's ``__loader__`` and
``__spec__.loader`` stay the original loader.

A callback that raises makes the import fail (the module is removed from
``sys.modules``, as for an error in the module body): that is how a strict
deferred patch refuses to run the engine.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["cancel", "pending_modules", "when_imported"]

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_callbacks: dict[str, list[Callback]] = {}


class _Loader(importlib.abc.Loader):
    """The original loader, plus the callbacks once the module body has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        name = module.__name__
        with _lock:
            callbacks = _callbacks.pop(name, [])
        loaded = sys.modules.get(name, module)
        for callback in callbacks:
            callback(loaded)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds watched modules through the other finders and wraps their loader."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        with _lock:
            if fullname not in _callbacks:
                return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


_FINDER = _Finder()


def when_imported(module: str, callback: Callback) -> bool:
    """Run ``callback(module_object)`` right after ``module`` is first imported.

    Returns:
        ``True`` when the callback was registered; ``False`` when the module
        is imported already (the caller acts now; nothing is registered).
    """
    with _lock:
        if module in sys.modules:
            return False
        _callbacks.setdefault(module, []).append(callback)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
        return True


def cancel(module: str, callback: Callback) -> None:
    """Forget a callback registered for ``module`` (no error if it already ran)."""
    with _lock:
        waiting = _callbacks.get(module, [])
        if callback in waiting:
            waiting.remove(callback)
        if not waiting:
            _callbacks.pop(module, None)


def pending_modules() -> list[str]:
    """Modules that callbacks are still waiting for."""
    with _lock:
        return sorted(_callbacks)
