"""vLLM on one NVIDIA GPU with and without kvcached: tokens, memory, throughput, shared device.

Run by ``scripts/run_gpu_vllm.sh`` on the GPU machine (vLLM from the offline
bundle, kvcached installed beside it)::

    python3 benchmarks/bench_vllm_gpu.py tokens --out $OUT/vllm-gpu-tokens.json
    python3 benchmarks/bench_vllm_gpu.py perf   --out $OUT/vllm-gpu-perf.json

Every engine runs in a child process of its own (``LLM(...)`` there; its engine
core and worker below it), driven over a connection, so engines with different
settings live side by side and their GPU memory is read per process through
NVML (no CUDA context is created for reading). Models are random-weight Llamas
built locally: ``tiny`` (kvcached_testing/tiny_model.py) and ``1b`` (Llama-3.2-1B's
geometry: 16 layers, hidden 2048, 32 heads, 8 KV heads, intermediate 8192).
Every engine gets the same explicit KV budget (``kv_cache_memory_bytes``), so
vanilla and kvcached engines have the same block count and schedule alike;
prefix caching is on; prompts are token ids.

``tokens``
    Every model shape (:data:`TOKEN_MODELS`: head_dim 64/128/256, 2/8/1 KV heads,
    one with sliding-window layers) x runner (V2, vLLM's default on GPUs, and V1,
    ``VLLM_USE_V2_MODEL_RUNNER=0``) x mode (CUDA graphs, ``enforce_eager``) x KV
    sizing (``kv_cache_memory_bytes``, or ``gpu_memory_utilization`` with vLLM's
    memory and CUDA-graph profiling). Per configuration a vanilla engine, a
    second vanilla engine (the A/A control) and a kvcached engine serve
    :func:`token_workload`: several ``generate`` calls with greedy prompts of
    16-1500 tokens, the same prompts again (prefix-cache hits), seeded sampling
    and ``n=3``. Greedy decoding on a GPU is not bit-reproducible across engines
    (batch shapes pick different kernel splits), so the measure is the number of
    sequences differing from the vanilla engine, kvcached against the control,
    and every request's ``num_cached_tokens`` equal to vanilla's; with
    ``VLLM_BATCH_INVARIANT=1`` (V2, eager) vanilla and kvcached must agree
    exactly. ``summary`` holds the verdict per configuration.
``perf``
    The 1B-shaped model. Throughput: a vanilla, a kvcached and a control
    vanilla engine live at once; ``--reps`` rounds each, rotating order with a
    pause before each call (longer than kvcached's 1 s idle trim, and the kvcached
    engines return their prefix cache after 1 s idle too, :data:`GROW_ENV`, so every
    kvcached round grows its memory from empty), ``--prompts`` prompts of 256-1024
    tokens, ``--max-tokens`` generated; ratio of generated tokens per second over all
    rounds and the median of the per-round ratios, for kvcached, each ``--variant``
    and the control.
    Engine start: a primer vanilla engine starts and stops first (it fills
    torch.compile's cache); then every measured engine starts together from
    that cache, so all of them start alike (an engine that compiled its own
    graphs ran a few percent slower than one that loaded them; the control
    ratio showed it): ``init_ratio_kvcached_vs_control`` is kvcached's start
    time over the control's. Page calls: each kvcached engine's map and unmap calls as
    its pools timed them (calls, 2 MiB handles, seconds). Memory: NVML per process,
    sampled every 50 ms throughout, shows the kvcached engine growing under
    each round and falling back after it. Shared device: two kvcached engines
    whose KV budgets (80 GiB each) could not both be pinned, and a third
    process holding device memory: A serves a burst that keeps a prefix cache
    and idles; B bursts and completes; A serves its prefixes again; then the
    holder takes all but a few GiB and B bursts again (requests wait, nothing
    crashes), and the holder lets go.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvcached_testing
from kvcached_testing.tiny_model import token_prompts  # noqa: E402

GIB = 1 << 30
#: ``perf``: every kvcached engine (variants start from it) returns all its memory in the
#: pause before a round, prefix cache included, so each round grows from empty (by default
#: an engine keeps its prefix cache mapped as vanilla does, and a round would reuse it).
GROW_ENV = {"KVCACHED_CACHE_IDLE_S": "1"}
TINY_KV = 4 * GIB
PERF_KV = 24 * GIB
SHARE_KV = 80 * GIB


def log(*args) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


# ------------------------------------------------------------------ models


#: The token run's model shapes (:func:`kvcached_testing.tiny_model.build_tiny_llama`):
#: KV heads and head_dim differ; ``swa256`` has sliding-window and full-attention layers
#: (two KV cache groups in vLLM).
TOKEN_MODELS = {
    "tiny": {},  # 2 layers, 2 KV heads, head_dim 64
    "h128": dict(num_layers=8, hidden_size=1024, num_heads=8, num_kv_heads=8, head_dim=128,
                 init_std=0.05),
    "swa256": dict(num_layers=4, hidden_size=512, num_heads=4, num_kv_heads=1, head_dim=256,
                   sliding_window=256, init_std=0.1),
}


def build_models(root: Path, phase: str) -> dict[str, str]:
    """The token run's models (``tokens``) or the 1B-shaped one (``perf``), built here
    (random weights, no downloads)."""
    from kvcached_testing.tiny_model import build_tiny_llama

    paths = {}
    for name, shape in (TOKEN_MODELS.items() if phase == "tokens" else ()):
        paths[name] = str(root / name)
        if not (root / name / "config.json").exists():
            build_tiny_llama(root / name, **shape)
    big = root / "llama-1b-shape"
    if phase == "tokens":
        return paths
    if not (big / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=64, max_position_embeddings=4096, rope_theta=500000.0,
                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                          torch_dtype="bfloat16", initializer_range=0.02)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(big, safe_serialization=True)
        del model
        torch.cuda.empty_cache()
    return {**paths, "1b": str(big)}


# ------------------------------------------------------------------ engine child

#: vLLM metrics an engine reports (``metrics`` command), by the name they get here.
ENGINE_METRICS = {"vllm:num_preemptions": "preemptions",
                  "vllm:num_preemptions_total": "preemptions",
                  "vllm:iteration_tokens_total": "steps",
                  "vllm:prefix_cache_hits": "prefix_hits",
                  "vllm:prefix_cache_hits_total": "prefix_hits",
                  "vllm:prefix_cache_queries": "prefix_queries",
                  "vllm:prefix_cache_queries_total": "prefix_queries"}


def engine_child(args: argparse.Namespace) -> None:
    """One ``LLM`` serving the parent's commands until ``finish``."""
    from multiprocessing.connection import Client

    from vllm import LLM, SamplingParams

    kw = json.loads(args.engine_kw)
    t0 = time.perf_counter()
    try:
        llm = LLM(**kw)
        first = {"init_s": time.perf_counter() - t0, "pid": os.getpid()}
    except BaseException as exc:  # reported to the parent, which logs our output
        first = {"error": f"{type(exc).__name__}: {exc}"}
    # Connect only now: the handshake waits for the parent, which may be starting others.
    conn = Client(args.address, authkey=args.key.encode())
    conn.send(first)
    if "error" in first:
        sys.exit(1)
    while True:
        cmd, spec = conn.recv()
        if cmd == "generate":
            seeds = spec.get("seeds") or [None] * len(spec["prompts"])
            params = [SamplingParams(temperature=0.0 if seed is None else spec["temperature"],
                                     top_p=spec.get("top_p", 1.0), seed=seed, n=spec.get("n", 1),
                                     max_tokens=spec["max_tokens"], ignore_eos=True,
                                     detokenize=False) for seed in seeds]
            batch = [{"prompt_token_ids": p} for p in spec["prompts"]]
            t = time.perf_counter()
            out = llm.generate(batch, params, use_tqdm=False)
            dt = time.perf_counter() - t
            toks = [list(c.token_ids) for o in out for c in o.outputs]
            conn.send({"seconds": dt, "generated": sum(map(len, toks)),
                       "tokens": toks if spec.get("return_tokens", True) else None,
                       "cached": [o.num_cached_tokens for o in out]})
        elif cmd == "metrics":
            found = {}
            try:
                for m in llm.get_metrics():
                    key = ENGINE_METRICS.get(m.name)
                    if key == "steps":  # a histogram of tokens per engine step
                        found["steps"] = found.get("steps", 0) + int(m.count)
                        found["step_tokens"] = found.get("step_tokens", 0) + int(m.sum)
                    elif key:
                        found[key] = found.get(key, 0) + int(m.value)
            except Exception as exc:  # metrics are a nice-to-have
                found["error"] = str(exc)
            conn.send(found)
        else:
            conn.send({})
            try:
                llm.llm_engine.engine_core.shutdown()
            finally:
                os._exit(0)


