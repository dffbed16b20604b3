"""vLLM's CUDA-graph memory profiling on a throwaway KV cache, with kvcached on.

Before it sizes the real KV cache, vLLM's GPU worker builds a small KV cache,
captures CUDA graphs that read it and drops it (``profile_cudagraph_memory``
-> ``_init_minimal_kv_cache_for_profiling`` / ``_cleanup_profiling_kv_cache``,
V1 runner, every covered release before 0.34). Here the CPU worker runs that
same code of the installed release first, as the GPU worker does, in an engine
whose worker lives in the test's subprocess: the throwaway cache must be
vLLM's own, nothing of kvcached may outlive vLLM's cleanup, and the real KV
cache is then kvcached's and serves the tokens vanilla vLLM serves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]

_RUN = r'''
import json, os, sys
from kvcached_testing.tiny_model import PROMPTS
from vllm.v1.worker.cpu_worker import CPUWorker

seen = {}
determine = CPUWorker.determine_available_memory


def profile_first(self):
    """What vLLM's GPU worker does before sizing the KV cache: profile CUDA-graph memory
    on a throwaway KV cache (here of 64 blocks: the capture size a GPU config has)."""
    from kvcached_vllm import worker
    runner, cc = self.model_runner, self.model_runner.compilation_config
    saved, cc.max_cudagraph_capture_size = cc.max_cudagraph_capture_size, 64
    try:
        seen["estimate"] = runner.profile_cudagraph_memory()
    finally:
        cc.max_cudagraph_capture_size = saved
    seen["backings_after_profiling"] = len(worker.backings())
    seen["kv_caches_after_profiling"] = len(runner.kv_caches)
    return determine(self)


CPUWorker.determine_available_memory = profile_first
from vllm import LLM, SamplingParams

llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=2048, seed=0, enforce_eager=True,
          enable_prefix_caching=True, max_num_seqs=64, kv_cache_memory_bytes=256 << 20)
out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
from kvcached_vllm import worker
from kvcached_vllm.scheduler import runtimes
seen["backings"] = [b.listener is not None for b in worker.backings()]
seen["runtimes"] = len(runtimes())
seen["tokens"] = [list(o.outputs[0].token_ids) for o in out]
print("RESULT " + json.dumps(seen), flush=True)
'''


def _run(model: Path, enabled: bool, tmp_path: Path) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
               VLLM_ENABLE_V1_MULTIPROCESSING="0",  # engine core and worker in one process
               KVCACHED_ENABLED="1" if enabled else "0",
               KVCACHED_IPC_NAME=f"tprof-{os.getpid()}-{int(enabled)}")
    if enabled:
        env["KVCACHED_STRICT"] = "1"  # a KV cache kvcached cannot page fails the start
    proc = subprocess.run([sys.executable, "-c", _RUN, str(model)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, log[-6000:]
    return json.loads(lines[-1][len("RESULT "):]), log


def test_profiling_kv_cache_is_vllms_and_the_real_one_is_elastic(tiny_model, tmp_path):
    elastic, log = _run(tiny_model, True, tmp_path)
    assert elastic["backings_after_profiling"] == 0  # the throwaway cache was vLLM's own
    assert elastic["kv_caches_after_profiling"] == 0  # and vLLM's cleanup dropped it
    assert elastic["backings"] == [True] and elastic["runtimes"] == 1  # the real one serves
    assert "cannot page" not in log
    vanilla, _ = _run(tiny_model, False, tmp_path)
    assert vanilla["backings"] == [] and vanilla["runtimes"] == 0
    assert elastic["estimate"] == vanilla["estimate"]
    assert elastic["tokens"] == vanilla["tokens"]
