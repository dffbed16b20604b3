"""An elastic KV cache on the CPU: memory grows under a burst and shrinks after.

    .venv/bin/python examples/elastic_kv_demo.py

A 32-layer model's K and V buffers get 16 GiB of *virtual* space; physical
pages (real memory in this process) are mapped only while blocks are in use.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvcached_core.allocator import K, KVBlockManager, KVLayout, KVTensors, PageAllocator

LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 64, 16
BLOCK_BYTES = BLOCK_TOKENS * HEADS * HEAD_DIM * 2  # fp16, per layer and buffer


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def report(label: str, kv: KVTensors, pages: PageAllocator) -> None:
    s = pages.stats()
    print(f"{label:<34} mapped KV {kv.mapped_pages * kv.page_bytes / 2**20:8.0f} MiB "
          f"(in use {s.in_use:3d} pages, reserve {s.reserved:2d})   process RSS {rss_mib():7.0f} MiB")


def main() -> None:
    layout = KVLayout.for_bytes(16 << 30, num_layers=LAYERS, page_size=2 << 20)
    kv = KVTensors.open("cpu", layout)
    pages = PageAllocator(kv, idle_trim_s=1.0)
    blocks = KVBlockManager(pages, block_bytes=BLOCK_BYTES)
    print(f"virtual KV cache: {layout.total_bytes / 2**30:.0f} GiB over {LAYERS} layers, "
          f"{blocks.capacity()} blocks of {BLOCK_TOKENS} tokens, page bundle "
          f"{kv.page_bytes / 2**20:.0f} MiB")
    report("idle", kv, pages)

    requests = []
    for burst in range(4):  # a burst of 8 requests of 4096 tokens at a time
        for _ in range(8):
            ids = blocks.alloc(4096 // BLOCK_TOKENS)
            assert ids is not None
            for layer in range(LAYERS):  # write the "prefill" K values
                view = kv.block_view(layer, K, BLOCK_BYTES, torch.float16)
                view[torch.tensor(ids)] = float(layer)
            requests.append(ids)
        report(f"burst: {len(requests):2d} requests in flight", kv, pages)

    check = kv.block_view(7, K, BLOCK_BYTES, torch.float16)[torch.tensor(requests[0])]
    assert bool((check == 7.0).all()), "KV data read back wrong"
    while requests:
        for ids in requests[:8]:
            blocks.free(ids)
        del requests[:8]
        report(f"finished: {len(requests):2d} requests left", kv, pages)
    time.sleep(1.5)  # the idle trim returns the reserve
    pages.wait_idle(2.0)
    report("after idle trim", kv, pages)
    pages.close()


if __name__ == "__main__":
    main()
