"""The controller: every configured model's engine, its state, sleep and wake, the budget.

States of a model::

    asleep --(request, or start: eager)--> starting --(health 200)--> awake
    awake --(idle past its policy, or LRU to make weight room)--> sleeping --> asleep
    awake --(engine exits by itself)--> failed --(backoff)--> starting
    starting --(engine exits / times out)--> failed --(backoff)--> starting

Requests for a model that is not awake wait in its queue (bounded, with a timeout) and
wake it; the controller makes weight room first, sleeping the least recently used idle
awake model of the same device while the awake models' weights would exceed
``weight_capacity``. All of it runs on one asyncio loop: state changes and the
in-flight counts they check happen without an ``await`` between them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvcached_serve.config import ModelConfig, ServeConfig
from kvcached_serve.engines import (EngineError, EngineProcess, EngineSleep, ProcessSleep,
                                    SleepMode, sleep_mode_for)
from kvcached_serve.metrics import Metrics

__all__ = ["Controller", "ModelRuntime", "NotReady", "device_budget_key"]

log = logging.getLogger("kvcached_serve")

#: What a wake is assumed to take before one was measured (Retry-After).
DEFAULT_WAKE_S = 30.0


class NotReady(Exception):
    """A request's model did not become ready: the queue is full or the wait timed out."""

    def __init__(self, model: str, reason: str, retry_after: int, detail: str) -> None:
        super().__init__(detail)
        self.model, self.reason, self.retry_after = model, reason, retry_after


@dataclass(eq=False)
class ModelRuntime:
    cfg: ModelConfig
    engine: EngineProcess
    sleep_mode: SleepMode
    state: str = "asleep"
    last_used: float = 0.0
    inflight: int = 0
    waiting: int = 0
    failures: int = 0
    wake_started: float = 0.0
    kv_limit: int = -1  # the live KV limit the controller set (-1: none)
    last_wake_s: float | None = None
    #: How the engine went to sleep last (the sleep mode's name, ``process`` when it was
    #: stopped instead); ``None`` when its next wake is a start (first, or after a crash).
    slept_as: str | None = None
    last_error: str | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    task: asyncio.Task | None = None


def device_budget_key(device: str) -> str:
    """The kvcached budget record of a configured device (``cpu``, ``cuda:N``), as its
    engines compute it (:func:`kvcached_core.ipc.budget.device_key`: the physical index
    behind ``CUDA_VISIBLE_DEVICES``, ``KVCACHED_BUDGET_DEVICE`` when set)."""
    from kvcached_core.ipc.budget import device_key

    kind, _, index = device.partition(":")
    return device_key("host" if kind == "cpu" else kind, int(index or 0))


