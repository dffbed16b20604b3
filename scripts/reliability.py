"""Try every injectable fault and a set of bad inputs many times; write RELIABILITY.md.

    python scripts/reliability.py                 # 20 tries each, writes RELIABILITY.md
    python scripts/reliability.py --tries 200 --out /tmp/R.md

Each scenario runs on the host backend (no accelerator needed) with the real
allocator, the native page server and the scheduler's WorkerGroup, arming
faults with :func:`kvcached_core.faults.configure`. A try passes when the
outcome is the expected one *and* nothing is lost: the allocator's, the
mapper's and the worker's page counts agree afterwards and the next call works.
The engine-level checks (a vLLM engine that loses maps, hangs or loses its
worker) are tests/vllm/test_faults.py. Exit status 1 if any try failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import random
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcached_core import _native, faults  # noqa: E402
from kvcached_core.allocator import KVLayout, KVTensors, PageAllocator  # noqa: E402
from kvcached_core.config import RANGES, Settings, env_setting, parse_size  # noqa: E402
from kvcached_core.errors import KVCachedConfigError, WorkerError, WorkerOutOfMemoryError  # noqa: E402
from kvcached_core.ipc import WorkerGroup, WorkerListener  # noqa: E402
from kvcached_core.vmm import open_mapper  # noqa: E402

PAGE = 64 << 10
PAGES = 8
QUIET = Settings(page_size=PAGE, contiguous_layout=None, prealloc=False, min_reserved_pages=0,
                 max_reserved_pages=2, idle_trim_s=0.0, memory_limit=None, gpu_utilization=0.95)


@dataclass
class Result:
    name: str
    fault: str
    expected: str
    tries: int = 0
    passed: int = 0
    seen: dict[str, int] = field(default_factory=dict)
    worst_s: float = 0.0

    def record(self, outcome: str, ok: bool, seconds: float) -> None:
        self.tries += 1
        self.passed += ok
        self.seen[outcome] = self.seen.get(outcome, 0) + 1
        self.worst_s = max(self.worst_s, seconds)


class Check(Exception):
    """A try whose outcome or state was not the expected one."""


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise Check(what)


# ----------------------------------------------------------------- allocator scenarios

def _stack() -> tuple[KVTensors, PageAllocator]:
    kv = KVTensors.open("cpu", KVLayout(2, PAGES * PAGE, PAGE, 2, False))
    return kv, PageAllocator(kv, settings=QUIET, mem_info_ttl_s=0.0)


def _allocator_try(spec: str, want_miss: bool) -> str:
    kv, pa = _stack()
    try:
        held = pa.alloc_pages(random.randint(0, 3)) or []
        before = pa.stats()
        faults.configure(spec)
        got = pa.alloc_pages(2)
        faults.configure(None)
        outcome = "no space (None)" if got is None else "allocated"
        if got is None:
            expect(pa.stats() == before, "a failed allocation changed the allocator's state")
        expect((got is None) == want_miss, f"unexpected outcome {outcome}")
        again = pa.alloc_pages(2) if got is None else got
        expect(again is not None, "the allocation after the fault failed")
        held += again
        expect(kv.mapped_pages == pa.num_mapped == len(held), "mapped page counts disagree")
        expect(kv.mapper.stats().mapped_pages == len(held) * kv.handles_per_page,
               "the mapper's count disagrees")
        pa.free_pages(held)
        pa.trim()
        expect(kv.mapped_pages == 0, "pages left mapped after freeing everything")
        return outcome
    finally:
        faults.configure(None)
        pa.close()


# ----------------------------------------------------------------- IPC scenarios

class Served:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))
        os.chmod(self.dir, 0o700)
        self.mapper = open_mapper("cpu", PAGE)
        self.buf = self.mapper.reserve(PAGES * PAGE)
        self.server = _native.PageServer(self.mapper, 0)
        self.server.add_group(0, [(self.buf, [0])], PAGES)
        self.path = os.fspath(self.dir / "w.sock")
        self.listener = WorkerListener(self.path, lambda op, g, p: self.server.apply(op, g, p),
                                       rank=0, server=self.server, label="native").start()

    def mapped(self) -> list[int]:
        return [p for p in range(PAGES) if self.buf.is_mapped(p)]

    def close(self) -> None:
        self.listener.close()
        expect(not os.path.exists(self.path), "the listener left its socket file")
        shutil.rmtree(self.dir, ignore_errors=True)


def _ipc_try(served: Served, spec: str, timeout: float, want: type[BaseException] | None,
             text: str) -> str:
    page = random.randrange(1, PAGES)
    with WorkerGroup([served.path], timeout=timeout, connect_timeout=5) as group:
        group.ping()
        faults.configure(spec)
        outcome = "mapped"
        try:
            group.map(0, [page])
        except WorkerError as exc:
            outcome = type(exc).__name__
            expect(want is not None and isinstance(exc, want), f"unexpected {exc!r}")
            expect(text in str(exc), f"error does not say {text!r}: {exc}")
        faults.configure(None)
        if want is None:
            expect(outcome == "mapped", "the call failed")
        time.sleep(max(0.0, _stall_of(spec) - timeout) + 0.05)  # a stalled request completes
        group.reset()
        in_worker = group.query(0)[0]
        expect(in_worker == served.mapped(), "the worker's answer disagrees with its mapper")
        group.unmap(0, in_worker)
        expect(served.mapped() == [], "pages left mapped")
        group.map(0, [page])  # the next call works
        group.unmap(0, [page])
    return outcome


def _stall_of(spec: str) -> float:
    return max((r.seconds for r in faults.parse(spec) if r.action == "stall"), default=0.0)


def _dying_worker(path: str, ready) -> None:  # a spawned process
    from kvcached_core import _native, faults
    from kvcached_core.ipc import WorkerListener
    from kvcached_core.vmm import open_mapper

    mapper = open_mapper("cpu", PAGE)
    buf = mapper.reserve(PAGES * PAGE)
    server = _native.PageServer(mapper, 0)
    server.add_group(0, [(buf, [0])], PAGES)
    WorkerListener(path, lambda op, g, p: server.apply(op, g, p), rank=0, server=server,
                   label="native").start()
    faults.configure("ipc:1:kill")
    ready.set()
    time.sleep(120)


def _death_try() -> str:
    d = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))
    os.chmod(d, 0o700)
    path = os.fspath(d / "w.sock")
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_dying_worker, args=(path, ready), daemon=True)
    proc.start()
    try:
        expect(ready.wait(60), "the worker did not start")
        with WorkerGroup([path], timeout=5, connect_timeout=5) as group:
            try:
                group.map(0, [1])
                raise Check("the map succeeded on a dying worker")
            except WorkerError as exc:
                expect("has exited" in str(exc) or "closed the connection" in str(exc), str(exc))
        proc.join(10)
        expect(proc.exitcode == -9, f"worker exit code {proc.exitcode}")
        # Its socket file is left; the next worker on the path replaces it.
        ready2 = ctx.Event()
        proc2 = ctx.Process(target=_dying_worker, args=(path, ready2), daemon=True)
        proc2.start()
        expect(ready2.wait(60), "a new worker could not take over the dead one's path")
        proc2.kill()
        proc2.join(10)
        return "WorkerError (worker exited)"
    finally:
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(d, ignore_errors=True)


def _garbage_try(served: Served) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(served.path)
        s.sendall(random.randbytes(random.randint(1, 200)))
    with WorkerGroup([served.path], timeout=5, connect_timeout=5) as group:
        group.ping()
        expect(group.query(0) == [served.mapped()], "the server's state changed")
    return "refused, server keeps serving"


# ----------------------------------------------------------------- bad inputs

BAD_VALUES = ["nan", "inf", "-inf", "1e400", "9" * 400, "-5", "abc", ""]


def _bad_setting_try(name: str, value: str) -> str:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        if name == "KVCACHED_MEMORY_LIMIT":
            parse_size(value, name)
        else:
            lo, hi = RANGES[name]
            env_setting(name, int(lo) if isinstance(lo, int) else float(lo))
        expect(value == "", f"{name}={value!r} was accepted")
        return "accepted"
    except KVCachedConfigError as exc:
        expect(name in str(exc), f"the error does not name {name}: {exc}")
        return "KVCachedConfigError naming the variable"
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


BAD_FAULT_SPECS = ["map:0:fail", "map:2-1:fail", "disk:1:fail", "map:1:explode", "map:1:stall",
                   "map:1:stall=nan", "map:1:stall=1e9", "call:1:kill", "map:" + "9" * 30 + ":fail"]


def _bad_spec_try(spec: str) -> str:
    try:
        faults.parse(spec)
        return "accepted"
    except KVCachedConfigError as exc:
        expect("KVCACHED_FAULTS" in str(exc), str(exc))
        return "KVCachedConfigError naming the variable"


# ----------------------------------------------------------------- driver

def run(tries: int) -> list[Result]:
    results: list[Result] = []

    def scenario(name: str, fault: str, expected: str, fn: Callable[[], str], n: int = tries,
                 ok_outcomes: tuple[str, ...] = ()) -> None:
        r = Result(name, fault, expected)
        for _ in range(n):
            t0 = time.monotonic()
            try:
                outcome = fn()
                ok = not ok_outcomes or outcome in ok_outcomes
            except Check as exc:
                outcome, ok = f"FAILED: {exc}", False
            except Exception as exc:  # noqa: BLE001 - recorded, not hidden
                outcome, ok = f"FAILED: {type(exc).__name__}: {exc}", False
            r.record(outcome, ok, time.monotonic() - t0)
        results.append(r)
        print(f"{name}: {r.passed}/{r.tries}", file=sys.stderr)

    scenario("map fails while growing", "map:1:fail",
             "allocation is a miss (None), state unchanged, next one works",
             lambda: _allocator_try("map:1:fail", True))
    scenario("handle create fails mid-page", "create:2:fail",
             "the half-made page rolls back, a miss, next one works",
             lambda: _allocator_try("create:2:fail", True))
    scenario("map stalls", "map:1:stall=0.02", "allocation succeeds late",
             lambda: _allocator_try("map:1:stall=0.02", False))
    served = Served()
    try:
        scenario("worker stops answering", "ipc:1:stall=0.6 (timeout 0.2 s)",
                 "WorkerError within the timeout; after reset the worker's pages agree",
                 lambda: _ipc_try(served, "ipc:1:stall=0.6", 0.2, WorkerError,
                                  "KVCACHED_IPC_TIMEOUT_S"), n=max(3, tries // 4))
        scenario("worker drops the connection", "ipc:1:fail",
                 "WorkerError naming the closed connection; nothing mapped",
                 lambda: _ipc_try(served, "ipc:1:fail", 5, WorkerError, "closed the connection"))
        scenario("map fails in the worker", "map:1:fail (worker)",
                 "WorkerOutOfMemoryError; nothing mapped; connection stays usable",
                 lambda: _ipc_try(served, "map:1:fail", 5, WorkerOutOfMemoryError,
                                  "injected fault"))
        scenario("scheduler's call breaks", "call:1:fail",
                 "WorkerError; after reset the call works",
                 lambda: _ipc_try(served, "call:1:fail", 5, WorkerError, "injected fault"))
        scenario("garbage frames to a worker", "random bytes",
                 "connection refused, server keeps serving", lambda: _garbage_try(served))
    finally:
        served.close()
    scenario("worker dies mid-request", "ipc:1:kill",
             "WorkerError: worker exited; a new worker takes over its path", _death_try,
             n=max(2, tries // 10))
    for name in sorted(RANGES):
        values = iter(BAD_VALUES * tries)
        scenario(f"bad {name}", "nan, inf, 1e400, 400 digits, -5, abc, empty",
                 "KVCachedConfigError naming the variable, or the default for empty",
                 lambda name=name, values=values: _bad_setting_try(name, next(values)),
                 n=len(BAD_VALUES),
                 ok_outcomes=("KVCachedConfigError naming the variable",)
                 + (("accepted",) if name != "KVCACHED_MEMORY_LIMIT" else ()))
    specs = iter(BAD_FAULT_SPECS)
    scenario("bad KVCACHED_FAULTS", "; ".join(BAD_FAULT_SPECS),
             "KVCachedConfigError naming the variable", lambda: _bad_spec_try(next(specs)),
             n=len(BAD_FAULT_SPECS), ok_outcomes=("KVCachedConfigError naming the variable",))
    return results


def render(results: list[Result], tries: int, seconds: float) -> str:
    lines = [
        "# Reliability",
        "",
        "Generated by `python scripts/reliability.py` "
        f"(`--tries {tries}`, {seconds:.0f} s, Python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()}); do not edit by hand.",
        "",
        "Each fault is injected with `KVCACHED_FAULTS` rules (kvcached_core/faults.py) on the",
        "host backend with the real allocator, native page server and WorkerGroup. A try passes",
        "when the outcome is the expected one and nothing is lost: allocator, mapper and worker",
        "agree on the mapped pages afterwards, and the next call works. An empty bad setting",
        "means \"use the default\". Engine-level checks: tests/vllm/test_faults.py.",
        "",
        "| scenario | fault / input | expected | tries | passed | outcomes | slowest try |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        seen = "; ".join(f"{k} x{v}" for k, v in sorted(r.seen.items()))
        lines.append(f"| {r.name} | `{r.fault}` | {r.expected} | {r.tries} | {r.passed} | {seen} "
                     f"| {r.worst_s * 1000:.0f} ms |")
    total, ok = sum(r.tries for r in results), sum(r.passed for r in results)
    lines += ["", f"**{ok} of {total} tries passed"
              + (", nothing lost.**" if ok == total else f"; {total - ok} FAILED.**"), ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "RELIABILITY.md"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    random.seed(args.seed)
    t0 = time.monotonic()
    results = run(args.tries)
    Path(args.out).write_text(render(results, args.tries, time.monotonic() - t0))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(r.passed == r.tries for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
