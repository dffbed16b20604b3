"""vLLM's scheduler with and without kvcached, replayed without a model: engine-core CPU per step.

    .venv-vllm/bin/python benchmarks/bench_vllm_scheduler.py [--rounds 6] [--profile]
        [--emulate-map-us 850] [--emulate-gpu 6000,4]
        [--out benchmarks/results/vllm-cpu-scheduler-replay.json]

Why: on an H200 vLLM with kvcached matched vanilla throughput on a host with a
fast CPU/driver path and read 0.85-0.93x on hosts whose CPU path is ~45 %
slower (benchmarks/results/vllm-gpu-throughput-hosts.json). vLLM overlaps the
engine core's CPU work for step N+1 with the GPU's step N; once the engine
core is the bottleneck, whatever kvcached adds to it shows in throughput. This
prices that addition on a CPU alone.

What runs: vLLM's own ``Scheduler`` (``AsyncScheduler``: async scheduling is
vLLM's default on GPUs) twice in one process, driven as
``EngineCore.step_with_batch_queue`` drives it on a GPU (a batch queue of two:
step N+1 is scheduled before step N's output is applied), with a made-up
``ModelRunnerOutput`` per step (one sampled token per request whose prefill
completed, nothing for a partial prefill) instead of a model:

* ``vanilla``: built before kvcached's patch set is applied, and its patched
  methods (``schedule``, ``update_from_output``, ``finish_requests``,
  ``reset_prefix_cache``, its KV cache manager's ``allocate_slots``) bound to
  vLLM's originals on the instance: what an engine with ``KVCACHED_ENABLED=0``
  runs.
* ``kvcached``: the patch set applied as an engine applies it
  (``kvcached_vllm.entry.register``), so ``Scheduler.__init__`` builds the
  elastic runtime and ``ElasticBlockPool``, ``schedule`` / ``update_from_output``
  count the step fence under the pool's lock, and ``allocate_slots`` turns pool
  exhaustion into a miss. The worker side is kvcached's own
  ``ElasticKVBacking`` over a host mapper in this process (its native page
  server and its listener on the engine's namespace), which is what a 1-GPU
  engine has: vLLM runs that worker inside the engine core, and the pool
  applies map / unmap to its page server directly (``--pages socket`` makes the
  pool go through the IPC socket instead, as with TP > 1 or a CPU engine).
  The GPU path is forced on the host backend: ``GPU_SETTINGS`` (a reserve of up
  to 64 page bundles following the allocation rate), a ``StepFence`` (async
  scheduling), and blocks from byte 0 of a page (a CPU engine starts 64 bytes
  in); ``--cpu-path`` keeps the CPU engine's settings and a synchronous
  ``Scheduler`` instead.

Workload, as ``bench_vllm_gpu.py perf``: a warm-up round (prompt seed 500), then
``--rounds`` rounds of 256 prompts of 256-1024 random token ids (seed = round,
vocabulary 500, so no shared prefixes), 128 tokens generated each (EOS
ignored), prefix caching on, 16-token blocks, ``max_num_seqs`` 256,
``max_num_batched_tokens`` 16384 (vLLM's default for the ``LLM`` class on a
GPU of 70 GiB or more, hence on the H200 run), ``max_model_len`` 4096. Each
scheduler serves each round after a ``--pause`` (default 1.5 s, longer than
kvcached's 1 s idle trim, so kvcached gives its reserve back and maps again as
on the GPU); which goes first alternates by round. KV geometry per layer is the
GPU run's 1B model (16 tokens x 8 KV heads x head_dim 64 x K,V x bf16 = 32 KiB a
block), 49152 blocks as there, but ``--layers`` (default 2) layers, so host memory
stays small; the ``KVCacheConfig`` comes from vLLM's own ``get_kv_cache_configs``
(layer-outer layout, one backing buffer) after kvcached's page alignment.

Measured, per round and scheduler: seconds in ``schedule()`` and in
``update_from_output()`` (``perf_counter`` around each call; CPU time of the
thread too), steps; for kvcached also the seconds the scheduling thread spent
inside ``KVBlockManager._grow`` (new pages for a step: a page from the reserve,
or a synchronous map), page maps and unmaps (pages, calls, seconds, split by
the scheduling thread and kvcached's background thread) during the round and
during the pause before it, and mapped pages at the round's start and end.
Reported: medians over rounds, kvcached/vanilla ratios for schedule, update,
their sum and the round's wall time, per-step means (us), and per-step latency
summaries. ``--emulate-gpu US,US_PER_TOKEN`` puts a device's time into the loop: each
step takes that long after the previous one, and its output is applied no sooner,
so kvcached's page thread can map while a step runs (as on a GPU) and the wall
time ratio stands for throughput (6000,4: about the 1B model's steps on an H100,
70 ms for a 16k-token prefill, 7 ms for a decode step of 256). ``--profile``
runs the kvcached scheduler's rounds under cProfile (after the timed rounds, so
the timings are not inflated) and records the top 25 functions by cumulative and
by own time, for both schedulers. ``--emulate-map-us N`` keeps the worker out of
it: each page id's map or unmap takes N us (a sleep; 0 leaves kvcached's own
bookkeeping alone), since the host mapper's 4 MiB map (zeroed host memory,
several ms) is far slower than a GPU's (33-53 us per 2 MiB handle,
vllm-gpu-throughput-hosts.json). Results:
benchmarks/results/vllm-cpu-scheduler-replay.json (``--out`` elsewhere; the
runs recorded beside it: ``-nomap`` with ``--emulate-map-us 0 --profile``,
``-map850us`` with ``--emulate-map-us 850``, about 16 regions x 53 us: the 1B
model's 16 layers at the slow host's cold map; ``-arrival`` and ``-arrival-off`` with
``KVCACHED_CACHE_IDLE_S=1 ... --emulate-gpu 6000,4 --emulate-map-us 850 --intake-us 150``
and without / with ``--no-arrival``: what mapping ahead as requests arrive saves a burst
that grows from empty).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
import types
import uuid
from pathlib import Path

from _timing import run_info, summary, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvcached_testing
from kvcached_testing.tiny_model import token_prompts  # noqa: E402

BLOCK_SIZE = 16
KV_HEADS = 8
HEAD_DIM = 64
#: vLLM's default for the LLM class on a GPU of >= 70 GiB (the H200 run).
MAX_BATCHED_TOKENS = 16384
MAX_MODEL_LEN = 4096
#: The scheduler methods kvcached's patch set wraps (vanilla keeps vLLM's own).
SCHEDULER_METHODS = ("schedule", "update_from_output", "finish_requests", "reset_prefix_cache")


def log(*args) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


# ------------------------------------------------------------------ set-up


def engine_config(model: str, args: argparse.Namespace):
    from vllm.engine.arg_utils import EngineArgs

    # EngineArgs loads vLLM's plugins, kvcached's among them: vanilla until apply_patch_set.
    os.environ["KVCACHED_ENABLED"] = "0"
    cfg = EngineArgs(model=model, dtype="bfloat16", seed=0, enable_prefix_caching=True,
                     block_size=BLOCK_SIZE, max_num_seqs=args.max_num_seqs,
                     max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=args.max_batched_tokens,
                     skip_tokenizer_init=True,
                     num_gpu_blocks_override=args.blocks).create_engine_config()
    # vLLM turns async scheduling off on CPUs; the GPU engine runs with it.
    cfg.scheduler_config.async_scheduling = not args.cpu_path
    # The engine core resolves the layout from the attention backend; FlashAttention's is
    # layer-outer with tokens before heads.
    cfg.cache_config.kv_cache_layout = "LBNHC"
    return cfg


def kv_cache_config(cfg, args: argparse.Namespace):
    """The scheduler's ``KVCacheConfig`` as the engine core builds it (``get_kv_cache_configs``,
    with kvcached's page alignment applied when the patch set is)."""
    import torch
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import core
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                             dtype=torch.bfloat16)
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(args.layers)}
    memory = args.blocks * spec.page_size_bytes * args.layers
    configs = core.get_kv_cache_configs(cfg, [specs], [memory])  # the engine core's name
    kc = kv_cache_utils.generate_scheduler_kv_cache_config(configs)
    _, hash_block = kv_cache_utils.resolve_kv_cache_block_sizes(kc, cfg)
    kc.hash_block_size = hash_block
    cfg.cache_config.num_gpu_blocks = kc.num_blocks
    return configs[0], kc, spec.page_size_bytes


