"""Compat for SGLang's idle memory-leak check with an elastic KV pool.

SGLang's scheduler asserts at idle that every KV slot is free, evictable,
protected or held (``available + evictable (+ protected ...) == total``) and
that every request slot is free (``len(req_to_token_pool.free_slots) == size``).
With kvcached the allocator's ``available_size()`` is also bounded by the
physical memory and limits of the moment, so the first identity breaks by
design while the second still holds.

Rather than silencing the check (which on releases up to 0.5.10 also drops the
request-slot check, the idle metrics and the KV-event publishing, because they
live in the same method), kvcached runs SGLang's own check unchanged inside a
*leak-check view*: while it is active an elastic allocator reports its logical
free count, ``size - allocated``, which no other engine and no memory limit can
move. So:

* a consistent elastic pool passes (the identity holds exactly);
* a genuine KV leak (slots allocated in kvcached that neither a request nor the
  radix cache holds) still fails the identity and SGLang reports it;
* the request-to-token pool check, metrics and events run as before.

The view is a :class:`contextvars.ContextVar`, so it is per thread and ends
with the check. Where the check is entered depends on the release (layouts in
:mod:`kvcached_sglang.patches`): ``Scheduler.check_memory`` (0.4.9-0.5.3),
``SchedulerRuntimeCheckerMixin.check_memory`` (0.5.4-0.5.10), the mixin's
``on_idle`` (0.5.11-0.5.12) and ``Scheduler.on_idle`` (0.5.13+); the opt-in busy
checks get the same view.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["in_leak_check_view", "leak_check_view", "with_leak_check_view"]

_VIEW: contextvars.ContextVar[bool] = contextvars.ContextVar("kvcached_leak_check_view",
                                                               default=False)


def in_leak_check_view() -> bool:
    """Whether the calling thread is inside SGLang's memory-leak check."""
    return _VIEW.get()


@contextlib.contextmanager
def leak_check_view() -> Iterator[None]:
    """Elastic allocators report logical free counts inside this block."""
    token = _VIEW.set(True)
    try:
        yield
    finally:
        _VIEW.reset(token)


def with_leak_check_view(
    original: Callable[..., Any], before: Callable[[Any], Any] | None = None
) -> Callable[..., Any]:
    """Patch wrapper: run SGLang's check method ``original`` inside :func:`leak_check_view`.

    ``before(scheduler)``, if given, runs first (outside the view), with the
    method's ``self``: the idle entry points use it to trim the prefix cache.
    """

    @functools.wraps(original)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if before is not None and args:
            before(args[0])
        token = _VIEW.set(True)
        try:
            return original(*args, **kwargs)
        finally:
            _VIEW.reset(token)

    return checked
