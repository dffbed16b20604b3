"""What kvcached redoes in a child created by ``fork()``.

A child gets a copy of its parent's memory but only the thread that called
``fork()``: a lock that another thread of the parent held at that moment stays
held in the child for good. Modules that keep process-wide locks register a
callback here that replaces them in the child::

    _lock = threading.Lock()

    def _fresh_lock() -> None:
        global _lock
        _lock = threading.Lock()

    at_fork_in_child(_fresh_lock)  # cheap to call again, e.g. from a constructor

One ``os.register_at_fork`` handler per process runs the callbacks in the
child, in the order they were first registered; one that raises is logged and
the others still run. Objects that belong to the process that made them (page
mappers, listeners, shared-memory records) instead compare ``os.getpid()``
with the pid they were made in.

This module is the bottom floor: it imports nothing of kvcached, so every
layer (IPC, allocator, plugin framework) can use it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

__all__ = ["at_fork_in_child"]

_log = logging.getLogger("kvcached")

# Callbacks in registration order (a dict: registering one twice keeps one entry).
_CALLBACKS: dict[Callable[[], None], None] = {}
_registered = False


def _run_in_child() -> None:
    for callback in list(_CALLBACKS):
        try:
            callback()
        except Exception:  # one broken callback must not leave the others' locks held
            _log.exception("kvcached: after-fork callback %r failed", callback)


def at_fork_in_child(callback: Callable[[], None]) -> None:
    """Run ``callback()`` in every child this process forks from now on (once per callback)."""
    global _registered
    _CALLBACKS.setdefault(callback, None)
    if not _registered and hasattr(os, "register_at_fork"):
        _registered = True
        os.register_at_fork(after_in_child=_run_in_child)
