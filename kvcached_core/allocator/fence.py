"""Step fence: when device work that may read a freed page has finished.

An engine that schedules ahead (vLLM's async scheduling, SGLang's overlap
scheduler) frees a finished request's blocks while the step it scheduled next
may still be on its way to the device: the worker has received it, or is
about to, but has not launched its kernels. Unmapping such a page at once
would let those kernels read unmapped memory (on a GPU: an illegal address
that kills the engine). A device synchronisation in the worker does not help,
because the kernels are not queued yet.

The engine adapter counts steps::

    fence = StepFence()
    pages = PageAllocator(kv, fence=fence)
    seq = fence.step_scheduled()    # after each schedule(): this step's number
    fence.step_completed(seq)       # when that step's output arrived

A page freed while ``scheduled == s`` can only be read by steps up to ``s``,
so it may be unmapped once ``completed >= s``. Until then the allocator keeps
it mapped (in its reserve, where a new allocation may take it again) and its
background thread unmaps it when the fence allows.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

__all__ = ["StepFence"]


class StepFence:
    """Counts scheduled and completed engine steps for the allocators that share it."""

    def __init__(self) -> None:
        self._scheduled = 0
        self._completed = 0
        self._lock = threading.Lock()
        self._waiters: weakref.WeakKeyDictionary[object, Callable[[], None]] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def scheduled(self) -> int:
        """Steps scheduled so far: the stamp of a page freed now."""
        return self._scheduled

    @property
    def completed(self) -> int:
        """The highest step whose device work has finished."""
        return self._completed

    def step_scheduled(self) -> int:
        """Count one more scheduled step; returns its number."""
        with self._lock:
            self._scheduled += 1
            return self._scheduled

    def step_completed(self, seq: int | None = None) -> None:
        """Step ``seq`` (default: the next one) and every step before it have finished."""
        with self._lock:
            done = self._completed + 1 if seq is None else seq
            if done <= self._completed:
                return
            self._completed = min(done, self._scheduled) if seq is None else done
            waiters = list(self._waiters.values())
        for wake in waiters:
            wake()

    def is_safe(self, stamp: int) -> bool:
        """Whether a page stamped ``stamp`` may be unmapped now."""
        return stamp <= self._completed

    def subscribe(self, owner: object, wake: Callable[[], None]) -> None:
        """Call ``wake()`` after each completion while ``owner`` lives."""
        with self._lock:
            self._waiters[owner] = wake

    def __repr__(self) -> str:
        return f"<StepFence scheduled={self._scheduled} completed={self._completed}>"
