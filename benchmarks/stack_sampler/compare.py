"""Compare engines' stack samples (``bench_vllm_gpu.py --stacks DIR``): where one spent more time.

    python benchmarks/stack_sampler/compare.py DIR [--base vanilla] [--top 40] [--json OUT]

``DIR`` holds one folder per engine (``vanilla``, ``kvcached``, a variant, ``control``), each
with a ``<pid>.json`` per process (see ``sitecustomize.py``). Per engine, the thread that
ran vLLM's engine core loop (whose samples include ``EngineCoreProc.run_busy_loop``) is
compared function by function with the same thread of ``--base``: samples with the function
on the stack (inclusive), largest differences first, and the other threads' busiest
functions (kvcached's page thread, the worker's). Counts times the period are milliseconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CORE_LOOP = "core.py:EngineCoreProc.run_busy_loop"


def load(engine_dir: Path) -> dict[str, dict]:
    """Every thread of every process of one engine, keyed ``pid/thread``."""
    threads: dict[str, dict] = {}
    for f in sorted(engine_dir.glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for name, t in data.get("threads", {}).items():
            threads[f"{f.stem}/{name}"] = dict(t, period_ms=data.get("period_ms"))
    return threads


def core_thread(threads: dict[str, dict]) -> dict | None:
    """The engine core's loop thread: most samples with the core loop on the stack."""
    best = max(threads.values(), key=lambda t: t["inclusive"].get(CORE_LOOP, 0), default=None)
    return best if best and best["inclusive"].get(CORE_LOOP) else None


def compare(root: Path, base: str, top: int) -> dict:
    engines = {d.name: load(d) for d in sorted(root.iterdir()) if d.is_dir()}
    if base not in engines:
        raise SystemExit(f"no {base!r} folder in {root} (found {sorted(engines)})")
    cores = {n: core_thread(t) for n, t in engines.items()}
    ref = cores[base]
    if ref is None:
        raise SystemExit(f"{base}: no thread ran {CORE_LOOP}")
    out: dict = {"base": base, "period_ms": ref.get("period_ms"), "engine_core": {}, "others": {}}
    for name, core in cores.items():
        if core is None:
            out["engine_core"][name] = None
            continue
        funcs = set(core["inclusive"]) | set(ref["inclusive"])
        diff = sorted(((core["inclusive"].get(f, 0) - ref["inclusive"].get(f, 0), f)
                       for f in funcs), key=lambda x: -abs(x[0]))
        out["engine_core"][name] = {
            "samples": core["samples"],
            "core_loop": core["inclusive"].get(CORE_LOOP, 0),
            "largest_differences": [
                {"function": f, "samples": core["inclusive"].get(f, 0),
                 base: ref["inclusive"].get(f, 0), "difference": d}
                for d, f in diff[:top] if d],
            "self_top": sorted(core["self"].items(), key=lambda kv: -kv[1])[:15],
        }
        others = {k: t for k, t in engines[name].items() if t is not core}
        busiest = sorted(others.items(), key=lambda kv: -kv[1]["samples"])[:6]
        out["others"][name] = {
            k: {"samples": t["samples"],
                "self_top": sorted(t["self"].items(), key=lambda kv: -kv[1])[:8]}
            for k, t in busiest}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--base", default="vanilla")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", type=Path, help="write the comparison here too")
    args = ap.parse_args(argv)
    out = compare(args.dir, args.base, args.top)
    for name, core in out["engine_core"].items():
        if core is None:
            print(f"== {name}: no engine core thread")
            continue
        print(f"== {name}: engine core loop {core['core_loop']} samples "
              f"(x {out['period_ms']} ms)")
        for row in core["largest_differences"][:args.top]:
            print(f"  {row['difference']:+7d}  {row['samples']:7d} vs {row[args.base]:7d}  "
                  f"{row['function']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
