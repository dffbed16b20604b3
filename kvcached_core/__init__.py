"""kvcached-core: an elastic KV cache for LLM serving engines.

The package root stays light: importing it starts no thread, opens no socket,
touches no device and loads nothing of the plugin framework. Native code loads
on first use of :mod:`kvcached_core.vmm`; :data:`hookimpl`, the marker plugins
put on their hook implementations, comes from
:mod:`kvcached_core.plugins.hookspecs` on first use.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcached_core.plugins.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["hookimpl", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "hookimpl":
        from kvcached_core.plugins.hookspecs import hookimpl

        globals()["hookimpl"] = hookimpl
        return hookimpl
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