class Controller:
    """Runs the configured engines; the HTTP app calls :meth:`acquire` / :meth:`release`."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        if cfg.log_dir:
            self.log_dir = Path(cfg.log_dir)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._own_log_dir = False
        else:
            self.log_dir = Path(tempfile.mkdtemp(prefix="kvcached-serve-"))
            self._own_log_dir = True
        self.models: dict[str, ModelRuntime] = {}
        for m in cfg.models:
            engine = EngineProcess(cfg, m, self.log_dir)
            mode = EngineSleep() if sleep_mode_for(cfg, m) == "engine" else ProcessSleep()
            self.models[m.name] = ModelRuntime(m, engine, mode)
        self.client: httpx.AsyncClient | None = None
        self.started = False
        self.stopping = False
        self._tasks: list[asyncio.Task] = []
        self._weights_lock = asyncio.Lock()
        self._budgets: dict[str, tuple[bool, int]] = {}  # key -> (created by us, previous capacity)
        self.metrics.attach(self)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Set the device budgets, start the eager engines (without waiting for them) and
        the idle and exit watchers."""
        # Engines' servers close a keep-alive connection after 5 s idle (uvicorn's default in
        # vLLM and SGLang): drop ours sooner, so a request never goes out on one being closed.
        # A busy engine on a loaded host may take long to accept: the connect may too.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=60.0),
                                        limits=httpx.Limits(max_connections=1024,
                                                            max_keepalive_connections=256,
                                                            keepalive_expiry=2.0))
        self._prepare_dirs()
        self._set_budgets()
        for m in self.models.values():
            log.info("%s: %s engine on %s, namespace %s, sleep mode %s", m.cfg.name,
                     m.cfg.engine, m.cfg.device, m.engine.namespace, m.sleep_mode.name)
        self.started = True
        for m in self.models.values():
            if m.cfg.start == "eager":
                self.ensure_awake(m)
        self._tasks.append(asyncio.create_task(self._watch(), name="kvcached-serve-watch"))

    async def wait_started(self) -> None:
        """Until every eager model's first start finished (awake or failed)."""
        while True:
            pending = [m.task for m in self.models.values() if m.task is not None
                       and m.cfg.start == "eager" and m.state == "starting"]
            if not pending:
                return
            await asyncio.wait(pending)

    async def stop(self) -> None:
        """Stop every engine (whole process groups), restore the budgets, leave nothing."""
        self.stopping = True
        for t in self._tasks:
            t.cancel()
        for m in self.models.values():
            if m.task is not None:
                m.task.cancel()
        await asyncio.gather(*self._tasks, *(m.task for m in self.models.values() if m.task),
                             return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(m.engine.stop)
                               for m in self.models.values()), return_exceptions=True)
        for m in self.models.values():
            m.state = "stopped"
            m.ready.set()  # waiters see "stopped" and give up
        self._restore_budgets()
        if self.client is not None:
            await self.client.aclose()
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        log.info("stopped every engine")

    def _prepare_dirs(self) -> None:
        from kvcached_core.ipc import paths

        if self.cfg.shm_dir:
            paths.private_dir(os.path.abspath(self.cfg.shm_dir), "shm_dir")
        if self.cfg.ipc_dir:
            paths.private_dir(os.path.abspath(self.cfg.ipc_dir), "ipc_dir")

    def _set_budgets(self) -> None:
        if self.cfg.device_budget is None:
            return
        from kvcached_core.ipc.budget import BudgetRecord, budget_path

        for dev in sorted({m.cfg.device for m in self.models.values()}):
            key = device_budget_key(dev)
            existed = budget_path(key, self.cfg.shm_dir).exists()
            with BudgetRecord.open(key, self.cfg.shm_dir) as rec:
                self._budgets[key] = (not existed, rec.capacity)
                rec.set_capacity(self.cfg.device_budget)
            log.info("device budget %s: %d bytes of KV for every engine together", key,
                     self.cfg.device_budget)

    def _restore_budgets(self) -> None:
        from kvcached_core.ipc.budget import BudgetRecord, budget_path

        for key, (created, previous) in self._budgets.items():
            try:
                with BudgetRecord.open(key, self.cfg.shm_dir, create=False) as rec:
                    alive = any(s.alive for s in rec.read().slots)
                    if created and not alive:
                        os.unlink(budget_path(key, self.cfg.shm_dir))
                    else:
                        rec.set_capacity(previous)
            except Exception as exc:  # noqa: BLE001 - the rest of the stop goes on
                log.warning("budget %s: restoring it failed: %s", key, exc)
        self._budgets.clear()

    # ------------------------------------------------------------ requests

    async def acquire(self, name: str) -> float:
        """Wait until model ``name`` is awake and count one request in flight; returns the
        seconds waited.

        Raises:
            KeyError: No such model.
            NotReady: The queue is full, or the model was not ready in time.
        """
        m = self.models[name]
        if m.state == "awake" and not m.engine.running:
            self._engine_exited(m)  # found before the watcher's next look
        if m.state == "awake":
            m.inflight += 1
            m.last_used = time.monotonic()
            return 0.0
        q = self.cfg.queue_of(m.cfg)
        if m.waiting >= q.max_size:
            self.metrics.queue_timeouts.labels(name, "queue_full").inc()
            raise NotReady(name, "queue_full", self.retry_after(m),
                           f"model {name} is {m.state} and {m.waiting} requests already wait "
                           f"for it (queue.max_size {q.max_size})")
        t0 = time.monotonic()
        deadline = t0 + q.timeout_s
        m.waiting += 1
        self.metrics.queue_depth.labels(name).set(m.waiting)
        try:
            while m.state != "awake":
                if m.state == "stopped" or self.stopping:
                    raise NotReady(name, "stopping", 5, "the server is stopping")
                self.ensure_awake(m)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                try:
                    await asyncio.wait_for(m.ready.wait(), min(remaining, 1.0))
                except TimeoutError:
                    continue
                if m.state != "awake":
                    await asyncio.sleep(0.05)
        except TimeoutError:
            self.metrics.queue_timeouts.labels(name, "timeout").inc()
            why = f" (last error: {m.last_error.splitlines()[0]})" if m.last_error else ""
            raise NotReady(name, "timeout", self.retry_after(m),
                           f"model {name} did not become ready within {q.timeout_s:g} s "
                           f"(it is {m.state}){why}") from None
        finally:
            m.waiting -= 1
            self.metrics.queue_depth.labels(name).set(m.waiting)
        m.inflight += 1
        m.last_used = time.monotonic()
        waited = m.last_used - t0
        self.metrics.queue_wait.labels(name).observe(waited)
        return waited

    def release(self, name: str) -> None:
        m = self.models[name]
        m.inflight -= 1
        m.last_used = time.monotonic()

    def retry_after(self, m: ModelRuntime) -> int:
        """Seconds until the model is likely ready (its last wake took that long)."""
        expected = m.last_wake_s or DEFAULT_WAKE_S
        if m.state == "starting":
            expected -= time.monotonic() - m.wake_started
        return max(1, int(expected + 0.999))

    # ------------------------------------------------------------ wake / sleep

    def ensure_awake(self, m: ModelRuntime) -> None:
        """Start waking ``m`` unless it is awake or a transition is under way."""
        if self.stopping or m.state == "awake" or (m.task is not None and not m.task.done()):
            return
        m.task = asyncio.create_task(self._wake(m), name=f"wake-{m.cfg.name}")

    async def _wake(self, m: ModelRuntime, delay: float = 0.0) -> None:
        if delay:
            await asyncio.sleep(delay)
        async with m.lock:
            if m.state == "awake" or self.stopping:
                return
            t0 = time.monotonic()
            await self._make_room(m)
            m.state = "starting"
            m.wake_started = time.monotonic()
            mode, m.slept_as = m.slept_as or "start", None
            try:
                await m.sleep_mode.wake(m.engine, self.client)
            except EngineError as exc:
                m.last_error = str(exc)
                log.error("%s: %s", m.cfg.name, exc)
                await asyncio.to_thread(m.engine.stop)
                m.state = "failed"
                self._schedule_restart(m)
                return
            m.state = "awake"
            m.kv_limit = -1  # a fresh engine's pools have no live limit
            m.last_used = time.monotonic()
            m.last_wake_s = m.last_used - t0
            m.last_error = None
            m.ready.set()
            self.metrics.wakes.labels(m.cfg.name).inc()
            self.metrics.wake_latency.labels(m.cfg.name, mode).observe(m.last_wake_s)
            log.info("%s: awake after %.1f s (%s)", m.cfg.name, m.last_wake_s,
                     "a start" if mode == "start" else f"{mode} wake")

    def _weights_fit(self, m: ModelRuntime) -> bool:
        cap = self.cfg.weight_capacity
        if cap is None:
            return True
        held = sum(o.cfg.weight_bytes or 0 for o in self.models.values()
                   if o is not m and o.cfg.device == m.cfg.device and o.state in (
                       "starting", "awake", "sleeping"))
        return held + (m.cfg.weight_bytes or 0) <= cap

    async def _make_room(self, m: ModelRuntime) -> None:
        """Sleep least recently used idle models of ``m``'s device until ``m``'s weights fit;
        waits while every candidate is busy."""
        async with self._weights_lock:
            while not self._weights_fit(m):
                idle = [o for o in self.models.values() if o is not m and o.state == "awake"
                        and o.cfg.device == m.cfg.device and o.inflight == 0]
                if idle:
                    victim = min(idle, key=lambda o: o.last_used)
                    log.info("%s: weights do not fit; %s (least recently used) sleeps",
                             m.cfg.name, victim.cfg.name)
                    await self._sleep(victim, "lru")
                else:
                    await asyncio.sleep(0.1)
            m.state = "starting"  # counted as holding weights from here

    async def sleep(self, name: str, reason: str = "manual") -> bool:
        """Put a model to sleep now (if it is awake and idle); returns whether it slept."""
        return await self._sleep(self.models[name], reason)

    async def _sleep(self, m: ModelRuntime, reason: str) -> bool:
        if m.state != "awake" or m.inflight:
            return False
        # No await between the check above and this: no request slips in.
        m.state = "sleeping"
        m.ready.clear()
        t0 = time.monotonic()
        async with m.lock:
            try:
                await m.sleep_mode.sleep(m.engine, self.client)
                m.slept_as = m.sleep_mode.name
            except EngineError as exc:  # the engine would not sleep: stop it instead
                log.error("%s: %s; stopping the engine instead", m.cfg.name, exc)
                await asyncio.to_thread(m.engine.stop)
                m.slept_as = "process"
            m.state = "asleep"
        self.metrics.sleeps.labels(m.cfg.name, reason).inc()
        self.metrics.sleep_latency.labels(m.cfg.name, m.sleep_mode.name).observe(
            time.monotonic() - t0)
        log.info("%s: asleep (%s, %s, %.1f s)", m.cfg.name, reason, m.sleep_mode.name,
                 time.monotonic() - t0)
        return True

    # ------------------------------------------------------------ failures

    def _schedule_restart(self, m: ModelRuntime) -> None:
        if self.stopping:
            return
        r = self.cfg.restart
        m.failures += 1
        delay = min(r.max_backoff_s, r.backoff_s * 2 ** (m.failures - 1))
        log.warning("%s: restarting in %.1f s (failure %d)", m.cfg.name, delay, m.failures)
        m.task = asyncio.create_task(self._restart(m, delay), name=f"restart-{m.cfg.name}")

    async def _restart(self, m: ModelRuntime, delay: float) -> None:
        self.metrics.restarts.labels(m.cfg.name).inc()
        m.task = asyncio.current_task()
        await self._wake(m, delay)

    def _engine_exited(self, m: ModelRuntime) -> None:
        """``m`` was awake and its engine is gone: it fails now (no request is sent to it
        any more), and its remains are cleaned up and it restarts in the background."""
        code = m.engine.proc.poll() if m.engine.proc else None
        up = time.monotonic() - m.engine.started_at
        m.state = "failed"
        m.ready.clear()
        m.last_error = (f"the {m.cfg.engine} engine exited with code {code} after {up:.0f} s; "
                        f"log {m.engine.log_path}")
        log.error("%s: %s", m.cfg.name, m.last_error)
        self.metrics.crashes.labels(m.cfg.name).inc()
        if up >= self.cfg.restart.reset_after_s:
            m.failures = 0
        m.task = asyncio.create_task(self._recover(m), name=f"recover-{m.cfg.name}")

    async def _recover(self, m: ModelRuntime) -> None:
        await asyncio.to_thread(m.engine.stop)  # the rest of its group, its kvcached records
        self._schedule_restart(m)

    async def _watch(self) -> None:
        """Twice a second: engines that exited by themselves, models idle past their policy."""
        rounds = 0
        while True:
            await asyncio.sleep(0.5)
            rounds += 1
            try:
                await self._watch_round(rounds)
            except Exception:  # noqa: BLE001 - the watcher must go on: it is the only one
                log.exception("watching the engines failed this round")

    async def _watch_round(self, rounds: int) -> None:
        now = time.monotonic()
        if rounds % 20 == 0:  # every 10 s: the shared memory the engines made since
            for m in self.models.values():
                if m.state == "awake" and m.engine.running:
                    await asyncio.to_thread(m.engine.note_shm_files)
        if self.cfg.kv_balance and self.cfg.device_budget is not None:
            try:
                self._balance_kv()
            except Exception as exc:  # noqa: BLE001 - the rest of the round goes on
                log.warning("KV balance: %s", exc)
        for m in self.models.values():
            if m.state == "awake" and not m.engine.running:
                self._engine_exited(m)
            elif (m.state == "awake" and m.cfg.idle.sleep_after_s is not None
                  and m.inflight == 0 and m.waiting == 0
                  and now - m.last_used >= m.cfg.idle.sleep_after_s
                  and (m.task is None or m.task.done())):
                m.task = asyncio.create_task(self._sleep(m, "idle"), name=f"sleep-{m.cfg.name}")

    def _balance_kv(self) -> None:
        """Arbitrate the device budget between models that want it at the same time.

        Alone, a model may map the whole budget. The pages of running requests cannot be
        given back, and an engine reuses the pages its finished requests free, so a busy
        engine that took the budget keeps it while another engine's requests wait. While
        several models of a device have requests, each one's pools get a live limit
        (``kvctl limit``'s record) of the budget shared in proportion to its requests in
        flight and queued, at least ``kv_min_share`` of it; an idle model gets that least
        share (its cached prefixes go back). A pool over its limit admits no new request
        and shrinks as its requests finish; the limits are lifted once at most one model
        has requests (a model's ``kv_share`` stays its cap throughout)."""
        from kvcached_core.ipc import shm

        budget = self.cfg.device_budget
        floor = int(budget * self.cfg.kv_min_share)
        by_device: dict[str, list[ModelRuntime]] = {}
        for m in self.models.values():
            if m.state == "awake":
                by_device.setdefault(m.cfg.device, []).append(m)
        for models in by_device.values():
            demand = {m: m.inflight + m.waiting for m in models}
            total = sum(demand.values())
            contended = sum(1 for d in demand.values() if d) >= 2
            for m in models:
                if not contended:
                    limit = shm.NO_LIMIT
                else:
                    limit = max(floor, int(budget * demand[m] / total))
                    if m.cfg.kv_share is not None:
                        limit = min(limit, int(m.cfg.kv_share * budget))
                if limit == m.kv_limit or (
                        limit != shm.NO_LIMIT and m.kv_limit != shm.NO_LIMIT
                        and abs(limit - m.kv_limit) < budget // 32):
                    continue
                pools = [p for p in shm.list_pools(m.engine.namespace, self.cfg.shm_dir)
                         if p.alive]
                if not pools:
                    log.debug("%s: no live KV pool in namespace %s to limit", m.cfg.name,
                              m.engine.namespace)
                    continue
                each = limit if limit == shm.NO_LIMIT else max(1, limit // len(pools))
                for p in pools:
                    shm.set_limit(m.engine.namespace, p.pool, each, self.cfg.shm_dir)
                was, m.kv_limit = m.kv_limit, limit
                if limit == shm.NO_LIMIT:
                    log.info("%s: KV limit lifted", m.cfg.name)
                else:  # set: info; moved with the demand (about once a second): debug
                    log.log(logging.INFO if was == shm.NO_LIMIT else logging.DEBUG,
                            "%s: KV limit %.1f MiB (%d of %d requests on %s)", m.cfg.name,
                            limit / (1 << 20), demand[m], total, m.cfg.device)

    # ------------------------------------------------------------ views

    def budget_readings(self) -> dict[str, Any]:
        """The device budget records of the configured devices."""
        try:
            from kvcached_core.ipc.budget import list_budgets
        except ImportError:
            return {}
        keys = {device_budget_key(m.cfg.device) for m in self.models.values()}
        try:
            return {r.device: r for r in list_budgets(self.cfg.shm_dir) if r.device in keys}
        except Exception:  # noqa: BLE001 - a scrape must not fail on one record
            return {}

    def kv_mapped(self) -> dict[str, int]:
        """KV bytes each model's engine has mapped (its live budget slots)."""
        by_ns = {m.engine.namespace: m.cfg.name for m in self.models.values()}
        out: dict[str, int] = {}
        for reading in self.budget_readings().values():
            for s in reading.slots:
                name = by_ns.get(s.name.split("/")[0])
                if name is not None and s.alive:
                    out[name] = out.get(name, 0) + s.mapped
        return out

    def describe(self) -> list[dict[str, Any]]:
        """One entry per model: what /v1/models and /health report."""
        kv = self.kv_mapped()
        return [{"id": m.cfg.name, "engine": m.cfg.engine, "device": m.cfg.device,
                 "state": m.state, "sleep_mode": m.sleep_mode.name,
                 "namespace": m.engine.namespace, "pid": m.engine.pid if m.engine.running else None,
                 "inflight": m.inflight, "queued": m.waiting, "kv_mapped_bytes": kv.get(m.cfg.name, 0),
                 "kv_limit_bytes": None if m.kv_limit < 0 else m.kv_limit,
                 "weight_bytes": m.cfg.weight_bytes, "last_error": m.last_error}
                for m in self.models.values()]
