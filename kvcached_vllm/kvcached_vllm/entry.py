"""vLLM's entry point (group ``vllm.general_plugins``).

vLLM calls :func:`register` with no arguments in the API/driver process
(``EngineArgs.__post_init__``), at the start of ``EngineCore.__init__`` and in each
worker before the worker class is imported. It must be cheap and idempotent:
kvcached-core's :func:`~kvcached_core.plugins.bootstrap` applies the patch set once
per process and is a no-op when ``KVCACHED_ENABLED`` is off.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Apply kvcached's vLLM patch set in this process (see :mod:`kvcached_vllm.patches`)."""
    from kvcached_core.plugins import bootstrap

    bootstrap("vllm")
