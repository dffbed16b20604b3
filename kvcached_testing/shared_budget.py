"""Two engines on the CPU sharing one device budget: giveback and live limits.

Engine B is a ``vllm.LLM`` with kvcached; engine A is another one, or (``a_sglang``)
an ``sglang.Engine`` with kvcached (a release from ``.sglang/``, run by ``.venv``'s
Python as the SGLang tests run it). Each runs in a process of its own (this module,
``python -m kvcached_testing.shared_budget --child MODEL`` or ``--sglang-child MODEL``)
and serves the tiny random-weight Llama of ``kvcached_testing/tiny_model.py``; both
join one budget (``KVCACHED_DEVICE_BUDGET``) in a private shared-memory directory,
with no cap on cached prefixes (``KVCACHED_MAX_CACHED_TOKENS=-1``). Both engines'
page ids are 4 MiB (vLLM: 2 MiB pages x 2 layers; SGLang: 1 MiB pages x 2 layers x K/V):

1. A serves ``a_prompts`` distinct long prompts: their blocks stay in A's
   prefix cache, mapped, and A idles.
2. B serves a burst that does not fit next to A's cache. B's first step that
   needs fresh pages misses for lack of budget and asks; A's background thread
   gives back its reserve, then whole pages of its prefix cache (vLLM at once
   under its scheduler's lock; SGLang's scheduler at its next idle moment,
   as its radix cache is not to be touched from another thread). Recorded:
   B's misses, the bytes A gave back, the bytes of pages A has in use before
   and after (its pool segments: they fall only if cached blocks were evicted,
   not when only the reserve goes), the time from B's miss to A's pages
   being unmapped (A's slots in the budget record: ``giveback_ms``), B's
   preemptions (vLLM's own counter) and whether the record ever held more
   than the budget (sampled every ms by this process).
3. B idles with its cache; ``kvctl limit``'s call lowers B's limit to one page
   bundle: the time until B's pool segment shows it within the limit
   (``applied_ms``); then the limit is lifted and B serves prompts that need
   several bundles.

:func:`run_share` runs it: ``tests/vllm/test_shared_budget.py`` checks its
results, ``benchmarks/bench_vllm_share.py`` records them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvcached_testing.sglang_release import ROOT, SGLANG_DIR, release_env, write_dist_record
from kvcached_testing.vllm_cpu import NUM_LAYERS, PAGE, TINY_ENGINE_KW, long_prompts

__all__ = ["BUNDLE", "run_share"]

BUNDLE = PAGE * NUM_LAYERS  # one page id of the tiny model: 4 MiB, 4096 tokens
ENGINE_KW = dict(TINY_ENGINE_KW, max_num_seqs=16, disable_log_stats=False)


# ------------------------------------------------------------ engine child


def _answers() -> Any:
    """The descriptor answers go to. Everything else written to fd 1 (the engine's
    prints, its processes that inherit it) goes to the log from now on."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


