"""Engine code run under substituted global names, its module left untouched.

Some engine functions need one dependency swapped for one call (vLLM's KV
allocation code allocating with ``torch.zeros``; SGLang's memory profile
reading ``get_available_gpu_memory``). Patching the engine's module would
change that name for every caller, in every thread; instead kvcached runs a
private copy of the function whose globals are the module's with the given
names rebound::

    if not reads_global(allocate, "torch"):
        raise ...  # the gate did not foresee this release
    clone = with_globals(allocate, torch=torch_with_elastic_zeros)
    clone(*args)

The copy shares the function's code, defaults, keyword defaults and closure;
its globals are a snapshot of the module's dict taken when it is made, plus
the substitutes. Only the function's own code sees the substitutes: a function
it calls still reads its own module's globals.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

__all__ = ["reads_global", "with_globals"]


def reads_global(func: Callable[..., Any], name: str) -> bool:
    """Whether ``func`` is plain Python code whose own body refers to the name ``name``.

    ``False`` for builtins, ``functools.partial`` objects and other callables
    without ``__code__`` (e.g. another plugin's wrapper object).
    """
    code = getattr(func, "__code__", None)
    return code is not None and name in code.co_names


def with_globals(func: Callable[..., Any], /, **names: Any) -> types.FunctionType:
    """A copy of the plain Python function ``func`` in which the global ``names`` are rebound.

    Raises:
        TypeError: ``func`` has no Python code object (a builtin, a partial,
            a callable object).
    """
    code = getattr(func, "__code__", None)
    scope = getattr(func, "__globals__", None)
    if code is None or scope is None:
        raise TypeError(f"{getattr(func, '__qualname__', func)!r} is not a plain Python function")
    clone = types.FunctionType(code, {**scope, **names}, func.__name__, func.__defaults__,
                               func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    clone.__qualname__ = func.__qualname__
    return clone
