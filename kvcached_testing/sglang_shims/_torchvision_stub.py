"""A permissive ``torchvision`` stub and a tiny post-import hook (test shim, not SGLang code).

Why: PyPI's torchvision is a CUDA build that fails to load beside CPU torch, and SGLang
imports ``torchvision.io.decode_jpeg`` (and, through transformers, ``torchvision.transforms``)
at module level. No test decodes images, so every attribute is a placeholder that raises when
called. No distribution metadata is provided, so transformers treats torchvision as absent.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable


class _PlaceholderMeta(type):
    """Any class attribute of a placeholder (``InterpolationMode.NEAREST``) is a placeholder."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderMeta(name, (_Placeholder,), {"__module__": cls.__module__})


class _Placeholder(metaclass=_PlaceholderMeta):
    """Stands for any torchvision object; raises when used for real."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("torchvision is stubbed in the SGLang CPU tests")

    def __class_getitem__(cls, item: Any) -> type:
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderMeta(name, (_Placeholder,), {"__module__": self.__name__})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        if spec.name == "torchvision":
            module.__version__ = "0.0.0+stub"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Put the stub finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _PostImport(importlib.abc.MetaPathFinder):
    """Calls ``hook(module)`` once, right after ``name`` is imported."""

    def __init__(self, name: str, hook: Callable[[types.ModuleType], None]) -> None:
        self.name, self.hook = name, hook

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, hook = spec.loader, self.hook
        exec_module = loader.exec_module

        def exec_and_hook(module: types.ModuleType) -> None:
            exec_module(module)
            hook(module)

        loader.exec_module = exec_and_hook  # type: ignore[method-assign]
        return spec


def when_imported(name: str, hook: Callable[[types.ModuleType], None]) -> None:
    """Run ``hook`` on ``name`` now if imported, else right after its import."""
    if name in sys.modules:
        hook(sys.modules[name])
    else:
        sys.meta_path.insert(0, _PostImport(name, hook))
