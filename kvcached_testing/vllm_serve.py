"""``vllm serve`` in a subprocess, and what its failure says about the host.

:func:`serve` starts vLLM's OpenAI-compatible server (vLLM's own CLI, unchanged),
waits for ``/health`` and hands back a :class:`Server` whose requests raise
:class:`ServeFailure` when the server died, never became healthy, or did not
answer. A failure of a kvcached server is judged against a vanilla control:
:func:`vanilla_control` starts the same server with ``KVCACHED_ENABLED=0`` and
sends it the same requests; :func:`verdict` then says whether the engine itself
cannot serve on this host (vanilla failed as early or earlier: skip, naming
vanilla's failure) or kvcached failed where vanilla served (fail, with
kvcached's log).

Every server runs with ``PYTHONFAULTHANDLER=1``: a process of the engine killed
by a signal (SIGILL, SIGSEGV, ...) writes the signal and its Python stack into
the log, which the failure's summary quotes.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvcached_testing.vllm_cpu import KV_BYTES

__all__ = ["STAGES", "ServeFailure", "Server", "serve", "vanilla_control",
           "verdict"]

#: Where a server can fail, earliest first.
STAGES = ("start", "request")

# Log lines that name why an engine process died, most telling first.
_EVIDENCE = (
    re.compile(r"Fatal Python error: .*"),          # faulthandler: the signal
    re.compile(r"\S.*died unexpectedly.*"),          # vLLM: a worker's exit code
    re.compile(r"\S.*(?:Illegal instruction|SIGILL).*"),
)
# The first exception a traceback names (the root cause), or a command-line error.
_ERROR_LINE = re.compile(r"(?:^|\] )((?:[\w.]+\.)?\w*(?:Error|Exception): .+)|^(\S.*: error: .+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_text(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name} (exit code {returncode})"
        except ValueError:
            return f"exit code {returncode}"
    return f"exit code {returncode}"


def _fault_frame(lines: list[str]) -> str | None:
    """Where faulthandler's signal hit: the faulting thread's innermost frame outside
    torch's op dispatch (e.g. vLLM's ``cpu_attention_with_kv_cache``)."""
    start = next((i for i, x in enumerate(lines) if x.startswith("Current thread")), None)
    if start is None:
        return None
    for line in lines[start + 1:start + 40]:
        line = line.strip()
        if not line.startswith("File "):
            break
        if "/torch/" not in line:
            return line
    return None


def _evidence(log: str) -> list[str]:
    """The log's lines that tell why an engine process died (at most three, shortened)."""
    lines = log.splitlines()
    found: list[str] = []
    for pattern in _EVIDENCE:
        for i, line in enumerate(lines):
            m = pattern.search(line)
            if not m:
                continue
            found.append(m.group(0).strip()[:300])
            if pattern is _EVIDENCE[0]:
                frame = _fault_frame(lines[i:])
                if frame:
                    found.append(frame[:300])
            break
    if not any(x.startswith("Fatal Python error") for x in found):
        error = next((m for m in map(_ERROR_LINE.search, lines) if m), None)
        if error:
            found.append((error.group(1) or error.group(2)).strip()[:300])
    return found[:3]


class ServeFailure(Exception):
    """A ``vllm serve`` process that failed at ``stage`` (one of :data:`STAGES`).

    ``what`` says how (died, not healthy, a request's error), ``returncode`` is the
    server's exit status (``None`` if it still ran), ``log`` the path of its output.
    """

    def __init__(self, stage: str, what: str, returncode: int | None, log: Path):
        assert stage in STAGES, stage
        self.stage, self.what, self.returncode, self.log = stage, what, returncode, log
        super().__init__(self.summary)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"

    @property
    def summary(self) -> str:
        parts = [f"{self.stage}: {self.what}; server {_exit_text(self.returncode)}"]
        parts += _evidence(self.log_text())
        return " | ".join(parts)

    def tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]