class Engine:
    """An engine in a child process, with its own environment and log."""

    def __init__(self, name: str, model: str, *, enabled: bool, kv_bytes: int | None,
                 eager: bool = False, v2: bool = True, extra_env: dict | None = None,
                 max_num_seqs: int = 256, max_model_len: int = 4096, start: bool = True,
                 utilization: float = 0.1) -> None:
        from multiprocessing.connection import Listener

        self.name = name
        self.enabled = enabled
        self.ns = f"g{uuid.uuid4().hex[:8]}"
        self.logf = tempfile.NamedTemporaryFile("w+", prefix=f"engine-{name}-", suffix=".log",
                                                delete=False)
        env = dict(os.environ, KVCACHED_ENABLED="1" if enabled else "0",
                   VLLM_USE_V2_MODEL_RUNNER="1" if v2 else "0")
        if enabled:
            env.update(KVCACHED_IPC_NAME=self.ns, KVCACHED_STRICT="1")
        env.update(extra_env or {})
        # kv_bytes None: the KV cache is sized by gpu_memory_utilization (vLLM profiles).
        kw = dict(model=model, dtype="bfloat16", seed=0, enable_prefix_caching=True,
                  enforce_eager=eager, kv_cache_memory_bytes=kv_bytes,
                  gpu_memory_utilization=utilization,
                  max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                  skip_tokenizer_init=True, disable_log_stats=False)
        self.kw = kw
        address = os.path.join(tempfile.mkdtemp(prefix="kvg-"), "c")
        self._listener = Listener(address, authkey=self.ns.encode())
        cmd = [sys.executable, __file__, "_child", "--address", address, "--key", self.ns,
               "--engine-kw", json.dumps(kw)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.logf, stderr=subprocess.STDOUT)
        self.conn = None
        self.init_s = None
        self.pid = self.proc.pid
        if start:
            self.wait_ready()

    def wait_ready(self) -> Engine:
        self.conn = self._listener.accept()
        msg = self.recv()
        if "error" in msg:
            raise RuntimeError(f"{self.name}: {msg['error']}\n{self.tail()}")
        self.init_s = msg["init_s"]
        log(f"{self.name}: started in {self.init_s:.1f} s")
        return self

    def tail(self, n: int = 6000) -> str:
        self.logf.flush()
        return Path(self.logf.name).read_text(errors="replace")[-n:]

    def recv(self) -> dict:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.wait(timeout=30)
            raise RuntimeError(f"{self.name} engine died (exit {self.proc.returncode}):\n"
                               f"{self.tail()}") from None

    def call(self, cmd: str, spec: dict | None = None) -> dict:
        self.conn.send((cmd, spec or {}))
        return self.recv()

    def generate(self, prompts, max_tokens, **spec) -> dict:
        return self.call("generate", dict(spec, prompts=prompts, max_tokens=max_tokens))

    def finish(self) -> None:
        if self.conn is not None and self.proc.poll() is None:
            try:
                self.call("finish")
            except RuntimeError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._listener.close()

    def kvcached_log(self) -> list[str]:
        """kvcached's own log lines (patch set, elastic pool, warnings), at most 12."""
        lines = [line[-400:] for line in self.tail(400000).splitlines() if "kvcached" in line]
        keep = [x for x in lines if "WARNING" in x or "ERROR" in x or "elastic KV cache" in x
                or "serves KV pages" in x]
        return keep[:10] + [x for x in lines if "patch set" in x][-2:]

    def setup_lines(self) -> list[str]:
        """What the engine logged of its set-up that could make two engines' steps differ
        (CUDA graph modes and sizes, attention backend, KV cache size), without the prefix."""
        keys = ("cudagraph", "cuda graph", "graph capturing", "attention backend",
                "kv cache size", "maximum concurrency", "async scheduling", "chunked prefill")
        self.logf.flush()
        text = Path(self.logf.name).read_text(errors="replace")
        lines = [line.split("] ", 1)[-1][:300] for line in text.splitlines()
                 if any(k in line.lower() for k in keys)]
        return list(dict.fromkeys(lines))[:20]


