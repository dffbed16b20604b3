"""The kvcached IPC namespace of one vLLM engine: what its engine core and workers share.

Below :mod:`kvcached_vllm.scheduler` (the engine core connects to it) and
:mod:`kvcached_vllm.worker` (the workers listen in it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["instance_namespace"]


def instance_namespace(vllm_config: Any) -> str:
    """The IPC namespace shared by the engine core and the workers of one engine.

    ``KVCACHED_IPC_NAME`` when set; else derived from vLLM's ``instance_id``
    (every process of an engine gets the same ``VllmConfig``) and the data
    parallel rank.
    """
    from kvcached_core.ipc import namespace

    dp = getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0
    return namespace(f"vllm-{vllm_config.instance_id}-dp{dp}")
