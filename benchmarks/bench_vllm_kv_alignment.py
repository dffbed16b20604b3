"""Where the KV cache starts inside a page, and vLLM's CPU decode step time.

    .venv-vllm/bin/python benchmarks/bench_vllm_kv_alignment.py

One vanilla vLLM engine on CPU (kvcached off), the tiny local Llama of
``bench_vllm.py`` (``kvcached_testing.vllm_cpu``), worker pinned to the first
core. Its worker holds the same KV cache in several backings at once and
switches the layers' KV views between them before each generate call
(``collective_rpc`` into a worker extension, prefix cache reset), in a
shuffled order per round; every call is a burst of ``--prompts`` requests,
the same prompts for every backing of a round (their greedy tokens are
compared in the first round).
Engine, model, requests and scheduler are shared, so only the memory under
the views differs:

* ``torch``: vLLM's own ``torch.zeros`` buffer (the reference);
* ``page+N``: kvcached's host mapper (memfd pages mapped into a reservation,
  every page of the buffer mapped), the tensor starting ``N`` bytes into its
  first page. ``page+0`` puts every block on a 4 KiB boundary; ``page+64`` is
  where kvcached's vLLM adapter places a CPU engine's KV cache
  (``kvcached_vllm.geometry.HOST_BLOCK_OFFSET``), and where torch's CPU
  allocator puts large buffers.

Per burst: the median decode step (``execute_model`` of steps with one token
per request) in the worker. Bursts drift 10-20 % on a shared VM, so each
burst is divided by the mean of its neighbours in time (any backing), and the
medians of those ratios are reported per backing, with ``ratio_vs_torch``.
Results go to benchmarks/results/vllm-cpu-kv-alignment.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _timing import run_info, summary, write_result

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # kvcached_testing


class KVPlacement:
    """vLLM worker extension: extra KV backings and step timing (``collective_rpc``)."""

    def kvp_setup(self, kinds: list[str]) -> int:
        """Build a backing per kind, each holding views shaped like vLLM's; returns buffer bytes."""
        import torch

        from kvcached_core.vmm import as_tensor, open_mapper

        ctx = self.model_runner.compilation_config.static_forward_context
        layers = {n: m for n, m in ctx.items() if isinstance(getattr(m, "kv_cache", None),
                                                            torch.Tensor) and m.kv_cache.numel()}
        first = next(iter(layers.values())).kv_cache
        storage = first.untyped_storage()
        nbytes = storage.nbytes()
        page = 2 << 20
        self._kvp_keep, self._kvp_views, self._kvp_layers = [], {}, layers
        for kind in kinds:
            if kind == "torch":
                self._kvp_views[kind] = {n: m.kv_cache for n, m in layers.items()}
                continue
            off = int(kind.split("+")[1])
            mapper = open_mapper("cpu", page)
            size = -(-(off + nbytes) // page) * page
            vt = mapper.reserve(size)
            mapper.map([vt], list(range(size // page)))
            base = as_tensor(vt, torch.uint8)[off:off + nbytes]
            self._kvp_keep.append((mapper, vt, base))
            views = {}
            for n, m in layers.items():
                kv = m.kv_cache
                views[n] = torch.empty(0, dtype=kv.dtype).set_(
                    base.untyped_storage(), kv.storage_offset() + off // kv.element_size(),
                    kv.size(), kv.stride())
                assert views[n].data_ptr() - base.data_ptr() == kv.data_ptr() - storage.data_ptr()
            self._kvp_views[kind] = views
        self._kvp_steps: list[tuple[int, float]] = []
        runner = self.model_runner
        original = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            t = time.perf_counter()
            try:
                return original(scheduler_output, *args, **kwargs)
            finally:
                self._kvp_steps.append((scheduler_output.total_num_scheduled_tokens,
                                        time.perf_counter() - t))

        runner.execute_model = execute_model
        return nbytes

    def kvp_use(self, kind: str) -> str:
        """Point every layer's KV view at backing ``kind``; returns its start address mod 4 KiB."""
        for n, m in self._kvp_layers.items():
            m.kv_cache = self._kvp_views[kind][n]
        self._kvp_steps.clear()
        return str(next(iter(self._kvp_views[kind].values())).data_ptr() % 4096)

    def kvp_steps(self) -> list[tuple[int, float]]:
        """``(tokens, seconds)`` of each model step since the last :meth:`kvp_use`."""
        return list(self._kvp_steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="torch,page+0,page+64")
    ap.add_argument("--rounds", type=int, default=80, help="bursts per backing")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                         "vllm-cpu-kv-alignment.json"))
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    if kinds[0] != "torch":
        ap.error("--kinds must start with torch (the reference)")

    os.environ["KVCACHED_ENABLED"] = "0"
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), *inherited])
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[0])
        os.sched_setaffinity(0, cores[1:])

    from vllm import LLM, SamplingParams

    from kvcached_testing.tiny_model import build_tiny_llama
    from kvcached_testing.vllm_cpu import TINY_ENGINE_KW, long_prompts

    with tempfile.TemporaryDirectory(prefix="kvcached-align-") as tmp:
        model = build_tiny_llama(Path(tmp) / "model")
        llm = LLM(model=str(model), max_num_seqs=args.prompts,
                  worker_extension_cls="bench_vllm_kv_alignment.KVPlacement", **TINY_ENGINE_KW)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        nbytes = llm.collective_rpc("kvp_setup", args=(kinds,))[0]
        residues = {k: llm.collective_rpc("kvp_use", args=(k,))[0] for k in kinds}
        llm.generate(long_prompts(8, args.prompt_len, seed=999), params, use_tqdm=False)
        bursts: list[tuple[str, float, float]] = []  # kind, decode median s, generate s
        tokens: dict[str, list] = {}
        rng = random.Random(0)
        for r in range(args.rounds):
            order = kinds[:]
            rng.shuffle(order)
            for kind in order:
                llm.reset_prefix_cache()  # cached blocks hold KV in the previous backing
                llm.collective_rpc("kvp_use", args=(kind,))
                t = time.perf_counter()
                out = llm.generate(long_prompts(args.prompts, args.prompt_len, seed=r), params,
                                   use_tqdm=False)
                dt = time.perf_counter() - t
                steps = llm.collective_rpc("kvp_steps")[0]
                decode = [s for n, s in steps if n <= args.prompts][4:-2]
                bursts.append((kind, statistics.median(decode), dt))
                if r == 0:
                    tokens[kind] = [list(o.outputs[0].token_ids) for o in out]
            if r == 0 and any(tokens[kind] != tokens["torch"] for kind in kinds):
                raise SystemExit("a backing changed the generated tokens")
            print(f"round {r + 1}/{args.rounds}", flush=True)
        del llm

    k = len(kinds)
    ratios: dict[str, dict[str, list[float]]] = {kind: {"decode": [], "generate": []}
                                                for kind in kinds}
    for i, (kind, dec, gen) in enumerate(bursts):
        near = [j for j in range(i - k // 2 - 1, i + k // 2 + 2) if 0 <= j < len(bursts) and j != i]
        ratios[kind]["decode"].append(dec / statistics.mean(bursts[j][1] for j in near))
        ratios[kind]["generate"].append(gen / statistics.mean(bursts[j][2] for j in near))
    res = {}
    for kind in kinds:
        d, g = ratios[kind]["decode"], ratios[kind]["generate"]
        res[kind] = {"start_mod_4096": int(residues[kind]), "bursts": len(d),
                     "decode_step_median_ms": round(1e3 * statistics.median(
                         b[1] for b in bursts if b[0] == kind), 3),
                     "decode_vs_neighbours": round(statistics.median(d), 4),
                     "decode_vs_neighbours_sem": round(statistics.pstdev(d) / len(d) ** 0.5, 4),
                     "generate_vs_neighbours": round(statistics.median(g), 4)}
    ref = res["torch"]
    for kind in kinds:
        r = res[kind]
        for what in ("decode", "generate"):
            r[f"{what}_ratio_vs_torch"] = round(
                r[f"{what}_vs_neighbours"] / ref[f"{what}_vs_neighbours"], 4)
        print(f"{kind:9s} start%4096 {r['start_mod_4096']:5d}  decode step "
              f"{r['decode_step_median_ms']:6.3f} ms  vs neighbours {r['decode_vs_neighbours']:.3f} "
              f"(+-{r['decode_vs_neighbours_sem']:.3f})  decode x torch "
              f"{r['decode_ratio_vs_torch']:.3f}  generate x torch {r['generate_ratio_vs_torch']:.3f}")
    import torch
    import vllm

    result = run_info("vllm-cpu-kv-alignment", vllm=vllm.__version__, torch=torch.__version__)
    result.update({
        "workload": {"prompts": args.prompts, "prompt_tokens_each": args.prompt_len,
                     "max_tokens": args.max_tokens, "bursts_per_backing": args.rounds,
                     "kv_buffer_bytes": nbytes, "engine_kwargs": TINY_ENGINE_KW,
                     "pinning": "worker on the first core, front end and engine core on the "
                                "others"},
        "backings": res,
        "tokens_identical": True,
        "latency": {f"decode_{kind}": summary([1e6 * b[1] for b in bursts if b[0] == kind])
                    for kind in kinds},
    })
    write_result(args.out, result, "decode step (burst medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
