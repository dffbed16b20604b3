"""Serves a tiny local Llama with a real SGLang engine on the CPU and reports JSON.

Runs in a subprocess set up by ``test_engine_e2e.py`` (the release, the shims and the
dist records on ``PYTHONPATH``, as ``conftest.release_env`` builds it):

``engine_run.py build <dir>``
    writes the tiny random-weight Llama of ``kvcached_testing/tiny_model.py`` to ``<dir>``.
``engine_run.py serve <model> <workdir> [--leak]``
    starts ``sglang.Engine`` (``device="cpu"``, ``torch_native`` attention, no CUDA
    graphs, page size 1, token ids in and out), then

    1. a workload of short prompts, greedy, twice (the second time from the radix cache);
    2. a burst of long concurrent requests, sampling the KV pool's counters (written by
       the ``engine_probe`` plugin inside the scheduler) and the scheduler's RSS;
    3. an idle spell (kvcached trims the radix cache to its cap: memory falls back); a
       second kvcached pool in this process then needs the device budget the idle engine
       holds, and the engine gives back its reserve and prefix cache; the burst again,
       and ``kvctl limit`` of one page id on the idle engine, then lifted; then
       ``flush_cache()`` and another idle spell, sampling again;
    4. an idle spell during which SGLang's idle leak check runs (strict mode), then one
       more request to show the engine survived it;

    and prints ``ENGINE-JSON {...}``. With ``--leak`` it then arms the probe's request-slot
    leak and sends one request: SGLang's idle check must report it (in strict mode it
    raises and the engine takes itself down, so this comes last).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHORT = dict(n=6, lo=8, hi=60, new=24, seed=11)
BURST = dict(n=8, length=2500, new=32, seed=7)
SAMPLE_S = 0.05


def build(out: str) -> None:
    from kvcached_testing.tiny_model import build_tiny_llama  # the repository root is on the path

    print(build_tiny_llama(out))


def _prompts(n: int, lo: int, hi: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the 3 special tokens (ids 0-2) of the tiny tokenizer.
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _ids(outputs) -> list[list[int]]:
    return [list(o["output_ids"]) for o in outputs]


def _scheduler_pid(work: Path) -> int:
    """The scheduler process: from the probe, else (no probe loaded) by SGLang's title."""
    import psutil

    try:
        return int((work / "scheduler.pid").read_text())
    except OSError:
        pass
    for child in psutil.Process().children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith("sglang::scheduler"):
                return child.pid
        except psutil.Error:
            continue
    raise RuntimeError("no scheduler process found (no probe, no sglang::scheduler child)")


def _installation() -> dict:
    """Where kvcached's adapter came from in this (launching) process and what it did."""
    out: dict = {"prefix": sys.prefix, "base_prefix": sys.base_prefix}
    try:
        import kvcached_sglang
        from kvcached_core.plugins import bootstrap_results

        import kvcached_core

        out["kvcached_sglang"] = kvcached_sglang.__file__
        out["kvcached_core"] = kvcached_core.__file__
        res = bootstrap_results().get("sglang")
        out["bootstrap"] = None if res is None else res.status
    except ImportError as exc:
        out["error"] = str(exc)
    return out


