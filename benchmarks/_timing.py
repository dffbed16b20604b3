"""Timing and reporting helpers shared by the IPC benchmarks.

Imported by the benchmark scripts as ``_timing`` (their own directory is on
``sys.path`` when they run as ``python benchmarks/<name>.py``).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["command_line", "map_unmap_pair", "median_ratio", "print_table", "run_info", "summary",
           "timed", "versions", "write_result"]


def timed(fn: Callable[[int], None], n: int, offset: int = 0) -> list[float]:
    """Microseconds of ``fn(i)`` for ``n`` calls, ``i`` counting from ``offset``."""
    out = []
    for i in range(offset, offset + n):
        t0 = time.perf_counter_ns()
        fn(i)
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def summary(xs: Sequence[float], per: int = 1) -> dict[str, float]:
    """Median, p90, p99 and mean of ``xs`` (microseconds), each divided by ``per``."""
    xs = sorted(x / per for x in xs)
    q = statistics.quantiles(xs, n=100)
    return {"median_us": round(statistics.median(xs), 1), "p90_us": round(q[89], 1),
            "p99_us": round(q[98], 1), "mean_us": round(statistics.fmean(xs), 1), "n": len(xs)}


def map_unmap_pair(map_one: Callable[[int], None], unmap_one: Callable[[int], None],
                   pages: int, n: int, into: dict[str, list[float]], tag: str) -> None:
    """Time ``n`` maps and their unmaps, cycling ``i % pages`` as the argument.

    The microseconds go to ``into["map_<tag>"]`` and ``into["unmap_<tag>"]``.
    """
    for i in range(n):
        p = i % pages
        t0 = time.perf_counter_ns()
        map_one(p)
        t1 = time.perf_counter_ns()
        unmap_one(p)
        t2 = time.perf_counter_ns()
        into[f"map_{tag}"].append((t1 - t0) / 1e3)
        into[f"unmap_{tag}"].append((t2 - t1) / 1e3)


def command_line() -> str:
    """How this benchmark was started, for the results file."""
    return "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])


def source_commit() -> str | None:
    """The commit the run's code is (``git rev-parse HEAD``; where the checkout travelled
    without its history, as to a GPU machine, ``KVCACHED_COMMIT``)."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            return out.stdout.strip()
    except OSError:
        pass
    return os.environ.get("KVCACHED_COMMIT") or None


def versions(*dists: str) -> dict[str, str]:
    """The installed versions of those of ``dists`` that are installed."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in dists:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return out


def run_info(benchmark: str, **fields: Any) -> dict[str, Any]:
    """The head of a results file: benchmark name, command line, commit, ``fields``, then the
    machine."""
    return {"benchmark": benchmark, "command": command_line(), "commit": source_commit(), **fields,
            "cpus": len(os.sched_getaffinity(0)), "host": platform.node(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}


def median_ratio(latency: dict[str, dict[str, float]], num: str, den: str) -> float:
    """``latency[num]`` over ``latency[den]``, by median, to three decimals."""
    return round(latency[num]["median_us"] / latency[den]["median_us"], 3)


def print_table(latency: dict[str, dict[str, float]], title: str) -> None:
    """Print median, p90 and p99 of each :func:`summary` in ``latency``."""
    print(f"{title:<18}{'median us':>10}{'p90 us':>9}{'p99 us':>9}")
    for key, r in latency.items():
        print(f"{key:<18}{r['median_us']:>10}{r['p90_us']:>9}{r['p99_us']:>9}")


#: The checkout these benchmarks run from.
ROOT = Path(__file__).resolve().parents[1]
_IPC_DIR = re.compile(r"/tmp/kvcached-\d+/|/run/user/\d+/kvcached/")
_LOCAL_PATH = re.compile(r"(?<![\w.$])/(?:work|root|home|tmp|var/tmp)(?:/[^\s\"',;:()\[\]]+)*")


def portable(value: Any) -> Any:
    """``value`` with no path of the machine it ran on: the checkout becomes relative (``.``),
    kvcached's IPC directory ``$KVCACHED_IPC_DIR``, any other path under a home, work or
    temporary folder ``$LOCAL/`` and its last two parts (an output folder, a temporary
    model). Installed software's paths (``/usr``, ``/opt``) stay: they tell the host."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    if not isinstance(value, str):
        return value
    root = str(ROOT)
    text = value.replace(root + "/", "").replace(root, ".")
    text = _IPC_DIR.sub("$KVCACHED_IPC_DIR/", text)
    return _LOCAL_PATH.sub(lambda m: "$LOCAL/" + "/".join(m.group(0).split("/")[-2:]), text)


def save_json(path: str | Path, result: dict[str, Any], indent: int = 2) -> Path:
    """Write a results file (parents created), with no local path (:func:`portable`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(portable(result), indent=indent) + "\n")
    return path


def write_result(out: str | Path, result: dict[str, Any], title: str) -> Path:
    """Write ``result`` as indented JSON to ``out`` (:func:`save_json`), print its table.

    The table (headed ``title``) is of ``result["latency"]``; returns the path written.
    """
    path = save_json(out, result)
    print_table(result["latency"], title)
    print(f"wrote {path}")
    return path
