"""Engine functions run under substituted global names (kvcached_core.plugins.rebind)."""

from __future__ import annotations

import functools
import math

import pytest

from kvcached_core.plugins import reads_global, with_globals

SCALE = 2


def scaled(x, *, offset=0, factor=3):
    """Reads two globals: ``SCALE`` and ``math``."""
    return SCALE * math.floor(x) * factor + offset


def make_closure(base):
    def inner(x):
        return base + SCALE * x
    return inner


def test_the_clone_sees_the_substitutes_and_the_module_does_not_change():
    clone = with_globals(scaled, SCALE=10)
    assert clone(1.5) == 30 and clone(1.5, offset=1, factor=1) == 11
    assert scaled(1.5) == 6 and globals()["SCALE"] == 2  # the module's own name is untouched
    assert clone.__name__ == "scaled" and clone.__qualname__ == scaled.__qualname__
    assert clone.__kwdefaults__ == {"offset": 0, "factor": 3}
    assert clone.__code__ is scaled.__code__


def test_a_substitute_for_a_module_reaches_only_the_clone():
    class FakeMath:
        @staticmethod
        def floor(x):
            return 100

    assert with_globals(scaled, math=FakeMath)(1.5) == 2 * 100 * 3
    assert math.floor(1.5) == 1


def test_closures_and_defaults_are_kept():
    inner = make_closure(7)
    assert with_globals(inner, SCALE=0)(5) == 7
    assert inner(5) == 17


def test_reads_global_names_only_plain_code_that_uses_the_name():
    assert reads_global(scaled, "SCALE") and reads_global(scaled, "math")
    assert not reads_global(scaled, "torch")
    assert not reads_global(len, "SCALE")  # a builtin has no code
    assert not reads_global(functools.partial(scaled, 1), "SCALE")


@pytest.mark.parametrize("func", [len, functools.partial(scaled, 1)])
def test_callables_without_code_are_refused(func):
    with pytest.raises(TypeError, match="not a plain Python function"):
        with_globals(func, SCALE=1)
