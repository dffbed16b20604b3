"""One controller in front of real tiny engines on this CPU, checked through its HTTP API.

The module starts one controller (``python -m kvcached_serve``) with four models of the
tiny random-weight Llama, in one device budget (64 MiB of KV) and a weight capacity that
holds two of them awake (so at most two engine processes run at a time):

* ``tiny-a`` (vLLM, eager start, a chat template), ``tiny-b`` (vLLM, eager start);
* ``tiny-c`` (vLLM, lazy: first started by a request; a queue of one request, 3 s);
* ``tiny-d`` (SGLang's HTTP server when ``.sglang/`` holds the release, else vLLM; lazy,
  sleeps after 6 s idle).

The tests run in order on it, each building on the state the last one left: routing,
streaming, bad requests, the endpoints a gateway uses, kvctl's view, the queue answering
503 while ``tiny-c`` starts (and ``tiny-b``, least recently used, sleeping to make weight
room), an engine killed mid-stream and restarted while the other model serves, ``tiny-d``
sleeping when idle and waking on its next request, and a stop that leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serve.conftest import (SGLANG_ARGS, VLLM_ARGS, Launcher, Served, engine_run_dirs,
                                  http, sglang_engine)

pytest.importorskip("vllm")

pytestmark = pytest.mark.engine

WEIGHT_CAPACITY = "2M"  # the tiny model's weights are 0.87 MiB: two fit, three do not
BUDGET = 64 << 20


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]] | None:
    return sglang_engine(tmp_path_factory.mktemp("sglang"))


@pytest.fixture(scope="module")
def served(launcher: Launcher, tiny_model: Path, chat_template: Path, sglang) -> Served:
    vllm = dict(VLLM_ARGS)
    models = [
        {"name": "tiny-a", "engine": "vllm", "model": str(tiny_model),
         "args": {**vllm, "chat_template": str(chat_template)}},
        {"name": "tiny-b", "engine": "vllm", "model": str(tiny_model), "args": vllm},
        {"name": "tiny-c", "engine": "vllm", "model": str(tiny_model), "args": vllm,
         "start": "lazy", "queue": {"max_size": 1, "timeout_s": 3}},
    ]
    d = {"name": "tiny-d", "model": str(tiny_model), "start": "lazy",
         "idle": {"sleep_after_s": 6}}
    if sglang is not None:
        python, env = sglang
        d.update(engine="sglang", python=python, env=env,
                 args={**SGLANG_ARGS, "chat_template": str(chat_template)})
    else:
        d.update(engine="vllm", args={**vllm, "chat_template": str(chat_template)})
    models.append(d)
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    s = launcher.start(models, device_budget=BUDGET, weight_capacity=WEIGHT_CAPACITY,
                       restart={"backoff_s": 0.5})
    s.dev_shm_before = before
    return s


def completion(s: Served, model: str, prompt: str = "Once upon a time", max_tokens: int = 8,
               **extra) -> dict:
    status, _, body = s.post("/v1/completions", {"model": model, "prompt": prompt,
                                                 "max_tokens": max_tokens, "temperature": 0,
                                                 "ignore_eos": True, **extra})
    assert status == 200, body[:2000]
    return json.loads(body)


def data_lines(response) -> Iterator[str]:
    """A streamed response's ``data:`` payloads as they come, split at "\\n" only (generated
    text may hold U+2028, which ``iter_lines`` would also split at)."""
    buf = b""
    for chunk in response.iter_bytes():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()


def sse_events(s: Served, path: str, body: dict) -> list[tuple[float, str]]:
    """The ``data:`` payloads of a streamed response with their arrival times."""
    import httpx

    out: list[tuple[float, str]] = []
    t0 = time.monotonic()
    with httpx.stream("POST", s.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for data in data_lines(r):
            out.append((time.monotonic() - t0, data))
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------- routing and streaming


def test_routes_by_model(served: Served):
    a = completion(served, "tiny-a", max_tokens=12)
    b = completion(served, "tiny-b", max_tokens=12)
    assert a["model"] == "tiny-a" and b["model"] == "tiny-b"
    assert a["usage"]["completion_tokens"] == 12 == b["usage"]["completion_tokens"]
    # Same weights, greedy: each engine gives the text the other gives.
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    chat = served.post("/v1/chat/completions", {"model": "tiny-a", "max_tokens": 6,
                                                "messages": [{"role": "user", "content": "hi"}],
                                                "temperature": 0})
    assert chat[0] == 200, chat[2]
    reply = json.loads(chat[2])
    assert reply["model"] == "tiny-a" and reply["choices"][0]["message"]["role"] == "assistant"
    assert served.state("tiny-c") == "asleep" and served.state("tiny-d") == "asleep"
    # The engine's ZMQ sockets are in a directory of its own, which its stop removes.
    runs = engine_run_dirs(served.engine_pid("tiny-a"))
    assert runs and any(p.is_socket() for d in runs for p in Path(d).iterdir()), runs


def _stream_frozen_after_first_event(served: Served, pgid: int) -> tuple[list[str], bool]:
    """One streamed completion of tiny-b whose engine is frozen (SIGSTOP) once the first
    event arrived and let go 1.5 s later: (the events, whether the stream was still going
    when the engine was let go)."""
    import httpx

    events: list[str] = []
    resumed: list[float] = []

    def resume() -> None:
        resumed.append(time.monotonic())
        os.killpg(pgid, signal.SIGCONT)

    timer = threading.Timer(1.5, resume)
    try:
        with httpx.stream("POST", served.url + "/v1/completions", timeout=120, json={
                "model": "tiny-b", "prompt": "alpha beta", "max_tokens": 600,
                "temperature": 0, "ignore_eos": True, "logprobs": 5, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for data in data_lines(r):
                events.append(data)
                if len(events) == 1:
                    os.killpg(pgid, signal.SIGSTOP)
                    timer.start()
        done_at = time.monotonic()
    finally:
        timer.cancel()
        os.killpg(pgid, signal.SIGCONT)
    return events, bool(resumed) and done_at > resumed[0] + 0.05


def test_streaming_passes_chunks_through(served: Served):
    """The first event reaches the client while the engine is still generating: the engine
    is frozen (SIGSTOP) once it arrived, and the stream ends only after it is let go.

    On a busy host the client may read its first event only after the engine has generated
    everything (then freezing it stops nothing): such an attempt tells nothing either way
    and is made again, up to three times; a controller that buffered the stream would fail
    every one."""
    pgid = served.engine_pid("tiny-b")
    for _ in range(3):
        events, frozen_mid_stream = _stream_frozen_after_first_event(served, pgid)
        if frozen_mid_stream:
            break
    assert frozen_mid_stream, "the whole stream came before the engine resumed, three times"
    assert events[-1] == "[DONE]"
    chunks = [json.loads(d) for d in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 600
    # Chunk by chunk, not one buffered body (vLLM merges the tokens of a consumer that fell
    # behind, as after the pause, into one chunk: fewer chunks than tokens).
    assert len(chunks) > 100
    chat = sse_events(served, "/v1/chat/completions", {
        "model": "tiny-a", "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8, "stream": True})
    assert chat[-1][1] == "[DONE]"
    assert json.loads(chat[0][1])["object"] == "chat.completion.chunk"
    text = served.metrics()
    assert metric(text, "kvcached_serve_ttft_seconds_count", model="tiny-b") >= 1
    assert metric(text, "kvcached_serve_ttft_seconds_count", model="tiny-a") >= 1


# ---------------------------------------------------------------- errors users get


def _error(status_body: tuple[int, dict, bytes], status: int) -> dict:
    code, _, body = status_body
    assert code == status, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def test_bad_requests(served: Served):
    err = _error(http("POST", served.url + "/v1/completions", raw=b"{not json"), 400)
    assert "not valid JSON" in err["message"] and err["type"] == "invalid_request_error"
    err = _error(http("POST", served.url + "/v1/completions", raw=b"[1, 2]"), 400)
    assert "JSON object" in err["message"]
    err = _error(served.post("/v1/completions", {"prompt": "x"}), 400)
    assert err["param"] == "model" and "tiny-a" in err["message"]
    err = _error(served.post("/v1/chat/completions", {"model": "gpt-17", "messages": []}), 404)
    assert err["code"] == "model_not_found" and "gpt-17" in err["message"]
    err = _error(served.post("/v1/completions", {"model": "tiny-a", "prompt": "x",
                                                 "stream": "yes"}), 400)
    assert err["param"] == "stream"
    _error(served.get("/v1/nothing"), 404)
    _error(served.get("/v1/completions"), 405)
    # The engine's own validation errors come back as the engine wrote them.
    code, _, body = served.post("/v1/completions", {"model": "tiny-a", "prompt": "x",
                                                    "max_tokens": -3})
    assert code == 400 and "error" in json.loads(body)
    text = served.metrics()
    assert metric(text, "kvcached_serve_requests_total", model="tiny-a", status="400") >= 1


# ---------------------------------------------------------------- what a gateway needs


def test_gateway_endpoints(served: Served):
    """Beyond one machine: a gateway routes on /v1/models, checks /health, scrapes /metrics."""
    models = served.models()
    assert set(models) == {"tiny-a", "tiny-b", "tiny-c", "tiny-d"}  # asleep ones too
    for m in models.values():
        assert m["object"] == "model" and m["owned_by"] == "kvcached-serve"
        assert m["state"] in ("awake", "asleep") and m["sleep_mode"] == "process"
    code, _, body = served.get("/v1/models/tiny-c")
    assert code == 200 and json.loads(body)["id"] == "tiny-c"
    _error(served.get("/v1/models/nope"), 404)
    code, _, body = served.get("/health")
    health = json.loads(body)
    assert code == 200 and health["status"] == "ok"
    assert health["models"] == {k: v["state"] for k, v in models.items()}
    text = served.metrics()
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name for f in text_string_to_metric_families(text)}
    for name in ("kvcached_serve_requests", "kvcached_serve_ttft_seconds",
                 "kvcached_serve_e2e_latency_seconds", "kvcached_serve_queue_depth",
                 "kvcached_serve_sleeps", "kvcached_serve_wakes",
                 "kvcached_serve_wake_latency_seconds", "kvcached_serve_model_awake",
                 "kvcached_serve_kv_mapped_bytes", "kvcached_serve_device_budget_bytes"):
        assert name in families, name
    assert metric(text, "kvcached_serve_model_awake", model="tiny-a") == 1
    assert metric(text, "kvcached_serve_model_awake", model="tiny-c") == 0
    assert metric(text, "kvcached_serve_device_budget_bytes", device="host") == BUDGET
    assert metric(text, "kvcached_serve_kv_mapped_bytes", model="tiny-a") > 0


def test_kvctl_names_engines_by_model(served: Served):
    env = dict(os.environ, KVCACHED_SHM_DIR=str(served.shm_dir))
    prefix = served.config["namespace_prefix"]
    out = subprocess.run([sys.executable, "-m", "kvcached_core.cli.kvctl", "status", "--json"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    (host,) = [d for d in status["devices"] if d["device"] == "host"]
    assert host["budget"] == BUDGET
    assert {e["namespace"] for e in host["engines"]} == {prefix + "tiny-a", prefix + "tiny-b"}
    out = subprocess.run([sys.executable, "-m", "kvcached_core.cli.kvtop", "--once"],
                         env=dict(env, COLUMNS="200"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert prefix + "tiny-a" in out.stdout and prefix + "tiny-b" in out.stdout


def test_contended_budget_is_shared_by_demand(served: Served):
    """While two models have requests, each gets a live KV limit (a share of the budget by
    its requests); once one is left alone the limits are lifted."""
    import httpx

    done = threading.Event()
    outcomes: list[str] = []  # how each stream ended, for the failure message

    def stream(model: str) -> None:
        # Asked again until the limits were seen: a quiet host ends a stream in seconds.
        while not done.is_set():
            chunks = 0
            try:
                with httpx.stream("POST", served.url + "/v1/completions", timeout=120, json={
                        "model": model, "prompt": "alpha beta gamma", "max_tokens": 1500,
                        "ignore_eos": True, "logprobs": 5, "stream": True}) as r:
                    for _ in data_lines(r):
                        chunks += 1
                        if done.is_set():
                            break  # closing the stream aborts the request at the engine
                    outcomes.append(f"{model}: HTTP {r.status_code}, {chunks} events")
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                outcomes.append(f"{model}: {exc!r} after {chunks} events")
                return

    # Both engines serve before the streams start: a model (re)starting on a busy host may
    # take longer than tiny-a's streams last, and the limits need both in flight at once.
    for m in ("tiny-a", "tiny-b"):
        completion(served, m)
    assert served.state("tiny-a") == served.state("tiny-b") == "awake"
    threads = [threading.Thread(target=stream, args=(m,))
               for m in ("tiny-a", "tiny-a", "tiny-a", "tiny-b")]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            engines = served.engines()
            limits = {m: engines[m]["kv_limit_bytes"] for m in ("tiny-a", "tiny-b")}
            if all(limits.values()) and engines["tiny-a"]["inflight"] == 3 and (
                    limits["tiny-a"] > limits["tiny-b"]):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"no limits in 60 s: {limits}\nengines: {json.dumps(engines)}\n"
                            f"streams: {outcomes[-12:]}\ncontroller log:\n{served.tail()}")
            time.sleep(0.2)
        # In proportion to the requests (3 : 1), at least a tenth of the budget each.
        assert limits["tiny-a"] > limits["tiny-b"] >= BUDGET // 10, limits
        assert limits["tiny-a"] + limits["tiny-b"] <= BUDGET
        env = dict(os.environ, KVCACHED_SHM_DIR=str(served.shm_dir))
        out = subprocess.run([sys.executable, "-m", "kvcached_core.cli.kvctl", "list", "--json"],
                             env=env, capture_output=True, text=True, timeout=60)
        pools = {p["namespace"]: p for p in json.loads(out.stdout)["pools"]}
        prefix = served.config["namespace_prefix"]
        for m in ("tiny-a", "tiny-b"):  # the limits are in the pools' records
            assert BUDGET // 10 <= (pools[prefix + m]["limit"] or 0) <= BUDGET, pools
    finally:
        done.set()
        for t in threads:
            t.join()
    deadline = time.monotonic() + 30
    while any(served.engines()[m]["kv_limit_bytes"] for m in ("tiny-a", "tiny-b")):
        assert time.monotonic() < deadline, served.engines()
        time.sleep(0.2)


# ---------------------------------------------------------------- queue, wake, LRU


def test_queue_503_then_wake_sleeps_least_recently_used(served: Served):
    completion(served, "tiny-b")
    completion(served, "tiny-a")  # tiny-b is now the least recently used
    b_pid = served.engine_pid("tiny-b")
    answers: list = [None, None]

    def ask(i: int) -> None:
        t0 = time.monotonic()
        answers[i] = (served.post("/v1/completions", {"model": "tiny-c", "prompt": "x",
                                                      "max_tokens": 4}), time.monotonic() - t0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    for t in threads:
        t.join()
    (first, t_first), (second, t_second) = answers
    # One waits its 3 s in the queue of one; the other finds the queue full at once.
    waited, full = (first, second) if t_first > t_second else (second, first)
    for (code, headers, body) in (waited, full):
        err = _error((code, headers, body), 503)
        assert err["code"] == "model_not_ready"
        assert int(headers["retry-after"]) >= 1
    assert max(t_first, t_second) >= 3.0 and min(t_first, t_second) < 2.0
    assert "queue.max_size 1" in json.loads(full[2])["error"]["message"]
    # tiny-c goes on waking: tiny-b (least recently used, idle) sleeps to make weight room.
    served.wait_state("tiny-c", "awake")
    assert served.state("tiny-b") == "asleep" and served.state("tiny-a") == "awake"
    assert not alive(b_pid)  # on the CPU a sleeping model's engine process is gone
    assert completion(served, "tiny-c")["model"] == "tiny-c"
    text = served.metrics()
    assert metric(text, "kvcached_serve_sleeps_total", model="tiny-b", reason="lru") == 1
    assert metric(text, "kvcached_serve_queue_rejections_total", model="tiny-c",
                  reason="timeout") == 1
    assert metric(text, "kvcached_serve_queue_rejections_total", model="tiny-c",
                  reason="queue_full") == 1
    assert metric(text, "kvcached_serve_wake_latency_seconds_count", model="tiny-c",
                  mode="start") == 1  # its first start: no sleep to wake from
    assert metric(text, "kvcached_serve_kv_mapped_bytes", model="tiny-b") == 0


# ---------------------------------------------------------------- crash and restart


def test_engine_killed_mid_stream_restarts_others_serve(served: Served):
    import httpx

    pid = served.engine_pid("tiny-c")
    got: list[str] = []
    with httpx.stream("POST", served.url + "/v1/completions", timeout=120, json={
            "model": "tiny-c", "prompt": "x", "max_tokens": 1900, "ignore_eos": True,
            "logprobs": 5, "stream": True}) as r:
        assert r.status_code == 200
        # The stream is open: the engine's server dies before it could generate it all.
        os.kill(pid, signal.SIGKILL)
        got.extend(data_lines(r))
    assert len(got) < 1900
    err = json.loads(got[-1])["error"]
    assert err["code"] == "engine_failed" and "tiny-c" in err["message"]
    # The other model serves while tiny-c restarts.
    t0 = time.monotonic()
    assert completion(served, "tiny-a")["model"] == "tiny-a"
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 180
    while not (served.state("tiny-c") == "awake"
               and served.engines()["tiny-c"]["pid"] not in (None, pid)):
        assert time.monotonic() < deadline, served.tail()
        time.sleep(0.25)
    assert completion(served, "tiny-c")["usage"]["completion_tokens"] == 8
    text = served.metrics()
    assert metric(text, "kvcached_serve_engine_exits_total", model="tiny-c") == 1
    assert metric(text, "kvcached_serve_engine_restarts_total", model="tiny-c") == 1
    assert metric(text, "kvcached_serve_requests_total", model="tiny-c", status="502") == 1
    # The dead engine's budget slots no longer count: only live engines' bytes are mapped.
    from kvcached_core.ipc.budget import BudgetRecord

    with BudgetRecord.open("host", served.shm_dir, create=False) as rec:
        reading = rec.read()
    assert all(s.alive for s in reading.slots), reading.slots
    assert reading.mapped <= BUDGET


# ---------------------------------------------------------------- idle sleep and wake


def test_lazy_model_wakes_and_sleeps_when_idle(served: Served, sglang):
    engine = "sglang" if sglang is not None else "vllm"
    completion(served, "tiny-c")  # tiny-a is now the least recently used
    events = sse_events(served, "/v1/completions", {
        "model": "tiny-d", "prompt": "gamma delta", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, "stream": True})
    assert events[-1][1] == "[DONE]" and len(events) >= 3
    health = served.engines()
    assert health["tiny-d"]["engine"] == engine and health["tiny-a"]["state"] == "asleep"
    chat = served.post("/v1/chat/completions", {"model": "tiny-d", "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "x"}]})
    assert chat[0] == 200, chat[2]
    pid = served.engine_pid("tiny-d")
    slept_in = served.wait_state("tiny-d", "asleep", timeout=30)  # idle past its 6 s
    assert slept_in < 20 and not alive(pid)
    assert completion(served, "tiny-d", max_tokens=5)["usage"]["completion_tokens"] == 5
    text = served.metrics()
    assert metric(text, "kvcached_serve_sleeps_total", model="tiny-d", reason="idle") == 1
    assert metric(text, "kvcached_serve_wakes_total", model="tiny-d") == 2
    # A start and a wake are timed apart: the wake is labelled with the sleep it ends.
    assert metric(text, "kvcached_serve_wake_latency_seconds_count", model="tiny-d",
                  mode="start") == 1
    assert metric(text, "kvcached_serve_wake_latency_seconds_count", model="tiny-d",
                  mode="process") == 1
    assert metric(text, "kvcached_serve_sleeps_total", model="tiny-a", reason="lru") == 1


# ---------------------------------------------------------------- stop


def _held_by_someone(path: str) -> bool:
    """Whether a live process has ``path`` open or mapped."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if path in open(f"/proc/{pid}/maps").read():
                return True
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                    return True
        except OSError:
            continue
    return False


