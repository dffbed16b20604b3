"""The original kvcached's environment variables, in one place.

Users coming from the original kvcached (``kvcached`` on PyPI, ``kvcached.vmm_ops``)
have its variables in their launch scripts. None of them is silently ignored:
each is either honoured with its meaning or rejected with a
:class:`KVCachedConfigError` that names the variable and the setting to use.

Honoured under a new name (:data:`ALIASES`; read wherever the new setting is
read, in every process, through :func:`kvcached_core.env` parsers):

=================================  ==========================  ================================
original                           new                         how
=================================  ==========================  ================================
``ENABLE_KVCACHED``                ``KVCACHED_ENABLED``        ``false`` leaves engines vanilla
``KVCACHED_AUTOPATCH``             ``KVCACHED_ENABLED``        ``false`` leaves engines vanilla
``KVCACHED_PAGE_PREALLOC_ENABLED`` ``KVCACHED_PREALLOC``       same meaning
``KVCACHED_IPC_TIMEOUT``           ``KVCACHED_IPC_TIMEOUT_S``  seconds; ``<= 0`` (no bound) is
                                                               rejected
=================================  ==========================  ================================

Honoured under the same name (:data:`SAME_NAME`): ``KVCACHED_PAGE_SIZE_MB``,
``KVCACHED_CONTIGUOUS_LAYOUT``, ``KVCACHED_MIN_RESERVED_PAGES``,
``KVCACHED_MAX_RESERVED_PAGES``, ``KVCACHED_GPU_UTILIZATION``,
``KVCACHED_MAX_CACHED_TOKENS``, ``KVCACHED_IPC_NAME``, ``KVCACHED_LOG_LEVEL``
(the ``kvcached`` logger's level, applied by :func:`check_environment`) and
``KVCACHED_SANITY_CHECK=1`` (frees are always checked now).

Rejected (:data:`REJECTED`): ``KVCACHED_MAX_CACHED_BLOCKS``,
``KVCACHED_LOG_COLOR``, ``KVCACHED_LOG_COLOR_CODE``,
``KVCACHED_NIXL_CONTIGUOUS_LAYOUT``, ``KVCACHED_SANITY_CHECK=0``; at build
time setup.py rejects ``KVCACHED_USE_CUDA``, ``KVCACHED_USE_HIP`` and
``KVCACHED_BACKEND``.

Where both an original name and its new name are set they must agree, or the
error names both.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.spelling import parse_bool

__all__ = ["ALIASES", "REJECTED", "SAME_NAME", "Alias", "lookup", "check_environment"]

def _bool_text(name: str, value: str) -> str:
    return "1" if parse_bool(name, value) else "0"


def _seconds_text(name: str, value: str) -> str:
    try:
        seconds = float(value)
    except ValueError:
        raise KVCachedConfigError(f"{name}={value!r} is not a number of seconds") from None
    if not math.isfinite(seconds):
        raise KVCachedConfigError(f"{name}={value!r} is not a finite number of seconds")
    if seconds <= 0:
        raise KVCachedConfigError(
            f"{name}={value.strip()}: the original kvcached's 'no timeout' has no equivalent; "
            "set KVCACHED_IPC_TIMEOUT_S (seconds, 0.001..86400) instead"
        )
    return repr(seconds)


@dataclass(frozen=True)
class Alias:
    """An original variable honoured as ``new``: ``convert`` turns its value into ``new``'s."""

    old: str
    new: str
    convert: Callable[[str, str], str]


#: New setting -> the original variables read in its place when it is unset.
ALIASES: dict[str, tuple[Alias, ...]] = {
    "KVCACHED_ENABLED": (
        Alias("ENABLE_KVCACHED", "KVCACHED_ENABLED", _bool_text),
        Alias("KVCACHED_AUTOPATCH", "KVCACHED_ENABLED", _bool_text),
    ),
    "KVCACHED_PREALLOC": (Alias("KVCACHED_PAGE_PREALLOC_ENABLED", "KVCACHED_PREALLOC", _bool_text),),
    "KVCACHED_IPC_TIMEOUT_S": (Alias("KVCACHED_IPC_TIMEOUT", "KVCACHED_IPC_TIMEOUT_S", _seconds_text),),
}

#: The original's variables that keep their name and meaning here.
SAME_NAME = (
    "KVCACHED_PAGE_SIZE_MB",
    "KVCACHED_CONTIGUOUS_LAYOUT",
    "KVCACHED_MIN_RESERVED_PAGES",
    "KVCACHED_MAX_RESERVED_PAGES",
    "KVCACHED_GPU_UTILIZATION",
    "KVCACHED_MAX_CACHED_TOKENS",
    "KVCACHED_IPC_NAME",
    "KVCACHED_LOG_LEVEL",
    "KVCACHED_SANITY_CHECK",
)