class Server:
    """A healthy ``vllm serve``: ``base`` is its URL; requests go through :meth:`get`
    and :meth:`post`, which raise :class:`ServeFailure` when it does not answer."""

    def __init__(self, proc: subprocess.Popen, base: str, log: Path):
        self.proc, self.base, self.log = proc, base, log

    def _failed(self, what: str) -> ServeFailure:
        try:  # a server whose engine died shuts down: give it a moment to say how
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        return ServeFailure("request", what, self.proc.poll(), self.log)

    def _open(self, req: urllib.request.Request | str, timeout: float) -> bytes:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.read()
        except (OSError, http.client.HTTPException) as e:
            target = req if isinstance(req, str) else f"{req.get_method()} {req.full_url}"
            raise self._failed(f"{target} -> {type(e).__name__}: {e}") from e

    def get(self, path: str, timeout: float = 30) -> str:
        return self._open(self.base + path, timeout).decode()

    def post(self, path: str, body: dict, timeout: float = 60) -> dict:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return json.loads(self._open(req, timeout))


@contextmanager
def serve(model: str | os.PathLike[str], args: list[str], env: dict[str, str], log: Path,
          *, start_timeout: float = 240) -> Iterator[Server]:
    """``vllm serve model *args`` on a free local port, healthy; stopped on exit.

    Raises :class:`ServeFailure` (stage ``start``) when the server exits or is not
    healthy within ``start_timeout`` seconds.
    """
    port = _free_port()
    env = dict(env, PYTHONFAULTHANDLER="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvcached_vllm.serve", "serve", str(model),
             "--host", "127.0.0.1", "--port", str(port), *args],
            env=env, stdout=out, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + start_timeout
            while True:
                if proc.poll() is not None:
                    raise ServeFailure("start", "exited before it was healthy",
                                       proc.returncode, log)
                try:
                    with urllib.request.urlopen(base + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except (OSError, http.client.HTTPException):
                    pass
                if time.monotonic() > deadline:
                    raise ServeFailure("start", f"not healthy after {start_timeout:.0f} s",
                                       None, log)
                time.sleep(1)
            yield Server(proc, base, log)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def vanilla_control(model: str | os.PathLike[str], args: list[str], env: dict[str, str],
                    log: Path, requests: Callable[[Server], object]) -> ServeFailure | None:
    """The same server without kvcached, sent ``requests``: its failure, or ``None``.

    Vanilla vLLM on CPU sizes its KV cache from the memory free when it starts and
    refuses to start when less than ``gpu_memory_utilization`` of the node is free;
    kvcached sizes it from the node's total. So that the control starts wherever
    kvcached's server did, it gets an explicit budget (``--kv-cache-memory-bytes``,
    the benchmarks' ``KV_BYTES``) unless ``args`` set one.
    """
    env = dict(env, KVCACHED_ENABLED="0")
    if not any(a.startswith("--kv-cache-memory-bytes") for a in args):
        args = [*args, "--kv-cache-memory-bytes", str(KV_BYTES)]
    try:
        with serve(model, args, env, log) as server:
            requests(server)
    except ServeFailure as failure:
        return failure
    return None


def verdict(kvcached: ServeFailure, vanilla: ServeFailure | None) -> tuple[str, str]:
    """``("skip", reason)`` when vanilla vLLM failed at ``kvcached``'s stage or earlier
    (the engine cannot serve on this host), else ``("fail", message)`` with kvcached's log."""
    if vanilla is not None and STAGES.index(vanilla.stage) <= STAGES.index(kvcached.stage):
        return "skip", (f"vanilla vLLM (the same server with KVCACHED_ENABLED=0) cannot serve on "
                        f"this host either: {vanilla.summary} [kvcached's server: "
                        f"{kvcached.summary}]")
    control = ("vanilla vLLM served the same requests" if vanilla is None else
               f"vanilla vLLM got further before failing ({vanilla.summary})")
    return "fail", (f"kvcached's vllm serve failed ({kvcached.summary}) where {control}; "
                    f"kvcached's log ({kvcached.log}):\n{kvcached.tail()}")