# ------------------------------------------------------------------ GPU memory (NVML)


class MemorySampler:
    """Samples, every ``period`` s, the device's used memory and each engine's processes'."""

    def __init__(self, engines: dict[str, Engine], period: float = 0.05) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.dev = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.engines = engines
        self.period = period
        self.samples: list[dict] = []
        self.marks: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _descendants(self) -> dict[int, str]:
        parent: dict[int, int] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    pass
        roots = {e.pid: name for name, e in self.engines.items()}
        owner = {}
        for pid in parent:
            p: int | None = pid
            for _ in range(10):
                if p in roots:
                    owner[pid] = roots[p]
                    break
                p = parent.get(p)
                if p is None:
                    break
        return owner

    def read(self) -> dict:
        n = self.nvml
        info = n.nvmlDeviceGetMemoryInfo(self.dev)
        owner = self._descendants()
        per: dict[str, int] = {}
        for proc in n.nvmlDeviceGetComputeRunningProcesses(self.dev):
            name = owner.get(proc.pid)
            if name is not None and proc.usedGpuMemory is not None:
                per[name] = per.get(name, 0) + int(proc.usedGpuMemory)
        return {"t": round(time.monotonic() - self.t0, 3), "used": int(info.used),
                "free": int(info.free), "engines": per}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.read())
            except Exception as exc:  # keep sampling
                self.samples.append({"t": round(time.monotonic() - self.t0, 3), "error": str(exc)})
            self._stop.wait(self.period)

    def mark(self, what: str) -> None:
        self.marks.append((round(time.monotonic() - self.t0, 3), what))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def series(self, name: str) -> list[tuple[float, int]]:
        return [(s["t"], s["engines"].get(name, 0)) for s in self.samples if "engines" in s]

    def window(self, name: str, t0: float, t1: float) -> list[int]:
        return [v for t, v in self.series(name) if t0 <= t <= t1]


