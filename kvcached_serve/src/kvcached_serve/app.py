"""The OpenAI-compatible HTTP endpoint (Starlette), routing on the request's ``model``.

Routes:

* ``POST /v1/completions``, ``POST /v1/chat/completions`` — forwarded to the model's engine;
  streamed responses (``"stream": true``) pass through chunk by chunk as the engine sends them.
* ``GET /v1/models``, ``GET /v1/models/{model}`` — every configured model, awake or not (a
  sleeping model is served: its request wakes it), with its state.
* ``GET /health`` — 200 once the eager models' first starts are over, 503 before; the body
  lists each model's state.
* ``GET /metrics`` — Prometheus text.
* ``POST /admin/models/{model}/sleep`` / ``.../wake`` — operator controls.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed body, 404 for an unknown model or route, 503 with ``Retry-After`` when the model's
queue is full or it did not become ready in time, 502 when its engine failed mid-request
(for a stream: an ``error`` event, then the stream ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvcached_serve.controller import Controller, NotReady

__all__ = ["create_app", "openai_error"]

log = logging.getLogger("kvcached_serve")


#: What ``/health`` tells about each engine.
_ENGINE_FIELDS = ("engine", "device", "state", "sleep_mode", "namespace", "pid", "inflight",
                  "queued", "kv_mapped_bytes", "kv_limit_bytes", "last_error")


def openai_error(status: int, message: str, type_: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


def _bad_request(message: str, param: str | None = None) -> JSONResponse:
    return openai_error(400, message, "invalid_request_error", "invalid_request", param)


class _FirstToken:
    """Spots the first streamed event that carries generation (not chat's role preamble)."""

    def __init__(self) -> None:
        self.buf = b""
        self.seen = False

    def feed(self, chunk: bytes) -> bool:
        """True when ``chunk`` completes the first generated event."""
        if self.seen:
            return False
        self.buf += chunk
        while b"\n\n" in self.buf:
            event, self.buf = self.buf.split(b"\n\n", 1)
            for line in event.splitlines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    self.seen = True
                    return True
                try:
                    obj = json.loads(data)
                except ValueError:
                    continue
                choices = obj.get("choices") or []
                if any("text" in c or _generated_delta(c.get("delta")) for c in choices) or (
                        "error" in obj):
                    self.seen = True
                    return True
        return False


def _generated_delta(delta: Any) -> bool:
    if not isinstance(delta, dict):
        return False
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                or ("content" in delta and "role" not in delta))


