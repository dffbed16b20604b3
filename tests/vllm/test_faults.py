"""Injected faults in a real vLLM engine on CPU (``KVCACHED_FAULTS``, see kvcached_core.faults).

- the worker cannot map while the burst grows the KV cache: requests wait or
  are preempted, and complete with the tokens of a run without faults;
- the worker stops answering, or dies: the engine stops with an error that
  names the worker within ``KVCACHED_IPC_TIMEOUT_S``, and nothing is left in
  the IPC and shared-memory directories
  (no listening socket, no pool record).

Faults are armed at run time in the worker (``collective_rpc``), so one engine
start serves the growth checks and then the hang; the death needs a second one.
The engines' stderr (engine core and worker) goes to a file the tests read.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvcached_core.ipc import paths  # noqa: E402

from conftest import engine, env as set_env, greedy, long_prompts, token_ids, unique_namespace  # noqa: E402

pytestmark = pytest.mark.engine

IPC_TIMEOUT_S = 5.0
BURST = dict(n=10, length=1200)
OUT = 24
FAILED_MAPS = 2  # maps the worker refuses while the burst grows
# Never reached: shows the variable arms every engine process at start-up.
ENV_RULE = "ipc:1000000000+:kill"


@contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Processes started in the block write their stderr to ``path``."""
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _arm(spec):
    def arm(worker):  # runs in the worker process
        import kvcached_core
        import kvcached_vllm
        from kvcached_core import faults

        faults.configure(spec)
        return kvcached_core.__file__, kvcached_vllm.__file__, [str(r) for r in faults.rules()]

    return arm


def _counts(worker):
    from kvcached_core import faults

    return faults.counts()


@contextmanager
def _faulty_engine(tiny_model, tag: str) -> Iterator[tuple]:
    ns = unique_namespace(tag)
    dirs = [Path(tempfile.mkdtemp(prefix=f"kvf{tag}-", dir="/tmp")) for _ in range(2)]
    log = dirs[0].parent / f"{dirs[0].name}.log"
    env = {"KVCACHED_FAULTS": ENV_RULE, "KVCACHED_IPC_TIMEOUT_S": str(IPC_TIMEOUT_S),
           "KVCACHED_IPC_DIR": str(dirs[0]), "KVCACHED_SHM_DIR": str(dirs[1]),
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc of test functions
    state = {}
    try:
        with _stderr_to(log):
            cm = engine(tiny_model, enabled=True, namespace=ns, extra_env=env)
            llm = cm.__enter__()
        try:
            with set_env(VLLM_ALLOW_INSECURE_SERIALIZATION="1"):  # this side sends functions
                yield llm, dirs, log, state
        finally:
            t0 = time.monotonic()
            try:
                cm.__exit__(None, None, None)
            except Exception as exc:  # a dead engine may complain while stopping
                state["shutdown_error"] = exc
            state["shutdown_s"] = time.monotonic() - t0
            state["left"] = _leftovers(dirs, ns)
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        log.unlink(missing_ok=True)


def _leftovers(dirs: list[Path], ns: str) -> list[str]:
    """What an engine left behind (after giving it a moment to exit): a socket some
    process still listens on, or a pool record of its namespace. The user's device
    budget record is shared by every engine and stays by design (ipc.budget). A worker
    that exits removes its socket (test_engine.py checks it); one these faults leave to
    be killed cannot, and the next worker replaces a file nobody listens on."""
    deadline = time.monotonic() + 15
    while True:
        left = [f"{p} (still listening)" for p in dirs[0].rglob("*.sock")
                if paths.accepts_connections(p)]
        left += [str(p) for d in (dirs[1], Path("/dev/shm")) for p in d.glob(f"kvcached.{ns}*")]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@pytest.fixture(scope="module")
def hanging(tiny_model):
    with _faulty_engine(tiny_model, "h") as got:
        yield got
    llm, dirs, log, state = got
    assert not state.get("left"), f"left behind: {state['left']}"


def test_env_arms_every_engine_process_and_runs_this_checkout(hanging):
    llm, *_ = hanging
    core, vllm_adapter, rules = llm.collective_rpc(_arm(ENV_RULE), timeout=60)[0]
    here = Path(__file__).resolve().parents[2]
    assert Path(core).resolve().is_relative_to(here) and Path(vllm_adapter).resolve().is_relative_to(here)
    assert rules == [ENV_RULE]


def test_out_of_memory_while_growing_waits_and_completes_identically(hanging):
    llm, *_ = hanging
    prompts = long_prompts(**BURST, seed=11)
    reference = token_ids(llm.generate(prompts, greedy(OUT)))
    assert llm.reset_prefix_cache()  # the same prompts must allocate again
    time.sleep(2.5)  # the idle reserve is unmapped: the burst must map again
    llm.collective_rpc(_arm(f"map:1-{FAILED_MAPS}:fail"), timeout=60)
    faulty = token_ids(llm.generate(prompts, greedy(OUT)))
    (counts,) = llm.collective_rpc(_counts, timeout=60)
    assert counts["map"] >= FAILED_MAPS, counts  # every refused map happened
    assert faulty == reference
    assert all(len(ids) == OUT for ids in faulty)
    # The burst may finish in the pages still mapped (one request at a time), so the
    # pool's recovery shows in the next one: it grows the cache again.
    assert llm.reset_prefix_cache()
    time.sleep(2.5)
    again = token_ids(llm.generate(prompts, greedy(OUT)))
    (after,) = llm.collective_rpc(_counts, timeout=60)
    assert after["map"] > counts["map"], (counts, after)
    assert again == reference


def test_a_worker_that_stops_answering_stops_the_engine_with_a_clear_error(hanging):
    llm, _, log, _ = hanging
    llm.collective_rpc(_arm("ipc:1+:stall=10"), timeout=60)
    time.sleep(2.5)  # idle: the next burst maps, and each map now waits 10 s in the worker
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        llm.generate(long_prompts(**BURST, seed=12), greedy(OUT))
    elapsed = time.monotonic() - t0
    assert elapsed < IPC_TIMEOUT_S + 20, elapsed
    text = log.read_text(errors="replace")
    assert "WorkerError" in text and f"no reply within {IPC_TIMEOUT_S:g} s (KVCACHED_IPC_TIMEOUT_S)" in text, (
        info.value, text[-3000:])


def test_a_worker_that_dies_stops_the_engine_with_a_clear_error_and_leaves_nothing(tiny_model):
    with _faulty_engine(tiny_model, "d") as (llm, _, log, state):
        llm.collective_rpc(_arm("ipc:1+:kill"), timeout=60)
        time.sleep(2.5)
        t0 = time.monotonic()
        with pytest.raises(Exception):
            llm.generate(long_prompts(**BURST, seed=13), greedy(OUT))
        elapsed = time.monotonic() - t0
        text = log.read_text(errors="replace")
    assert "WorkerError" in text and ("has exited" in text or "closed the connection" in text), (
        text[-3000:])
    assert elapsed < IPC_TIMEOUT_S + 20, elapsed
    assert not state["left"], f"left behind: {state['left']}"
    assert state["shutdown_s"] < 60
