"""SGLang's own entry point into kvcached (group ``sglang.srt.plugins``, SGLang >= 0.5.11).

SGLang loads this module; kvcached-core's bootstrap then finds the adapter record
through the other entry point, :mod:`kvcached_sglang.plugin` (group ``kvcached.engines``).

SGLang's ``load_plugins()`` calls :func:`register` with no arguments in
``Engine.__init__``, the launchers and at the start of every scheduler process
(after ``scheduler.py`` and its memory-pool imports are loaded; the patches
therefore change class attributes, which are looked up at call time, never
module-level names). Older releases reach :func:`register` through
:mod:`kvcached_sglang.autoload`.

:func:`register` is cheap and idempotent: kvcached-core's
:func:`~kvcached_core.plugins.bootstrap` applies the patch set once per process
and is a no-op when ``KVCACHED_ENABLED`` is off.
"""

from __future__ import annotations

import os

from kvcached_sglang import PLUGIN_NAME

__all__ = ["allowed_by_sglang", "register"]


def allowed_by_sglang() -> bool:
    """Whether SGLang's ``SGLANG_PLUGINS`` allow-list (empty = all) admits kvcached.

    SGLang >= 0.5.11 applies the list itself; the import hook for older releases
    asks here, so the variable means the same on every release.
    """
    text = os.environ.get("SGLANG_PLUGINS", "").strip()
    if not text:
        return True
    return PLUGIN_NAME in {part.strip() for part in text.split(",")}


def register() -> None:
    """Apply kvcached's SGLang patch set in this process (see :mod:`kvcached_sglang.patches`)."""
    from kvcached_core.plugins import bootstrap

    bootstrap("sglang")
