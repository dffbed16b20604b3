"""A memory limit below the burst's need, and ``vllm serve`` answering HTTP with kvcached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from conftest import engine, greedy, long_prompts, token_ids, unique_namespace  # noqa: E402

from kvcached_testing.vllm_serve import ServeFailure, Server, serve, vanilla_control, verdict  # noqa: E402

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


# ``vllm serve`` itself, in float32. On x86 hosts with AMX (Sapphire Rapids and newer),
# vLLM's CPU attention runs its AMX kernel for a bfloat16 KV cache (``_get_attn_isa`` in
# vllm/v1/attention/backends/cpu_attn.py). That kernel executes tile instructions without
# asking Linux for AMX permission (arch_prctl(ARCH_REQ_XCOMP_PERM), once per process):
# vLLM never asks; in a worker the request comes from oneDNN, the first time a GEMM goes
# through it. The tiny model's linear layers all take vLLM's packed-weight kernel
# (``check_cpu_sgl_kernel``), which hands GEMMs of more than 4 tokens to PyTorch's oneDNN
# brgemm and computes smaller ones with AVX-512 alone: a first request of 4 tokens (as
# here) reaches the AMX attention kernel before anything asked, and the worker dies of
# SIGILL, with or without kvcached (the ``vllm.LLM`` tests' first steps are longer). In
# float32, vLLM takes neither the AMX attention kernel nor the packed-weight one, on any
# host.
SERVE_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
              "--served-model-name", "tiny"]


def _completions(server: Server) -> tuple[dict, dict]:
    """The two requests of the test: one prompt, then three equal ones (greedy)."""
    done = server.post("/v1/completions", {"model": "tiny", "prompt": "Once upon a time",
                                           "max_tokens": 16, "temperature": 0,
                                           "ignore_eos": True})
    chat_free = server.post("/v1/completions", {"model": "tiny", "prompt": ["a b c"] * 3,
                                                "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True})
    return done, chat_free


#: vLLM's own server around the engine test_engine.py runs in every release: once in CI, in
#: the newest environment (scripts/vllm_release_matrix.sh serves every release).
@pytest.mark.newest_vllm
def test_vllm_serve_answers_openai_requests(tiny_model, tmp_path: Path):
    """A server that fails (dies, is never healthy, does not answer) is judged by a
    vanilla control: the test skips, naming vanilla's failure, only where vanilla
    vLLM fails as early; it fails when vanilla serves what kvcached could not."""
    ns = unique_namespace("s")
    envs = dict(os.environ, KVCACHED_IPC_NAME=ns, KVCACHED_STRICT="1", KVCACHED_ENABLED="1",
                VLLM_TARGET_DEVICE="cpu")
    try:
        with serve(tiny_model, SERVE_ARGS, envs, tmp_path / "serve.log") as server:
            done, chat_free = _completions(server)
            assert done["choices"][0]["text"] and done["usage"]["completion_tokens"] == 16
            texts = {c["text"] for c in chat_free["choices"]}
            assert len(texts) == 1  # same prompt, greedy: same text
            from kvcached_vllm.monitor import KVMemoryMonitor

            with KVMemoryMonitor(ns, page_bytes=PAGE_BUNDLE) as mon:
                assert mon.read()[0].mapped_pages >= 1  # the engine's KV cache is kvcached's
            _check_metrics_and_views(server, ns)
    except ServeFailure as failure:
        vanilla = vanilla_control(tiny_model, SERVE_ARGS, envs, tmp_path / "serve-vanilla.log",
                                  _completions)
        outcome, message = verdict(failure, vanilla)
        if outcome == "skip":
            pytest.skip(message)
        pytest.fail(message, pytrace=False)


def _metric(text: str, name: str, ns: str, extra: str = "") -> float:
    """The value of ``name{...namespace="ns"...extra}`` in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'namespace="{ns}"' in line and extra in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} of {ns} not in /metrics:\n" +
                         "\n".join(x for x in text.splitlines() if "kvcached" in x))


def _check_metrics_and_views(server: Server, ns: str) -> None:
    """vLLM's own /metrics shows the pool (gauges, map/unmap latency histograms);
    kvctl status --json and kvtop --once show it too, without a device context."""
    text = server.get("/metrics")
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
