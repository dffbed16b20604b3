"""One command: three tiny models behind one OpenAI-compatible endpoint, sharing one KV budget.

    .venv-vllm/bin/python examples/multi_model_demo.py

Builds the tiny random-weight Llama (nothing downloaded) and starts ``kvcached-serve`` in
front of three engines on this CPU: two ``vllm serve`` (``tiny-a``, ``tiny-b``) and SGLang's
HTTP server (``tiny-s``, the SGLang release in ``.sglang/`` run by ``.venv``'s interpreter as
the tests run it; without one, a third vLLM engine stands in and the demo says so). All
three map their KV caches through kvcached in one host budget of 64 MiB, in a private
shared-memory directory. A bursty trace (the busy model moves every 10 s) then runs
through the endpoint while a table shows, every second, each model's state and the KV
memory its engine has mapped: memory follows the traffic inside the one budget. Then the
server stops, and every engine with it.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 64 << 20
PHASE_S = 10.0
PHASES = 4
SGLANG_RELEASE = "0.5.12.post1"
SGLANG_ARGS = {"device": "cpu", "dtype": "bfloat16", "attention_backend": "torch_native",
               "sampling_backend": "pytorch", "disable_cuda_graph": True, "page_size": 1,
               "max_total_tokens": 65536, "grammar_backend": "none", "random_seed": 0}
# float32: vLLM's bf16 CPU attention runs AMX instructions before anything asked Linux for
# AMX, and a short first request kills the worker on AMX hosts (tests/vllm/test_limit_and_serve.py).
VLLM_ARGS = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True, "seed": 0,
             "max_num_seqs": 16, "kv_cache_memory_bytes": BUDGET}


def sglang_engine(work: Path) -> tuple[str, dict[str, str]] | str:
    """(interpreter, environment) of SGLang's HTTP server here, or why there is none."""
    from kvcached_testing.sglang_release import (SGLANG_DIR, release_env, release_installed,
                                                 write_dist_record)

    python = ROOT / ".venv" / "bin" / "python"
    if not release_installed(SGLANG_RELEASE):
        return f"SGLang {SGLANG_RELEASE} is not in .sglang/ (scripts/setup_sglang.sh installs it)"
    if not python.exists() or not (SGLANG_DIR / "_http").is_dir():
        return "no .venv or .sglang/_http (scripts/setup.sh makes them)"
    env = release_env(SGLANG_RELEASE, write_dist_record(work / "sglang-dist"))
    keep = {k: env[k] for k in ("PYTHONPATH", "SGLANG_USE_CPU_ENGINE", "OMP_NUM_THREADS",
                                "TOKENIZERS_PARALLELISM")}
    keep["PYTHONPATH"] += os.pathsep + str(SGLANG_DIR / "_http")
    keep["KVCACHED_PAGE_SIZE_MB"] = "1"
    return str(python), keep


def trace(names: list[str], seed: int = 0) -> list[tuple[float, str, list[int], int]]:
    """Bursts: in each 10 s phase one model gets most requests, in clumps."""
    rng = random.Random(seed)
    out = []
    for phase in range(PHASES):
        hot = names[phase % len(names)]
        t = phase * PHASE_S
        while t < (phase + 1) * PHASE_S:
            t += rng.expovariate(0.6)  # a burst every ~1.7 s
            for _ in range(rng.randint(4, 10)):
                name = hot if rng.random() < 0.85 else rng.choice(names)
                prompt = [rng.randrange(3, 500) for _ in range(rng.randint(800, 1800))]
                out.append((t + rng.uniform(0, 0.3), name, prompt, rng.randint(16, 96)))
    return sorted(out, key=lambda r: r[0])