class _Relay(StreamingResponse):
    """A streamed answer that runs ``close`` once it ends, however it ends: the relay's own
    ``finally`` runs only if the relay started, and a client gone before the first chunk
    leaves it unstarted (the request would stay counted in flight)."""

    def __init__(self, content: AsyncIterator[bytes], close: Any, **kw: Any) -> None:
        super().__init__(content, **kw)
        self._close = close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def create_app(controller: Controller) -> Starlette:
    """The ASGI app; its lifespan starts and stops ``controller``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await controller.start()
        initial = asyncio.create_task(controller.wait_started())
        app.state.initial = initial
        try:
            yield
        finally:
            initial.cancel()
            await controller.stop()

    async def proxy(request: Request, path: str) -> Response:
        t0 = time.monotonic()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return _bad_request(f"The request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _bad_request(f"The request body must be a JSON object, not "
                                f"{type(body).__name__}")
        name = body.get("model")
        if not isinstance(name, str) or not name:
            return _bad_request("'model' is required: the name of one of the served models "
                                f"({', '.join(controller.models)})", "model")
        if name not in controller.models:
            return openai_error(404, f"The model '{name}' does not exist; this server serves "
                                f"{', '.join(controller.models)}", "invalid_request_error",
                                "model_not_found", "model")
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            return _bad_request(f"'stream' must be true or false, not {stream!r}", "stream")
        metrics = controller.metrics
        try:
            await controller.acquire(name)
        except NotReady as exc:
            metrics.requests.labels(name, "503").inc()
            return openai_error(503, str(exc), "server_error", "model_not_ready",
                                headers={"Retry-After": str(exc.retry_after)})
        released = False

        def done(status: int) -> None:
            nonlocal released
            if not released:
                released = True
                controller.release(name)
                metrics.requests.labels(name, str(status)).inc()
                metrics.e2e.labels(name).observe(time.monotonic() - t0)

        m = controller.models[name]
        metrics.inflight.labels(name).set(m.inflight)
        try:
            upstream = await m.engine.send(controller.client, path, raw)
        except httpx.HTTPError as exc:
            done(502)
            return openai_error(502, f"The engine of model '{name}' did not answer: "
                                f"{type(exc).__name__}: {exc}", "server_error", "engine_failed")
        is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        if not (stream and is_sse):
            try:
                content = await upstream.aread()
            except httpx.HTTPError as exc:
                done(502)
                return openai_error(502, f"The engine of model '{name}' failed during the "
                                    f"request: {type(exc).__name__}: {exc}", "server_error",
                                    "engine_failed")
            finally:
                await upstream.aclose()
            done(upstream.status_code)
            return Response(content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type", "application/json"))

        async def relay() -> AsyncIterator[bytes]:
            first = _FirstToken()
            status = upstream.status_code
            try:
                async for chunk in upstream.aiter_raw():
                    if first.feed(chunk):
                        metrics.ttft.labels(name).observe(time.monotonic() - t0)
                    yield chunk
            except httpx.HTTPError as exc:
                status = 502
                err = {"error": {"message": f"The engine of model '{name}' failed during the "
                                 f"stream: {type(exc).__name__}: {exc}", "type": "server_error",
                                 "param": None, "code": "engine_failed"}}
                yield f"data: {json.dumps(err)}\n\n".encode()
            finally:
                await upstream.aclose()
                done(status)

        async def close() -> None:  # also when the client left before the relay began
            await upstream.aclose()
            done(499)

        return _Relay(relay(), close, status_code=upstream.status_code,
                      media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    def _model_entry(d: dict[str, Any]) -> dict[str, Any]:
        return {"id": d["id"], "object": "model", "created": created, "owned_by": "kvcached-serve",
                "engine": d["engine"], "device": d["device"], "state": d["state"],
                "sleep_mode": d["sleep_mode"], "kv_mapped_bytes": d["kv_mapped_bytes"]}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list",
                             "data": [_model_entry(d) for d in controller.describe()]})

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        for d in controller.describe():
            if d["id"] == name:
                return JSONResponse(_model_entry(d))
        return openai_error(404, f"The model '{name}' does not exist", "invalid_request_error",
                            "model_not_found", "model")

    async def health(request: Request) -> Response:
        initial = getattr(request.app.state, "initial", None)
        ready = controller.started and not controller.stopping and initial is not None and initial.done()
        described = controller.describe()
        body = {"status": "ok" if ready else ("stopping" if controller.stopping else "starting"),
                "models": {d["id"]: d["state"] for d in described},
                "engines": {d["id"]: {k: d[k] for k in _ENGINE_FIELDS} for d in described}}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics_route(request: Request) -> Response:
        for m in controller.models.values():
            controller.metrics.inflight.labels(m.cfg.name).set(m.inflight)
            controller.metrics.queue_depth.labels(m.cfg.name).set(m.waiting)
        return Response(generate_latest(controller.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    async def admin(request: Request) -> Response:
        name, action = request.path_params["model"], request.path_params["action"]
        if name not in controller.models:
            return openai_error(404, f"The model '{name}' does not exist", "invalid_request_error",
                                "model_not_found", "model")
        if action == "sleep":
            slept = await controller.sleep(name, "admin")
            return JSONResponse({"model": name, "slept": slept,
                                 "state": controller.models[name].state})
        if action == "wake":
            try:
                await controller.acquire(name)
            except NotReady as exc:
                return openai_error(503, str(exc), "server_error", "model_not_ready",
                                    headers={"Retry-After": str(exc.retry_after)})
            controller.release(name)
            return JSONResponse({"model": name, "state": controller.models[name].state})
        return openai_error(404, f"No admin action '{action}' (sleep, wake)",
                            "invalid_request_error", "not_found")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return openai_error(404, f"No route {request.url.path}", "invalid_request_error",
                                "not_found")
        if exc.status_code == 405:
            return openai_error(405, f"{request.method} is not allowed on {request.url.path}",
                                "invalid_request_error", "method_not_allowed")
        return openai_error(exc.status_code, str(exc.detail), "invalid_request_error")

    created = int(time.time())
    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/admin/models/{model}/{action}", admin, methods=["POST"]),
    ], lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.controller = controller
    return app
