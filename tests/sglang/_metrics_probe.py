"""Runs inside one SGLang release (a subprocess set up by test_metrics.py) and reports JSON.

``_metrics_probe.py <order> <site dir>`` loads kvcached the way a server process
of that release does, builds SGLang's ``/metrics`` route on SGLang's own FastAPI
app with SGLang's (patched) ``add_prometheus_middleware`` as its HTTP server
does, publishes kvcached pool records (a raw segment with known figures and a
real elastic SGLang ``MHATokenToKVPool``) and scrapes ``/metrics`` through
Starlette's ``TestClient``. ``order``:

* ``pth`` (< 0.5.11): the real ``kvcached_sglang_autoload.pth`` line, then
  ``import sglang.srt.entrypoints.http_server`` (the hook bootstraps while that
  import reaches the scheduler module, as in ``python -m sglang.launch_server``);
* ``plugins-first`` (>= 0.5.11): SGLang's ``load_plugins()`` then the import
  (``sglang serve``, ``launch_server``'s ``__main__``);
* ``server-first`` (>= 0.5.11): the import, then ``load_plugins()`` (a program
  that imports the server and launches it; ``_launch_subprocesses`` loads plugins).
"""

from __future__ import annotations

import json
import os
import site
import sys
import traceback
from typing import Any

REPORT: dict[str, Any] = {}
RAW_NS, RAW_POOL = "metrics-raw", "probe"
MiB = 1 << 20


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def main(order: str, site_dir: str) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if order == "pth":
        site.addsitedir(site_dir)  # runs kvcached_sglang_autoload.pth as at start-up
        import sglang.srt.entrypoints.http_server as http
    elif order == "plugins-first":
        from sglang.srt.plugins import load_plugins

        load_plugins()
        import sglang.srt.entrypoints.http_server as http
    elif order == "server-first":
        import sglang.srt.entrypoints.http_server as http
        from sglang.srt.plugins import load_plugins

        load_plugins()
    else:
        raise SystemExit(f"unknown order {order!r}")

    import sglang
    from kvcached_core.plugins import bootstrap_results, patch_of, teardown

    REPORT["sglang_version"] = sglang.__version__
    res = bootstrap_results().get("sglang")
    ps = res.patch_set if res is not None else None
    REPORT["bootstrap"] = {
        "status": res.status if res else None,
        "applied": list(ps.applied) if ps else [],
        "deferred": list(ps.deferred) if ps else [],
        "skipped": [list(x) for x in ps.skipped] if ps else [],
        "failed": [list(x) for x in ps.failed] if ps else [],
    }
    middleware = http.add_prometheus_middleware
    installed = patch_of(middleware)  # the patch whose wrapper SGLang's server calls, if any
    REPORT["wrapped"] = installed[1] if installed is not None else None
    # kvcached must not import prometheus_client before SGLang sets its directory.
    REPORT["prometheus_imported_early"] = "prometheus_client" in sys.modules

    # What SGLang's launcher does before the HTTP server starts.
    from sglang.srt import utils as sgl_utils

    sgl_utils.set_prometheus_multiproc_dir()

    # kvcached records: a raw segment with known figures ...
    from kvcached_core.ipc.shm import PoolSegment

    seg = PoolSegment.create(RAW_NS, RAW_POOL, capacity=64 * MiB)
    seg.update(used=6 * MiB, reserved=2 * MiB)
    seg.set_limit(32 * MiB)
    seg.observe("map", 0.0004, 2 * MiB)
    seg.observe("map", 0.002, 4 * MiB)
    seg.observe("unmap", 0.0001, 2 * MiB)

    # ... and a real elastic SGLang pool with slots in use (its record: mha-tp<rank>).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _probe import make_allocator, make_pool

    pool = make_pool(4096)
    state = getattr(pool, "_kvcached", None)
    REPORT["pool_elastic"] = state is not None
    alloc = make_allocator(pool)
    held = alloc.alloc(1500)
    REPORT["pool_mapped"] = state.mapped_bytes() if state is not None else None

    # The HTTP server's two lines, on SGLang's own app, then one timed call of SGLang's.
    app = http.app
    http.add_prometheus_middleware(app)
    http.enable_func_timer()
    timer = sys.modules[http.enable_func_timer.__module__]
    timer.time_func_latency(lambda: None, name="kvcached_probe")()

    from starlette.testclient import TestClient

    client = TestClient(app)
    first = client.get("/metrics")
    second = client.get("/metrics")
    REPORT["status"] = [first.status_code, second.status_code]
    REPORT["samples"] = samples(second.text)

    # The same route as vanilla SGLang builds it (the unwrapped function, a fresh app).
    from starlette.applications import Starlette

    vanilla = Starlette()
    middleware.__wrapped__(vanilla)
    REPORT["vanilla_samples"] = samples(TestClient(vanilla).get("/metrics").text)

    alloc.free(held)
    if state is not None:
        state.close()
    seg.close()

    rev = teardown("sglang")
    REPORT["revert"] = {"conflicts": [str(c) for c in rev.conflicts] if rev else None,
                        "stale_aliases": [str(c) for c in rev.stale_aliases] if rev else None}
    # No longer the wrapper the server called (a reverted patch is not in the registry).
    REPORT["restored"] = installed is not None and http.add_prometheus_middleware is not middleware
    common = sys.modules.get("sglang.srt.utils.common", sgl_utils)
    REPORT["definition_restored"] = installed is not None and not any(
        getattr(m, "add_prometheus_middleware", None) is middleware for m in (sgl_utils, common))


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        REPORT["error"] = f"{type(exc).__name__}: {exc}"
        REPORT["traceback"] = traceback.format_exc()[-4000:]
    print("PROBE-JSON " + json.dumps(REPORT, default=str))
