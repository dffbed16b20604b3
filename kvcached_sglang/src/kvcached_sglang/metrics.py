"""kvcached's Prometheus metrics on SGLang's own ``/metrics`` (``--enable-metrics``).

SGLang serves ``/metrics`` from ``add_prometheus_middleware(app)`` (the same
function in every release 0.4.9 - 0.5.23, in ``sglang.srt.utils``, from 0.5.3
``sglang.srt.utils.common``): it imports ``prometheus_client`` (only then:
``PROMETHEUS_MULTIPROC_DIR`` must be set first), builds a local
``CollectorRegistry`` with a ``MultiProcessCollector`` over SGLang's
multi-process directory and mounts ``make_asgi_app(registry=registry)`` at
``/metrics``. The process that runs it is the HTTP server's (the tokenizer
manager's; from 0.5.3 in the app's lifespan, also each worker of
``--tokenizer-worker-num``), which owns no KV pool.

kvcached wraps that function: SGLang's code runs unchanged, then kvcached finds
the registry the mounted ASGI app serves (``prometheus_client``'s
``make_asgi_app`` keeps it in its closure) and adds
:class:`kvcached_core.metrics.KVCachedCollector` to it once. The collector reads
every pool and budget record of the user on the machine at each scrape (the
schedulers' pools publish them), so nothing crosses SGLang's multi-process
files and no aggregation is needed. Should the registry not be found (another
``prometheus_client``), kvcached logs a warning and SGLang's ``/metrics`` stays
exactly as SGLang built it; an error in kvcached's part never stops the server.

Which binding is wrapped depends on when kvcached's patches land in the HTTP
server process relative to ``http_server``'s ``from sglang.srt.utils import
add_prometheus_middleware`` (see :mod:`kvcached_sglang.patches`):

* up to 0.5.10 the ``.pth`` hook bootstraps when ``sglang.srt.managers.scheduler``
  finishes importing, which ``http_server`` reaches (through ``engine``) before it
  copies the name: kvcached wraps the definition (and, from 0.5.3, the
  ``sglang.srt.utils`` re-export), and ``http_server`` copies the wrapper;
* from 0.5.11 SGLang's ``load_plugins()`` runs before or after ``http_server`` is
  imported (``sglang serve`` / ``launch_server`` first, an embedding program may
  import the server first): kvcached wraps ``http_server``'s own binding, deferred
  until that module is imported.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from kvcached_core.errors import PatchError

__all__ = ["EXPECTED_SOURCE", "make_add_prometheus_middleware", "served_registry"]

_log = logging.getLogger("kvcached")

#: What the wrapper relies on in SGLang's ``add_prometheus_middleware``: a local
#: registry, served through ``make_asgi_app`` from a route appended to ``app``.
EXPECTED_SOURCE = (
    "registry = CollectorRegistry()",
    "MultiProcessCollector(registry)",
    'Mount("/metrics", make_asgi_app(registry=registry))',
    "app.routes.append(metrics_route)",
)


def served_registry(route: Any) -> Any:
    """The ``CollectorRegistry`` a ``/metrics`` route's ``make_asgi_app`` serves, or ``None``."""
    from prometheus_client.registry import CollectorRegistry

    asgi = getattr(route, "_base_app", None) or getattr(route, "app", None)
    try:
        captured = inspect.getclosurevars(asgi).nonlocals
    except TypeError:  # not a plain function (an app object of another library)
        return None
    registry = captured.get("registry")
    return registry if isinstance(registry, CollectorRegistry) else None


def make_add_prometheus_middleware(original: Callable[..., Any],
                                   version: Any) -> Callable[..., Any]:
    """Patch wrapper for SGLang's ``add_prometheus_middleware(app)``."""
    from kvcached_core.plugins import patch_of

    installed = patch_of(original)
    if installed is not None:
        raise PatchError(f"add_prometheus_middleware is already the wrapper of kvcached patch "
                         f"{installed[1]!r}")
    try:
        src = inspect.getsource(original)
    except (OSError, TypeError):
        src = ""
    missing = [n for n in EXPECTED_SOURCE if n not in src]
    if missing:
        raise PatchError(
            f"SGLang {version}: {getattr(original, '__qualname__', original)} no longer "
            f"contains {missing}; the /metrics gate did not foresee this layout")

    @functools.wraps(original)
    def add_prometheus_middleware(app: Any, *args: Any, **kwargs: Any) -> Any:
        before = {id(r) for r in getattr(app, "routes", ())}
        result = original(app, *args, **kwargs)
        try:
            routes = [r for r in getattr(app, "routes", ())
                      if id(r) not in before and getattr(r, "path", None) == "/metrics"]
            registry = served_registry(routes[-1]) if routes else None
            if registry is None:
                _log.warning("kvcached: SGLang's /metrics route serves no registry kvcached "
                             "can find; kvcached's pool metrics are not shown there")
            else:
                from kvcached_core.metrics import register

                register(registry)
                _log.info("kvcached: SGLang's /metrics also shows kvcached's pools")
        except Exception:  # SGLang's metrics must never suffer from kvcached's
            _log.warning("kvcached: cannot add kvcached's metrics to SGLang's /metrics",
                         exc_info=True)
        return result

    return add_prometheus_middleware