def test_stop_leaves_nothing(served: Served):
    served.engines()
    pids = set(served.engine_pids)
    assert len(pids) >= 5  # a, b, c (twice), d (twice)
    assert served.stop() == 0
    assert "stopped every engine" in served.tail()
    left = [p for p in pids if alive(p)]
    assert not left, f"engine processes left: {left}"
    for pgid in pids:  # nothing of any engine's process group either
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
    # No pool segment, budget record or socket directory of kvcached is left, nor the
    # engines' own sockets (each engine's private directory for them).
    assert os.listdir(served.shm_dir) == []
    assert os.listdir(served.ipc_dir) == []
    assert len(served.run_dirs) >= 4, served.run_dirs
    assert not [d for d in served.run_dirs if os.path.exists(d)]
    # No shared memory the engines made is left behind unowned: vLLM's message queues
    # (psm_*, hundreds of MiB; a killed engine left them) and kvcached's records of this
    # controller's namespaces. (Small semaphores, and files of other test runs on this
    # machine meanwhile, scripts/test.sh's other group among them, cannot be told from ours
    # by name, so they are not counted here.)
    if os.path.isdir("/dev/shm"):
        new = set(os.listdir("/dev/shm")) - served.dev_shm_before
        ours = served.config["namespace_prefix"]
        leaked = [n for n in new if (n.startswith("psm_") or
                                     (n.startswith("kvcached") and ours in n))
                  and not _held_by_someone(f"/dev/shm/{n}")]
        assert not leaked, leaked
