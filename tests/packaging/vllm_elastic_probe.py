"""Run by test_vllm_install.py with the interpreter of a fresh environment: start a tiny vLLM
engine the way tests/vllm does and print, as one JSON line, where kvcached came from and the
KV pages its worker had mapped at start, at the peak of a burst and after it.

Usage: python vllm_elastic_probe.py WORKDIR
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "vllm"))  # tests/vllm helpers
# kvcached_testing, after site-packages: kvcached itself must come from the installed wheels.
sys.path.append(str(REPO))

from conftest import engine, greedy, long_prompts, token_ids  # noqa: E402

from kvcached_testing.tiny_model import build_tiny_llama  # noqa: E402

NUM_LAYERS = 2
PAGE = 2 << 20


def main(workdir: Path) -> None:
    import kvcached_core
    import kvcached_vllm
    from kvcached_vllm.monitor import KVMemoryMonitor

    seconds: dict[str, float] = {}
    t0 = time.monotonic()
    model = build_tiny_llama(workdir / "tiny-llama")
    seconds["model"] = time.monotonic() - t0
    ns = f"tpkg-{uuid.uuid4().hex[:8]}"
    with engine(model, enabled=True, namespace=ns,
                extra_env={"KVCACHED_MAX_CACHED_TOKENS": "512", "KVCACHED_IDLE_TRIM_S": "0.5"}) as llm, \
            KVMemoryMonitor(ns, page_bytes=PAGE * NUM_LAYERS) as mon:
        seconds["engine_start"] = time.monotonic() - t0 - seconds["model"]
        time.sleep(1.5)  # past the idle trim: the pool at rest
        start = mon.read()[0].mapped_pages
        t1 = time.monotonic()
        samples: list[int] = []
        out: dict = {}

        def burst() -> None:
            out["ids"] = token_ids(llm.generate(long_prompts(12, 1500, seed=3), greedy(8)))

        thread = threading.Thread(target=burst)
        thread.start()
        while thread.is_alive():
            samples.append(mon.read()[0].mapped_pages)
            time.sleep(0.05)
        thread.join()
        seconds["burst"] = time.monotonic() - t1
        deadline = time.monotonic() + 5
        after = mon.read()[0].mapped_pages
        while after > start + 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            after = mon.read()[0].mapped_pages
    print(json.dumps({"kvcached_core": kvcached_core.__file__, "kvcached_vllm": kvcached_vllm.__file__,
                      "start": start, "peak": max(samples, default=start), "after": after,
                      "outputs": len(out["ids"]), "seconds": {k: round(v, 1) for k, v in seconds.items()}}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