class Sampler:
    """Reads the probe's pool counters and the scheduler's RSS."""

    def __init__(self, work: Path) -> None:
        import psutil

        self.work = work
        self.proc = psutil.Process(_scheduler_pid(work))

    def read(self) -> dict:
        snap: dict = {"t": time.time(), "rss": self.proc.memory_info().rss}
        try:
            stats = json.loads((self.work / "stats.json").read_text())
        except (OSError, ValueError):
            return snap
        snap["view_calls"] = stats["view_calls"]
        snap["view_logical"] = stats["view_logical"]
        snap["view_available"] = stats["view_available"]
        snap["profile"] = stats.get("profile", {})
        if stats["pools"]:
            pool = stats["pools"][0]
            snap.update(mapped=pool["mapped"], in_use=pool["in_use"],
                        reserved=pool["reserved"], used_tokens=pool["used_tokens"],
                        page_bytes=pool["page_bytes"], limit_pages=pool["limit_pages"],
                        size=pool["size"], num_pages=pool["num_pages"])
        return snap

    def settle(self, seconds: float, steady_s: float = 0.5, limit_s: float = 30.0) -> dict:
        """A reading at least ``seconds`` from now, once the pool's counters (pages mapped,
        reserved, in use; cached tokens) have not moved for ``steady_s`` (the probe writes
        them every 50 ms): on a busy host the idle trims that follow a burst may outlast
        ``seconds``, and what follows (a giveback, a limit) must meet the engine at rest.
        Gives up waiting after ``limit_s`` and returns the last reading; a vanilla engine
        (no kvcached pool, so no counters) is read once."""
        def counters(snap: dict) -> tuple:
            return tuple(snap.get(k) for k in ("mapped", "reserved", "in_use", "used_tokens"))

        time.sleep(seconds)
        last = self.read()
        if "mapped" not in last:
            return last
        since, end = time.monotonic(), time.monotonic() + limit_s
        while time.monotonic() - since < steady_s and time.monotonic() < end:
            time.sleep(0.25)
            snap = self.read()
            if counters(snap) != counters(last):
                since = time.monotonic()
            last = snap
        return last


def serve(model: str, work_dir: str, leak: bool) -> None:
    import sglang as sgl

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"sglang_version": sgl.__version__}
    cfg = json.loads((Path(model) / "config.json").read_text())
    vocab = cfg["vocab_size"]

    t0 = time.time()
    engine = sgl.Engine(
        model_path=model, device="cpu", dtype="bfloat16", skip_tokenizer_init=True,
        attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
        page_size=1, max_total_tokens=65536, grammar_backend="none", random_seed=0,
        log_level="warning",
    )
    report["startup_s"] = round(time.time() - t0, 1)
    report["installation"] = _installation()
    greedy = lambda n: {"temperature": 0.0, "max_new_tokens": n}  # noqa: E731
    sampler = Sampler(work)
    report["start"] = sampler.settle(0.5)

    short = _prompts(SHORT["n"], SHORT["lo"], SHORT["hi"], SHORT["seed"], vocab)
    report["short"] = _ids(engine.generate(input_ids=short, sampling_params=greedy(SHORT["new"])))
    report["short_again"] = _ids(engine.generate(input_ids=short,
                                                 sampling_params=greedy(SHORT["new"])))

    report["before_burst"] = sampler.settle(1.5)
    burst = _prompts(BURST["n"], BURST["length"], BURST["length"], BURST["seed"], vocab)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(ids=_ids(engine.generate(
        input_ids=burst, sampling_params=greedy(BURST["new"])))))
    samples = []
    runner.start()
    while runner.is_alive():
        samples.append(sampler.read())
        time.sleep(SAMPLE_S)
    runner.join()
    report["burst"] = result.get("ids")
    report["burst_samples"] = samples
    report["after_burst"] = sampler.settle(1.5)  # idle: the radix cache trimmed to the cap
    if "page_bytes" in report["after_burst"]:  # kvcached backs the pool
        report["giveback"] = _giveback(sampler)
        # The burst again (its cache was given away), then kvctl limit on the idle engine.
        engine.generate(input_ids=burst, sampling_params=greedy(BURST["new"]))
        sampler.settle(1.5)
        report["limit"] = _limit_cycle(sampler)
    report["flushed"] = bool(_flush(engine))
    report["after_flush"] = sampler.settle(2.0)

    # Idle: SGLang's scheduler runs its idle memory check (strict by default) repeatedly.
    idle0 = sampler.read()
    report["idle"] = sampler.settle(2.0)
    report["idle_view_calls"] = report["idle"].get("view_calls", 0) - idle0.get("view_calls", 0)
    report["after_idle"] = _ids(engine.generate(input_ids=short[:1],
                                                sampling_params=greedy(SHORT["new"])))
    report["alive_after_idle"] = True
    print("ENGINE-JSON " + json.dumps(report), flush=True)

    if leak:
        (work / "leak_req_slot").write_text("1")
        print("LEAK-ARMED", flush=True)
        engine.generate(input_ids=short[1:2], sampling_params=greedy(4))
        # The idle check follows within milliseconds; its failure reaches this process as a
        # SIGQUIT that SGLang handles on the engine's event loop, so keep that loop running.
        import asyncio

        deadline = time.time() + 90  # generous: a loaded 2-core machine is slow to react
        while time.time() < deadline:
            engine.loop.run_until_complete(asyncio.sleep(0.5))
        print("LEAK-NOT-REPORTED", flush=True)  # unreachable when SGLang takes itself down
    engine.shutdown()


