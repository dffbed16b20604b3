"""``kvctl``: inspect and control kvcached.

Each subcommand registers itself in :func:`build_parser` through an
``add_<name>_command(subparsers)`` function that sets ``func`` (the handler,
called with the parsed arguments and returning the exit status).

Subcommands:

* ``doctor [--json] [--import-engines]``: installed plugins, engine versions
  and the patches that would apply; exit status 0 when no problem was found,
  1 otherwise.
* ``list [--json]``: every live KV pool on this machine (namespace, pool,
  limit, used and reserved bytes), from the pools' shared-memory segments.
* ``status [--namespace NS] [--json] [--remove-stale]``: every device (budget,
  mapped bytes) with its engines and pools (mapped, used, reserved, limit,
  map / unmap totals and mean latency), and the records of dead engines; the
  one-shot form of ``kvtop``. Reads shared memory only.
* ``limit NAMESPACE POOL SIZE [--json]``: set a pool's memory limit (``2G``, ``512M``,
  ``40%`` of the device, or ``none``); the pool's owner applies it within a
  fraction of a second, also when idle (reserve and evictable cache at once,
  pages in use as they are freed).
* ``budget [SIZE] [--device KEY] [--json]``: show or set the per-device budget
  shared by every engine of this user (:mod:`kvcached_core.ipc.budget`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = [
    "add_budget_command",
    "add_doctor_command",
    "add_limit_command",
    "add_list_command",
    "add_status_command",
    "build_parser",
    "main",
    "render_doctor",
]


def _yes_no(value: bool | None) -> str:
    return "invalid" if value is None else ("yes" if value else "no")


def render_doctor(report: dict[str, Any], out: TextIO) -> None:
    """Write a doctor report (see :func:`kvcached_core.plugins.doctor.build_report`) as text."""
    write = out.write
    write(f"kvcached-core {report['kvcached_core']['version']} (Python {report['python']})\n")
    write(f"enabled: {_yes_no(report['enabled'])}   strict: {_yes_no(report['strict'])}\n")
    settings = [f"{k}={v}" for k, v in report["env"].items() if v is not None]
    write(f"settings: {', '.join(settings) or 'none'}\n")

    write(f"\nplugins (entry-point group {report['entry_point_group']}):\n")
    if not report["plugins"]:
        write("  none installed\n")
    for plugin in report["plugins"]:
        dist = f"{plugin['distribution']} {plugin['distribution_version'] or ''}".strip()
        line = f"  {plugin['name']:<16} {dist:<28} {plugin['status']}"
        if plugin["hooks"]:
            line += f"  hooks: {', '.join(plugin['hooks'])}"
        if plugin["error"]:
            line += f"  ({plugin['error']})"
        write(line + "\n")

    write("\nengines:\n")
    if not report["engines"]:
        write("  no engine adapter registered\n")
    for engine in report["engines"]:
        version = engine["version"] or {}
        found = version.get("value") or "unknown"
        if version.get("source"):
            found += f" ({version['source']})"
        elif engine["installed"] is False:
            found = "not installed"
        in_range = {True: "supported", False: "NOT supported", None: ""}[engine["in_range"]]
        write(
            f"  {engine['name']}: adapter from {engine['plugin']} ({engine['distribution']}), "
            f"supports {engine['versions'] or '-'}; found {found} {in_range}\n"
        )
        if version.get("note"):
            write(f"    note: {version['note']}\n")
        for patch in engine["patches"]:
            reason = f"  ({patch['reason']})" if patch["reason"] else ""
            write(f"    {patch['verdict']:<12} {patch['name']}  ->  {patch['target']}{reason}\n")
        if engine["bootstrap"]:
            boot = engine["bootstrap"]
            write(f"    bootstrapped in this process: {boot['status']} {boot['reason']}\n")

    write("\nbackends contributed by plugins:\n")
    if not report["backends"]:
        write("  none\n")
    for backend in report["backends"]:
        devices = ", ".join(backend["devices"]) or "-"
        write(f"  {backend['name']} (devices: {devices}) from {backend['plugin']}\n")

    write("\nproblems:\n" if report["problems"] else "\nno problems found\n")
    for problem in report["problems"]:
        write(f"  - {problem}\n")


def _run_doctor(args: argparse.Namespace) -> int:
    from kvcached_core.plugins.doctor import build_report

    report = build_report(import_engines=args.import_engines)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render_doctor(report, sys.stdout)
    return 0 if report["ok"] else 1


def add_doctor_command(subparsers: Any) -> None:
    """Add ``kvctl doctor`` to ``subparsers``."""
    parser = subparsers.add_parser(
        "doctor",
        help="check installed plugins, engine versions and patches",
        description="Report kvcached's plugins, the engines they adapt, the versions "
        "found and the patches that would apply. Exit status 1 when a problem is found.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--import-engines",
        action="store_true",
        help="import engines and patch targets (slower; reads __version__, checks targets)",
    )
    parser.set_defaults(func=_run_doctor)


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f} MiB"


def _run_list(args: argparse.Namespace) -> int:
    from kvcached_core.ipc.shm import list_pools

    pools = list_pools()
    if args.json:
        json.dump({"schema": "kvcached.pools/1", "pools": [
            {"namespace": p.namespace, "pool": p.pool, "pid": p.pid, "alive": p.alive,
             "limit": p.limit if p.has_limit else None, "mapped": p.mapped, "used": p.used,
             "reserved": p.reserved, "capacity": p.capacity} for p in pools]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if not pools:
        print("no kvcached pools on this machine")
        return 0
    print(f"{'namespace':<28}{'pool':<12}{'pid':>8}{'limit':>14}{'used':>14}{'reserved':>14}")
    for p in pools:
        limit = _mib(p.limit) if p.has_limit else "none"
        pid = str(p.pid) if p.alive else f"{p.pid}(gone)"
        print(f"{p.namespace:<28}{p.pool:<12}{pid:>8}{limit:>14}{_mib(p.used):>14}{_mib(p.reserved):>14}")
    return 0


def add_list_command(subparsers: Any) -> None:
    """Add ``kvctl list`` to ``subparsers``."""
    parser = subparsers.add_parser("list", help="list the live KV pools on this machine")
    parser.add_argument("--json", action="store_true", help="print the pools as JSON")
    parser.set_defaults(func=_run_list)


def _run_limit(args: argparse.Namespace) -> int:
    from kvcached_core.config import parse_size_spec
    from kvcached_core.errors import KVCachedError
    from kvcached_core.ipc.shm import NO_LIMIT, open_pool

    try:
        spec = None if args.size.strip().lower() == "none" else parse_size_spec(args.size, "SIZE")
        with open_pool(args.namespace, args.pool) as view:
            before = view.read()
            if not before.alive:
                raise KVCachedError(f"pool {args.pool} of namespace {args.namespace} belongs to "
                                    f"the dead process {before.pid} (a stale record)")
            limit = NO_LIMIT if spec is None else spec.resolve(before.device_total)
            view.set_limit(limit)
            stats = view.read()
    except KVCachedError as err:
        print(f"kvctl limit: {err}", file=sys.stderr)
        return 2
    if args.json:
        json.dump({"schema": "kvcached.limit/1", "namespace": stats.namespace,
                   "pool": stats.pool, "limit": stats.limit if stats.has_limit else None,
                   "bounded_by_capacity": stats.has_limit and stats.limit > stats.capacity,
                   "capacity": stats.capacity, "used": stats.used, "mapped": stats.mapped},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    shown = _mib(stats.limit) if stats.has_limit else "none"
    if stats.has_limit and stats.limit > stats.capacity:
        shown += f" (the pool's reservation, {_mib(stats.capacity)}, bounds it)"
    print(f"{stats.namespace} {stats.pool}: limit {shown} (used {_mib(stats.used)})")
    return 0


def add_limit_command(subparsers: Any) -> None:
    """Add ``kvctl limit`` to ``subparsers``."""
    parser = subparsers.add_parser(
        "limit", help="set a KV pool's memory limit",
        description="Set the memory limit of one KV pool (see kvctl list). The pool applies "
        "it within a fraction of a second, also when idle: its reserve and evictable "
        "prefix cache go at once; below what the pool uses, it stops growing and shrinks "
        "as requests finish.")
    parser.add_argument("namespace", help="the pool's namespace, as kvctl list shows it")
    parser.add_argument("pool", help="the pool's name, as kvctl list shows it")
    parser.add_argument("size", help="bytes (2G, 512M, 1048576), a share of the device "
                        "(40%%), or none")
    parser.add_argument("--json", action="store_true", help="print the new setting as JSON")
    parser.set_defaults(func=_run_limit)


def _run_status(args: argparse.Namespace) -> int:
    from kvcached_core.cli.view import snapshot
    from kvcached_core.errors import KVCachedError
    from kvcached_core.ipc.shm import remove_stale

    try:
        removed = remove_stale() if args.remove_stale else []
        snap = snapshot(args.namespace)
    except KVCachedError as err:
        print(f"kvctl status: {err}", file=sys.stderr)
        return 2
    if args.namespace is not None and not snap["devices"]:
        print(f"kvctl status: no live pool in namespace {args.namespace} "
              "(kvctl list shows the live pools)", file=sys.stderr)
        return 2
    if args.json:
        json.dump({**snap, "removed": removed}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for path in removed:
        print(f"removed the stale record {path}")
    if not snap["devices"]:
        print("no kvcached pools on this machine")
    for dev in snap["devices"]:
        budget = "none" if dev["budget"] is None else _mib(dev["budget"])
        print(f"device {dev['device']}: mapped {_mib(dev['mapped'])}, budget {budget}, "
              f"budget misses {dev['misses']}")
        for eng in dev["engines"]:
            print(f"  engine {eng['namespace']}")
            for p in eng["pools"]:
                limit = "none" if p["limit"] is None else _mib(p["limit"])
                lat = p["map_latency"]
                mean = "-" if lat["mean_ms"] is None else f"{lat['mean_ms']:.2f} ms"
                print(f"    {p['pool']:<14} pid {p['pid']:<8} mapped {_mib(p['mapped'])}, "
                      f"used {_mib(p['used'])}, reserved {_mib(p['reserved'])}, limit {limit}; "
                      f"{lat['count']} maps (mean {mean})")
    for s in snap["stale"]:
        print(f"stale: {s['namespace']} {s['pool']} of the dead process {s['pid']} "
              "(kvctl status --remove-stale removes it)")
    return 0


def add_status_command(subparsers: Any) -> None:
    """Add ``kvctl status`` to ``subparsers``."""
    parser = subparsers.add_parser(
        "status", help="KV memory per device and engine (kvtop, once)",
        description="Every device's budget and mapped bytes, its engines and their pools "
        "(mapped, used, reserved, limit, map/unmap counts and latency), and the records "
        "dead engines left. Reads shared memory only; never touches a device.")
    parser.add_argument("--namespace", default=None, help="one engine only")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    parser.add_argument("--remove-stale", action="store_true",
                        help="first remove the records of dead engines")
    parser.set_defaults(func=_run_status)


def _run_budget(args: argparse.Namespace) -> int:
    from kvcached_core.config import parse_size_spec
    from kvcached_core.errors import KVCachedError
    from kvcached_core.ipc.budget import NO_BUDGET, BudgetRecord, list_budgets

    try:
        if args.size is not None:
            spec = (None if args.size.strip().lower() == "none"
                    else parse_size_spec(args.size, "SIZE"))
            with BudgetRecord.open(args.device) as rec:
                rec.set_capacity(NO_BUDGET if spec is None else spec.resolve(rec.device_total))
        readings = [r for r in list_budgets() if args.device in (None, r.device)]
    except KVCachedError as err:
        print(f"kvctl budget: {err}", file=sys.stderr)
        return 2
    if args.json:
        json.dump({"schema": "kvcached.budgets/1", "budgets": [
            {"device": r.device, "capacity": r.capacity if r.has_budget else None,
             "mapped": r.mapped, "device_total": r.device_total or None,
             "pressure_gen": r.pressure_gen, "slots": [
                 {"name": s.name, "pid": s.pid, "alive": s.alive, "mapped": s.mapped,
                  "misses": s.misses, "given_bytes": s.given_bytes, "givebacks": s.givebacks,
                  "max_giveback_ms": s.max_giveback_ns / 1e6} for s in r.slots]}
            for r in readings]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if not readings:
        print("no device budget records on this machine")
    for r in readings:
        cap = _mib(r.capacity) if r.has_budget else "none"
        print(f"{r.device}: budget {cap}, mapped {_mib(r.mapped)}")
        for s in r.slots:
            pid = str(s.pid) if s.alive else f"{s.pid}(gone)"
            print(f"  {s.name:<40}{pid:>8}{_mib(s.mapped):>14}  misses {s.misses}  "
                  f"gave {_mib(s.given_bytes)} in {s.givebacks}")
    return 0


def add_budget_command(subparsers: Any) -> None:
    """Add ``kvctl budget`` to ``subparsers``."""
    parser = subparsers.add_parser(
        "budget", help="show or set the KV budget shared by all engines on a device",
        description="Show the per-device KV budgets, or set one: the KV bytes every pool "
        "of every engine of this user may map on the device together. An engine short "
        "of budget asks the others, which give back their reserve and evictable prefix "
        "cache.")
    parser.add_argument("size", nargs="?", help="bytes (8G), a share of the device (40%%), "
                        "or none; omit to show")
    parser.add_argument("--device", default=None,
                        help="device key: host, cuda0, ... (default when setting: host)")
    parser.add_argument("--json", action="store_true", help="print the budgets as JSON")

    def run(args: argparse.Namespace) -> int:
        if args.size is not None and args.device is None:
            args.device = "host"
        return _run_budget(args)

    parser.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvctl`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="kvctl", description="Inspect and control kvcached.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_doctor_command(subparsers)
    add_list_command(subparsers)
    add_status_command(subparsers)
    add_limit_command(subparsers)
    add_budget_command(subparsers)
    return parser


def _size_last(argv: list[str]) -> list[str]:
    """``kvctl limit``'s SIZE written like an option (``-5%``, ``-1G``) moved behind ``--``, so
    the size check names what is wrong with it instead of argparse missing an argument."""
    if not argv or argv[0] != "limit" or "--" in argv:
        return argv
    negative = [a for a in argv[1:] if re.fullmatch(r"-[0-9.][0-9A-Za-z.%]*", a)]
    if not negative:
        return argv
    return [a for a in argv if a not in negative] + ["--", *negative]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvctl`` and return its exit status."""
    parser = build_parser()
    args = parser.parse_args(_size_last(list(sys.argv[1:] if argv is None else argv)))
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
