"""kvcached's plugin framework.

* :mod:`.hookspecs`: the hooks plugins implement (marked with ``kvcached_core.hookimpl``).
* :mod:`.records`: the typed records plugins return and kvcached reports.
* :mod:`.patching`: :class:`Patch` and the all-or-nothing :class:`PatchSet`.
* :mod:`.versions`: engine version detection and range matching.
* :mod:`.rebind`: engine functions run under substituted global names (:func:`with_globals`).
* :mod:`.manager`: entry-point discovery (group ``kvcached.engines``) and hook calls.
* :mod:`.bootstrap`: :func:`bootstrap`, called from an adapter's engine entry point.
* :mod:`.doctor`: the report behind ``kvctl doctor``.

Importing this package loads no plugin and patches nothing.
"""

from kvcached_core.plugins.bootstrap import (
    bootstrap,
    bootstrap_results,
    build_patch_set,
    engine_patch_set,
    reset_bootstrap,
    teardown,
)
from kvcached_core.plugins.manager import (
    ENTRY_POINT_GROUP,
    KVCachedPluginManager,
    available_backends,
    backend_for,
    get_plugin_manager,
    reset_plugin_manager,
    select_backend,
)
from kvcached_core.plugins.patching import (
    UNSET,
    Patch,
    PatchSet,
    active_patches,
    is_applied,
    parse_target,
    patch_of,
)
from kvcached_core.plugins.rebind import reads_global, with_globals
from kvcached_core.plugins.records import (
    BackendRecord,
    BootstrapResult,
    EngineAdapter,
    PatchPlan,
    PatchSetResult,
    PluginInfo,
    RevertResult,
)
from kvcached_core.plugins.versions import (
    EngineVersion,
    detect_engine_version,
    parse_specifier,
    parse_version,
    version_matches,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "UNSET",
    "BackendRecord",
    "BootstrapResult",
    "EngineAdapter",
    "EngineVersion",
    "KVCachedPluginManager",
    "Patch",
    "PatchPlan",
    "PatchSet",
    "PatchSetResult",
    "PluginInfo",
    "RevertResult",
    "active_patches",
    "available_backends",
    "backend_for",
    "bootstrap",
    "bootstrap_results",
    "build_patch_set",
    "detect_engine_version",
    "engine_patch_set",
    "get_plugin_manager",
    "is_applied",
    "parse_specifier",
    "parse_target",
    "parse_version",
    "patch_of",
    "reads_global",
    "reset_bootstrap",
    "reset_plugin_manager",
    "select_backend",
    "teardown",
    "version_matches",
    "with_globals",
]
