"""Shared by the kernel shims: a module ``__getattr__`` whose every name raises when called."""

from __future__ import annotations

from typing import Any, Callable


def missing_attrs(module: str, why: str) -> Callable[[str], Any]:
    """``__getattr__`` for a stand-in module: any public name is a function that raises."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def _missing(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"{module}.{name}: {why}")

        return _missing

    return __getattr__
