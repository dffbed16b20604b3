"""Where an engine's Python threads spend their time: a sampling profiler for benchmarks.

With ``KVBENCH_STACKS=DIR`` set and this folder first on ``PYTHONPATH``, every
Python process (and every child it forks) samples the stacks of all its threads
every ``KVBENCH_STACKS_MS`` milliseconds (default 5) and rewrites
``DIR/<pid>.json`` every two seconds: per thread, the samples taken and, per
function (``file:qualname``), how many samples had it on the stack
(``inclusive``) and at the top (``self``). Counts times the period are
milliseconds. Without the variable nothing happens.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("KVBENCH_STACKS")


def _start() -> None:
    period = float(os.environ.get("KVBENCH_STACKS_MS", "5")) / 1000
    threads: dict[str, dict] = {}
    path = os.path.join(_DIR, f"{os.getpid()}.json")
    os.makedirs(_DIR, exist_ok=True)

    def name(code) -> str:
        return f"{os.path.basename(code.co_filename)}:{getattr(code, 'co_qualname', code.co_name)}"

    def dump() -> None:
        out = {"argv": sys.argv[:3], "period_ms": period * 1000, "threads": {}}
        for tname, t in threads.items():
            top = sorted(t["inclusive"].items(), key=lambda kv: -kv[1])[:400]
            out["threads"][tname] = {
                "samples": t["samples"], "inclusive": dict(top),
                "self": dict(sorted(t["self"].items(), key=lambda kv: -kv[1])[:100])}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, path)

    def run() -> None:
        me = threading.get_ident()
        last = time.monotonic()
        while True:
            time.sleep(period)
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                t = threads.setdefault(names.get(ident, str(ident)),
                                       {"samples": 0, "inclusive": {}, "self": {}})
                t["samples"] += 1
                seen = set()
                leaf = True
                while frame is not None:
                    n = name(frame.f_code)
                    if leaf:
                        t["self"][n] = t["self"].get(n, 0) + 1
                        leaf = False
                    if n not in seen:
                        seen.add(n)
                        t["inclusive"][n] = t["inclusive"].get(n, 0) + 1
                    frame = frame.f_back
            if time.monotonic() - last > 2.0:
                last = time.monotonic()
                try:
                    dump()
                except OSError:
                    pass

    threading.Thread(target=run, name="kvbench-stacks", daemon=True).start()


if _DIR:
    _start()
    os.register_at_fork(after_in_child=_start)
