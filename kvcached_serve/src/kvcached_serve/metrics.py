"""The controller's Prometheus metrics (one registry per controller)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from kvcached_serve.controller import Controller

__all__ = ["Metrics", "STATES"]

STATES = ("asleep", "starting", "awake", "sleeping", "failed", "stopped")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0,
            120.0, 300.0)
_WAKE = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 300.0, 600.0)


class Metrics:
    """Counters and histograms the request path and the controller update; gauges of the
    models' states and KV memory are read at scrape time."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvcached_serve_requests", "Requests by model and HTTP status",
                                ["model", "status"], registry=r)
        self.ttft = Histogram("kvcached_serve_ttft_seconds", "Time to the first streamed "
                              "token, queueing and waking included", ["model"],
                              buckets=_LATENCY, registry=r)
        self.e2e = Histogram("kvcached_serve_e2e_latency_seconds", "Request latency, arrival "
                             "to last byte", ["model"], buckets=_LATENCY, registry=r)
        self.queue_wait = Histogram("kvcached_serve_queue_wait_seconds", "Time a request "
                                    "waited for its model to start or wake", ["model"],
                                    buckets=_LATENCY, registry=r)
        self.queue_timeouts = Counter("kvcached_serve_queue_rejections", "Requests answered "
                                      "503 because their model was not ready in time or the "
                                      "queue was full", ["model", "reason"], registry=r)
        self.sleeps = Counter("kvcached_serve_sleeps", "Models put to sleep", ["model", "reason"],
                              registry=r)
        self.wakes = Counter("kvcached_serve_wakes", "Models woken (first starts included)",
                             ["model"], registry=r)
        self.wake_latency = Histogram("kvcached_serve_wake_latency_seconds", "From the decision "
                                      "to wake to the engine answering health; mode: the sleep "
                                      "mode it wakes from, or start (a first start or a "
                                      "restart)", ["model", "mode"],
                                      buckets=_WAKE, registry=r)
        self.sleep_latency = Histogram("kvcached_serve_sleep_latency_seconds", "Time to put a "
                                       "model to sleep", ["model", "mode"], buckets=_WAKE,
                                       registry=r)
        self.restarts = Counter("kvcached_serve_engine_restarts", "Engines restarted after "
                                "they exited by themselves", ["model"], registry=r)
        self.crashes = Counter("kvcached_serve_engine_exits", "Engines that exited by "
                               "themselves", ["model"], registry=r)
        self.queue_depth = Gauge("kvcached_serve_queue_depth", "Requests waiting for their "
                                 "model", ["model"], registry=r)
        self.inflight = Gauge("kvcached_serve_inflight_requests", "Requests at the engine",
                              ["model"], registry=r)

    def attach(self, controller: Controller) -> None:
        self.registry.register(_StateCollector(controller))


class _StateCollector:
    """Model state, awake flag, weight and KV bytes, read when scraped."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        awake = GaugeMetricFamily("kvcached_serve_model_awake", "1 when the model is awake "
                                  "(serving without a wake)", labels=["model", "engine", "device"])
        state = GaugeMetricFamily("kvcached_serve_model_state", "1 for the model's current "
                                  "state", labels=["model", "state"])
        weights = GaugeMetricFamily("kvcached_serve_model_weight_bytes", "Weight bytes the "
                                    "model holds on its device while awake", labels=["model"])
        kv = GaugeMetricFamily("kvcached_serve_kv_mapped_bytes", "KV bytes the model's engine "
                               "has mapped (its slots in the device budget)", labels=["model"])
        limit = GaugeMetricFamily("kvcached_serve_kv_limit_bytes", "The live KV limit the "
                                  "controller set on the model while the budget is contended "
                                  "(-1: none)", labels=["model"])
        budget = GaugeMetricFamily("kvcached_serve_device_budget_bytes", "KV bytes all engines "
                                   "of a device may map together", labels=["device"])
        mapped = GaugeMetricFamily("kvcached_serve_device_kv_mapped_bytes", "KV bytes mapped "
                                   "on a device by every engine", labels=["device"])
        cap = GaugeMetricFamily("kvcached_serve_weight_capacity_bytes", "Weight bytes the "
                                "awake models of a device may hold", labels=["device"])
        kv_by_model = self.c.kv_mapped()
        for m in self.c.models.values():
            name = m.cfg.name
            awake.add_metric([name, m.cfg.engine, m.cfg.device], 1.0 if m.state == "awake" else 0.0)
            for s in STATES:
                state.add_metric([name, s], 1.0 if m.state == s else 0.0)
            weights.add_metric([name], float(m.cfg.weight_bytes or 0))
            kv.add_metric([name], float(kv_by_model.get(name, 0)))
            limit.add_metric([name], float(m.kv_limit))
        for dev, reading in self.c.budget_readings().items():
            budget.add_metric([dev], float(reading.capacity if reading.has_budget else -1))
            mapped.add_metric([dev], float(reading.mapped))
        if self.c.cfg.weight_capacity is not None:
            for dev in sorted({m.cfg.device for m in self.c.models.values()}):
                cap.add_metric([dev], float(self.c.cfg.weight_capacity))
        yield from (awake, state, weights, kv, limit, budget, mapped, cap)
