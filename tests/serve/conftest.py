"""Fixtures of the kvcached-serve tests: a real controller (``python -m kvcached_serve``) in a
subprocess, in front of real tiny engines on this CPU.

Run them with the vLLM environment's interpreter (it has vLLM and the endpoint's
dependencies)::

    .venv-vllm/bin/python -m pytest tests/serve

kvcached-serve is imported from ``kvcached_serve/src`` of this checkout when it is not
installed. An SGLang model joins when ``.sglang/`` holds :data:`SGLANG_RELEASE` (its HTTP
server runs on ``.venv``'s interpreter with the shims, as ``tests/sglang`` runs SGLang).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvcached_testing.serve_controller import (
    SERVE_SRC, free_port, log_tail, start_controller, wait_healthy)

ROOT = Path(__file__).resolve().parents[2]
if str(SERVE_SRC) not in sys.path:
    sys.path.insert(0, str(SERVE_SRC))

#: The SGLang release whose HTTP server the tests start (as tests/sglang's e2e runs it).
SGLANG_RELEASE = "0.5.12.post1"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "assistant:")
# float32: vLLM's bf16 CPU attention runs AMX instructions before anything asked Linux for
# AMX, and a short first request kills the worker on AMX hosts (tests/vllm/test_limit_and_serve.py).
VLLM_ARGS = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True, "seed": 0,
             "max_num_seqs": 16}
SGLANG_ARGS = {"device": "cpu", "dtype": "bfloat16", "attention_backend": "torch_native",
               "sampling_backend": "pytorch", "disable_cuda_graph": True, "page_size": 1,
               "max_total_tokens": 65536, "grammar_backend": "none", "random_seed": 0}


def serve_importable() -> bool:
    try:
        import httpx  # noqa: F401
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
        import yaml  # noqa: F401

        import kvcached_serve  # noqa: F401
    except ImportError:
        return False
    return True


def sglang_engine(workdir: Path) -> tuple[str, dict[str, str]] | None:
    """(interpreter, environment) that run SGLang's HTTP server here, or None."""
    from kvcached_testing.sglang_release import (SGLANG_DIR, release_env, release_installed,
                                                 write_dist_record)

    python = ROOT / ".venv" / "bin" / "python"
    if not release_installed(SGLANG_RELEASE) or not python.exists() or not (
            SGLANG_DIR / "_http").is_dir():
        return None
    env = release_env(SGLANG_RELEASE, write_dist_record(workdir / "sglang-dist"))
    keep = {k: env[k] for k in ("PYTHONPATH", "SGLANG_USE_CPU_ENGINE", "OMP_NUM_THREADS",
                                "TOKENIZERS_PARALLELISM")}
    keep["PYTHONPATH"] += os.pathsep + str(SGLANG_DIR / "_http")  # the HTTP server's packages
    keep["KVCACHED_PAGE_SIZE_MB"] = "1"
    return str(python), keep


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm")
    from kvcached_testing.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def chat_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


def http(method: str, url: str, body: Any = None, raw: bytes | None = None,
         timeout: float = 120) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request; HTTP errors are answers, not exceptions."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def engine_run_dirs(pid: int) -> set[str]:
    """The private socket directory the controller gave engine ``pid`` (vLLM's
    ``VLLM_RPC_BASE_PATH``, SGLang's ``TMPDIR``), read from its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:  # gone meanwhile
        return set()
    return {env[k].decode() for k in (b"VLLM_RPC_BASE_PATH", b"TMPDIR")
            if k in env and b"kvcached-serve-" in env[k]}


@dataclass
class Served:
    """A running controller: its URL, config and private kvcached directories."""

    proc: subprocess.Popen
    url: str
    config: dict
    workdir: Path
    shm_dir: Path
    ipc_dir: Path
    log: Path
    engine_pids: set[int] = field(default_factory=set)
    run_dirs: set[str] = field(default_factory=set)  # engines' private socket directories

    def get(self, path: str, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        return http("GET", self.url + path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        return http("POST", self.url + path, body, **kw)

    def models(self) -> dict[str, dict]:
        status, _, body = self.get("/v1/models")
        assert status == 200, body
        return {m["id"]: m for m in json.loads(body)["data"]}

    def state(self, name: str) -> str:
        return self.models()[name]["state"]

    def wait_state(self, name: str, want: str, timeout: float = 180) -> float:
        t0 = time.monotonic()
        while True:
            st = self.state(name)
            if st == want:
                return time.monotonic() - t0
            assert self.proc.poll() is None, self.tail()
            assert time.monotonic() - t0 < timeout, f"{name} is {st}, not {want}:\n{self.tail()}"
            time.sleep(0.25)

    def engines(self) -> dict[str, dict]:
        """/health's view of each engine (state, pid, namespace, ...); remembers the pids."""
        _, _, body = self.get("/health")
        engines = json.loads(body)["engines"]
        for e in engines.values():
            if e["pid"]:
                self.engine_pids.add(e["pid"])
                self.run_dirs.update(engine_run_dirs(e["pid"]))
        return engines

    def engine_pid(self, name: str) -> int:
        """The engine's server process (leader of its own process group)."""
        pid = self.engines()[name]["pid"]
        assert pid, f"{name} has no running engine"
        return pid

    def metrics(self) -> str:
        status, _, body = self.get("/metrics")
        assert status == 200
        return body.decode()

    def tail(self, n: int = 4000) -> str:
        return log_tail(self.log, n)

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


class Launcher:
    """Starts controllers on configs with private kvcached directories and a unique namespace
    prefix; :meth:`stop_all` stops every one it started."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.started: list[Served] = []

    def start(self, models: list[dict], ready_timeout: float = 300, **top: Any) -> Served:
        work = self.factory.mktemp("serve")
        cfg = {"port": free_port(), "shm_dir": str(work / "shm"), "ipc_dir": str(work / "ipc"),
               "namespace_prefix": f"t{uuid.uuid4().hex[:6]}-", "log_dir": str(work / "logs"),
               **top, "models": models}
        proc, url, log = start_controller(cfg, work)
        served = Served(proc, url, cfg, work, Path(cfg["shm_dir"]), Path(cfg["ipc_dir"]), log)
        self.started.append(served)
        wait_healthy(url, proc, log, ready_timeout)
        served.engines()
        return served

    def stop_all(self) -> None:
        for s in self.started:
            s.stop()


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    if not serve_importable():
        pytest.skip("kvcached-serve's dependencies (starlette, uvicorn, httpx, pydantic, "
                    "PyYAML, prometheus-client) are not installed here")
    launch = Launcher(tmp_path_factory)
    yield launch
    launch.stop_all()
