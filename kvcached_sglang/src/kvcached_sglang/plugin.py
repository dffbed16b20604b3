"""kvcached-core's entry point (group ``kvcached.engines``): the SGLang engine adapter record.

kvcached-core loads this module (bootstrap, ``kvctl doctor``), never SGLang: SGLang
itself loads :mod:`kvcached_sglang.entry` (group ``sglang.srt.plugins``).

Importing this module is cheap: it imports neither SGLang nor torch.
"""

from __future__ import annotations

from kvcached_core import hookimpl
from kvcached_core.plugins import EngineAdapter

from kvcached_sglang import COVERED_RELEASES, SUPPORTED_VERSIONS

__all__ = ["kvcached_engine_adapters"]


@hookimpl
def kvcached_engine_adapters() -> EngineAdapter:
    """The SGLang adapter: elastic KV pools and allocators, idle leak-check compat."""
    return EngineAdapter(
        name="sglang",
        distributions=("sglang",),
        module="sglang",
        versions=SUPPORTED_VERSIONS,
        patch_sets="kvcached_sglang.patches:build_patches",
        description="elastic KV cache for SGLang (KV pools, token allocators, leak check)",
        covered=COVERED_RELEASES,
    )