async def drive(url: str, engines: dict[str, str]) -> dict[str, list]:
    import httpx

    names = list(engines)
    results: dict[str, list] = {n: [] for n in names}
    peak = [0]
    t0 = time.monotonic() + 0.5

    async def one(client: httpx.AsyncClient, at: float, name: str, prompt: list[int],
                  n: int) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        start = time.monotonic()
        ttft = None
        try:
            async with client.stream("POST", url + "/v1/completions", json={
                    "model": name, "prompt": prompt, "max_tokens": n, "ignore_eos": True,
                    "temperature": 0, "stream": True}) as r:
                async for chunk in r.aiter_bytes():
                    if ttft is None and r.status_code == 200 and b"data:" in chunk:
                        ttft = time.monotonic() - start
                ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        results[name].append((ok, ttft))

    async def show(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        print(f"{'t':>5}  " + "".join(f"{n + ' (' + e + ')':>26}" for n, e in engines.items())
              + f"{'total / budget':>22}")
        while not stop.is_set():
            try:
                health = (await client.get(url + "/health")).json()["engines"]
                cells = [f"{health[n]['state']:>8} {health[n]['kv_mapped_bytes'] / 2**20:6.1f} MiB"
                         for n in names]
                total = sum(health[n]["kv_mapped_bytes"] for n in names)
                peak[0] = max(peak[0], total)
                print(f"{max(0.0, time.monotonic() - t0):5.0f}  " + "".join(f"{c:>26}" for c in cells)
                      + f"{total / 2**20:10.1f} / {BUDGET / 2**20:.0f} MiB", flush=True)
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass

    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30)) as client:
        stop = asyncio.Event()
        shower = asyncio.create_task(show(client, stop))
        await asyncio.gather(*(one(client, *req) for req in trace(names)))
        await asyncio.sleep(3.0)  # idle: the engines give their KV pages back
        stop.set()
        await shower
    print(f"\npeak KV mapped by all three together: {peak[0] / 2**20:.0f} MiB of the "
          f"{BUDGET >> 20} MiB budget")
    return results


def main() -> None:
    sys.path.append(str(ROOT))  # kvcached_testing (after site-packages)
    from kvcached_testing.serve_controller import free_port, start_controller, wait_healthy
    from kvcached_testing.tiny_model import build_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="kvcached-serve-demo-"))
    model = str(build_tiny_llama(work / "tiny-llama"))
    models = [{"name": "tiny-a", "engine": "vllm", "model": model, "args": VLLM_ARGS},
              {"name": "tiny-b", "engine": "vllm", "model": model, "args": VLLM_ARGS}]
    sg = sglang_engine(work)
    if isinstance(sg, str):
        print(f"note: no SGLang engine here ({sg}); tiny-s runs on vLLM instead", flush=True)
        models.append({"name": "tiny-s", "engine": "vllm", "model": model, "args": VLLM_ARGS})
    else:
        python, env = sg
        models.append({"name": "tiny-s", "engine": "sglang", "model": model, "python": python,
                       "env": env, "args": SGLANG_ARGS})
    engines = {m["name"]: m["engine"] for m in models}
    cfg = {"port": free_port(), "device_budget": BUDGET, "shm_dir": str(work / "shm"),
           "ipc_dir": str(work / "ipc"), "namespace_prefix": "demo-",
           "log_dir": str(work / "logs"), "models": models}
    proc, url, log = start_controller(cfg, work)
    print(f"starting kvcached-serve on {url} with {', '.join(f'{n} ({e})' for n, e in engines.items())}"
          f"; one KV budget of {BUDGET >> 20} MiB; engine logs in {work / 'logs'}", flush=True)
    print(f"(watch it: KVCACHED_SHM_DIR={work / 'shm'} kvctl status)", flush=True)
    try:
        import httpx

        up_s = wait_healthy(url, proc, log)
        models_list = httpx.get(url + "/v1/models").json()["data"]
        print(f"all engines up in {up_s:.0f} s: "
              + ", ".join(f"{m['id']} {m['state']}" for m in models_list), flush=True)
        results = asyncio.run(drive(url, engines))
        print("\nper model: requests ok / sent, TTFT p50")
        for n, rs in results.items():
            ttfts = sorted(t for ok, t in rs if ok and t is not None)
            p50 = f"{ttfts[len(ttfts) // 2]:.2f} s" if ttfts else "-"
            print(f"  {n:<8} {sum(ok for ok, _ in rs):>4} / {len(rs):<4} {p50}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    print(f"stopped (exit {proc.returncode}); every engine with it")
    if proc.returncode != 0:
        print(log.read_text()[-3000:])
        raise SystemExit(proc.returncode)


if __name__ == "__main__":
    main()
