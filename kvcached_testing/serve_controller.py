"""A kvcached-serve controller run as its own process, as the tests, benchmark and demo run it.

This checkout's ``kvcached_serve/src`` goes on the controller's ``PYTHONPATH`` (installed or
not, the controller and the code driving it go together) and the caller's ``KVCACHED_*``
settings stay out of it: the controller gives each engine its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["SERVE_SRC", "controller_env", "free_port", "log_tail", "start_controller",
           "wait_healthy", "write_config"]

SERVE_SRC = Path(__file__).resolve().parents[1] / "kvcached_serve" / "src"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def controller_env() -> dict[str, str]:
    """This environment without ``KVCACHED_*``, with this checkout's kvcached-serve."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SERVE_SRC), env.get("PYTHONPATH")]))
    return env


def write_config(path: Path, cfg: dict[str, Any]) -> Path:
    """``cfg`` as a YAML config file at ``path``."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def start_controller(cfg: dict[str, Any], work: Path) -> tuple[subprocess.Popen, str, Path]:
    """Write ``cfg`` to ``work/serve.yaml`` and start ``python -m kvcached_serve`` on it, its
    output in ``work/controller.log``. Returns ``(process, url, log)``; the URL is
    ``cfg["port"]``'s on 127.0.0.1."""
    path = write_config(work / "serve.yaml", cfg)
    log = work / "controller.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvcached_serve", str(path)],
                                env=controller_env(), stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{cfg['port']}", log


def log_tail(log: Path, n: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> float:
    """Seconds until ``url``'s ``/health`` answered 200 (every eager engine up).

    Raises:
        RuntimeError: the controller exited, or was not healthy within ``timeout`` seconds
            (with the end of its log).
    """
    import httpx

    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the controller exited ({proc.returncode}):\n{log_tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the controller was not healthy in {timeout:g} s:\n"
                               f"{log_tail(log)}")
        time.sleep(0.5)