def scheduler_class(args: argparse.Namespace):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler if args.cpu_path else AsyncScheduler


def build_scheduler(cls, cfg, kc):
    from vllm.v1.structured_output import StructuredOutputManager

    return cls(vllm_config=cfg, kv_cache_config=kc,
               structured_output_manager=StructuredOutputManager(cfg),
               block_size=BLOCK_SIZE, hash_block_size=kc.hash_block_size, log_stats=True)


def originals() -> dict[str, object]:
    """vLLM's own methods, before kvcached's patch set replaces them on the classes."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    got = {name: Scheduler.__dict__[name] for name in SCHEDULER_METHODS}
    got["allocate_slots"] = KVCacheManager.__dict__["allocate_slots"]
    return got


def pin_vanilla(sched, orig: dict) -> None:
    """The vanilla scheduler keeps vLLM's methods after the classes are patched."""
    for name in SCHEDULER_METHODS:
        setattr(sched, name, types.MethodType(orig[name], sched))
    mgr = sched.kv_cache_manager
    mgr.allocate_slots = types.MethodType(orig["allocate_slots"], mgr)


def apply_patch_set(args: argparse.Namespace) -> dict:
    """kvcached's patch set, as an engine process applies it; the GPU path if asked."""
    import kvcached_vllm.scheduler as kvs
    import kvcached_vllm.worker as kvw
    from kvcached_core.plugins import bootstrap_results, reset_bootstrap
    from kvcached_vllm import entry

    reset_bootstrap()  # vLLM's plugin loading ran it with KVCACHED_ENABLED=0
    os.environ["KVCACHED_ENABLED"] = "1"
    os.environ["KVCACHED_STRICT"] = "1"
    entry.register()
    result = bootstrap_results().get("vllm")
    if not args.cpu_path:
        # build_runtime reads these module globals at call time: the GPU engine's settings
        # and block placement on the host backend (the fence follows async scheduling).
        kvs.SETTINGS = kvs.GPU_SETTINGS
        kvs.block_offset_for = kvw.block_offset_for = lambda device_type: 0
    return {"bootstrap": str(getattr(result, "status", result))}


