"""Parsing of kvcached's environment variables.

This module is the one place where kvcached turns ``KVCACHED_*`` environment
variables into typed values. Every parser reads :data:`os.environ` at call time
(nothing is cached, nothing happens at import), treats an unset or blank
variable as "use the default", and raises :class:`KVCachedConfigError` naming
the variable and the bad value otherwise::

    >>> import os
    >>> os.environ["KVCACHED_ENABLED"] = "maybe"
    >>> env_bool("KVCACHED_ENABLED", True)
    Traceback (most recent call last):
    ...
    kvcached_core.errors.KVCachedConfigError: KVCACHED_ENABLED='maybe' is not a boolean (use 1/0/true/false/yes/no/on/off)
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvcached_core import legacy_env
from kvcached_core.errors import KVCachedConfigError
from kvcached_core.spelling import parse_bool, shown

__all__ = [
    "KVCachedConfigError",
    "shown",
    "env_bool",
    "parse_bool",
    "env_int",
    "env_float",
    "env_list",
]

_N = TypeVar("_N", int, float)

_LONG_INT_RE = re.compile(r"^[+-]?\d+$")  # an integer, however long


def _read(name: str) -> tuple[str, str] | None:
    """``(label, stripped value)`` of setting ``name``, or ``None`` when unset or blank.

    An unset ``name`` falls back to the original kvcached's variable for it
    (:mod:`kvcached_core.legacy_env`); ``label`` names the variable the value
    came from, for error messages.
    """
    return legacy_env.lookup(name, os.environ)


def env_bool(name: str, default: bool) -> bool:
    """Read a boolean variable.

    Accepts ``1/0``, ``true/false``, ``yes/no`` and ``on/off`` in any case.

    Args:
        name: The environment variable, e.g. ``"KVCACHED_ENABLED"``.
        default: The value when the variable is unset or blank.

    Raises:
        KVCachedConfigError: The value is none of the accepted spellings.
    """
    found = _read(name)
    return default if found is None else parse_bool(*found)


def _env_number(
    name: str,
    default: _N,
    parse: Callable[[str], _N],
    what: str,
    minimum: _N | None,
    maximum: _N | None,
) -> _N:
    found = _read(name)
    if found is None:
        return default
    name, value = found  # name: the variable the value came from, for messages
    try:
        number = parse(value)
    except (ValueError, OverflowError):
        if _LONG_INT_RE.match(value) and (minimum is not None or maximum is not None):
            # An integer too long for int(): out of range whichever the range is.
            side = "below the minimum" if value.startswith("-") else "above the maximum"
            bound = minimum if value.startswith("-") else maximum
            raise KVCachedConfigError(f"{name}={shown(value)} is {side} {bound!r}") from None
        raise KVCachedConfigError(f"{name}={shown(value, quote=True)} is not {what}") from None
    if minimum is not None and number < minimum:
        raise KVCachedConfigError(f"{name}={shown(value)} is below the minimum {minimum!r}")
    if maximum is not None and number > maximum:
        raise KVCachedConfigError(f"{name}={shown(value)} is above the maximum {maximum!r}")
    return number



def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(text)
    return number


def env_int(name: str, default: int, minimum: int | None = None, maximum: int | None = None) -> int:
    """Read an integer variable (decimal, optionally signed).

    Args:
        name: The environment variable.
        default: The value when the variable is unset or blank (not range-checked).
        minimum: The smallest accepted value, if any.
        maximum: The largest accepted value, if any.

    Raises:
        KVCachedConfigError: The value is not an integer or is out of range.
    """
    return _env_number(name, default, lambda text: int(text, 10), "an integer", minimum, maximum)


def env_float(
    name: str, default: float, minimum: float | None = None, maximum: float | None = None
) -> float:
    """Read a finite floating-point variable; the arguments are those of :func:`env_int`.

    Raises:
        KVCachedConfigError: The value is not a finite number or is out of range.
    """
    return _env_number(name, default, _finite_float, "a finite number", minimum, maximum)


def env_list(name: str, default: Sequence[str] = ()) -> list[str]:
    """Read a comma-separated list.

    Items are stripped; empty items and repeats are dropped, order is kept
    (``" a, b,,a "`` gives ``["a", "b"]``).

    Args:
        name: The environment variable.
        default: The items when the variable is unset or blank.
    """
    found = _read(name)
    if found is None:
        return list(default)
    value = found[1]
    items: list[str] = []
    for item in value.split(","):
        item = item.strip()
        if item and item not in items:
            items.append(item)
    return items
