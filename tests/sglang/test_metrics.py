"""kvcached's pools on SGLang's own ``/metrics``, in every tested release (one subprocess each).

Each subprocess loads kvcached as that release's server process does (``.pth``
hook up to 0.5.10, SGLang's ``load_plugins()`` from 0.5.11, in both orders
relative to the import of ``http_server``), runs SGLang's ``add_prometheus_middleware``
and ``enable_func_timer`` on SGLang's FastAPI app, publishes a raw pool record and a
real elastic ``MHATokenToKVPool``'s, and scrapes ``/metrics`` (``_metrics_probe.py``).
Importing ``http_server`` needs the HTTP-only packages of ``.sglang/_http``
(``scripts/setup_sglang.sh``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from kvcached_testing.sglang_release import ADAPTER_DIST, SGLANG_DIR, release_env
from tests.sglang.conftest import RELEASES, skip_unless_installed

PROBE = Path(__file__).resolve().parent / "_metrics_probe.py"
HTTP_DEPS = SGLANG_DIR / "_http"
MiB = 1 << 20
FIRST_PLUGIN_RELEASE = Version("0.5.11")

#: Which record wraps add_prometheus_middleware (kvcached_sglang.patches._METRICS).
EXPECTED_PATCH = {v: ("kvcached-metrics" if Version(v) < Version("0.5.3") else
                      "kvcached-metrics-common" if Version(v) < FIRST_PLUGIN_RELEASE else
                      "kvcached-metrics-http") for v in RELEASES}

CASES = [(v, "pth" if Version(v) < FIRST_PLUGIN_RELEASE else "plugins-first") for v in RELEASES]
_PLUGIN_RELEASES = [v for v in RELEASES if Version(v) >= FIRST_PLUGIN_RELEASE]
#: Both load orders on the oldest and the newest release with plugin entry points.
CASES += [(v, "server-first") for v in dict.fromkeys(_PLUGIN_RELEASES[:1] + _PLUGIN_RELEASES[-1:])]

def _probe(key: tuple[str, str], dist_record: Path, tmp_path_factory) -> dict[str, Any]:
    version, order = key
    tmp = tmp_path_factory.mktemp(f"metrics-{version}-{order}")
    site_dir = tmp / "site"
    site_dir.mkdir()
    (site_dir / "kvcached_sglang_autoload.pth").write_text(
        (ADAPTER_DIST / "kvcached_sglang_autoload.pth").read_text())
    shm = tmp / "shm"
    shm.mkdir(mode=0o700)
    env = release_env(version, dist_record, KVCACHED_SHM_DIR=str(shm),
                      KVCACHED_IPC_NAME="metrics-sgl", KVCACHED_PAGE_SIZE_MB="1",
                      KVCACHED_PREALLOC="0", KVCACHED_IDLE_TRIM_S="0")
    env["PYTHONPATH"] += os.pathsep + str(HTTP_DEPS)
    proc = subprocess.run([sys.executable, str(PROBE), order, str(site_dir)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(tmp))
    out = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE-JSON ")]
    if proc.returncode != 0 or not out:
        pytest.fail(f"metrics probe for SGLang {version} ({order}) failed "
                    f"(rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    rep = json.loads(out[-1][len("PROBE-JSON "):])
    assert "error" not in rep, rep.get("traceback", rep)
    return rep


def _report(version: str, order: str, dist_record: Path, tmp_path_factory,
            prefetched) -> dict[str, Any]:
    skip_unless_installed(version)
    if not (HTTP_DEPS / ".done").is_file():
        pytest.skip(f"SGLang's HTTP-server packages are not in {HTTP_DEPS}; "
                    "run scripts/setup_sglang.sh")
    return prefetched.get(("metrics", version, order), [("metrics", *c) for c in CASES],
                          lambda key: _probe(key[1:], dist_record, tmp_path_factory))


def _values(samples: list, metric: str, **labels: str) -> list[float]:
    return [v for n, lab, v in samples if n == metric and all(lab.get(k) == x
                                                              for k, x in labels.items())]


def _one(samples: list, metric: str, **labels: str) -> float:
    found = _values(samples, metric, **labels)
    assert len(found) == 1, (metric, labels, found)
    return found[0]


@pytest.mark.parametrize("version,order", CASES)
def test_sglang_metrics_endpoint_shows_kvcached_pools(version, order, dist_record,
                                                      tmp_path_factory, prefetched):
    rep = _report(version, order, dist_record, tmp_path_factory, prefetched)
    assert rep["sglang_version"] == version
    boot = rep["bootstrap"]
    assert boot["status"] == "applied" and boot["failed"] == [], boot
    assert EXPECTED_PATCH[version] in boot["applied"] and boot["deferred"] == [], boot
    other = {n for n in EXPECTED_PATCH.values() if n != EXPECTED_PATCH[version]}
    assert not other & set(boot["applied"])
    # The name SGLang's server calls is kvcached's wrapper, and kvcached imported
    # prometheus_client no earlier than SGLang (its multi-process directory comes first).
    assert rep["wrapped"] == EXPECTED_PATCH[version]
    assert rep["prometheus_imported_early"] is False
    assert rep["status"] == [200, 200]

    got = rep["samples"]
    raw = {"namespace": "metrics-raw", "pool": "probe"}
    assert _one(got, "kvcached_pool_mapped_bytes", **raw) == 8 * MiB
    assert _one(got, "kvcached_pool_used_bytes", **raw) == 6 * MiB
    assert _one(got, "kvcached_pool_reserved_bytes", **raw) == 2 * MiB
    assert _one(got, "kvcached_pool_limit_bytes", **raw) == 32 * MiB
    assert _one(got, "kvcached_pool_capacity_bytes", **raw) == 64 * MiB
    assert _one(got, "kvcached_pool_map_bytes_total", **raw) == 6 * MiB
    assert _one(got, "kvcached_pool_unmap_bytes_total", **raw) == 2 * MiB
    assert _one(got, "kvcached_pool_map_latency_seconds_count", **raw) == 2
    assert _one(got, "kvcached_pool_map_latency_seconds_sum", **raw) == pytest.approx(0.0024)
    assert _one(got, "kvcached_pool_map_latency_seconds_bucket", le="0.0005", **raw) == 1
    assert _one(got, "kvcached_pool_map_latency_seconds_bucket", le="+Inf", **raw) == 2
    assert _one(got, "kvcached_pool_unmap_latency_seconds_count", **raw) == 1

    # The real elastic SGLang pool (namespace from KVCACHED_IPC_NAME, pool mha-tp0).
    assert rep["pool_elastic"] is True and rep["pool_mapped"] > 0
    real = {"namespace": "metrics-sgl", "pool": "mha-tp0"}
    assert _one(got, "kvcached_pool_mapped_bytes", **real) == rep["pool_mapped"]
    assert _one(got, "kvcached_pool_used_bytes", **real) > 0
    assert _one(got, "kvcached_pool_capacity_bytes", **real) >= rep["pool_mapped"]
    assert _one(got, "kvcached_pool_map_latency_seconds_count", **real) >= 1
    assert _one(got, "kvcached_pool_map_bytes_total", **real) >= rep["pool_mapped"]


@pytest.mark.parametrize("version,order", CASES)
def test_sglang_own_metrics_unchanged(version, order, dist_record, tmp_path_factory,
                                      prefetched):
    rep = _report(version, order, dist_record, tmp_path_factory, prefetched)
    got, vanilla = rep["samples"], rep["vanilla_samples"]
    # SGLang's own histogram, recorded by SGLang's timer through its multi-process files.
    assert _one(got, "sglang:func_latency_seconds_count", name="kvcached_probe") == 1
    assert _one(vanilla, "sglang:func_latency_seconds_count", name="kvcached_probe") == 1

    def key(samples: list, mine: bool) -> set:
        return {(n, tuple(sorted(lab.items())), v) for n, lab, v in samples
                if n.startswith("kvcached_") == mine}

    # Everything but kvcached's families is what vanilla SGLang's route serves.
    assert key(got, False) == key(vanilla, False) and key(got, False)
    assert key(vanilla, True) == set()


@pytest.mark.parametrize("version,order", CASES)
def test_metrics_patch_reverts(version, order, dist_record, tmp_path_factory, prefetched):
    rep = _report(version, order, dist_record, tmp_path_factory, prefetched)
    assert rep["revert"]["conflicts"] == []
    assert rep["definition_restored"] is True
    if Version(version) >= FIRST_PLUGIN_RELEASE:
        assert rep["restored"] is True and rep["revert"]["stale_aliases"] == []
    else:
        # http_server copied the wrapper after kvcached patched its source (that is how
        # it reaches the server); the revert reports the copy, as for any late alias.
        assert rep["revert"]["stale_aliases"] == [
            "sglang.srt.entrypoints.http_server:add_prometheus_middleware"]


# --------------------------------------------------------------------- without SGLang


def _sglang_like(routes_app: Any):
    """A function with SGLang's ``add_prometheus_middleware`` text (what the gate reads),
    whose mounted app is ``routes_app`` instead of prometheus_client's."""

    def add_prometheus_middleware(app):
        registry = CollectorRegistry()  # noqa: F841
        # multiprocess.MultiProcessCollector(registry)
        metrics_route = Mount("/metrics", make_asgi_app(registry=registry))
        app.routes.append(metrics_route)

    CollectorRegistry = object  # noqa: N806
    Mount = lambda path, app: types.SimpleNamespace(path=path, app=app)  # noqa: E731,N806
    make_asgi_app = lambda registry: routes_app  # noqa: E731
    return add_prometheus_middleware