def start_worker(cfg, worker_kc, args: argparse.Namespace):
    """kvcached's worker side in this process: the backing vLLM's ``allocate_kv_cache``
    would get, its native page server and its listener on the engine's namespace."""
    import torch

    import kvcached_vllm.worker as kvw

    os.environ["KVCACHED_IPC_NAME"] = f"replay-{uuid.uuid4().hex[:8]}"
    backing = kvw.ElasticKVBacking("cpu", worker_kc, "replay")
    sizes = {t.size for t in worker_kc.kv_cache_tensors}
    assert len(sizes) == 1, sizes
    backing.zeros(sizes.pop(), dtype=torch.int8)
    backing.finish()
    backing.start_listener(cfg)
    if args.pages == "local":
        kvw._BACKINGS.append(backing)  # the engine core's own worker (one GPU)
    return backing


class PageCalls:
    """Map / unmap calls of the kvcached pool's backing: pages, calls, seconds, per thread.

    ``emulate_us`` (not ``None``): the calls do not reach the worker; each takes that many
    microseconds per page id (a sleep, which releases the GIL as a driver call does), so
    kvcached's own work is seen apart from the host mapper's cost.
    """

    def __init__(self, kv, emulate_us: float | None = None) -> None:
        self.rows = collections.defaultdict(lambda: [0, 0, 0.0])  # (op, thread) -> pages, calls, s
        self.main = threading.get_ident()
        self.lock = threading.Lock()
        for op in ("map_pages", "unmap_pages"):
            fn = getattr(kv, op) if emulate_us is None else self._emulated(kv, op, emulate_us)
            setattr(kv, op, self._wrap(op, fn))

    @staticmethod
    def _emulated(kv, op: str, us: float):
        def call(pages, *a, **k):
            if us:
                time.sleep(us * len(pages) / 1e6)
            with kv._lock:  # RemoteKVTensors' own record of what is mapped
                if op == "map_pages":
                    kv._mapped.update(pages)
                else:
                    kv._mapped.difference_update(pages)

        return call

    def _wrap(self, op: str, fn):
        def call(pages, *a, **k):
            pages = list(pages)
            t0 = time.perf_counter()
            try:
                return fn(pages, *a, **k)
            finally:
                dt = time.perf_counter() - t0
                who = "sched" if threading.get_ident() == self.main else "bg"
                with self.lock:
                    row = self.rows[(op.split("_")[0], who)]
                    row[0] += len(pages)
                    row[1] += 1
                    row[2] += dt

        return call

    def take(self) -> dict:
        with self.lock:
            out = {f"{op}_{who}": {"pages": r[0], "calls": r[1], "seconds": round(r[2], 5)}
                   for (op, who), r in sorted(self.rows.items())}
            self.rows.clear()
        return out


