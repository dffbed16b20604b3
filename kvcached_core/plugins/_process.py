"""Per-process state shared by the patching and bootstrap code.

One re-entrant lock serialises applying and reverting patches. A child created
by ``fork()`` gets a fresh lock (the parent's could be held by a thread that
does not exist in the child; :mod:`kvcached_core.forks` replaces it);
everything else a child inherits (applied patches and the record of them)
stays valid, because its memory is a copy of the parent's.
"""

from __future__ import annotations

import threading

from kvcached_core.forks import at_fork_in_child

__all__ = ["process_lock", "watch_forks"]

_lock = threading.RLock()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()


def watch_forks() -> None:
    """Register the fork handler once per process (cheap to call repeatedly)."""
    at_fork_in_child(_after_fork_in_child)


def process_lock() -> threading.RLock:
    """The lock guarding patch state in this process."""
    watch_forks()
    return _lock
