"""vLLM's own entry point into kvcached (group ``vllm.general_plugins``).

vLLM loads this module; kvcached-core's bootstrap then finds the adapter record
through the other entry point, :mod:`kvcached_vllm.plugin` (group ``kvcached.engines``).

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

    _log_through_vllm()
    bootstrap("vllm")


def _log_through_vllm() -> None:
    """kvcached's log lines go where vLLM's go, in its format and at its level.

    vLLM configures its own ``vllm`` logger only; without a handler kvcached's
    INFO lines (the patch set applied, the elastic pool's size) would be lost.
    Records still propagate, so a handler the application set on the root
    logger sees them too, once: vLLM's handlers that the root logger also has
    (vLLM 0.28 under a test runner's capture, say) are not added again.
    """
    import logging

    ours, theirs = logging.getLogger("kvcached"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    root = logging.getLogger().handlers
    for handler in theirs.handlers:
        if handler not in root:
            ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
