"""kvcached's one "no value" marker, for arguments and attributes where ``None`` is a value.

``Patch(replacement=None)`` sets an attribute to ``None``, and
``PageAllocator.reconfigure(memory_limit=None)`` removes the limit, so both
need a default that is not ``None``: :data:`UNSET`. It is a singleton (copies
and unpickled copies are the same object, so test it with ``is``), it is
false, and it prints as ``UNSET``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UNSET"]


class _Unset:
    """The type of :data:`UNSET`."""

    _instance: _Unset | None = None

    def __new__(cls) -> _Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "UNSET"  # pickles as a reference to this module's UNSET


#: "No value given" (or "no such attribute"), distinct from ``None``.
UNSET: Any = _Unset()
