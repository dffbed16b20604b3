"""Block order and vLLM's CPU decode attention step.

    .venv-vllm/bin/python benchmarks/bench_block_order.py

Why kvcached's block manager hands out the lowest free blocks of a page first.
vLLM's CPU attention reads each request's blocks in table order; this replays
its decode step (``cpu_attn_reshape_and_cache`` + ``cpu_attention_with_kv_cache``
on every layer, vLLM's own ops, one thread) over one KV buffer shaped like the
tiny engine of ``kvcached_testing.vllm_cpu`` (2 layers, 2 KV heads, head_dim 64, 16-token
blocks, bf16), for a burst of ``--requests`` requests of ``--prompt-len`` tokens
decoding 64 tokens, with the block tables of:

* ``vllm``: what vLLM's own ``BlockPool`` hands such a burst (a fresh pool:
  each prompt's blocks adjacent, decode blocks interleaved across requests);
* ``kvcached``: what kvcached's ``ElasticBlockPool`` (built by the scheduler's
  factory, ``kvcached_testing.vllm_cpu.make_pools``) hands the burst after ``--churn`` earlier
  bursts were served and freed in request order with the prefix cache on and
  capped (8192 tokens, the adapter's default), so freed blocks are reused;
* ``shuffled``: the ``vllm`` tables with their block ids permuted at random
  among themselves: the same memory, read in a scattered order (what reusing
  freed blocks last-in-first-out produced before).

Each round runs the 64 decode steps of every table set in a shuffled order;
per round the median step of each set is divided by the ``vllm`` one, and
the medians of those ratios are reported (``ratio_vs_vllm``), with per-step
latency summaries. Results go to benchmarks/results/vllm-cpu-block-order.json.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from pathlib import Path

from _timing import run_info, summary, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvcached_testing

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 64, 16
BLOCK_BYTES = HEADS * BLOCK * 2 * HEAD_DIM * 2   # per layer: K and V, bf16
KV_BYTES = 512 << 20                             # as the engine benchmark
DECODE = 64


def burst_tables(pool, n_req: int, prompt_blocks: int, hashes: itertools.count,
                 free: bool) -> list[list[int]]:
    """Allocate a burst as vLLM's scheduler does; with ``free``, cache and free it after."""
    reqs = [pool.get_new_blocks(prompt_blocks) for _ in range(n_req)]
    for _ in range(DECODE // BLOCK):  # one more block per request every 16 tokens
        for blocks in reqs:
            blocks.extend(pool.get_new_blocks(1))
    tables = [[b.block_id for b in blocks] for blocks in reqs]
    if free:
        for blocks in reqs:  # full blocks carry a prefix hash, as in the engine
            for b in blocks:
                h = next(hashes).to_bytes(8, "little") + bytes(4)
                b.set_block_hash(h, BLOCK)
                pool.cached_block_hash_to_block.insert(h, b)
        for blocks in reqs:
            pool.free_blocks(reversed(blocks))
    return tables


def make_tables(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    os.environ.setdefault("KVCACHED_MAX_CACHED_TOKENS", "8192")
    from kvcached_testing.vllm_cpu import make_pools

    num_blocks = KV_BYTES // (BLOCK_BYTES * LAYERS)
    native, elastic, keep = make_pools(num_blocks)
    from kvcached_vllm.scheduler import _max_cached_blocks

    elastic.max_cached_blocks = _max_cached_blocks(BLOCK)
    prompt_blocks = args.prompt_len // BLOCK
    hashes = itertools.count()
    for _ in range(args.churn):
        burst_tables(elastic, args.requests, prompt_blocks, hashes, free=True)
    tables = {"vllm": burst_tables(native, args.requests, prompt_blocks, hashes, free=False),
              "kvcached": burst_tables(elastic, args.requests, prompt_blocks, hashes, free=False)}
    ids = sorted({b for t in tables["vllm"] for b in t})
    perm = dict(zip(ids, random.Random(args.seed).sample(ids, len(ids))))
    tables["shuffled"] = [[perm[b] for b in t] for t in tables["vllm"]]
    keep[3].close()
    keep[2].close()
    return tables


class Replay:
    """vLLM's CPU decode step over one KV buffer, for fixed block tables."""

    def __init__(self, num_blocks: int, isa: str) -> None:
        import torch
        import vllm._custom_ops as ops

        self.torch, self.ops, self.isa = torch, ops, isa
        layer = num_blocks * BLOCK_BYTES
        self.buffer = torch.zeros(LAYERS * layer, dtype=torch.uint8)
        self.layers = []
        for i in range(LAYERS):
            t = self.buffer[i * layer:(i + 1) * layer].view(torch.bfloat16)
            kv = t.view(num_blocks, HEADS, BLOCK * 2, HEAD_DIM)
            self.layers.append(kv.chunk(2, dim=2))  # vLLM's CPU split of K and V

    def fill(self, tables: list[list[int]]) -> None:
        for k, v in self.layers:
            for table in tables:
                for b in table:
                    k[b].normal_()
                    v[b].normal_()

    def steps(self, tables: list[list[int]], prompt_len: int) -> list[float]:
        """Seconds of each of the burst's decode steps."""
        torch, ops = self.torch, self.ops
        n = len(tables)
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        qsl = torch.arange(n + 1, dtype=torch.int32)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        kn, vn = (torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
                  for _ in range(2))
        out = torch.empty(n, HEADS * HEAD_DIM, dtype=torch.bfloat16)
        times = []
        for step in range(DECODE):
            pos = prompt_len + step  # the new token's position
            lens = torch.full((n,), pos + 1, dtype=torch.int32)
            slots = torch.tensor([t[pos // BLOCK] * BLOCK + pos % BLOCK for t in tables],
                                 dtype=torch.int64)
            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=n, num_heads=HEADS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                seq_lens=lens, dtype=torch.bfloat16, query_start_loc=qsl, causal=True,
                sliding_window_size=-1, isa=self.isa, enable_kv_split=False)
            t0 = time.perf_counter()
            for k, v in self.layers:
                ops.cpu_attn_reshape_and_cache(kn, vn, k, v, slots, self.isa)
                ops.cpu_attention_with_kv_cache(
                    query=q, key_cache=k, value_cache=v, output=out, query_start_loc=qsl,
                    seq_lens=lens, scale=HEAD_DIM ** -0.5, causal=True, alibi_slopes=None,
                    sliding_window=-1, block_table=bt, softcap=0.0, scheduler_metadata=meta,
                    s_aux=None)
            times.append(time.perf_counter() - t0)
        return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--churn", type=int, default=3, help="bursts served before the measured one")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--isa", default="vec16", help="vLLM CPU attention ISA (vec16: generic)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"
                                         / "vllm-cpu-block-order.json"))
    args = ap.parse_args(argv)

    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:1])  # one compute thread on one core, as the engine's worker
    import torch
    import vllm

    torch.set_num_threads(1)
    tables = make_tables(args)
    replay = Replay(KV_BYTES // (BLOCK_BYTES * LAYERS), args.isa)
    replay.fill(tables["vllm"])
    replay.fill(tables["kvcached"])
    kinds = list(tables)
    rng = random.Random(args.seed)
    steps: dict[str, list[float]] = {k: [] for k in kinds}
    ratios: dict[str, list[float]] = {k: [] for k in kinds}
    for k in kinds:
        replay.steps(tables[k], args.prompt_len)  # warm-up
    for _ in range(args.rounds):
        med = {}
        for k in rng.sample(kinds, len(kinds)):
            ts = replay.steps(tables[k], args.prompt_len)
            steps[k] += ts
            med[k] = statistics.median(ts)
        for k in kinds:
            ratios[k].append(med[k] / med["vllm"])

    def adjacency(ts: list[list[int]]) -> float:
        pairs = [(a, b) for t in ts for a, b in zip(t, t[1:])]
        return round(sum(b == a + 1 for a, b in pairs) / len(pairs), 3)

    result = run_info("vllm-cpu-block-order", vllm=vllm.__version__, torch=torch.__version__)
    result.update({
        "what": "vLLM's CPU decode step (reshape_and_cache + attention, every layer, one "
                "thread) over one KV buffer, by block table order; per round the median step "
                "of each table set over vllm's",
        "workload": {"requests": args.requests, "prompt_tokens": args.prompt_len,
                     "decode_steps": DECODE, "layers": LAYERS, "kv_heads": HEADS,
                     "head_dim": HEAD_DIM, "block_tokens": BLOCK, "churn_bursts": args.churn,
                     "rounds": args.rounds, "isa": args.isa},
        "adjacent_pairs": {k: adjacency(t) for k, t in tables.items()},
        "first_tables": {k: t[:2] for k, t in tables.items()},
        "ratio_vs_vllm": {k: round(statistics.median(r), 3) for k, r in ratios.items()},
        "latency": {k: summary([s * 1e6 for s in v]) for k, v in steps.items()},
    })
    write_result(args.out, result, "decode step")
    print("ratio_vs_vllm", result["ratio_vs_vllm"], "adjacent", result["adjacent_pairs"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
