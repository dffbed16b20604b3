"""kvcached-sglang: SGLang engine adapter for kvcached (elastic KV cache).

Installing the distribution is enough: SGLang >= 0.5.11 loads it through its
``sglang.srt.plugins`` entry point, older releases through the import hook that
``kvcached_sglang_autoload.pth`` installs (:mod:`kvcached_sglang.autoload`).
``KVCACHED_ENABLED=0``, or an ``SGLANG_PLUGINS`` allow-list without ``kvcached``,
keeps SGLang vanilla.

The distribution has two entry points, one per host that loads it:

=========================  ===========================  ======================================
entry-point group          loaded by                    module
=========================  ===========================  ======================================
``sglang.srt.plugins``     SGLang >= 0.5.11, in every   :mod:`kvcached_sglang.entry`
                           engine process (older: the   (:func:`~kvcached_sglang.entry.register`)
                           auto-load hook)
``kvcached.engines``       kvcached-core (bootstrap,    :mod:`kvcached_sglang.plugin`
                           ``kvctl doctor``)            (the adapter record)
=========================  ===========================  ======================================

Importing this package is cheap: it imports neither SGLang, torch nor kvcached-core
(the ``.pth`` imports it in every interpreter).
"""

from __future__ import annotations

__version__ = "0.1.0"

#: SGLang releases the adapter declares support for (every gate checked against
#: the released wheels of 0.4.9.post6 ... 0.5.23). ``.dev0`` bounds put
#: development builds and pre-releases of a release inside exactly one range.
SUPPORTED_VERSIONS = ">=0.4.9.dev0,<0.5.24.dev0"

#: The releases whose source the adapter's gates are tested against (one
#: environment each, ``scripts/setup_sglang.sh``); ``kvctl doctor`` names the
#: nearest one to an engine outside the range.
COVERED_RELEASES = ("0.4.9.post6", "0.4.10.post2", "0.5.1", "0.5.3", "0.5.4", "0.5.9",
                    "0.5.11", "0.5.12.post1", "0.5.13", "0.5.15", "0.5.23")

#: The entry-point name SGLang's ``SGLANG_PLUGINS`` allow-list must contain.
PLUGIN_NAME = "kvcached"

__all__ = ["COVERED_RELEASES", "PLUGIN_NAME", "SUPPORTED_VERSIONS", "__version__"]
