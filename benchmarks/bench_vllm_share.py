"""Two engines on the CPU sharing one device budget: giveback and live limits.

    .venv-vllm/bin/python benchmarks/bench_vllm_share.py                      # vLLM + vLLM
    .venv-vllm/bin/python benchmarks/bench_vllm_share.py --a-engine sglang   # SGLang + vLLM

Engine B is a ``vllm.LLM`` with kvcached; engine A is another one, or with
``--a-engine sglang`` an ``sglang.Engine`` with kvcached (the release of
``--sglang`` from ``.sglang/``). The scenario (A's prefix cache given back to
B's burst, then a live limit on idle B) is ``kvcached_testing.shared_budget``'s,
which ``tests/vllm/test_shared_budget.py`` also runs; see its docs.

Results go to benchmarks/results/vllm-cpu-share.json (``--a-engine sglang``:
sglang-vllm-cpu-share.json) with the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from _timing import run_info, save_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvcached_testing

from kvcached_testing.shared_budget import run_share  # noqa: E402
from kvcached_testing.tiny_model import build_tiny_llama  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-bundles", type=int, default=10)
    parser.add_argument("--a-prompts", type=int, default=14)
    parser.add_argument("--b-prompts", type=int, default=12)
    parser.add_argument("--length", type=int, default=1800)
    parser.add_argument("--a-engine", choices=("vllm", "sglang"), default="vllm")
    parser.add_argument("--sglang", default="0.5.23", help="SGLang release of engine A")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    a_sglang = args.sglang if args.a_engine == "sglang" else None
    name = "vllm-cpu-share" if a_sglang is None else "sglang-vllm-cpu-share"
    with tempfile.TemporaryDirectory(prefix="kvshare-") as tmp:
        work = Path(tmp)
        model = build_tiny_llama(work / "model")
        result = run_share(model, work, budget_bundles=args.budget_bundles,
                           a_prompts=args.a_prompts, b_prompts=args.b_prompts,
                           length=args.length, a_sglang=a_sglang)
    result["b"].pop("tokens")
    import vllm

    out = {**run_info(name, vllm=vllm.__version__), **result}
    path = save_json(args.out or ROOT / "benchmarks" / "results" / f"{name}.json", out)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
