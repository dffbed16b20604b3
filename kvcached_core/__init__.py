"""kvcached-core: an elastic KV cache for LLM serving engines.

The package root stays light: importing it starts no thread, opens no socket
and touches no device. Native code loads on first use of :mod:`kvcached_core.vmm`.
"""

from kvcached_core.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["hookimpl", "__version__"]
