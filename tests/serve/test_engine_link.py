"""The controller's link to an engine's server, against a real socket server standing in for
one: a connection the server closes without answering (its keep-alive timeout closing an idle
connection just as the controller reuses it) is sent again once while the engine runs, and
never to an engine that exited."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve.conftest import serve_importable

pytestmark = pytest.mark.skipif(not serve_importable(), reason="kvcached-serve's dependencies "
                                "are not installed here")

ANSWER = b'{"ok": true}'


async def _server(drop_first: int) -> tuple[asyncio.base_events.Server, list[bytes]]:
    """A server that closes its first ``drop_first`` connections after reading the request
    (no answer), then answers 200 with ``ANSWER``. Returns it and the requests it read."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        seen.append(await reader.readexactly(length))
        if len(seen) > drop_first:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), seen


def _engine(tmp_path: Path, port: int, running: bool):
    from kvcached_serve.config import parse_config
    from kvcached_serve.engines import EngineProcess

    cfg = parse_config({"models": [{"name": "a", "engine": "vllm", "model": str(tmp_path)}]})
    engine = EngineProcess(cfg, cfg.models[0], tmp_path)
    engine.port, engine.base_url = port, f"http://127.0.0.1:{port}"
    # A real process stands for the engine's: alive, or already exited.
    engine.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"
                                    if running else "pass"])
    if not running:
        engine.proc.wait()
    return engine


def _send(tmp_path: Path, drop_first: int, running: bool) -> tuple[object, list[bytes]]:
    import httpx

    async def main():
        server, seen = await _server(drop_first)
        engine = _engine(tmp_path, server.sockets[0].getsockname()[1], running)
        try:
            async with server, httpx.AsyncClient() as client:
                try:
                    response = await engine.send(client, "/v1/completions", b'{"model": "a"}')
                    return (response.status_code, await response.aread()), seen
                except httpx.HTTPError as exc:
                    return exc, seen
        finally:
            if engine.proc.poll() is None:
                engine.proc.kill()
            engine.proc.wait()

    return asyncio.run(main())


def test_a_connection_closed_before_the_answer_is_sent_again_once(tmp_path: Path):
    assert _send(tmp_path, drop_first=1, running=True) == ((200, ANSWER), [b'{"model": "a"}'] * 2)
    # Closed twice: the second failure is the request's (the proxy answers 502 with it).
    result, seen = _send(tmp_path, drop_first=2, running=True)
    assert isinstance(result, Exception) and len(seen) == 2


def test_an_engine_that_exited_is_not_asked_again(tmp_path: Path):
    result, seen = _send(tmp_path, drop_first=1, running=False)
    assert isinstance(result, Exception) and len(seen) == 1