#: Original variables with no equivalent -> what to do instead.
REJECTED: dict[str, str] = {
    "KVCACHED_MAX_CACHED_BLOCKS": (
        "is not read by kvcached (the original ignored it too); "
        "cap the prefix cache with KVCACHED_MAX_CACHED_TOKENS"
    ),
    "KVCACHED_LOG_COLOR": (
        "is not read: kvcached logs through Python's 'kvcached' logger, coloured or not by your "
        "logging configuration; set its level with KVCACHED_LOG_LEVEL"
    ),
    "KVCACHED_LOG_COLOR_CODE": (
        "is not read: kvcached logs through Python's 'kvcached' logger, coloured or not by your "
        "logging configuration; set its level with KVCACHED_LOG_LEVEL"
    ),
    "KVCACHED_NIXL_CONTIGUOUS_LAYOUT": (
        "is not read (the original never read it either); the layout is KVCACHED_CONTIGUOUS_LAYOUT"
    ),
}

_LOG_LEVELS = {
    "critical": logging.CRITICAL, "fatal": logging.CRITICAL, "error": logging.ERROR,
    "warning": logging.WARNING, "warn": logging.WARNING, "info": logging.INFO,
    "debug": logging.DEBUG,
}


def _set(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    return value if value is not None and value.strip() else None


def lookup(name: str, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The value of setting ``name``, honouring the original's names for it.

    Returns ``(label, text)``: ``label`` names the variable the text came from
    (for error messages), ``text`` is in ``name``'s format; ``None`` when
    neither ``name`` nor an original name for it is set.

    Raises:
        KVCachedConfigError: An original name's value is malformed, or it
            disagrees with ``name`` or with another original name.
    """
    environ = os.environ if environ is None else environ
    value = _set(environ, name)
    found: list[tuple[str, str]] = []
    for alias in ALIASES.get(name, ()):
        old = _set(environ, alias.old)
        if old is not None:
            found.append((alias.old, alias.convert(alias.old, old)))
    if not found:
        return None if value is None else (name, value.strip())
    if value is not None:
        for old, converted in found:
            if _canonical(name, value) != converted:
                raise KVCachedConfigError(
                    f"{old}={environ[old].strip()!r} (the original kvcached's name for {name}) "
                    f"disagrees with {name}={value.strip()!r}; unset {old}"
                )
        return name, value.strip()
    if name == "KVCACHED_ENABLED":
        # The original patched only with both ENABLE_KVCACHED and KVCACHED_AUTOPATCH on.
        off = [old for old, converted in found if converted == "0"]
        if off:
            return f"{off[0]} (the original kvcached's name for {name})", "0"
    old, converted = found[0]
    return f"{old} (the original kvcached's name for {name})", converted


def _canonical(name: str, value: str) -> str:
    """``value`` of ``name`` in the form the aliases convert to (for comparing)."""
    alias = ALIASES[name][0]
    try:
        return alias.convert(name, value)
    except KVCachedConfigError:
        return value.strip()


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Reject the original's variables that have no equivalent; apply ``KVCACHED_LOG_LEVEL``.

    Called when an engine's kvcached bootstrap runs and when settings are
    loaded, so a launch script written for the original kvcached fails at
    start, naming the variable, instead of running with it ignored.

    Raises:
        KVCachedConfigError: naming the first offending variable and the
            setting to use instead.
    """
    environ = os.environ if environ is None else environ
    for name, advice in REJECTED.items():
        value = _set(environ, name)
        if value is not None:
            raise KVCachedConfigError(f"{name}={value.strip()!r} {advice}")
    sanity = _set(environ, "KVCACHED_SANITY_CHECK")
    if sanity is not None and _bool_text("KVCACHED_SANITY_CHECK", sanity) == "0":
        raise KVCachedConfigError(
            f"KVCACHED_SANITY_CHECK={sanity.strip()!r}: kvcached always checks frees (a bad free "
            "raises MappingError) and cannot turn that off; unset KVCACHED_SANITY_CHECK"
        )
    for name in ALIASES:
        lookup(name, environ)  # malformed or conflicting original names fail here, not later
    level = _set(environ, "KVCACHED_LOG_LEVEL")
    if level is not None:
        key = level.strip().lower()
        if key not in _LOG_LEVELS:
            raise KVCachedConfigError(
                f"KVCACHED_LOG_LEVEL={level.strip()!r} is not a log level "
                "(use debug, info, warning, error or critical)"
            )
        logging.getLogger("kvcached").setLevel(_LOG_LEVELS[key])