class Holder:
    """A process holding device memory (cudaMalloc through torch), resized on command."""

    def __init__(self) -> None:
        code = ("import sys, torch\nheld = []\nfor line in sys.stdin:\n"
                "    gib = float(line)\n    held.clear(); torch.cuda.empty_cache()\n"
                "    n = int(gib * (1 << 30))\n"
                "    if n: held.append(torch.empty(n, dtype=torch.uint8, device='cuda'))\n"
                "    torch.cuda.synchronize(); print('ok', flush=True)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.gib = 0.0

    def hold(self, gib: float) -> None:
        self.proc.stdin.write(f"{max(0.0, gib)}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"
        self.gib = gib

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def differing(a: list[list[int]], b: list[list[int]]) -> dict:
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    first = []
    for i in diff[:8]:
        x, y = a[i], b[i]
        first.append(next((k for k in range(min(len(x), len(y))) if x[k] != y[k]), -1))
    return {"sequences": len(a), "differing": len(diff), "first_diff_positions": first}


# ------------------------------------------------------------------ phases


def kv_pages(engine: Engine) -> int | str:
    """Page bundles the kvcached engine's worker has mapped now (what went wrong asking,
    instead of failing the configuration's token comparison)."""
    from kvcached_core.ipc import WorkerGroup

    try:
        with WorkerGroup.for_namespace(engine.ns, tp_size=1, timeout=30,
                                       connect_timeout=5) as g:
            return len(g.query(0)[0])
    except Exception as exc:
        return f"not read: {exc}"


#: The ``generate`` calls of :func:`token_workload`, in order.
TOKEN_CALLS = ("greedy", "repeat", "seeded", "n3")
#: ``tokens``: engines of a configuration sized by ``gpu_memory_utilization`` get this share.
TOKEN_UTILIZATION = 0.06


def token_workload(e: Engine) -> dict:
    """Several ``generate`` calls on one engine: greedy prompts of 16-1500 tokens and a group
    sharing a 600-token prefix; the same prompts again (prefix-cache hits); seeded sampling;
    seeded sampling with ``n=3``. Tokens and each request's ``num_cached_tokens``."""
    prefix = token_prompts(1, 600, 600, seed=99)[0]
    greedy = token_prompts(40, 16, 1500, seed=1) + token_prompts(8, 50, 200, seed=2, prefix=prefix)
    seeded = token_prompts(8, 100, 400, seed=3)
    calls = {"greedy": e.generate(greedy, 64),
             "repeat": e.generate(greedy, 64),
             "seeded": e.generate(seeded, 48, temperature=0.8, top_p=0.95,
                                  seeds=list(range(100, 108))),
             "n3": e.generate(seeded[:4], 32, temperature=0.8, top_p=0.95, n=3,
                              seeds=list(range(200, 204)))}
    return {k: {"tokens": v["tokens"], "cached": v["cached"]} for k, v in calls.items()}


def compare_runs(res: dict[str, dict]) -> dict:
    """Per call: sequences differing from the vanilla engine, for kvcached and the control,
    and requests whose ``num_cached_tokens`` differ from vanilla's."""
    row: dict = {}
    for part in res["vanilla"]:
        row[part] = {n: {**differing(res["vanilla"][part]["tokens"], res[n][part]["tokens"]),
                         "cached_tokens_differing": sum(
                             a != b for a, b in zip(res["vanilla"][part]["cached"],
                                                    res[n][part]["cached"])),
                         "cached_tokens": sum(res[n][part]["cached"])}
                     for n in res if n != "vanilla"}
    return row


def kv_blocks(engine: Engine) -> int | None:
    """vLLM's KV block count as its log states it (``GPU KV cache size: N tokens``)."""
    import re

    found = re.findall(r"GPU KV cache size: ([\d,]+) tokens", engine.tail(400000))
    return int(found[-1].replace(",", "")) if found else None


class OutOfTime(Exception):
    """The run's time budget ends before a configuration could finish."""


def token_group(model: str, path: str, runner: str, mode: str, sizings: list[str],
                lock: threading.Lock, deadline: float, env: dict | None = None,
                done: Callable[[str, dict], None] | None = None) -> dict:
    """One model x runner x mode: for each KV sizing a vanilla, a control and a kvcached engine.

    The group's engines share one torch.compile cache: the first vanilla engine fills it,
    the others load the same compiled code. Engines sized by ``gpu_memory_utilization``
    profile the device's free memory, so they start one at a time across all groups
    (``lock``, which every engine's exit takes too: memory another process frees while
    vLLM profiles fails its start). ``done(label, row)`` gets each configuration's row as it
    finishes.
    """
    out: dict = {}
    cache = tempfile.mkdtemp()
    kw = dict(eager=mode == "eager", v2=runner == "v2")
    for sizing in sizings:
        label = f"{model}-{runner}-{mode}-{sizing}"
        if time.monotonic() > deadline - 60:
            out[label] = {"skipped": "time budget"}
            continue
        engines: dict[str, Engine] = {}
        t0 = time.monotonic()

        def start(n: str) -> Engine:
            return Engine(f"{label}-{n}", path, enabled=n == "kvcached",
                          kv_bytes=TINY_KV if sizing == "bytes" else None,
                          utilization=TOKEN_UTILIZATION, start=False, max_num_seqs=64,
                          extra_env={"VLLM_CACHE_ROOT": cache, **(env or {})}, **kw)

        try:
            for n in ("vanilla", "control", "kvcached"):
                if sizing == "util":
                    with lock:  # one profiling start at a time, across all groups
                        if time.monotonic() > deadline - 90:  # the wait for the lock was long
                            raise OutOfTime
                        engines[n] = start(n).wait_ready()
                elif n == "vanilla":  # alone: it fills the group's compile cache
                    engines[n] = start(n).wait_ready()
                else:
                    engines[n] = start(n)
            for e in engines.values():
                if e.conn is None:
                    e.wait_ready()
            res = {n: token_workload(e) for n, e in engines.items()}
            row = compare_runs(res)
            kv = engines["kvcached"]
            logs = kv.kvcached_log()
            row.update(
                init_s={n: round(e.init_s, 1) for n, e in engines.items()},
                kv_tokens={n: kv_blocks(e) for n, e in engines.items()},
                serves_kv_pages_lines=[x for x in logs if "serves KV pages" in x],
                kvcached_mapped_pages_after=kv_pages(kv),
                seconds=round(time.monotonic() - t0, 1), kvcached_log=logs)
            out[label] = row
            log(label, json.dumps({k: v for k, v in row.items() if k != "kvcached_log"}))
        except OutOfTime:
            out[label] = {"skipped": "time budget"}
            log(label, "skipped: time budget")
        except Exception as exc:
            out[label] = {"error": str(exc)[-3000:]}
            log(label, "FAILED", str(exc)[-3000:])
        finally:
            with lock:
                for e in engines.values():
                    e.finish()
        if done is not None:
            done(label, out[label])
    return out


def engine_env(args: argparse.Namespace) -> dict:
    """``--inproc``: every engine's core runs in its ``LLM``'s process, so a ``generate``
    call's requests are all queued before its first step and batches do not depend on
    when requests reach a separate engine-core process (vLLM's default on GPUs)."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if args.inproc else {}


def tokens_phase(models: dict, args: argparse.Namespace, deadline: float,
                 save: Callable[[dict], object] | None = None) -> dict:
    """Every model shape x runner x mode x KV sizing, each with a vanilla A/A control; then
    batch-invariant mode, where vanilla and kvcached must agree exactly. ``save`` gets the
    results so far (``"partial": true``) after each configuration: a run stopped from
    outside keeps what finished."""
    from concurrent.futures import ThreadPoolExecutor

    # CUDA graphs first (the profiling path), the model unlike the tiny one first.
    groups = [(m, r, mode) for mode in ("graphs", "eager") for m in ("h128", "swa256", "tiny")
              for r in ("v1", "v2")]

    def wanted(label: str) -> bool:
        return not args.configs or any(label.startswith(c) or c in label.split("-")
                                       for c in args.configs)

    lock = threading.Lock()
    out: dict = {"utilization": TOKEN_UTILIZATION, "kv_bytes": TINY_KV,
                 "engine_env": engine_env(args)}
    saving = threading.Lock()  # not ``lock``: that one is held through profiling starts

    def done(label: str, row: dict) -> None:
        with saving:
            out[label] = row
            if save is not None:
                save({**out, "summary": token_summary(out), "partial": True})

    jobs = []
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        for m, r, mode in groups:
            sizings = [s for s in ("bytes", "util") if wanted(f"{m}-{r}-{mode}-{s}")]
            if sizings:
                jobs.append(pool.submit(token_group, m, models[m], r, mode, sizings, lock,
                                        deadline, engine_env(args), done))
        for job in jobs:
            out.update(job.result())
    if time.monotonic() < deadline - 60 and (not args.configs or "batch-invariant" in args.configs):
        # Batch-invariant kernels: the same batch gives the same tokens in any engine.
        engines = {}
        try:
            for n in ("vanilla", "kvcached", "control"):
                engines[n] = Engine(f"bi-{n}", models["tiny"], enabled=n == "kvcached",
                                    kv_bytes=TINY_KV, eager=True, v2=True, start=False,
                                    max_num_seqs=64,
                                    extra_env={"VLLM_BATCH_INVARIANT": "1",
                                               "VLLM_CACHE_ROOT": tempfile.mkdtemp(),
                                               **engine_env(args)})
            for e in engines.values():
                e.wait_ready()
            res = {n: token_workload(e) for n, e in engines.items()}
            out["tiny-v2-eager-bytes-batch-invariant"] = compare_runs(res)
            log("batch invariant", json.dumps(out["tiny-v2-eager-bytes-batch-invariant"]))
        except Exception as exc:
            out["tiny-v2-eager-bytes-batch-invariant"] = {"error": str(exc)[-3000:]}
            log("batch invariant FAILED", str(exc)[-3000:])
        finally:
            for e in engines.values():
                e.finish()
    out["summary"] = token_summary(out)
    return out


def token_summary(out: dict) -> dict:
    """Per configuration: kvcached's differing sequences against the control's, and whether
    its ``num_cached_tokens`` equal vanilla's in every call."""
    rows = {}
    for label, row in out.items():
        if not isinstance(row, dict) or "greedy" not in row:
            if isinstance(row, dict) and ("error" in row or "skipped" in row):
                rows[label] = "error" if "error" in row else "skipped"
            continue
        calls = [k for k in TOKEN_CALLS if k in row]
        kv = sum(row[c]["kvcached"]["differing"] for c in calls)
        ctl = sum(row[c]["control"]["differing"] for c in calls)
        cached_ok = all(row[c]["kvcached"]["cached_tokens_differing"] == 0 for c in calls)
        rows[label] = {"kvcached_differing": kv, "control_differing": ctl,
                       "sequences": sum(row[c]["kvcached"]["sequences"] for c in calls),
                       "ok": kv <= ctl and cached_ok, "cached_tokens_equal": cached_ok}
    return rows


def _throughput(models: dict, args: argparse.Namespace, deadline: float) -> dict:
    engines: dict[str, Engine] = {}
    sampler = None
    try:
        cache = tempfile.mkdtemp()
        # A primer fills torch.compile's cache; the measured engines then all start
        # together from it, so they run the same compiled code and their start times compare.
        kv_bytes = int(args.kv_gib * GIB)
        primer = Engine("primer", models["1b"], enabled=False, kv_bytes=kv_bytes,
                        max_num_seqs=args.max_num_seqs, extra_env={"VLLM_CACHE_ROOT": cache})
        primer_s = primer.init_s
        primer.finish()
        variants = dict(parse_variant(v) for v in args.variant)
        for n in ("vanilla", "kvcached", *variants, "control"):
            enabled = n != "vanilla" and n != "control"
            env = {"VLLM_CACHE_ROOT": cache, **(GROW_ENV if enabled else {}),
                   **variants.get(n, {}), **stacks_env(args, n), **engine_env(args)}
            engines[n] = Engine(n, models["1b"], enabled=enabled, kv_bytes=kv_bytes,
                                max_num_seqs=args.max_num_seqs, start=False, extra_env=env)
        for n, e in list(engines.items()):
            try:
                e.wait_ready()
            except RuntimeError as exc:
                if n not in variants:
                    raise
                log(f"variant {n} did not start: {str(exc)[-2000:]}")  # reported, not fatal
                variants[n]["error"] = str(exc)[-2000:]
                engines.pop(n).finish()
        sampler = MemorySampler(engines)
        rounds = {n: [] for n in engines}
        tokens = {}
        warm = token_prompts(args.prompts, 256, 1024, seed=500)
        for n, e in engines.items():
            e.generate(warm, args.max_tokens, return_tokens=False)
        order = list(engines)
        before = {n: e.call("metrics") for n, e in engines.items()}
        reserve = 40 if args.configs == ["throughput"] else 150  # the share phase's time
        for r in range(args.reps):
            if time.monotonic() > deadline - reserve:
                log("throughput: stopping after", r, "reps (time budget)")
                break
            batch = token_prompts(args.prompts, 256, 1024, seed=r)
            for k in range(len(order)):
                n = order[(r + k) % len(order)]
                time.sleep(args.pause)
                sampler.mark(f"{n} round {r} start")
                res = engines[n].generate(batch, args.max_tokens)
                sampler.mark(f"{n} round {r} end")
                rounds[n].append({"seconds": res["seconds"], "generated": res["generated"],
                                  "start": sampler.marks[-2][0], "end": sampler.marks[-1][0]})
                tokens.setdefault(n, []).extend(res["tokens"])
            log(f"throughput rep {r}:", {n: round(rounds[n][-1]["generated"] /
                                               rounds[n][-1]["seconds"]) for n in order})
        after_rounds = {n: e.call("metrics") for n, e in engines.items()}
        preemptions = {n: m.get("preemptions") for n, m in after_rounds.items()}
        # Engine steps and tokens per step over the measured rounds: fewer tokens a step
        # (the scheduler admitting less) and slower steps read apart here.
        steps = {n: {k: m.get(k, 0) - before[n].get(k, 0)
                     for k in ("steps", "step_tokens", "prefix_hits", "prefix_queries")}
                 for n, m in after_rounds.items()}
        page_calls = {n: page_call_totals(e.ns) for n, e in engines.items() if e.enabled}
        time.sleep(3.0)  # after the last round: the kvcached engine's memory falls back
        sampler.mark("idle")
        time.sleep(0.2)
        sampler.stop()

        def tps(n):
            return sum(x["generated"] for x in rounds[n]) / sum(x["seconds"] for x in rounds[n])

        def per_rep(n):
            return [round((x["generated"] / x["seconds"]) / (v["generated"] / v["seconds"]), 4)
                    for x, v in zip(rounds[n], rounds["vanilla"])]

        def ratios(n):
            reps = per_rep(n)
            out = {"throughput_ratio": round(tps(n) / tps("vanilla"), 4),
                   "per_rep_median": round(statistics.median(reps), 4) if reps else None,
                   "per_rep_median_ci90": median_ci(reps),
                   "per_rep_ratio": reps}
            if n != "control":
                # Against both vanilla engines of the round (vanilla and the control): half
                # the denominator's own noise, where the host drifts from round to round.
                pair = [(x["generated"] / x["seconds"]) / (0.5 * sum(
                    y["generated"] / y["seconds"] for y in ys))
                    for x, *ys in zip(rounds[n], rounds["vanilla"], rounds["control"])]
                out["per_rep_median_vs_both_vanilla"] = (
                    round(statistics.median(pair), 4) if pair else None)
                out["per_rep_median_vs_both_vanilla_ci90"] = median_ci(pair)
            # Against the vanilla engines' throughput at the same moment: interpolated
            # between the vanilla rounds just before and just after this one (the control
            # against vanilla's alone), which takes out the host's drift over tens of seconds.
            near = bracketed_ratios(rounds[n], [x for m in ("vanilla", "control")
                                                if m != n for x in rounds[m]])
            out.update(per_rep_bracketed=near,
                       per_rep_bracketed_median=(round(statistics.median(near), 4)
                                                 if near else None),
                       per_rep_bracketed_ci90=median_ci(near))
            return out

        mem = {}
        for n in engines:
            during = [max(sampler.window(n, x["start"], x["end"]) or [0]) for x in rounds[n]]
            before = [min(sampler.window(n, x["start"] - args.pause + 0.1, x["start"]) or [0])
                      for x in rounds[n]]
            mem[n] = {"peak_during_rounds_gib": [round(v / GIB, 2) for v in during],
                      "low_before_rounds_gib": [round(v / GIB, 2) for v in before]}
        series = sampler.series("kvcached")
        last_end = rounds["kvcached"][-1]["end"]
        after = [(round(t - last_end, 2), v) for t, v in series if t >= last_end]
        base = min(v for _, v in after) if after else 0
        settle = next((t for t, v in after if v <= base + 256 * (1 << 20)), None)
        return {
            "kv_gib": args.kv_gib,
            "prompts": args.prompts, "prompt_len": [256, 1024], "max_tokens": args.max_tokens,
            "reps": len(rounds["kvcached"]), "pause_s": args.pause,
            "tokens_per_s": {n: round(tps(n), 1) for n in engines},
            "kvcached_env": GROW_ENV, "engine_env": engine_env(args),
            "rounds": {n: [{k: round(x[k], 3) for k in ("start", "end", "seconds")}
                           | {"generated": x["generated"]} for x in rs]
                       for n, rs in rounds.items()},
            **ratios("kvcached"),
            "control": ratios("control"),
            **({"variants": {n: ({"env": {**GROW_ENV, **env}, **ratios(n)} if n in engines
                                 else env)
                             for n, env in variants.items()}} if variants else {}),
            "init_s": {"primer (compiles)": round(primer_s, 1),
                       **{n: round(e.init_s, 1) for n, e in engines.items()}},
            "init_ratio_kvcached_vs_control": round(engines["kvcached"].init_s /
                                                    engines["control"].init_s, 4),
            "preemptions": preemptions,
            "engine_steps": {n: dict(v, seconds_per_step=round(
                sum(x["seconds"] for x in rounds[n]) / v["steps"], 5) if v["steps"] else None)
                for n, v in steps.items()},
            "page_calls": page_calls,
            # Every setting's greedy tokens against vanilla's, the control's among them.
            "tokens_vs_vanilla": {n: differing(tokens["vanilla"], tokens[n])
                                  for n in engines if n != "vanilla"},
            "memory": mem,
            "kvcached_after_last_round": {"settled_s": settle,
                                          "trace_gib": [(t, round(v / GIB, 2))
                                                        for t, v in after[::5]]},
            "kvcached_log": engines["kvcached"].kvcached_log(),
            "setup_lines": {n: e.setup_lines() for n, e in engines.items()},
        }
    finally:
        if sampler is not None:
            sampler.stop()
        for e in engines.values():
            e.finish()


def bracketed_ratios(runs: list[dict], refs: list[dict]) -> list[float]:
    """Each run's throughput over the reference runs' at its midpoint, interpolated between
    the last reference run before it and the first after it (runs: ``start``, ``end`` in one
    clock, ``generated``, ``seconds``); runs without a reference on both sides are left out."""
    def mid(x: dict) -> float:
        return 0.5 * (x["start"] + x["end"])

    def rate(x: dict) -> float:
        return x["generated"] / x["seconds"]

    ref = sorted((mid(x), rate(x)) for x in refs)
    out = []
    for x in runs:
        t = mid(x)
        before = [p for p in ref if p[0] < t]
        after = [p for p in ref if p[0] > t]
        if before and after:
            (t0, v0), (t1, v1) = before[-1], after[0]
            out.append(round(rate(x) / (v0 + (v1 - v0) * (t - t0) / (t1 - t0)), 4))
    return out


def median_ci(values: list[float], level: float = 0.9, draws: int = 4000) -> list | None:
    """A bootstrap interval of the median of per-round ratios (rounds resampled with
    replacement, a fixed seed): whether a run's rounds can tell a goal apart from the
    host's spread. None for fewer than four rounds."""
    import random

    if len(values) < 4:
        return None
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    tail = (1 - level) / 2
    return [round(meds[int(tail * draws)], 4), round(meds[int((1 - tail) * draws) - 1], 4)]


def page_call_totals(namespace: str) -> dict:
    """The map / unmap calls an engine's pools timed into their records (``kvctl status``):
    calls, 2 MiB handles and seconds, as the scheduler waited for them (the worker's driver
    calls plus the request to it), for comparison with ``bench_mapper.py``'s raw calls."""
    from kvcached_core.cli.view import snapshot

    totals: dict[str, dict] = {}
    for dev in snapshot(namespace)["devices"]:
        for eng in dev["engines"]:
            for pool in eng["pools"]:
                for kind in ("map", "unmap"):
                    lat, nbytes = pool[f"{kind}_latency"], pool[f"{kind}_bytes"]
                    row = totals.setdefault(kind, {"calls": 0, "handles_2mib": 0, "seconds": 0.0})
                    row["calls"] += lat["count"]
                    row["handles_2mib"] += nbytes // (2 << 20)
                    row["seconds"] += lat["sum_s"]
    for row in totals.values():
        row["seconds"] = round(row["seconds"], 4)
        row["us_per_handle"] = (round(1e6 * row["seconds"] / row["handles_2mib"], 2)
                                if row["handles_2mib"] else None)
    return totals


def _share(models: dict, args: argparse.Namespace, deadline: float) -> dict:
    engines: dict[str, Engine] = {}
    holder = Holder()
    sampler = None
    try:
        env = {"KVCACHED_MAX_CACHED_TOKENS": "131072"}  # A keeps a large prefix cache
        for n in ("A", "B"):
            engines[n] = Engine(n, models["1b"], enabled=True, kv_bytes=SHARE_KV, start=False,
                                max_num_seqs=args.max_num_seqs,
                                extra_env=dict(env, VLLM_CACHE_ROOT=tempfile.mkdtemp()))
        for e in engines.values():
            e.wait_ready()
        sampler = MemorySampler({**engines, "holder": holder})
        time.sleep(0.5)
        free = sampler.read()["free"]
        total = free + sampler.read()["used"]
        keep = 40 * GIB  # what the holder leaves: engines' KV share this (less 5 % headroom)
        holder.hold((free - keep) / GIB)
        sampler.mark(f"holder took {holder.gib:.1f} GiB")
        log(f"share: device {total / GIB:.1f} GiB, free after start {free / GIB:.1f}, "
            f"holder {holder.gib:.1f} GiB")
        steps = []

        def step(name, engine, prompts, max_tokens):
            sampler.mark(f"{name} start")
            t = time.monotonic()
            res = engines[engine].generate(prompts, max_tokens, return_tokens=False)
            sampler.mark(f"{name} end")
            rec = {"step": name, "engine": engine, "seconds": round(time.monotonic() - t, 2),
                   "generated": res["generated"], "start": sampler.marks[-2][0],
                   "end": sampler.marks[-1][0],
                   "preemptions_total": engines[engine].call("metrics").get("preemptions")}
            rec["peak_gib"] = {n: round(max(sampler.window(n, rec["start"], rec["end"]) or [0])
                                        / GIB, 2) for n in engines}
            steps.append(rec)
            log("share:", json.dumps(rec))

        # A: 256 prompts of 3000 tokens (about 24 GiB of KV); it keeps the last 128k tokens
        # cached (KVCACHED_MAX_CACHED_TOKENS above) when the burst is over.
        a_prompts = token_prompts(256, 3000, 3000, seed=700)
        step("A burst", "A", a_prompts, 32)
        time.sleep(2.5)  # A idles: its reserve goes, its prefix cache stays
        a_idle = sampler.read()["engines"].get("A", 0)
        b_prompts = token_prompts(args.share_prompts, 1500, 3000, seed=900)
        step("B burst", "B", b_prompts, 128)
        time.sleep(2.5)
        step("A again (its cached prefixes)", "A", a_prompts[-32:], 32)
        time.sleep(2.5)
        # The holder takes all but 10 GiB over the headroom: B's burst must wait for memory.
        now = sampler.read()
        squeeze = holder.gib + (now["free"] - 0.05 * total - 10 * GIB) / GIB
        holder.hold(squeeze)
        sampler.mark(f"holder took {holder.gib:.1f} GiB")
        step("B burst, device nearly full", "B", b_prompts, 128)
        holder.hold(0)
        sampler.mark("holder let go")
        step("B burst, holder gone", "B", b_prompts[: len(b_prompts) // 2], 128)
        time.sleep(1.5)
        sampler.stop()
        return {"device_gib": round(total / GIB, 1), "kv_budget_per_engine_gib": SHARE_KV // GIB,
                "holder_left_free_gib": keep // GIB, "a_idle_gib": round(a_idle / GIB, 2),
                "steps": steps, "marks": sampler.marks,
                "timeline_gib": [(s["t"], round(s.get("free", 0) / GIB, 1),
                                  {n: round(v / GIB, 2) for n, v in s.get("engines", {}).items()})
                                 for s in sampler.samples[::10]],
                "kvcached_log": {n: e.kvcached_log() for n, e in engines.items()}}
    finally:
        if sampler is not None:
            sampler.stop()
        for e in engines.values():
            e.finish()
        holder.close()


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:VAR=VALUE,VAR=VALUE`` -> (name, environment)."""
    name, _, assigns = text.partition(":")
    env = dict(a.split("=", 1) for a in assigns.split(",") if a)
    if not name or name in ("vanilla", "kvcached", "control") or not all(env):
        raise SystemExit(f"--variant {text!r}: want NAME:VAR=VALUE,... with a new name")
    return name, env


def stacks_env(args: argparse.Namespace, name: str) -> dict[str, str]:
    """The environment that makes an engine's processes sample their stacks (``--stacks``)."""
    if not args.stacks:
        return {}
    here = str(Path(__file__).resolve().parent / "stack_sampler")
    return {"KVBENCH_STACKS": os.path.join(os.path.abspath(args.stacks), name),
            "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}


def perf_phase(models: dict, args: argparse.Namespace, deadline: float) -> dict:
    out: dict = {}
    for name, fn in (("throughput", _throughput), ("share", _share)):
        if args.configs and name not in args.configs:
            continue
        if time.monotonic() > deadline - 120:
            out[name] = {"skipped": "time budget"}
            continue
        try:
            out[name] = fn(models, args, deadline)
        except Exception as exc:
            out[name] = {"error": str(exc)[-4000:]}
            log(name, "FAILED", str(exc)[-4000:])
    return out


# ------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=["tokens", "perf", "_child"])
    ap.add_argument("--out", default="benchmarks/results/vllm-gpu.json")
    ap.add_argument("--models", default="/tmp/kvcached-models")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds this run may take")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--pause", type=float, default=1.5)
    ap.add_argument("--kv-gib", type=float, default=PERF_KV / GIB,
                    help="perf throughput: every engine's KV budget (GiB)")
    ap.add_argument("--share-prompts", type=int, default=384)
    ap.add_argument("--configs", nargs="*", default=[],
                    help="tokens: only configurations whose label starts with one of these "
                         "or has it as a part (MODEL-RUNNER-MODE-SIZING: tiny-v1-graphs-util, "
                         "h128, graphs, util; batch-invariant); perf: throughput and/or share")
    ap.add_argument("--inproc", action="store_true",
                    help="tokens and perf throughput: engine cores in their LLM's process "
                         "(deterministic batches; by default vLLM's separate engine-core "
                         "process, where batches depend on when requests arrive)")
    ap.add_argument("--parallel", type=int, default=3,
                    help="tokens: model x runner x mode groups run at once")
    ap.add_argument("--variant", action="append", default=[],
                    help="perf throughput: one more kvcached engine, NAME:VAR=VALUE,VAR=VALUE "
                         "(e.g. held:KVCACHED_IDLE_TRIM_S=0)")
    ap.add_argument("--stacks", help="sample every engine's Python stacks into this folder "
                                     "(benchmarks/stack_sampler)")
    ap.add_argument("--address")
    ap.add_argument("--key")
    ap.add_argument("--engine-kw")
    args = ap.parse_args(argv)
    if args.phase == "_child":
        engine_child(args)
        return 0
    deadline = time.monotonic() + args.budget
    t = time.monotonic()
    models = build_models(Path(args.models), args.phase)
    log(f"models ready in {time.monotonic() - t:.1f} s")
    import vllm

    from _timing import run_info, save_json

    result = run_info(f"vllm-gpu-{args.phase}", vllm=vllm.__version__,
                      gpu=subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                                          "--format=csv,noheader"], capture_output=True,
                                         text=True).stdout.strip())
    import torch

    result["torch"] = torch.__version__
    result.update(tokens_phase(models, args, deadline,
                               save=lambda part: save_json(args.out, {**result, **part}, indent=1))
                  if args.phase == "tokens" else perf_phase(models, args, deadline))
    path = save_json(args.out, result, indent=1)
    log("wrote", path)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