def _giveback(sampler: Sampler) -> dict:
    """Another pool on this device needs the budget the idle engine holds.

    The other pool is a real kvcached pool of this process (standing in for a second
    engine on the device) with pages of the engine's size. The device budget is set to
    what the engine maps now plus the other pool's first page; the other pool's next page
    misses, asks, and the engine must give back its reserve and its prefix cache. Returns
    how long the other pool waited, what the engine gave and held before and after.
    """
    from kvcached_core.allocator import KVLayout
    from kvcached_core.config import load_settings
    from kvcached_core.ipc import budget as bud
    from kvcached_core.pool import ElasticPool

    before = sampler.read()
    page = before["page_bytes"]
    rec = bud.BudgetRecord.open(bud.device_key("host", 0))
    out: dict = {"engine_before": before, "held_before": rec.read().mapped}
    rec.set_capacity(out["held_before"] + page)
    layers = page // (2 << 20)  # the engine's 1 MiB pages x K/V per layer
    other = ElasticPool.local(
        "cpu", KVLayout(layers, 8 << 20, 1 << 20, 2, False), block_bytes=1 << 20,
        namespace="sglang-e2e-other", name="kv0",
        settings=load_settings(min_reserved_pages=0, max_reserved_pages=0, idle_keep_pages=0))
    try:
        t0 = time.monotonic()
        got = None
        while got is None and time.monotonic() - t0 < 20:
            got = other.blocks.alloc(1)
            if got is None:
                time.sleep(0.005)
        out["waited_ms"] = round(1e3 * (time.monotonic() - t0), 1)
        out["granted"] = got is not None
        # The engine counts what it gave in the budget record after its unmaps, which the
        # other pool may already have used: read the record once the engine is at rest.
        out["engine_after"] = sampler.settle(0.5)  # the probe writes its counters periodically
        reading = rec.read()
        out["capacity"] = reading.capacity
        out["held_after"] = reading.mapped
        out["slots"] = {s.name: dict(mapped=s.mapped, given=s.given_bytes, misses=s.misses)
                        for s in reading.slots}
    finally:
        other.close()
        rec.set_capacity(bud.NO_BUDGET)
        rec.close()
    return out


def _limit_cycle(sampler: Sampler) -> dict:
    """``kvctl limit`` on the idle engine holding a prefix cache: one page id, then lifted.
    Returns how long the engine took to get under the limit and what it held."""
    from kvcached_core.ipc import shm

    (pool,) = [p for p in shm.list_pools() if p.pool.startswith("mha-")]
    before = sampler.read()
    page = before["page_bytes"]
    t0 = time.monotonic()
    shm.set_limit(pool.namespace, pool.pool, page)
    under = None
    while time.monotonic() - t0 < 5:
        st = shm.open_pool(pool.namespace, pool.pool)
        with st:
            if st.read().mapped <= page:
                under = time.monotonic() - t0
                break
        time.sleep(0.002)
    limited = sampler.settle(0.5)  # the probe writes its counters periodically
    shm.set_limit(pool.namespace, pool.pool, shm.NO_LIMIT)
    return {"pool": f"{pool.namespace}.{pool.pool}", "limit_bytes": page,
            "under_limit_ms": None if under is None else round(1e3 * under, 1),
            "engine_before": before, "engine_limited": limited}


def _flush(engine) -> bool:
    # Flushing is refused while requests are still being finished; retry briefly.
    for _ in range(20):
        res = engine.flush_cache()
        ok = getattr(res, "success", res)
        if ok is None or ok:
            return True
        time.sleep(0.25)
    return False


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(sys.argv[2])
    else:
        serve(sys.argv[2], sys.argv[3], "--leak" in sys.argv[4:])
