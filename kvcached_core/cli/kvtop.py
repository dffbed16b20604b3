"""``kvtop``: a live terminal view of kvcached's memory, per device and per engine.

For every device: the shared budget and what all engines map on it; for every
engine (IPC namespace) and pool: mapped, used, reserved bytes, the limit, the
map rate (bytes mapped per second since the last refresh) and the mean map /
unmap latency. Read from the shared-memory records only, like ``kvctl
status`` (:mod:`kvcached_core.cli.view`): kvtop never creates a device
context and never changes anything. Records of dead engines are listed
below the table with the command that removes them.

Usage: ``kvtop [--interval S] [--namespace NS] [--once]``; Ctrl-C quits.
``--once`` prints one frame and exits (for scripts and pipes).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["build_parser", "main", "render"]


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _ms(lat: dict[str, Any]) -> str:
    return "-" if lat["mean_ms"] is None else f"{lat['mean_ms']:.2f}"


def render(snap: dict[str, Any], rates: dict[tuple[str, str], float]) -> Any:
    """The rich renderable of one snapshot (see :func:`kvcached_core.cli.view.snapshot`)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    stamp = time.strftime("%H:%M:%S", time.localtime(snap["time_ns"] / 1e9))
    parts.append(Text(f"kvtop  {stamp}  {len(snap['devices'])} device(s)", style="bold"))
    if not snap["devices"]:
        parts.append(Text("no kvcached pools on this machine"))
    for dev in snap["devices"]:
        budget = "none" if dev["budget"] is None else _size(dev["budget"])
        title = (f"device {dev['device']}: mapped {_size(dev['mapped'])}  budget {budget}"
                 f"  device {_size(dev['device_total'])}  budget misses {dev['misses']}")
        table = Table(title=title, title_justify="left", expand=False)
        for col in ("engine", "pool", "pid"):
            table.add_column(col)
        for col in ("mapped", "used", "reserved", "limit", "map rate", "map ms", "unmap ms"):
            table.add_column(col, justify="right")
        for eng in dev["engines"]:
            for i, p in enumerate(eng["pools"]):
                rate = rates.get((eng["namespace"], p["pool"]))
                over = p["limit"] is not None and p["mapped"] > p["limit"]
                table.add_row(
                    eng["namespace"] if i == 0 else "", p["pool"], str(p["pid"]),
                    _size(p["mapped"]), _size(p["used"]), _size(p["reserved"]),
                    Text(_size(p["limit"]) if p["limit"] is not None else "none",
                         style="red" if over else ""),
                    "-" if rate is None else f"{_size(int(rate))}/s",
                    _ms(p["map_latency"]), _ms(p["unmap_latency"]))
        parts.append(table)
    if snap["stale"]:
        names = ", ".join(f"{s['namespace']}/{s['pool']} (pid {s['pid']})" for s in snap["stale"])
        parts.append(Text(f"stale records of dead engines: {names}; "
                          "`kvctl status --remove-stale` removes them", style="yellow"))
    return Group(*parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtop", description="Live view of kvcached's KV memory per device and engine "
        "(read from shared memory; no device context).")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="seconds between refreshes (default 1)")
    parser.add_argument("--namespace", default=None, help="show one engine only")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvtop`` and return its exit status."""
    args = build_parser().parse_args(argv)
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        print("kvtop: needs the rich package (pip install rich)", file=sys.stderr)
        return 2
    from kvcached_core.cli.view import rates, snapshot
    from kvcached_core.errors import KVCachedError

    if not args.interval > 0:
        print(f"kvtop: --interval {args.interval} is not a positive number of seconds",
              file=sys.stderr)
        return 2
    console = Console()
    try:
        snap = snapshot(args.namespace)
        if args.namespace is not None and not snap["devices"]:
            print(f"kvtop: no live pool in namespace {args.namespace} (kvctl list shows the "
                  "live pools)", file=sys.stderr)
            return 2
        if args.once:
            console.print(render(snap, {}))
            return 0
        prev = snap
        with Live(render(snap, {}), console=console, auto_refresh=False,
                  screen=console.is_terminal) as live:
            while True:
                time.sleep(args.interval)
                snap = snapshot(args.namespace)
                live.update(render(snap, rates(prev, snap)), refresh=True)
                prev = snap
    except KVCachedError as err:
        print(f"kvtop: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
