"""The tiny vLLM engine on CPU, as the vLLM tests and benchmarks run it.

The model is :func:`kvcached_testing.tiny_model.build_tiny_llama`'s: 2 layers,
2 KV heads of head_dim 64, bf16, in vLLM's CPU default 16-token blocks.
vLLM itself is imported only by the functions that need it.
"""

from __future__ import annotations

import os
import random
import uuid
from types import SimpleNamespace

__all__ = ["BLOCK_BYTES", "BLOCK_SIZE", "KV_BYTES", "NUM_LAYERS", "PAGE", "TINY_ENGINE_KW",
           "kv_cache_config", "long_prompts", "make_elastic_pool", "make_pools"]

PAGE = 2 << 20
NUM_LAYERS = 2          # the tiny model
BLOCK_SIZE = 16         # vLLM's CPU default block size (tokens)
BLOCK_BYTES = BLOCK_SIZE * 2 * 64 * 2 * 2  # tokens x KV heads x head_dim x (K, V) x bf16
KV_BYTES = 512 << 20    # explicit KV budget, the same for vanilla and kvcached engines
#: ``vllm.LLM`` arguments of the benchmarks' tiny engines.
TINY_ENGINE_KW = dict(dtype="bfloat16", max_model_len=2048, seed=0, enforce_eager=True,
                      enable_prefix_caching=True, kv_cache_memory_bytes=KV_BYTES)


def long_prompts(n: int, length: int, seed: int = 0) -> list[dict]:
    """``n`` distinct token-id prompts of ``length`` tokens (no shared prefix)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(length)]} for _ in range(n)]


def kv_cache_config(num_blocks: int, *, block_bytes: int = BLOCK_BYTES,
                    layers: int = NUM_LAYERS, block_size: int = BLOCK_SIZE) -> SimpleNamespace:
    """The parts of a vLLM >= 0.29 ``KVCacheConfig`` kvcached reads: one tensor holding every
    layer's region of ``num_blocks`` blocks (by default shaped like the tiny engine's)."""
    region = num_blocks * block_bytes
    tensor = SimpleNamespace(size=layers * region, layers=[f"l{i}" for i in range(layers)],
                             layer_stride=region, block_stride=block_bytes, offset=0)
    spec = SimpleNamespace(block_size=block_size)
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                           kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])


def make_pools(num_blocks: int):
    """vLLM's block pool and the elastic one, the latter built as the scheduler builds it.

    Returns ``(native, elastic, keep)``; ``keep`` holds what the elastic pool runs
    on: ``(mapper, regions, listener, runtime)`` (close the last two when done).
    """
    from vllm.v1.core.block_pool import BlockPool

    elastic, keep = make_elastic_pool(num_blocks)
    # kvcached patches the coordinator's binding, never this class
    return BlockPool(**_pool_kw(num_blocks)), elastic, keep


def _pool_kw(num_blocks: int) -> dict:
    return dict(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE,
                enable_kv_cache_events=False, metrics_collector=None)


def make_elastic_pool(num_blocks: int):
    """The elastic block pool built as the scheduler builds it, on a host page mapper whose
    worker listener is a thread of this process. Returns ``(elastic, keep)`` as
    :func:`make_pools`."""
    from kvcached_core.ipc import WorkerListener
    from kvcached_core.ipc.worker import MapperHandler
    from kvcached_core.vmm import open_mapper
    from vllm.v1.core.block_pool import BlockPool

    from kvcached_vllm.scheduler import make_block_pool, runtimes, scheduler_context

    ns = f"bench-pool-{uuid.uuid4().hex[:8]}"
    os.environ["KVCACHED_IPC_NAME"] = ns
    num_pages = -(-num_blocks * BLOCK_BYTES // PAGE)
    mapper = open_mapper("cpu", PAGE)
    regions = [mapper.reserve(num_pages * PAGE) for _ in range(NUM_LAYERS)]
    listener = WorkerListener.for_namespace(ns, rank=0, handler=MapperHandler(mapper, {0: regions}),
                                            label="bench worker").start()
    vllm_config = SimpleNamespace(
        instance_id=ns, device_config=SimpleNamespace(device_type="cpu"),
        parallel_config=SimpleNamespace(data_parallel_rank=0, tensor_parallel_size=1,
                                        pipeline_parallel_size=1))
    with scheduler_context(vllm_config, kv_cache_config(num_blocks)):
        elastic = make_block_pool(BlockPool)(**_pool_kw(num_blocks))
    assert type(elastic).__name__ == "ElasticBlockPool", type(elastic)
    return elastic, (mapper, regions, listener, runtimes()[-1])