class GrowTimer:
    """Time the scheduling thread spends in ``KVBlockManager._grow`` (new pages for blocks)."""

    def __init__(self, blocks) -> None:
        self.seconds = 0.0
        self.calls = 0
        grow = blocks._grow

        def timed(deficit):
            t0 = time.perf_counter()
            try:
                return grow(deficit)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        blocks._grow = timed

    def take(self) -> dict:
        out = {"seconds": round(self.seconds, 5), "calls": self.calls}
        self.seconds, self.calls = 0.0, 0
        return out


# ------------------------------------------------------------------ replay


def make_requests(prompts: list[list[int]], tag: str, max_tokens: int, hasher) -> list:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                        detokenize=False)
    now = time.time()
    return [Request(f"{tag}-{i}", p, sampling_params=sp, pooling_params=None, arrival_time=now,
                    block_hasher=hasher) for i, p in enumerate(prompts)]


def fake_output(sched, out):
    """What the worker would return for ``out``: a token per request whose prefill completed."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    reqs = sched.requests
    sampled = [[] if reqs[r].num_computed_tokens < reqs[r].num_prompt_tokens else [7]
               for r in ids]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)


def serve(sched, requests: list, queue_size: int, pool=None,
          gpu: tuple[float, float] | None = None, intake_us: float = 0.0) -> dict:
    """Serve ``requests`` to completion as ``EngineCore.step_with_batch_queue`` (or ``step``
    with a queue of one) does; the engine core's time in the scheduler.

    ``gpu`` (``--emulate-gpu``: microseconds a step, and per scheduled token) stands in for
    the device: a step runs once the previous one is done, and its output is applied no
    sooner than it would be done, so the engine core waits as on a GPU and background work
    (kvcached's page thread) runs meanwhile. ``intake_us`` (``--intake-us``) is the engine's
    work on each request before the scheduler gets it (``LLM.generate``'s input processing),
    spent on this thread after each ``add_request``; the round's clock starts after the last.
    """
    sched_s, update_s, steps_sched, steps_update = [], [], 0, 0
    gpu_free = 0.0
    for req in requests:
        sched.add_request(req)
        if intake_us:
            until = time.perf_counter() + 1e-6 * intake_us
            while time.perf_counter() < until:
                pass
    queue: collections.deque = collections.deque()
    cpu0 = time.thread_time()
    t_round = time.perf_counter()
    mapped_max = 0
    while sched.has_requests() or queue:
        if sched.has_requests():
            t0 = time.perf_counter()
            out = sched.schedule()
            sched_s.append(time.perf_counter() - t0)
            steps_sched += 1
            executed = out.total_num_scheduled_tokens > 0
            done_at = 0.0
            if gpu is not None and executed:
                gpu_free = done_at = max(time.perf_counter(), gpu_free) + 1e-6 * (
                    gpu[0] + gpu[1] * out.total_num_scheduled_tokens)
            queue.appendleft((out, fake_output(sched, out), done_at))
            if len(queue) < queue_size and (executed or sched.has_requests()):
                continue
        out, mro, done_at = queue.pop()
        wait = done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        t0 = time.perf_counter()
        sched.update_from_output(out, mro)
        update_s.append(time.perf_counter() - t0)
        steps_update += 1
        if pool is not None:
            mapped_max = max(mapped_max, pool.pages.num_mapped)
    wall = time.perf_counter() - t_round
    cpu = time.thread_time() - cpu0
    done = sum(r.is_finished() for r in requests)
    assert done == len(requests), f"{done}/{len(requests)} requests finished"
    gen = sum(r.num_output_tokens for r in requests)
    return {"schedule_s": sum(sched_s), "update_s": sum(update_s),
            "steps": steps_sched, "updates": steps_update, "round_wall_s": round(wall, 4),
            "thread_cpu_s": round(cpu, 4), "generated": gen, "mapped_pages_max": mapped_max,
            "_sched": sched_s, "_update": update_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--pause", type=float, default=1.5, help="seconds before each round")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=49152)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=MAX_BATCHED_TOKENS)
    ap.add_argument("--pages", choices=("local", "socket"), default="local",
                    help="kvcached maps through the in-process page server (1 GPU) or the socket")
    ap.add_argument("--emulate-map-us", type=float, default=None,
                    help="map / unmap skip the worker and take this many us per page id "
                         "(0: kvcached's bookkeeping alone)")
    ap.add_argument("--emulate-gpu", metavar="US,US_PER_TOKEN",
                    help="a device that takes US + US_PER_TOKEN x scheduled tokens per step: "
                         "the engine core waits for each step's output as on a GPU, and "
                         "round_wall_s compares like throughput")
    ap.add_argument("--intake-us", type=float, default=0.0,
                    help="the engine's work on each request before the scheduler gets it "
                         "(LLM.generate's input processing), spent after each add_request")
    ap.add_argument("--no-arrival", action="store_true",
                    help="kvcached maps ahead only after each step, not as requests arrive "
                         "(what map-ahead on arrival saves)")
    ap.add_argument("--cpu-path", action="store_true",
                    help="the CPU engine's settings: synchronous Scheduler, no fence, SETTINGS")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile extra kvcached rounds; top 25 by cumulative and own time")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"
                                         / "vllm-cpu-scheduler-replay.json"))
    args = ap.parse_args()

    import torch
    import vllm

    import kvcached_core
    import kvcached_vllm
    from kvcached_testing.tiny_model import build_tiny_llama

    where = {"kvcached_core": kvcached_core.__file__, "kvcached_vllm": kvcached_vllm.__file__}
    log("modules:", where)
    model = build_tiny_llama(Path(tempfile.mkdtemp(prefix="replay-model-")),
                             num_layers=args.layers, hidden_size=KV_HEADS * HEAD_DIM,
                             num_heads=KV_HEADS, num_kv_heads=KV_HEADS)
    cfg = engine_config(str(model), args)
    sched_cls = scheduler_class(args)
    log("scheduler", sched_cls.__name__, "max_num_batched_tokens",
        cfg.scheduler_config.max_num_batched_tokens, "async", cfg.scheduler_config.async_scheduling)

    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    # vanilla: built before kvcached's patches exist, as in an engine without kvcached
    orig = originals()
    _, van_kc, block_bytes = kv_cache_config(cfg, args)
    vanilla = build_scheduler(sched_cls, cfg, van_kc)

    setup = apply_patch_set(args)
    worker_kc, kv_kc, _ = kv_cache_config(cfg, args)
    from vllm.v1.core.sched.scheduler import Scheduler

    assert Scheduler.__dict__["schedule"] is not orig["schedule"], "the patch set did not land"
    pin_vanilla(vanilla, orig)
    backing = start_worker(cfg, worker_kc, args)
    import kvcached_vllm.scheduler as kvs

    before = len(kvs.runtimes())
    elastic = build_scheduler(sched_cls, cfg, kv_kc)
    assert len(kvs.runtimes()) == before + 1, "the kvcached scheduler built no elastic runtime"
    rt = kvs.runtimes()[-1]
    if args.no_arrival:
        from kvcached_vllm.patches import ARRIVAL_ATTR

        elastic.__dict__.pop(ARRIVAL_ATTR, None)
    pool = rt.pool
    pa = pool.pages
    assert type(elastic.kv_cache_manager.block_pool).__name__.startswith("ElasticBlockPool")
    assert type(vanilla.kv_cache_manager.block_pool).__name__ == "BlockPool"
    local = getattr(pool.backing, "_server", None) is not None
    settings = pool.settings
    setup.update({
        "path": "cpu" if args.cpu_path else "gpu (forced on the host backend)",
        "scheduler_class": sched_cls.__name__,
        "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
        "batch_queue": 1 if args.cpu_path else 2,
        "step_fence": pool.fence is not None,
        "page_requests": "in-process page server" if local else "IPC socket",
        "settings": {k: getattr(settings, k) for k in
                     ("idle_trim_s", "idle_keep_pages", "max_reserved_pages", "min_reserved_pages",
                      "page_size", "cache_idle_s", "map_ahead") if hasattr(settings, k)},
        "block_offset": rt.geometry.block_offset, "num_blocks": kv_kc.num_blocks,
        "vanilla_num_blocks": van_kc.num_blocks, "block_bytes_per_layer": block_bytes,
        "layers": args.layers, "pages": rt.geometry.num_pages,
        "page_bytes_all_layers": rt.geometry.page_bytes,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "map_ahead_on_arrival": not args.no_arrival and rt.ahead,
        "intake_us_per_request": args.intake_us,
    })
    log("kvcached:", setup)
    calls = PageCalls(pool.backing, args.emulate_map_us)
    setup["page_calls"] = ("the host mapper through the worker's page server"
                           if args.emulate_map_us is None else
                           f"emulated: {args.emulate_map_us} us per page id, no worker call")
    grow = GrowTimer(pool.blocks)

    caching_hash = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
    init_none_hash(caching_hash)
    hasher = get_request_block_hasher(kv_kc.hash_block_size, caching_hash)
    qsize = 1 if args.cpu_path else 2
    gpu = tuple(float(x) for x in args.emulate_gpu.split(",")) if args.emulate_gpu else None
    if gpu is not None and len(gpu) != 2:
        raise SystemExit(f"--emulate-gpu={args.emulate_gpu!r}: give US,US_PER_TOKEN")
    setup["emulated_gpu_us"] = {"per_step": gpu[0], "per_token": gpu[1]} if gpu else None
    scheds = {"vanilla": vanilla, "kvcached": elastic}

    def one(name: str, prompts, tag: str) -> dict:
        is_kv = name == "kvcached"
        if is_kv:
            pause = calls.take()
            start_mapped = pa.num_mapped
            grow.take()
        res = serve(scheds[name], make_requests(prompts, tag, args.max_tokens, hasher), qsize,
                    pool if is_kv else None, gpu, args.intake_us)
        if is_kv:
            res.update(pause_page_calls=pause, round_page_calls=calls.take(),
                       grow=grow.take(), mapped_pages_start=start_mapped,
                       mapped_pages_end=pa.num_mapped)
        else:
            res.pop("mapped_pages_max")
        return res

    log("warm-up round")
    warm = token_prompts(args.prompts, 256, 1024, seed=500)
    for name in scheds:
        one(name, warm, f"{name}-warm")
    rounds: dict[str, list[dict]] = {n: [] for n in scheds}
    steps: dict[str, dict[str, list[float]]] = {n: {"schedule": [], "update": []} for n in scheds}
    order = list(scheds)
    for r in range(args.rounds):
        batch = token_prompts(args.prompts, 256, 1024, seed=r)
        for k in range(len(order)):
            name = order[(r + k) % len(order)]
            time.sleep(args.pause)
            res = one(name, batch, f"{name}-r{r}")
            steps[name]["schedule"] += res.pop("_sched")
            steps[name]["update"] += res.pop("_update")
            res["schedule_s"] = round(res["schedule_s"], 5)
            res["update_s"] = round(res["update_s"], 5)
            rounds[name].append(res)
        log(f"round {r}:", {n: (rounds[n][-1]["schedule_s"], rounds[n][-1]["update_s"],
                                rounds[n][-1]["steps"]) for n in scheds},
            "grow", rounds["kvcached"][-1]["grow"])

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in rounds[name])

    medians = {}
    for n in scheds:
        s, u = med(n, "schedule_s"), med(n, "update_s")
        st = med(n, "steps")
        medians[n] = {"schedule_s": round(s, 5), "update_s": round(u, 5),
                      "sum_s": round(statistics.median(x["schedule_s"] + x["update_s"]
                                                       for x in rounds[n]), 5),
                      "steps": st, "thread_cpu_s": round(med(n, "thread_cpu_s"), 4),
                      "schedule_us_per_step": round(1e6 * s / st, 1),
                      "update_us_per_step": round(1e6 * u / st, 1)}
    ratio = {k: round(statistics.median(
        (a[k] if k != "sum_s" else a["schedule_s"] + a["update_s"])
        / (b[k] if k != "sum_s" else b["schedule_s"] + b["update_s"])
        for a, b in zip(rounds["kvcached"], rounds["vanilla"])), 3)
        for k in ("schedule_s", "update_s", "sum_s", "round_wall_s")}
    kvr = rounds["kvcached"]
    pages = {
        "grow_s_median": statistics.median(x["grow"]["seconds"] for x in kvr),
        "grow_calls_median": statistics.median(x["grow"]["calls"] for x in kvr),
        "map_pages_sched_median": statistics.median(
            x["round_page_calls"].get("map_sched", {}).get("pages", 0) for x in kvr),
        "map_s_sched_median": statistics.median(
            x["round_page_calls"].get("map_sched", {}).get("seconds", 0) for x in kvr),
        "unmap_pages_sched_median": statistics.median(
            x["round_page_calls"].get("unmap_sched", {}).get("pages", 0) for x in kvr),
        "map_pages_bg_median": statistics.median(
            x["round_page_calls"].get("map_bg", {}).get("pages", 0) for x in kvr),
        "unmap_pages_in_pause_median": statistics.median(
            sum(v["pages"] for k, v in x["pause_page_calls"].items() if k.startswith("unmap"))
            for x in kvr),
        "mapped_pages_start_median": statistics.median(x["mapped_pages_start"] for x in kvr),
        "mapped_pages_max_median": statistics.median(x["mapped_pages_max"] for x in kvr),
    }
    latency = {}
    for n in scheds:
        for part in ("schedule", "update"):
            latency[f"{n} {part}"] = summary([1e6 * x for x in steps[n][part]])

    result = run_info("vllm-cpu-scheduler-replay", vllm=vllm.__version__,
                      torch=torch.__version__, modules=where,
                      loadavg_at_end=[round(x, 2) for x in os.getloadavg()])
    result.update(workload={"prompts": args.prompts, "prompt_len": [256, 1024],
                            "max_tokens": args.max_tokens, "rounds": args.rounds,
                            "pause_s": args.pause, "prompt_seeds": "round number; warm-up 500",
                            "prefix_caching": True, "block_size": BLOCK_SIZE},
                  kvcached=setup, medians=medians, ratio_kvcached_vs_vanilla=ratio,
                  kvcached_pages=pages, latency=latency, rounds=rounds)

    if args.profile:
        result["profile"] = {}
        for name in ("kvcached", "vanilla"):
            log("profiling", name, "rounds")
            prof = cProfile.Profile()
            for r in range(min(3, args.rounds)):
                time.sleep(args.pause)
                batch = token_prompts(args.prompts, 256, 1024, seed=1000 + r)
                reqs = make_requests(batch, f"{name}-prof-r{r}", args.max_tokens, hasher)
                prof.enable()
                serve(scheds[name], reqs, qsize)
                prof.disable()
            result["profile"][name] = {"rounds": min(3, args.rounds),
                                       "cumulative": top(prof, "cumulative"),
                                       "tottime": top(prof, "tottime")}

    print()
    print(f"{'per round (median)':<20}{'schedule s':>11}{'update s':>10}{'sum s':>8}"
          f"{'steps':>7}{'sched us/st':>12}{'upd us/st':>10}")
    for n, m in medians.items():
        print(f"{n:<20}{m['schedule_s']:>11}{m['update_s']:>10}{m['sum_s']:>8}{m['steps']:>7}"
              f"{m['schedule_us_per_step']:>12}{m['update_us_per_step']:>10}")
    print("kvcached/vanilla:", ratio)
    print("kvcached pages:", pages)
    write_result(args.out, result, "per step")
    elastic_close(rt, backing)


def top(prof: cProfile.Profile, key: str, n: int = 25) -> list[dict]:
    stats = pstats.Stats(prof, stream=io.StringIO())
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:n]:
        cc, nc, tt, ct, _ = stats.stats[func]
        path, line, name = func
        rows.append({"function": f"{Path(path).name}:{line}({name})", "calls": nc,
                     "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)})
    return rows


def elastic_close(rt, backing) -> None:
    try:
        rt.close()
    finally:
        backing.release()


if __name__ == "__main__":
    main()