def _serve(out: Any, ready: dict, generate: Callable[[dict], dict]) -> None:
    """Say ``ready``, then answer JSON commands from stdin, one JSON line each, until quit."""
    out.write(json.dumps({"ready": True, **ready}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        answer = generate(cmd) if cmd["op"] == "generate" else {
            "error": f"unknown op {cmd['op']}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def child(model: str) -> None:
    """One vLLM engine; JSON commands on stdin, one JSON answer per line on stdout."""
    out = _answers()
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, **ENGINE_KW)

    def preemptions() -> int:
        return int(sum(getattr(m, "value", 0) for m in llm.get_metrics()
                       if m.name == "vllm:num_preemptions"))

    def generate(cmd: dict) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
        before = preemptions()
        t = time.perf_counter()
        res = llm.generate(long_prompts(cmd["n"], cmd["length"], cmd["seed"]), params,
                           use_tqdm=False)
        return {"seconds": time.perf_counter() - t,
                "lengths": [len(r.outputs[0].token_ids) for r in res],
                "tokens": [list(r.outputs[0].token_ids) for r in res],
                "preemptions": preemptions() - before}

    import kvcached_core
    import kvcached_vllm

    _serve(out, {"kvcached_core": kvcached_core.__file__,
                 "kvcached_vllm": kvcached_vllm.__file__}, generate)
    shutdown = getattr(llm, "shutdown", None)
    if shutdown is not None:
        shutdown()


def sglang_child(model: str) -> None:
    """One SGLang engine, the same command channel as :func:`child` (greedy, token ids)."""
    out = _answers()
    import sglang as sgl

    engine = sgl.Engine(
        model_path=model, device="cpu", dtype="bfloat16", skip_tokenizer_init=True,
        attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
        page_size=1, max_total_tokens=65536, grammar_backend="none", random_seed=0,
        log_level="warning")

    def generate(cmd: dict) -> dict:
        ids = [p["prompt_token_ids"] for p in long_prompts(cmd["n"], cmd["length"], cmd["seed"])]
        t = time.perf_counter()
        res = engine.generate(input_ids=ids, sampling_params={
            "temperature": 0.0, "max_new_tokens": cmd["max_tokens"], "ignore_eos": True})
        return {"seconds": time.perf_counter() - t,
                "lengths": [len(r["output_ids"]) for r in res],
                "tokens": [list(r["output_ids"]) for r in res],
                "preemptions": None}  # SGLang keeps no such counter for an engine

    import kvcached_core
    import kvcached_sglang

    _serve(out, {"kvcached_core": kvcached_core.__file__,
                 "kvcached_sglang": kvcached_sglang.__file__, "sglang": sgl.__version__},
           generate)
    engine.shutdown()


def sglang_env(version: str, workdir: Path, **kv: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of an SGLang engine child (as tests/sglang runs one)."""
    if not (SGLANG_DIR / version).is_dir():
        raise SystemExit(f"--sglang {version}: no .sglang/{version} (scripts/setup_sglang.sh "
                         "installs the tested releases)")
    dist = write_dist_record(workdir / "sglang-dist")
    python = ROOT / ".venv" / "bin" / "python"
    return [str(python), "-m", __name__, "--sglang-child"], release_env(version, dist, **kv)


class Engine:
    """A child engine process and its command channel.

    The child leads a process group of its own: :meth:`close` ends the whole group,
    so the processes an engine starts (vLLM's engine core, SGLang's scheduler)
    cannot outlive it.
    """

    def __init__(self, model: Path, env: dict[str, str], log: Path,
                 command: list[str] | None = None) -> None:
        if command is None:  # a vLLM engine child: this module and kvcached_vllm, from this checkout
            command = [sys.executable, "-m", __name__, "--child"]
            paths = [str(ROOT), str(ROOT / "kvcached_vllm" / "src"), env.get("PYTHONPATH")]
            env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, paths)))
        self.log_path = log
        self.failed = False  # it gave no answer: close kills it without asking it to quit
        self.log = open(log, "wb")
        try:
            self.proc = subprocess.Popen(
                command + [str(model)], env=env, start_new_session=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        except BaseException:
            self.log.close()
            raise

    def wait_ready(self, timeout: float = 600) -> dict:
        return self._answer(timeout)

    def _answer(self, timeout: float) -> dict:
        result: dict = {}

        def read() -> None:
            result["line"] = self.proc.stdout.readline()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout
        while reader.is_alive() and self.proc.poll() is None and time.monotonic() < deadline:
            reader.join(0.1)
        if self.proc.poll() is not None:
            reader.join(1.0)  # an answer written just before it exited is still in the pipe
        line = result.get("line")
        if line:
            return json.loads(line)
        self.failed = True
        code = self.proc.poll()
        why = f"timed out after {timeout:g} s" if code is None else f"exited with code {code}"
        try:
            tail = self.log_path.read_bytes()[-3000:].decode(errors="replace")
        except OSError as exc:
            tail = f"(unreadable: {exc})"
        raise RuntimeError(f"engine child {why} without an answer; log {self.log_path}:\n{tail}")

    def ask(self, timeout: float = 600, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def close(self) -> None:
        try:
            if self.proc.poll() is None and not self.failed:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            try:  # whatever of the group is left: a hung child, or what it started
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(30)
            finally:
                for f in (self.proc.stdin, self.proc.stdout):
                    try:
                        f.close()
                    except OSError:
                        pass
                self.log.close()


def _totals(reading, ns: str) -> dict | None:
    """A namespace's live slots in a budget reading, summed (the longest giveback
    times of them), or None if it has none."""
    slots = [s for s in reading.slots if s.alive and s.name.split("/")[0] == ns]
    if not slots:
        return None
    return {"mapped": sum(s.mapped for s in slots), "misses": sum(s.misses for s in slots),
            "given_bytes": sum(s.given_bytes for s in slots),
            "givebacks": sum(s.givebacks for s in slots),
            "last_giveback_ns": max(s.last_giveback_ns for s in slots),
            "max_giveback_ns": max(s.max_giveback_ns for s in slots)}


def _pool_used(shm, ns: str, directory: Path) -> int:
    """Bytes of pages in use in a namespace's live pools (their segments)."""
    return sum(p.used for p in shm.list_pools(ns, directory) if p.alive)


def run_share(model: Path, workdir: Path, *, budget_bundles: int = 10, a_prompts: int = 14,
              b_prompts: int = 12, length: int = 1800, b_tokens: int = 32,
              a_sglang: str | None = None) -> dict:
    """The scenario of the module docs; returns the measurements (see the results file).

    ``a_sglang``: engine A is this SGLang release instead of a vLLM engine.
    """
    from kvcached_core.ipc import budget as bud
    from kvcached_core.ipc import shm

    shm_dir = workdir / "shm"
    shm_dir.mkdir(mode=0o700, exist_ok=True)
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"share-a-{tag}", f"share-b-{tag}"
    budget = budget_bundles * BUNDLE
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    base.update(KVCACHED_ENABLED="1", KVCACHED_STRICT="1", KVCACHED_SHM_DIR=str(shm_dir),
                KVCACHED_DEVICE_BUDGET=str(budget), KVCACHED_MAX_CACHED_TOKENS="-1",
                VLLM_TARGET_DEVICE="cpu")
    with ExitStack() as stack:  # closes what was opened, each even if another's close fails
        if a_sglang is None:
            a = Engine(model, dict(base, KVCACHED_IPC_NAME=ns_a), workdir / "engine-a.log")
        else:
            kv = {k: v for k, v in base.items() if k.startswith("KVCACHED_")}
            command, env = sglang_env(a_sglang, workdir, **kv, KVCACHED_IPC_NAME=ns_a,
                                      KVCACHED_PAGE_SIZE_MB="1")
            a = Engine(model, env, workdir / "engine-a.log", command)
        stack.callback(a.close)
        b = Engine(model, dict(base, KVCACHED_IPC_NAME=ns_b), workdir / "engine-b.log")
        stack.callback(b.close)
        imported = [e.wait_ready() for e in (a, b)]
        rec = stack.enter_context(bud.BudgetRecord.open("host", shm_dir, create=False))

        a_out = a.ask(op="generate", n=a_prompts, length=length, seed=1, max_tokens=4)
        time.sleep(2.0)  # A idles: its reserve is trimmed, its prefix cache stays
        before = rec.read()
        sa, sb = _totals(before, ns_a), _totals(before, ns_b)
        a_used = _pool_used(shm, ns_a, shm_dir)

        peak = {"mapped": rec.read().mapped, "samples": 1, "error": None}
        stop = threading.Event()

        def sample() -> None:
            try:
                while not stop.is_set():
                    peak["mapped"] = max(peak["mapped"], rec.read().mapped)
                    peak["samples"] += 1
                    time.sleep(0.001)
            except BaseException as exc:  # noqa: BLE001 - raised by the run below
                peak["error"] = exc

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            b_out = b.ask(op="generate", n=b_prompts, length=length, seed=2, max_tokens=b_tokens)
        finally:
            stop.set()
            sampler.join()
        if peak["error"] is not None:
            raise RuntimeError("sampling the budget record failed") from peak["error"]
        after = rec.read()
        sa2, sb2 = _totals(after, ns_a), _totals(after, ns_b)
        a_used2 = _pool_used(shm, ns_a, shm_dir)

        # Live limit on idle B: one bundle, then lifted.
        time.sleep(2.0)
        view = stack.enter_context(shm.open_pool(ns_b, "kv0", shm_dir))
        st0 = view.read()
        t0 = time.monotonic()
        view.set_limit(BUNDLE)
        applied = None
        while time.monotonic() - t0 < 1.5:  # until the pool is within the limit
            st = view.read()
            if st.used + st.reserved <= BUNDLE:
                applied = time.monotonic() - t0
                break
            time.sleep(0.0005)
        time.sleep(0.2)  # it stays there
        st_limited = view.read()
        view.set_limit(shm.NO_LIMIT)
        time.sleep(0.2)
        # Needs several bundles (6 x 1808 tokens, 4096 a bundle), which the limit forbade.
        b_again = b.ask(op="generate", n=6, length=length, seed=3, max_tokens=8)
        st_after = view.read()
    return {
        "engine_a": "vllm" if a_sglang is None else f"sglang {imported[0]['sglang']}",
        "engine_b": "vllm",
        "budget_bytes": budget,
        "imported_from": sorted({os.path.dirname(os.path.dirname(r["kvcached_core"]))
                                 for r in imported}),
        "kvcached_vllm_files": [r["kvcached_vllm"] for r in imported if "kvcached_vllm" in r],
        "a": {"prompts": a_prompts, "prompt_len": length,
              "mapped_before_b_bytes": sa and sa["mapped"],
              "mapped_after_b_bytes": sa2 and sa2["mapped"],
              "used_before_b_bytes": a_used, "used_after_b_bytes": a_used2,
              "given_back_bytes": sa2 and sa2["given_bytes"],
              "givebacks": sa2 and sa2["givebacks"],
              "giveback_ms_last": sa2 and sa2["last_giveback_ns"] / 1e6,
              "giveback_ms_max": sa2 and sa2["max_giveback_ns"] / 1e6},
        "b": {"prompts": b_prompts, "prompt_len": length, "max_tokens": b_tokens,
              "mapped_before_bytes": sb and sb["mapped"],
              "mapped_after_bytes": sb2 and sb2["mapped"],
              "misses": sb2 and sb2["misses"],
              "seconds": b_out["seconds"], "preemptions": b_out["preemptions"],
              "all_completed": all(n == b_tokens for n in b_out["lengths"]),
              "tokens": b_out["tokens"]},
        "a_served": {"seconds": a_out["seconds"], "preemptions": a_out["preemptions"]},
        "peak_mapped_bytes": peak["mapped"],
        "budget_samples": peak["samples"],
        "budget_respected": peak["mapped"] <= budget,
        "limit": {"limit_bytes": BUNDLE, "used_before_bytes": st0.used,
                  "reserved_before_bytes": st0.reserved,
                  "used_limited_bytes": st_limited.used,
                  "reserved_limited_bytes": st_limited.reserved,
                  "applied_ms": None if applied is None else applied * 1e3,
                  "served_after_lift": all(n == 8 for n in b_again["lengths"]),
                  "used_after_lift_bytes": st_after.used},
    }


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("--child", "--sglang-child"):
        raise SystemExit("usage: python -m kvcached_testing.shared_budget "
                         "--child|--sglang-child MODEL")
    (child if sys.argv[1] == "--child" else sglang_child)(sys.argv[2])
