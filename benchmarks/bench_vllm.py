"""vLLM on CPU with and without kvcached, side by side in one run.

    .venv-vllm/bin/python benchmarks/bench_vllm.py

Five measurements, vanilla and kvcached interleaved so
load from other processes on the machine hits both alike:

1. Throughput: offline ``LLM.generate`` on a tiny random-weight Llama (built
   locally by ``kvcached_testing/tiny_model.py``), greedy, a fixed batch of token-id
   prompts; generated tokens per second. Each of ``--reps`` reps starts a
   vanilla and a kvcached engine, each in a subprocess of its own (start
   order alternating across reps), keeps both alive and alternates their
   ``--rounds`` timed generate calls ABBA, each after a ``--pause`` (longer
   than vLLM's 1 s busy-wait, so the idle engine's worker sleeps). Engine-to-
   engine drift on a shared VM (10-20 %) then hits both alike. With ``--pin``
   (default) each worker computes alone on the first core
   (``VLLM_CPU_OMP_THREADS_BIND``), front ends and engine cores on the others.
   With ``--control`` (default) a second vanilla engine joins every rep and
   the call order runs through all permutations; its ratio to the first
   vanilla engine (``control_ratio``) is the harness's own reading when
   nothing differs. The generated token ids of every engine are compared
   with the first vanilla one (``tokens_identical``). Each engine first serves
   one untimed burst shaped like the timed ones; then its process's heap is
   collected and frozen (``gc.freeze``, as vLLM's engine core does), and
   collected again before each timed call, outside it: a full collection of
   that heap takes 0.4-0.5 s and otherwise fell inside one timed call per
   engine, at a round set by its allocations.
2. Engine init: seconds from the ``LLM(...)`` call to its return (engine core
   and worker started, KV cache allocated), same engines.
3. Block pool alloc+free cycles per second, no engine, one process: vLLM's
   ``BlockPool`` against kvcached's ``ElasticBlockPool`` built by the
   scheduler's own factory (``make_block_pool`` inside ``scheduler_context``)
   from a KV cache config shaped like the tiny engine's
   (``kvcached_testing.vllm_cpu.make_pools``). Its page map/unmap requests go
   over kvcached's IPC to a worker listener in this process (a thread) backed
   by a host page mapper. One op is ``get_new_blocks(n)``
   then ``free_blocks`` of those blocks, prefix caching on, with ``--held``
   blocks kept allocated in the background (running requests); the
   implementations alternate across repetitions.
4. In each kvcached engine, right after one more burst of ``--prompts`` long
   requests (after the timed rounds): seconds until the worker's mapped KV
   stops falling, and the page bundles still mapped beyond those holding
   live blocks then (``shrink_settled_s``, ``shrink_excess_pages``).
5. In each kvcached engine, after that: latency of a one-page
   map (and unmap) request from a separate process to the live engine's
   worker over kvcached's broadcaster (``WorkerGroup``, the object the
   engine core's ``RemoteKVTensors`` uses), on a page the scheduler does not
   use while idle.

Results go to benchmarks/results/vllm-cpu.json with the command line.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _timing import map_unmap_pair, run_info, summary, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvcached_testing

from kvcached_testing.vllm_cpu import (  # noqa: E402
    KV_BYTES, NUM_LAYERS, PAGE, TINY_ENGINE_KW, long_prompts, make_pools)


def median(xs):
    return statistics.median(xs)


# ------------------------------------------------------------ engine child


def engine_child(args: argparse.Namespace) -> None:
    """One engine serving the parent's commands over a connection, until ``finish``.

    Commands: ``("warmup",)``, ``("round", r)`` (one timed generate call on
    batch ``r``), ``("finish",)`` (kvcached: one more burst, then the shrink
    and map-latency measurements; then the engine shuts down).
    """
    from multiprocessing.connection import Client

    from vllm import LLM, SamplingParams

    conn = Client(args.address, authkey=args.namespace.encode())
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, max_num_seqs=args.max_num_seqs, **TINY_ENGINE_KW)
    conn.send({"init_s": time.perf_counter() - t0})
    mon = None

    def generate(seed: int) -> tuple[float, list]:
        batch = long_prompts(args.prompts, args.prompt_len, seed=seed)  # distinct: no prefix hits
        t = time.perf_counter()
        out = llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t, out

    while True:
        cmd = conn.recv()
        if cmd[0] == "warmup":
            # A burst shaped like the timed ones (other prompts): vLLM's CPU kernels set
            # themselves up for each new batch shape on first use (100-300 ms here).
            llm.generate(long_prompts(args.prompts, args.prompt_len, seed=999), params,
                         use_tqdm=False)
            # This front end's heap (vLLM, torch, the engine client) is then never scanned
            # again, as vLLM does in its engine core: a full collection of it took 0.4-0.5 s
            # and fell inside one timed call per engine, at a round set by its allocations.
            gc.collect()
            gc.freeze()
            if args.enabled:
                from kvcached_vllm.monitor import KVMemoryMonitor

                mon = KVMemoryMonitor(args.namespace, page_bytes=PAGE * NUM_LAYERS)
                mon.read()  # connected before the last burst ends
            conn.send({})
        elif cmd[0] == "round":
            gc.collect()  # what the last call left behind, outside the timed call
            dt, out = generate(cmd[1])
            conn.send({"seconds": dt,
                       "generated_tokens": sum(len(o.outputs[0].token_ids) for o in out),
                       "token_ids": [list(o.outputs[0].token_ids) for o in out]})
        else:
            result = {}
            if mon is not None:
                generate(args.rounds)  # the burst the shrink is watched after
                burst_end = time.perf_counter()
                result["shrink"] = shrink_after_burst(mon, args.namespace, burst_end)
                mon.close()
                result["map_latency"] = map_latency(args.namespace, args.map_samples)
            conn.send(result)
            llm.llm_engine.engine_core.shutdown()
            os._exit(0)  # do not wait on vLLM's teardown


def shrink_after_burst(mon, ns: str, burst_end: float, watch_s: float = 4.0) -> dict:
    """How fast the worker's mapped KV falls back once the last burst has finished.

    Polls the worker's mapped pages (its own answer: the memory really mapped)
    every 10 ms for ``watch_s`` seconds after ``generate`` returned. The last
    change is when memory settled. Then, every change being an unmap that
    republishes the pool's shared-memory stats, the pool's pages in use (pages
    holding a live block: running requests, none here, plus the capped
    prefix cache and the null block) are exact, and the excess is what stays
    mapped beyond them.
    """
    from kvcached_core.ipc.shm import open_pool

    trace = []
    while (now := time.perf_counter()) - burst_end < watch_s:
        pages = mon.read()[0].mapped_pages
        if not trace or trace[-1][1] != pages:
            trace.append((round(now - burst_end, 3), pages))
        time.sleep(0.01)
    with open_pool(ns, "kv0") as view:
        st = view.read()
    bundle = PAGE * NUM_LAYERS
    live = st.used // bundle
    mapped = trace[-1][1]
    return {"settled_s": trace[-1][0], "mapped_pages": mapped, "live_pages": live,
            "excess_pages": mapped - live, "first_read": trace[0], "trace": trace}


def map_latency(ns: str, n: int) -> dict:
    """Map then unmap the engine's last page ``n`` times through kvcached's broadcaster."""
    from kvcached_core.ipc import WorkerGroup

    from kvcached_vllm.monitor import KVMemoryMonitor

    with KVMemoryMonitor(ns, page_bytes=PAGE * NUM_LAYERS) as mon:
        mapped = mon.read()[0].mapped_pages
    time.sleep(1.5)  # past the idle trim: the scheduler maps nothing while we measure
    group = WorkerGroup.for_namespace(ns, tp_size=1)
    num_pages = -(-KV_BYTES // NUM_LAYERS // PAGE)
    last = num_pages - 1
    assert last not in group.query(0, [last])[0], "the last page is in use"
    bc = group.broadcaster(0)
    times: dict[str, list[float]] = {"map_live": [], "unmap_live": []}
    map_unmap_pair(lambda p: bc.map([last]), lambda p: bc.unmap([last]), 1, n, times, "live")
    maps, unmaps = times["map_live"], times["unmap_live"]
    group.close()
    return {"map": maps, "unmap": unmaps, "mapped_pages_after_run": mapped}


class Engine:
    """An engine in a child process of its own, driven over a connection."""

    def __init__(self, model: Path, enabled: bool, args: argparse.Namespace) -> None:
        from multiprocessing.connection import Listener

        ns = f"bench-{uuid.uuid4().hex[:8]}"
        self.name = "kvcached" if enabled else "vanilla"
        self.log = tempfile.TemporaryFile(mode="w+")
        address = os.path.join(tempfile.mkdtemp(prefix="bench-vllm-"), "conn")
        env = dict(os.environ, KVCACHED_ENABLED="1" if enabled else "0",
                   VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
        if enabled:
            env.update(KVCACHED_IPC_NAME=ns, KVCACHED_STRICT="1")
        cmd = [sys.executable, __file__, "--_child", "--model", str(model), "--address", address,
               "--namespace", ns, "--enabled", str(int(enabled))]
        for k in ("prompts", "prompt_len", "max_tokens", "rounds", "max_num_seqs", "map_samples"):
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        preexec = None
        cores = sorted(os.sched_getaffinity(0))
        if args.pin and len(cores) >= 2:  # the worker computes alone on the first core
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[0])
            preexec = functools.partial(os.sched_setaffinity, 0, cores[1:])
        with Listener(address, authkey=ns.encode()) as listener:
            self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                         preexec_fn=preexec)
            self.conn = listener.accept()
        self.init_s = self.recv()["init_s"]

    def recv(self) -> dict:
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.wait(timeout=60)
            self.log.seek(0)
            sys.stderr.write(self.log.read()[-8000:])
            raise SystemExit(f"{self.name} engine failed with {self.proc.returncode}") from None

    def call(self, *cmd) -> dict:
        self.conn.send(cmd)
        return self.recv()

    def finish(self) -> dict:
        result = self.call("finish")
        self.proc.wait(timeout=120)
        self.log.close()
        return result


def bench_engines(model: Path, args: argparse.Namespace) -> dict:
    """The engines of a rep live at once; their timed rounds rotate with a pause before each.

    With ``--control`` a second vanilla engine runs beside them: its ratio to
    the first (``control_ratio``) is what this harness reads when nothing differs.
    """
    slots = ["vanilla", "kvcached"] + (["control"] if args.control else [])
    runs: dict[str, list[dict]] = {name: [] for name in slots}
    start_order = []
    orders = list(itertools.permutations(slots)) if args.control else [slots, slots[::-1]]
    for rep in range(args.reps):
        names = slots[rep % len(slots):] + slots[:rep % len(slots)]
        start_order += names
        engines = {name: Engine(model, name == "kvcached", args) for name in names}
        rounds: dict[str, list[dict]] = {name: [] for name in names}
        for engine in engines.values():
            engine.call("warmup")
        for r in range(args.rounds):
            for name in orders[(r + rep) % len(orders)]:
                time.sleep(args.pause)  # the other engines' workers leave vLLM's busy-wait
                rounds[name].append(engines[name].call("round", r))
        for name in names:
            runs[name].append({"init_s": engines[name].init_s, "rounds": rounds[name],
                               "token_ids": rounds[name][0]["token_ids"],
                               **engines[name].finish()})
        line = [f"rep {rep}"]
        for name in slots:
            res = runs[name][-1]
            secs = sum(r["seconds"] for r in res["rounds"])
            toks = sum(r["generated_tokens"] for r in res["rounds"])
            line.append(f"{name} init {res['init_s']:6.2f} s generate {secs:6.2f} s "
                        f"{toks / secs:8.1f} tok/s")
        print("   ".join(line), flush=True)

    ref = runs["vanilla"][0]["token_ids"]
    identical = all(r["token_ids"] == ref for rs in runs.values() for r in rs)
    for rs in runs.values():
        for res in rs:
            del res["token_ids"]
            for r in res["rounds"]:
                del r["token_ids"]

    def tok_s(rounds):
        return sum(r["generated_tokens"] for r in rounds) / sum(r["seconds"] for r in rounds)

    tps = {k: [tok_s(res["rounds"]) for res in runs[k]] for k in runs}
    total = {k: tok_s([r for res in runs[k] for r in res["rounds"]]) for k in runs}
    round_ratios = [tok_s([a]) / tok_s([b]) for kv, va in zip(runs["kvcached"], runs["vanilla"])
                    for a, b in zip(kv["rounds"], va["rounds"])]
    init = {k: [res["init_s"] for res in runs[k]] for k in runs}
    sample = runs["vanilla"][0]["rounds"][0]
    out = {
        "workload": {"prompts": args.prompts, "prompt_tokens_each": args.prompt_len,
                     "max_tokens": args.max_tokens, "generate_calls_per_engine": args.rounds,
                     "max_num_seqs": args.max_num_seqs, "greedy": True, "ignore_eos": True,
                     "engine_kwargs": TINY_ENGINE_KW,
                     "warmup": "one burst of other prompts, as many and as long as a timed "
                               "call's, once per engine; then gc.collect + gc.freeze",
                     "gc": "gc.collect() before each timed call, outside it",
                     "generated_tokens_per_call": sample["generated_tokens"]},
        "method": "per rep all engines live (separate processes, started one after the other "
                  "in start_order); the order of their generate calls changes every round "
                  "(ABBA, or all permutations with the control), each after a "
                  f"{args.pause} s pause; throughput = all generated tokens / all generate time",
        "pinning": ("worker OMP threads on the first core (VLLM_CPU_OMP_THREADS_BIND), front end "
                    "and engine core on the other cores, both configurations") if args.pin
                   else "none (vLLM's automatic binding)",
        "start_order": start_order,
        "tokens_identical": identical,
        "throughput_ratio": round(total["kvcached"] / total["vanilla"], 3),
        "round_ratio_median": round(median(round_ratios), 3),
        "init_time_ratio": round(median(init["kvcached"]) / median(init["vanilla"]), 3),
        "throughput_tok_s": {k: {"all_rounds": round(total[k], 1),
                                 "per_rep": [round(x, 1) for x in v]} for k, v in tps.items()},
        "per_rep_ratio": [round(a / b, 3) for a, b in zip(tps["kvcached"], tps["vanilla"])],
        **({"control_ratio": round(total["control"] / total["vanilla"], 3),
            "control_per_rep_ratio": [round(a / b, 3)
                                      for a, b in zip(tps["control"], tps["vanilla"])]}
           if "control" in runs else {}),
        "round_ratios": [round(x, 3) for x in round_ratios],
        "init_s": {k: {"median": round(median(v), 2), "runs": [round(x, 2) for x in v]}
                   for k, v in init.items()},
    }
    maps = [x for res in runs["kvcached"] for x in res["map_latency"]["map"]]
    unmaps = [x for res in runs["kvcached"] for x in res["map_latency"]["unmap"]]
    out["map_latency"] = {
        "what": "one-page map / unmap request to a live engine's worker over kvcached's "
                "WorkerGroup broadcaster, from a separate process, engine idle",
        "map": summary(maps), "unmap": summary(unmaps),
        "mapped_pages_after_run": [res["map_latency"]["mapped_pages_after_run"]
                                   for res in runs["kvcached"]],
    }
    shrink = [res["shrink"] for res in runs["kvcached"]]
    out["shrink_after_burst"] = {
        "what": "after the last generate call returns: seconds until the worker's mapped KV "
                "stops changing (polled every 10 ms for 4 s) and page bundles (one 2 MiB page "
                "per layer) still mapped beyond those holding live blocks (capped prefix "
                "cache + null block), per kvcached engine",
        "settled_s": [x["settled_s"] for x in shrink],
        "excess_pages": [x["excess_pages"] for x in shrink],
        "max_settled_s": max(x["settled_s"] for x in shrink),
        "max_excess_pages": max(x["excess_pages"] for x in shrink),
        "runs": shrink,
    }
    return out


# ------------------------------------------------------------ block pools


def time_cycles(pool, n: int, cycles: int) -> float:
    """Seconds for ``cycles`` rounds of ``get_new_blocks(n)`` + ``free_blocks``."""
    get, free = pool.get_new_blocks, pool.free_blocks
    gc.collect()
    t0 = time.perf_counter()
    for _ in range(cycles):
        free(get(n))
    return time.perf_counter() - t0


def bench_pools(args: argparse.Namespace) -> dict:
    native, elastic, keep = make_pools(args.pool_blocks)
    pools = {"native": native, "elastic": elastic}
    held = {k: [p.get_new_blocks(16) for _ in range(args.held // 16)] for k, p in pools.items()}
    for k, p in pools.items():
        held[k].append(p.get_new_blocks(args.held % 16))
        time_cycles(p, 16, 2000)  # warm-up
    res: dict = {}
    for n in (1, 16):
        cycles = args.pool_cycles // n if n > 1 else args.pool_cycles
        ops: dict[str, list[float]] = {"native": [], "elastic": []}
        for rep in range(args.pool_reps):
            for k in (("native", "elastic") if rep % 2 == 0 else ("elastic", "native")):
                ops[k].append(cycles / time_cycles(pools[k], n, cycles))
        res[f"n={n}"] = {
            "cycles_per_rep": cycles,
            "native_ops_s": round(median(ops["native"])),
            "elastic_ops_s": round(median(ops["elastic"])),
            "ratio": round(median(ops["elastic"]) / median(ops["native"]), 3),
            "native_runs": [round(x) for x in ops["native"]],
            "elastic_runs": [round(x) for x in ops["elastic"]],
        }
        print(f"pool n={n:<3} native {res[f'n={n}']['native_ops_s']:>9} ops/s   elastic "
              f"{res[f'n={n}']['elastic_ops_s']:>9} ops/s   ratio {res[f'n={n}']['ratio']}",
              flush=True)
    rt = keep[3]
    for k, p in pools.items():
        for blocks in held[k]:
            p.free_blocks(blocks)
    mapped = rt.pool.pages.num_mapped
    rt.close()
    keep[2].close()
    ratios = {"n=1": res["n=1"]["ratio"], "n=16": res["n=16"]["ratio"]}
    return {
        "what": "ops/s, one op = get_new_blocks(n) + free_blocks(those blocks); "
                "prefix caching on, blocks carry no hash (never-cached path)",
        "num_blocks": args.pool_blocks, "held_blocks": args.held, "reps": args.pool_reps,
        "elastic_setup": "scheduler.make_block_pool inside scheduler_context (real "
                         "PageAllocator, KVBlockManager, RemoteKVTensors, WorkerGroup) with an "
                         "in-process WorkerListener + host mapper as the worker",
        "elastic_pages_mapped_at_end": mapped,
        "alloc_free_ops_ratio": {**ratios, "headline": min(ratios.values())},
        **res,
    }


# ------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6, help="engine pairs (one of each, both live)")
    ap.add_argument("--pin", type=int, default=1,
                    help="1: each engine's worker computes on the first core (vLLM's "
                         "VLLM_CPU_OMP_THREADS_BIND), its front end and engine core run on the "
                         "others; the same for both configurations")
    ap.add_argument("--control", type=int, default=1,
                    help="1: a second vanilla engine in every rep, as the harness's own A/A")
    ap.add_argument("--pause", type=float, default=1.2,
                    help="seconds before each timed generate call (past vLLM's 1 s busy-wait)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=14, help="timed generate calls per engine")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--map-samples", type=int, default=300)
    ap.add_argument("--pool-blocks", type=int, default=16384)
    ap.add_argument("--held", type=int, default=1000)
    ap.add_argument("--pool-cycles", type=int, default=30000)
    ap.add_argument("--pool-reps", type=int, default=31)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm-cpu.json"))
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--namespace", help=argparse.SUPPRESS)
    ap.add_argument("--enabled", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        engine_child(args)
        return 0

    import torch
    import vllm

    result = run_info("vllm-cpu", vllm=vllm.__version__, torch=torch.__version__,
                      page_bytes=PAGE,
                      kvcached_env={k: v for k, v in sorted(os.environ.items())
                                    if k.startswith("KVCACHED_")})
    t0 = time.perf_counter()
    result["block_pool"] = bench_pools(args)
    if not args.skip_engine:
        from kvcached_testing.tiny_model import build_tiny_llama

        with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
            model = build_tiny_llama(Path(tmp) / "tiny-llama")
            result["engine"] = bench_engines(model, args)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    e = result.get("engine", {})
    result["headline"] = {
        "throughput_ratio": e.get("throughput_ratio"),
        "control_ratio": e.get("control_ratio"),
        "init_time_ratio": e.get("init_time_ratio"),
        "alloc_free_ops_ratio": result["block_pool"]["alloc_free_ops_ratio"],
        "tokens_identical": e.get("tokens_identical"),
        "map_median_us": e.get("map_latency", {}).get("map", {}).get("median_us"),
        "shrink_settled_s": e.get("shrink_after_burst", {}).get("max_settled_s"),
        "shrink_excess_pages": e.get("shrink_after_burst", {}).get("max_excess_pages"),
        "targets": {"throughput_ratio": ">= 0.98", "init_time_ratio": "<= 1.05",
                    "alloc_free_ops_ratio": ">= 1.0", "map_median_us": "<= 200",
                    "shrink_settled_s": "<= 2", "shrink_excess_pages": "<= 1"},
    }
    result["latency"] = {k: e["map_latency"][k] for k in ("map", "unmap")} if e else {}
    write_result(args.out, result, "map to live worker")
    print(json.dumps(result["headline"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