def test_gate_refuses_an_unforeseen_function():
    from kvcached_core.errors import PatchError
    from kvcached_sglang.metrics import make_add_prometheus_middleware

    def add_prometheus_middleware(app):
        app.routes.append(("/metrics", None))

    with pytest.raises(PatchError, match="/metrics gate did not foresee"):
        make_add_prometheus_middleware(add_prometheus_middleware, "0.9.9")


def test_gate_refuses_to_wrap_kvcached_own_wrapper(monkeypatch):
    """A binding that already holds the wrapper a patch in place installed (the patch
    registry says which) is not wrapped a second time."""
    from kvcached_core.errors import PatchError
    from kvcached_core.plugins import Patch, PatchSet
    from kvcached_sglang.metrics import make_add_prometheus_middleware

    module = types.ModuleType("kvt_sglang_http")
    module.add_prometheus_middleware = _sglang_like(object())
    monkeypatch.setitem(sys.modules, module.__name__, module)
    patch_set = PatchSet("sglang", [Patch(
        f"{module.__name__}:add_prometheus_middleware", name="kvcached-metrics-http",
        wrapper=lambda original: make_add_prometheus_middleware(original, "0.5.23"))])
    assert patch_set.apply("0.5.23").status == "applied"
    try:
        with pytest.raises(PatchError, match="already the wrapper of kvcached patch "
                                             "'kvcached-metrics-http'"):
            make_add_prometheus_middleware(module.add_prometheus_middleware, "0.5.23")
    finally:
        assert patch_set.revert().ok
    make_add_prometheus_middleware(module.add_prometheus_middleware, "0.5.23")  # vanilla again


