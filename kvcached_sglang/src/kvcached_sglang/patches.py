"""kvcached's SGLang patch set, gated by SGLang release.

Every patch changes a class attribute that SGLang looks up at call time, never a
module-level name: in SGLang >= 0.5.11 the scheduler process loads plugins after
its memory-pool modules were imported, and ``from X import Y`` copies (for
example ``allocator.swa`` from 0.5.13) share the class object, so a changed
method reaches every user.

The table is the set :func:`build_patches` returns (``tests/sglang/test_patch_table.py``
holds them equal): ``X - Y`` runs from X's first development build through every
build of Y (its post releases too); (optional) patches skip, logged, instead of
rolling the set back.

=============================================  ===============  ====================================
patch                                          SGLang           what
=============================================  ===============  ====================================
elastic-mha-buffers                            0.4.9 - 0.5.15   MHA buffers on kvcached:
                                                                ``MHATokenToKVPool._create_buffers``
elastic-mha-buffers-normal                     0.5.16 - 0.5.23  ditto, ``_create_buffers_normal``
                                                                (the 0.5.16 dispatcher split)
elastic-mla-init                               0.4.9 - 0.5.4    MLA buffers on kvcached, built in
                                                                ``MLATokenToKVPool.__init__``
elastic-mla-buffers                            0.5.6 - 0.5.23   ditto, ``_create_buffers`` (0.5.5
                                                                keeps SGLang's MLA buffers)
elastic-token-allocator-<alloc>                0.4.9 - 0.5.12   token allocator (page 1) in
                                                                ``mem_cache.allocator``
elastic-token-allocator-<alloc>-pkg            0.5.13 - 0.5.23  ditto, ``mem_cache.allocator.token``
elastic-paged-allocator-<paged>                0.4.9 - 0.5.12   paged allocator (page > 1) in
                                                                ``mem_cache.allocator``
elastic-paged-allocator-<paged>-pkg            0.5.13 - 0.5.15  ditto, ``mem_cache.allocator.paged``
elastic-paged-allocator-<paged>-sink           0.5.23           ditto (0.5.16 - 0.5.22 keep SGLang's
                                                                paged buffers), plus
elastic-paged-allocator-release_page_ids-sink  0.5.23           ``_release_page_ids``, the free sink
elastic-token-allocator-<backup>               0.4.9 - 0.5.12   speculative decoding's backup and
elastic-paged-allocator-<backup>               0.4.9 - 0.5.12   restore: a journal of blocks
elastic-token-allocator-<backup>-pkg           0.5.13 - 0.5.23  ditto (0.5.23 has no such methods)
                                               (optional)
elastic-paged-allocator-<backup>-pkg           0.5.13 - 0.5.23  ditto
                                               (optional)
virtual-profile-tokens                         0.4.9 - 0.5.10   KV memory profiled as if alone:
                                                                ``profile_max_num_token``
virtual-profile-bytes                          0.5.11 - 0.5.15  ditto, ``_profile_available_bytes``
virtual-profile-configurator                   0.5.16 - 0.5.23  ditto, on ``KVCacheConfigurator``
leak-check-A                                   0.4.9 - 0.5.3    idle leak check, layout A:
                                                                ``Scheduler.check_memory``
leak-check-B                                   0.5.4 - 0.5.10   layout B: ``check_memory`` of
                                                                ``SchedulerRuntimeCheckerMixin``
leak-check-C                                   0.5.11 - 0.5.12  layout C: the mixin's ``on_idle``
                                                                (``_report_leak`` split)
leak-check-D                                   0.5.13 - 0.5.23  layout D: ``Scheduler.on_idle``
                                                                and the invariant checker
busy-check-0                                   0.5.6 - 0.5.12   opt-in busy checks: the mixin's
                                               (optional)       ``self_check_during_busy``
busy-check-1                                   0.5.13 - 0.5.23  ditto, the invariant checker's
                                               (optional)
kvcached-metrics                               0.4.9 - 0.5.2    /metrics shows kvcached:
                                               (optional)       ``utils:add_prometheus_middleware``
kvcached-metrics-common                        0.5.3 - 0.5.10   ``utils.common``'s, and its
                                               (optional)       ``utils`` re-export
kvcached-metrics-http                          0.5.11 - 0.5.23  ``http_server``'s own binding
                                               (optional)       (deferred to that import)
=============================================  ===============  ====================================

In the patch names ``<alloc>`` stands for each of ``available_size alloc free clear``,
``<paged>`` for each of ``available_size alloc alloc_extend alloc_decode free clear`` and
``<backup>`` for each of ``backup_state restore_state``.

The leak-check patches run SGLang's own check inside kvcached's leak-check view
(:mod:`kvcached_sglang.leakcheck`): the KV identity sees logical counts, the
request-to-token pool check, idle metrics and KV events stay as SGLang wrote
them. The same idle entry points first trim the prefix cache of an elastic pool
to ``KVCACHED_MAX_CACHED_TOKENS`` (:mod:`kvcached_sglang.prefix_cache`), so
memory returns after a burst. Before wrapping, each patch verifies that the method it wraps still
contains what the gate expects (for example that ``check_memory`` still holds the
request-pool check); a surprise fails the patch, which rolls the whole set back
with the class and release named.

The ``/metrics`` patches are the exception to the class-attribute rule: SGLang's
HTTP server calls the module-level function ``add_prometheus_middleware``, which
``http_server`` copies with ``from sglang.srt.utils import``. The binding
wrapped is the one in place when ``http_server`` looks it up: up to 0.5.10 the
``.pth`` hook bootstraps while ``http_server`` imports ``engine`` (so before its
copy) and kvcached wraps the source of that copy; from 0.5.11 ``load_plugins()``
may run before or after that import and kvcached wraps ``http_server``'s own
binding, deferred until the module is imported (schedulers never import it).
They are optional: a surprise skips them (logged) and leaves the elastic pool
in place. See :mod:`kvcached_sglang.metrics`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from kvcached_core.errors import PatchError
from kvcached_core.plugins import Patch

from kvcached_sglang.paged_lines import PAGED_LINES, paged_allocator_elastic, paged_patch_name

__all__ = ["LEAK_CHECK_LAYOUTS", "build_patches", "leak_check_layout", "paged_allocator_elastic"]

_SCHED = "sglang.srt.managers.scheduler"
_MIXIN = "sglang.srt.managers.scheduler_runtime_checker_mixin"
_CHECKER = "sglang.srt.managers.scheduler_components.invariant_checker"
_POOL = "sglang.srt.mem_cache.memory_pool"

#: layout -> (specifier, target of the idle check entry, what it must still contain)
LEAK_CHECK_LAYOUTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "A": (">=0.4.9.dev0,<0.5.4.dev0", f"{_SCHED}:Scheduler.check_memory",
          ("memory leak detected", "req_to_token_pool")),
    "B": (">=0.5.4.dev0,<0.5.11.dev0", f"{_MIXIN}:SchedulerRuntimeCheckerMixin.check_memory",
          ("memory leak detected", "_check_req_pool")),
    "C": (">=0.5.11.dev0,<0.5.13.dev0", f"{_MIXIN}:SchedulerRuntimeCheckerMixin.on_idle",
          ("_check_all_pools", "_report_leak", "_check_req_pool")),
    "D": (">=0.5.13.dev0,<0.5.24.dev0", f"{_SCHED}:Scheduler.on_idle",
          ("invariant_checker._check_all_pools", "_report_leak", "_check_req_pool")),
}

_BUSY_CHECKS: tuple[tuple[str, str], ...] = (
    (">=0.5.6.dev0,<0.5.13.dev0", f"{_MIXIN}:SchedulerRuntimeCheckerMixin.self_check_during_busy"),
    (">=0.5.13.dev0,<0.5.24.dev0", f"{_CHECKER}:SchedulerInvariantChecker.self_check_during_busy"),
)

#: Where SGLang's HTTP server finds ``add_prometheus_middleware`` when it mounts
#: ``/metrics``: (name, releases, target, also_rebind, deferred). See the module
#: docstring for why the binding differs by release line.
_METRICS: tuple[tuple[str, str, str, tuple[str, ...], bool], ...] = (
    ("kvcached-metrics", ">=0.4.9.dev0,<0.5.3.dev0",
     "sglang.srt.utils:add_prometheus_middleware", (), False),
    ("kvcached-metrics-common", ">=0.5.3.dev0,<0.5.11.dev0",
     "sglang.srt.utils.common:add_prometheus_middleware",
     ("sglang.srt.utils:add_prometheus_middleware",), False),
    ("kvcached-metrics-http", ">=0.5.11.dev0,<0.5.24.dev0",
     "sglang.srt.entrypoints.http_server:add_prometheus_middleware", (), True),
)

#: Where SGLang sizes the KV pool from free device memory.
_RUNNER = "sglang.srt.model_executor.model_runner"
_PROFILES: tuple[tuple[str, str, str], ...] = (
    ("virtual-profile-tokens", ">=0.4.9.dev0,<0.5.11.dev0",
     f"{_RUNNER}:ModelRunner.profile_max_num_token"),
    ("virtual-profile-bytes", ">=0.5.11.dev0,<0.5.16.dev0",
     f"{_RUNNER}:ModelRunner._profile_available_bytes"),
    ("virtual-profile-configurator", ">=0.5.16.dev0,<0.5.24.dev0",
     "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator._profile_available_bytes"),
)

_MHA_PARAMS = ("size", "page_size", "dtype", "head_num", "head_dim", "layer_num", "device")
_MLA_PARAMS = ("size", "page_size", "dtype", "kv_lora_rank", "qk_rope_head_dim", "layer_num",
               "device")
#: What the MLA gates assume of SGLang's source: (release line, method) -> needles / absentees.
_MLA_INLINE = ("self.kv_buffer = [", "(size + page_size, 1, ")
_MLA_FACTORY = ("self.kv_buffer = [", "(self.size + self.page_size, 1, self.kv_cache_dim)")
_ALLOC_PARAMS = {"__init__": ("size", "dtype", "device", "kvcache"), "alloc": ("need_size",),
                 "free": ("free_index",), "available_size": (), "clear": (),
                 "alloc_extend": ("prefix_lens", "seq_lens"), "alloc_decode": ("seq_lens",),
                 "_release_page_ids": (), "backup_state": (), "restore_state": ("state",)}
#: What the paged gates assume of SGLang's source: method -> needles. The kernel
#: methods take their new pages from the front of ``free_pages``; every free ends
#: in ``free`` (up to 0.5.15) or ``_release_page_ids`` (0.5.23).
_PAGED_SOURCE = {
    "alloc_extend": ("self.free_pages,", "self.free_pages = self.free_pages[num_new_pages:]"),
    "alloc_decode": ("self.free_pages,", "self.free_pages = self.free_pages[num_new_pages:]"),
    "free": ("free_index // self.page_size",),
    "_release_page_ids": ("page_ids",),
}
def leak_check_layout(version: Any) -> str | None:
    """``"A"``..``"D"``: where this SGLang release keeps its idle leak check (None: unknown)."""
    from kvcached_core.plugins import version_matches

    for layout, (spec, _target, _needles) in LEAK_CHECK_LAYOUTS.items():
        if version_matches(spec, version):
            return layout
    return None


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _owner(fn: Any) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _expect_source(version: Any, needles: Iterable[str],
                   gate: str = "leak-check") -> Callable[[Callable], None]:
    def check(original: Callable) -> None:
        src = _source(original)
        missing = [n for n in needles if n not in src]
        if src and missing:
            raise PatchError(
                f"SGLang {version}: {_owner(original)} no longer contains {missing}; the "
                f"{gate} gate did not foresee this layout"
            )
    return check


def _expect_params(version: Any, cls_name: str, method: str,
                   names: Iterable[str]) -> Callable[[Any], None]:
    def check(owner_module: Any) -> None:
        cls = getattr(owner_module, cls_name)
        fn = getattr(cls, method)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        missing = [n for n in names if n not in params and not has_var_kw]
        if missing:
            raise PatchError(
                f"SGLang {version}: {cls_name}.{method}{inspect.signature(fn)} lacks "
                f"parameters {missing} that the kvcached gate expects"
            )
    return check


def _module_of(fn: Any) -> Any:
    import sys

    return sys.modules[fn.__module__]


def _leak_wrapper(version: Any, needles: tuple[str, ...]) -> Callable[[Callable], Callable]:
    from kvcached_sglang.leakcheck import with_leak_check_view
    from kvcached_sglang.prefix_cache import trim_prefix_cache

    check = _expect_source(version, needles)

    def wrap(original: Callable) -> Callable:
        check(original)
        return with_leak_check_view(original, before=trim_prefix_cache)

    return wrap


def _busy_wrapper(original: Callable) -> Callable:
    from kvcached_sglang.leakcheck import with_leak_check_view

    return with_leak_check_view(original)


def _pool_wrapper(version: Any, finish: bool) -> Callable[[Callable], Callable]:
    from kvcached_sglang.memory_pool import make_create_buffers

    def wrap(original: Callable) -> Callable:
        module = _module_of(original)
        _expect_params(version, "MHATokenToKVPool", "__init__", _MHA_PARAMS)(module)
        return make_create_buffers(original, finish=finish)

    return wrap


def _other_size_uses(src: str) -> list[str]:
    """Uses of ``size`` in an inline MLA ``__init__`` other than those ``make_mla_init`` fixes.

    Allowed: passing it to ``super().__init__``, the buffer shape ``(size + page_size, ...)``, the
    allocation log (an f-string or ``_finalize_allocation_log(size)``).
    """
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(src))
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    other = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Name) and node.id == "size"):
            continue
        up = parent[node]
        text = ast.unparse(up)
        shape = text == "size + page_size" and isinstance(parent[up], ast.Tuple)
        if isinstance(up, ast.FormattedValue) or shape or (
                isinstance(up, ast.Call) and ast.unparse(up.func) in (
                    "super().__init__", "self._finalize_allocation_log")):
            continue
        other.append(text)
    return other


def _mla_wrapper(version: Any, inline: bool) -> Callable[[Callable], Callable]:
    """``MLATokenToKVPool.__init__`` (``inline``: buffers built in it) or ``._create_buffers``."""
    from kvcached_sglang.memory_pool import make_mla_create_buffers, make_mla_init

    def wrap(original: Callable) -> Callable:
        import sys

        module = sys.modules[_POOL]  # the patch target's module (``original`` may be inherited)
        _expect_params(version, "MLATokenToKVPool", "__init__", _MLA_PARAMS)(module)
        init_src = _source(module.MLATokenToKVPool.__init__)
        if inline:
            _expect_source(version, _MLA_INLINE, "MLA buffer")(original)
            other = _other_size_uses(init_src)
            if init_src and ("_create_buffers()" in init_src or other):
                raise PatchError(
                    f"SGLang {version}: MLATokenToKVPool.__init__ calls _create_buffers or uses "
                    f"its size beyond the buffer shape and the log ({other}); the inline MLA "
                    "buffer gate did not foresee this")
            return make_mla_init(original, module.MLATokenToKVPool)
        _expect_source(version, _MLA_FACTORY, "MLA buffer")(original)
        if init_src and "self._create_buffers()" not in init_src:
            raise PatchError(f"SGLang {version}: MLATokenToKVPool.__init__ no longer calls "
                             "_create_buffers; the MLA buffer gate did not foresee this")
        return make_mla_create_buffers(original, module.MLATokenToKVPool)

    return wrap


def _allocator_wrapper(version: Any, name: str,
                       cls_name: str = "TokenToKVPoolAllocator") -> Callable[[Callable], Callable]:
    from kvcached_sglang.allocator import elastic_allocator_method

    def wrap(original: Callable) -> Callable:
        module = _alloc_module(original, cls_name)
        _expect_params(version, cls_name, name, _ALLOC_PARAMS[name])(module)
        if name == "alloc":
            _expect_params(version, cls_name, "__init__", _ALLOC_PARAMS["__init__"])(module)
        if cls_name == "PagedTokenToKVPoolAllocator" and name in _PAGED_SOURCE:
            _expect_source(version, _PAGED_SOURCE[name], "paged allocator")(original)
            if name == "_release_page_ids":
                cls = getattr(module, cls_name)
                for sender in ("free_page_ids", "free_group_end"):
                    _expect_source(version, ("self._release_page_ids(",),
                                   "paged allocator")(getattr(cls, sender))
        return elastic_allocator_method(name, original)

    return wrap


def _alloc_module(original: Callable, cls_name: str = "TokenToKVPoolAllocator") -> Any:
    """The module that defines ``cls_name`` (the method may be inherited)."""
    import sys

    for name in ("sglang.srt.mem_cache.allocator.token", "sglang.srt.mem_cache.allocator.paged",
                 "sglang.srt.mem_cache.allocator"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, cls_name):
            return mod
    return _module_of(original)


def build_patches(version: Any) -> list[Patch]:
    """Every patch of the SGLang adapter; each carries its own release gate."""
    patches: list[Patch] = []

    # Elastic pool buffers (page size 1, and page size > 1 where the paged allocator is
    # patched below; other layouts keep SGLang's buffers).
    # MLA: one latent buffer per layer; 0.5.5 builds it inline next to FP4 scale buffers
    # sized from the same ``size``, so 0.5.5 keeps SGLang's MLA buffers.
    buffer_patches = (
        ("elastic-mha-buffers", "MHATokenToKVPool._create_buffers",
         ">=0.4.9.dev0,<0.5.16.dev0", _pool_wrapper(version, finish=True),
         "MHA K/V buffers are kvcached virtual tensors backed on demand"),
        ("elastic-mha-buffers-normal", "MHATokenToKVPool._create_buffers_normal",
         ">=0.5.16.dev0,<0.5.24.dev0", _pool_wrapper(version, finish=False),
         "MHA K/V buffers (0.5.16 dispatcher split) on kvcached"),
        ("elastic-mla-init", "MLATokenToKVPool.__init__",
         ">=0.4.9.dev0,<0.5.5.dev0", _mla_wrapper(version, inline=True),
         "MLA kv_buffer (built in __init__) as kvcached virtual tensors"),
        ("elastic-mla-buffers", "MLATokenToKVPool._create_buffers",
         ">=0.5.6.dev0,<0.5.24.dev0", _mla_wrapper(version, inline=False),
         "MLA kv_buffer as kvcached virtual tensors backed on demand"),
    )
    for name, attr, spec, wrapper, description in buffer_patches:
        patches.append(Patch(f"{_POOL}:{attr}", versions=spec, wrapper=wrapper, name=name,
                             description=description))

    # Token allocator, page size 1.
    from kvcached_sglang.allocator import ALLOCATOR_METHODS

    for spec, module in ((">=0.4.9.dev0,<0.5.13.dev0", "sglang.srt.mem_cache.allocator"),
                         (">=0.5.13.dev0,<0.5.24.dev0", "sglang.srt.mem_cache.allocator.token")):
        for meth in ALLOCATOR_METHODS:
            patches.append(Patch(
                f"{module}:TokenToKVPoolAllocator.{meth}", versions=spec,
                wrapper=_allocator_wrapper(version, meth),
                name=f"elastic-token-allocator-{meth}" + ("-pkg" if module.endswith("token") else ""),
                description="token slots drawn from kvcached blocks"))

    # Paged allocator (page size > 1): SGLang's kernels over pages kvcached hands out.
    from kvcached_sglang.allocator import PAGED_ALLOCATOR_METHODS

    for spec, module, extra, suffix in PAGED_LINES:
        for meth in PAGED_ALLOCATOR_METHODS + extra:
            patches.append(Patch(
                f"{module}:PagedTokenToKVPoolAllocator.{meth}", versions=spec,
                wrapper=_allocator_wrapper(version, meth, "PagedTokenToKVPoolAllocator"),
                name=paged_patch_name(meth, suffix),
                description="whole pages drawn from kvcached blocks; SGLang's kernels lay out "
                            "the slots"))

    # backup_state / restore_state (speculative decoding): a journal instead of a free-list
    # snapshot. From 0.5.13 optional: 0.5.23 has no such methods, 0.5.16 - 0.5.22 unchecked.
    from kvcached_sglang.allocator import BACKUP_METHODS

    backup_lines = (
        (">=0.4.9.dev0,<0.5.13.dev0", "sglang.srt.mem_cache.allocator", True),
        (">=0.5.13.dev0,<0.5.24.dev0", "sglang.srt.mem_cache.allocator.{}", False),
    )
    for spec, module, required in backup_lines:
        for cls_name, sub in (("TokenToKVPoolAllocator", "token"),
                              ("PagedTokenToKVPoolAllocator", "paged")):
            for meth in BACKUP_METHODS:
                patches.append(Patch(
                    f"{module.format(sub)}:{cls_name}.{meth}", versions=spec,
                    wrapper=_allocator_wrapper(version, meth, cls_name), required=required,
                    name=f"elastic-{sub}-allocator-{meth}"
                         + ("-pkg" if "{}" in module else ""),
                    description="speculative decoding's backup/restore as a journal of "
                                "kvcached blocks"))

    # Memory profile: SGLang's own code, with a view of the device without other processes.
    from kvcached_sglang.profile import make_virtual_profile

    for name, spec, target in _PROFILES:
        patches.append(Patch(
            target, versions=spec, name=name,
            wrapper=lambda original: make_virtual_profile(original, version),
            description="KV memory profiled as if the engine had the device to itself"))

    # Idle leak check: SGLang's own check in the leak-check view.
    for layout, (spec, target, needles) in LEAK_CHECK_LAYOUTS.items():
        patches.append(Patch(
            target, versions=spec, wrapper=_leak_wrapper(version, needles),
            name=f"leak-check-{layout}",
            description=f"idle leak check (layout {layout}) sees logical KV counts; "
                        "the request-slot check stays live; the idle prefix cache is "
                        "trimmed to KVCACHED_MAX_CACHED_TOKENS"))
    for i, (spec, target) in enumerate(_BUSY_CHECKS):
        patches.append(Patch(
            target, versions=spec, wrapper=_busy_wrapper, name=f"busy-check-{i}",
            required=False, description="opt-in busy leak check sees logical KV counts"))

    # /metrics (--enable-metrics): SGLang's registry also holds kvcached's collector.
    from kvcached_sglang.metrics import make_add_prometheus_middleware

    for name, spec, target, rebind, deferred in _METRICS:
        patches.append(Patch(
            target, versions=spec, name=name, also_rebind=rebind, deferred=deferred,
            required=False,
            wrapper=lambda original: make_add_prometheus_middleware(original, version),
            description="SGLang's /metrics also shows kvcached's pools (gauges, map/unmap "
                        "latency histograms)"))
    return patches
