"""How a setting's value is spelled and shown: booleans, values quoted in error messages.

Below :mod:`kvcached_core.env` (which reads the variables) and
:mod:`kvcached_core.legacy_env` (which translates the original kvcached's), so
both read values the same way without importing each other.
"""

from __future__ import annotations

from kvcached_core.errors import KVCachedConfigError

__all__ = ["parse_bool", "shown"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
#: Longest value text an error message quotes in full.
_SHOWN_CHARS = 40


def shown(text: str, quote: bool = False) -> str:
    """``text`` for an error message: quoted with ``quote``, abbreviated when long."""
    text = str(text)
    if len(text) <= _SHOWN_CHARS:
        return repr(text) if quote else text
    head = text[:_SHOWN_CHARS]
    return f"{head!r}... ({len(text)} characters)" if quote else f"{head}... ({len(text)} characters)"


def parse_bool(label: str, value: str) -> bool:
    """``value`` of variable ``label`` as a boolean (1/0/true/false/yes/no/on/off).

    Raises:
        KVCachedConfigError: The value is none of the accepted spellings.
    """
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise KVCachedConfigError(
        f"{label}={shown(value.strip(), quote=True)} is not a boolean "
        "(use 1/0/true/false/yes/no/on/off)"
    )