def test_unknown_registry_leaves_sglang_route_alone(caplog):
    from kvcached_sglang.metrics import make_add_prometheus_middleware

    class OtherApp:  # an ASGI app object of another library: no closure to read
        async def __call__(self, scope, receive, send):
            return None

    served = OtherApp()
    wrapped = make_add_prometheus_middleware(_sglang_like(served), "0.5.23")
    app = types.SimpleNamespace(routes=[])
    with caplog.at_level("WARNING", logger="kvcached"):
        wrapped(app)
    assert [r.app for r in app.routes] == [served]
    assert "serves no registry kvcached can find" in caplog.text


# ----------------------------------------------------------- a real server on the CPU

SERVER_RELEASE = "0.5.23"
SERVER_ARGS = ["--device", "cpu", "--dtype", "bfloat16", "--attention-backend", "torch_native",
               "--sampling-backend", "pytorch", "--disable-cuda-graph", "--page-size", "1",
               "--max-total-tokens", "65536", "--grammar-backend", "none", "--random-seed", "0",
               "--skip-tokenizer-init", "--log-level", "warning", "--enable-metrics"]
SERVER_START_S = 600


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


@pytest.mark.engine
def test_launch_server_metrics_endpoint_shows_kvcached_pool(dist_record, tmp_path):
    """``python -m sglang.launch_server --enable-metrics`` on the CPU, scraped over HTTP."""
    import signal
    import time

    from prometheus_client.parser import text_string_to_metric_families

    version = SERVER_RELEASE
    skip_unless_installed(version)
    if not (HTTP_DEPS / ".done").is_file():
        pytest.skip(f"SGLang's HTTP-server packages are not in {HTTP_DEPS}; "
                    "run scripts/setup_sglang.sh")
    env = release_env(version, dist_record, KVCACHED_SHM_DIR=str(tmp_path / "shm"),
                      KVCACHED_IPC_NAME="metrics-server", KVCACHED_PAGE_SIZE_MB="1")
    (tmp_path / "shm").mkdir(mode=0o700)
    env["PYTHONPATH"] += os.pathsep + str(HTTP_DEPS)
    model = tmp_path / "tiny-llama"
    build = subprocess.run(
        [sys.executable, "-c", "import sys; from kvcached_testing.tiny_model import "
         "build_tiny_llama; build_tiny_llama(sys.argv[1])", str(model)],
        env=env, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
         "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path),
        start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while _get(f"{base}/health", timeout=5)[0] != 200:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-6000:]
            assert time.monotonic() < deadline, "server did not start: " + (
                tmp_path / "server.log").read_text()[-6000:]
            time.sleep(2)
        status, out = _get(f"{base}/generate", {
            "input_ids": list(range(3, 203)),
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}, timeout=300)
        assert status == 200, out
        status, text = _get(f"{base}/metrics")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    assert status == 200, text
    got = [(s.name, dict(s.labels), s.value)
           for fam in text_string_to_metric_families(text) for s in fam.samples]
    pool = {"namespace": "metrics-server", "pool": "mha-tp0"}
    # The scheduler process's elastic pool, read by the HTTP server's process.
    assert _one(got, "kvcached_pool_mapped_bytes", **pool) > 0
    assert _one(got, "kvcached_pool_used_bytes", **pool) > 0
    assert _one(got, "kvcached_pool_map_latency_seconds_count", **pool) >= 1
    # SGLang's own metrics next to them: the request just served was counted.
    assert sum(_values(got, "sglang:prompt_tokens_total")) >= 200, sorted({n for n, _, _ in got})
