"""``kvcached-serve CONFIG``: run the endpoint and its engines until SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator, Sequence

from kvcached_serve.config import ConfigError, load_config

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcached-serve",
        description="One OpenAI-compatible endpoint in front of several vLLM / SGLang engines "
        "that share one device's memory through kvcached; idle models sleep and wake on demand.")
    p.add_argument("config", help="the YAML configuration (see docs/serve.md)")
    p.add_argument("--host", default=None, help="listen address (default: the config's host)")
    p.add_argument("--port", type=int, default=None, help="listen port (default: the config's)")
    p.add_argument("--check", action="store_true",
                   help="check the configuration, print it resolved as JSON, start nothing")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"kvcached-serve: {exc}", file=sys.stderr)
        return 2
    if args.host is not None:
        cfg.host = args.host
    if args.port is not None:
        cfg.port = args.port
    if args.check:
        json.dump(cfg.model_dump(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    import uvicorn

    from kvcached_serve.app import create_app
    from kvcached_serve.controller import Controller

    class Server(uvicorn.Server):
        """uvicorn's server, except that a SIGINT / SIGTERM it handled (every engine stopped)
        ends the process with status 0 instead of being raised again after the shutdown."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()

    app = create_app(Controller(cfg))
    server = Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=args.log_level,
                                   access_log=False, timeout_graceful_shutdown=5))
    server.run()
    return 0 if server.started else 1
