"""One command: a tiny vLLM engine on CPU with kvcached, KV memory growing and shrinking.

    .venv-vllm/bin/python examples/vllm_elastic_demo.py

Builds a random-weight Llama (head_dim 64, local tokenizer, nothing
downloaded), starts ``vllm.LLM`` with kvcached (installed = active), then sends
a burst of long requests while printing, twice a second, the KV bytes kvcached
has mapped in the worker and the worker's resident set size. After the burst
the reserve of mapped pages goes (``KVCACHED_IDLE_TRIM_S``), then, the engine
idle, the pages its prefix cache kept (``KVCACHED_CACHE_IDLE_S``, shortened
here from 30 s to 1.5 s): the mapped KV and the RSS fall back.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

PAGE_BUNDLE = 2 * (2 << 20)  # the tiny model's 2 layers x one 2 MiB page
SHUTDOWN_GRACE_S = 60  # seconds each engine process gets to exit once asked to


def _line(tag: str, w, t0: float) -> None:
    print(f"{time.monotonic() - t0:6.1f}s  {tag:<8} kv mapped {w.mapped_bytes / 2**20:7.1f} MiB"
          f"  ({w.mapped_pages:3d} pages)   worker rss {w.rss_bytes / 2**20:7.1f} MiB", flush=True)


def main() -> None:
    os.environ.setdefault("KVCACHED_IPC_NAME", f"demo-{uuid.uuid4().hex[:8]}")
    os.environ.setdefault("KVCACHED_IDLE_TRIM_S", "0.5")
    os.environ.setdefault("KVCACHED_CACHE_IDLE_S", "1.5")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # How long the engine core waits for its worker to exit before it signals it (see stop()).
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(SHUTDOWN_GRACE_S))
    # The checkout's kvcached_testing, after site-packages: kvcached comes from what is installed.
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from kvcached_testing.tiny_model import build_tiny_llama

    from vllm import LLM, SamplingParams

    from kvcached_vllm.monitor import KVMemoryMonitor

    model = build_tiny_llama(Path(tempfile.mkdtemp(prefix="kvcached-demo-")) / "tiny-llama")
    print("starting a tiny vLLM engine on CPU with kvcached ...", flush=True)
    llm = LLM(model=str(model), dtype="bfloat16", max_model_len=2048, enforce_eager=True,
              seed=0, max_num_seqs=16, enable_prefix_caching=True)
    mon = KVMemoryMonitor(os.environ["KVCACHED_IPC_NAME"], page_bytes=PAGE_BUNDLE)
    t0 = time.monotonic()
    _line("idle", mon.read()[0], t0)

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(1500)]}
               for _ in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    done = threading.Event()

    def burst() -> None:
        llm.generate(prompts, params, use_tqdm=False)
        done.set()

    print("burst: 16 requests x 1500 prompt tokens + 96 generated", flush=True)
    threading.Thread(target=burst, daemon=True).start()
    while not done.is_set():
        _line("burst", mon.read()[0], t0)
        time.sleep(0.5)
    for _ in range(8):
        _line("after", mon.read()[0], t0)
        time.sleep(0.5)
    mon.close()
    stop(llm)


def stop(llm, timeout: float = SHUTDOWN_GRACE_S) -> None:
    """Stop the engine before the interpreter exits, giving its processes ``timeout`` s to exit.

    Left to the interpreter's exit, vLLM's finalizers stop the engine core
    before the client that watches it, and the client reports that the
    engine core "exited unexpectedly". Exiting takes a while: the engine core
    first waits for its worker, and each process then tears down torch and
    vLLM (garbage collection over some 700,000 objects, with or without
    kvcached), 3-8 s each on a busy two-core CPU, more than vLLM's default
    5 s before it signals and then force-kills them. Stopping the client
    explicitly, with a grace for the engine core here and for the worker in
    ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (set in :func:`main`), ends the
    run without either warning.
    """
    shutdown = getattr(llm, "shutdown", None)  # LLM.shutdown, where the release has one
    if shutdown is not None:
        shutdown()
        return
    llm.llm_engine.engine_core.shutdown(timeout=timeout)


if __name__ == "__main__":
    main()
