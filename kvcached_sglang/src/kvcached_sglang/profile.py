"""SGLang's KV memory profile, taken as if the engine had the device to itself.

SGLang sizes its KV pool once, at start, from the device memory free at that
moment: ``rest = free_after_load - free_before_load * (1 - mem_fraction_static)``.
Next to other engines that figure is whatever they happen to hold then, so an
engine started beside a busy one gets a small pool for good, even after the
other one's elastic KV shrinks. With kvcached the pool is virtual address space
backed on demand, so kvcached runs SGLang's own profiling code with a view of
the device that leaves other processes out: free memory is the device's total
minus what this process holds (``torch.cuda.memory_reserved``, or the RSS on
the CPU), and the pre-load figure is the device's total. The budget becomes
``total * mem_fraction_static - own``: what SGLang computes when it is alone.
Physical memory is still checked on every map: when other engines hold it,
allocation reports no space and the scheduler waits (a scheduling miss).

The profiling code runs unchanged, with one name rebound in a private copy of
its globals (``get_available_gpu_memory``, through
:func:`kvcached_core.plugins.with_globals`); SGLang's module is never modified.
Where the release keeps it (the gates in :mod:`kvcached_sglang.patches`):

* ``ModelRunner.profile_max_num_token(total_gpu_memory)``: 0.4.9 - 0.5.10;
* ``ModelRunner._profile_available_bytes(pre_model_load_memory)``: 0.5.11 - 0.5.15;
* ``KVCacheConfigurator._profile_available_bytes(pre_model_load_memory)``: 0.5.16 on.

The view applies only to engines whose KV pools kvcached backs: anything that
would keep SGLang's static buffers (page size > 1, hybrid SWA / Mamba models,
the hierarchical cache, a custom memory pool, NSA / FP4 MLA, devices other than
CUDA/ROCm and the CPU) keeps SGLang's own profile, logged with the reason.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from kvcached_core.errors import PatchError
from kvcached_core.plugins.rebind import reads_global, with_globals

__all__ = ["LAST_PROFILE", "device_view", "make_virtual_profile", "static_reason"]

_log = logging.getLogger("kvcached")
_PROBE = "get_available_gpu_memory"
GiB = 1 << 30

#: The last virtual profile taken in this process (for logs, tests and ``kvctl``).
LAST_PROFILE: dict[str, Any] = {}


def device_view(device: str, gpu_id: int, empty_cache: bool = True) -> tuple[int, int] | None:
    """``(total, held by this process)`` bytes of the device, or ``None`` for other devices."""
    if device == "cuda":
        import torch

        if empty_cache:
            torch.cuda.empty_cache()
        total = torch.cuda.mem_get_info(gpu_id)[1]
        return int(total), int(torch.cuda.memory_reserved(gpu_id))
    if device == "cpu":
        import psutil

        return int(psutil.virtual_memory().total), int(psutil.Process().memory_info().rss)
    return None


def _virtual_probe(device: str, gpu_id: int, distributed: bool = False, empty_cache: bool = True,
                   cpu_group: Any = None) -> float:
    """``get_available_gpu_memory``'s signature and unit (GiB), over :func:`device_view`."""
    view = device_view(device, gpu_id, empty_cache)
    assert view is not None  # static_reason() ruled other devices out
    free = (view[0] - view[1]) / GiB
    if distributed:  # the smallest over the ranks, as SGLang's probe does
        import torch
        import torch.distributed as dist

        t = torch.tensor(free, dtype=torch.float32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group)
        free = float(t.item())
    LAST_PROFILE.update(total_bytes=view[0], own_bytes=view[1], free_gib=free)
    return free


def static_reason(obj: Any) -> str | None:
    """Why this engine's KV pools stay SGLang's static buffers (so its profile stays real).

    ``obj`` is the ``ModelRunner`` or (0.5.16+) the ``KVCacheConfigurator``.
    ``None``: every pool it builds is one kvcached backs.
    """
    device = str(getattr(obj, "device", ""))
    if device not in ("cuda", "cpu"):
        return f"device {device!r}"
    args = getattr(obj, "server_args", None)
    page = getattr(obj, "page_size", None) or getattr(args, "page_size", 1) or 1
    if page != 1:
        from kvcached_sglang.paged_lines import paged_allocator_elastic

        if not paged_allocator_elastic():
            return f"page size {page} (this release's paged allocator is not elastic)"
    for flag in ("is_hybrid", "is_hybrid_swa", "is_hybrid_swa_compress", "is_hybrid_gdn"):
        if getattr(obj, flag, False):
            return f"hybrid model ({flag})"
    if getattr(obj, "mambaish_config", None) is not None:
        return "hybrid Mamba / linear-attention model"
    for flag in ("enable_hierarchical_cache", "enable_custom_mem_pool", "enable_memory_saver",
                 "enable_lmcache", "disaggregation_mode"):
        value = getattr(args, flag, None)
        if value and value != "null":
            return f"server_args.{flag}={value!r}"
    if getattr(obj, "use_mla_backend", False):
        config = getattr(obj, "model_config", None)
        for holder in (obj, config):
            for flag in ("use_nsa", "use_dsa", "is_nsa", "is_dsa"):
                if getattr(holder, flag, False) is True:
                    return f"MLA with {flag}"
        dtype = str(getattr(args, "kv_cache_dtype", "auto"))
        if "fp4" in dtype:
            return f"MLA with kv_cache_dtype={dtype}"
    return None


def make_virtual_profile(original: Callable[..., Any], version: Any) -> Callable[..., Any]:
    """Patch wrapper for the release's profiling method (first argument: the pre-load GiB)."""
    if not reads_global(original, _PROBE) or _PROBE not in original.__globals__:
        raise PatchError(
            f"SGLang {version}: {getattr(original, '__qualname__', original)} no longer calls "
            f"{_PROBE}; the memory-profile gate did not foresee this")

    code = original.__code__
    pre_load_name = code.co_varnames[1] if code.co_argcount >= 2 else None
    if pre_load_name is None:
        raise PatchError(f"SGLang {version}: {original.__qualname__} takes no pre-load memory "
                         "figure; the memory-profile gate did not foresee this")

    @functools.wraps(original)
    def profile(self: Any, *args: Any, **kwargs: Any) -> Any:
        reason = static_reason(self)
        if reason is not None:
            _log.info("kvcached: SGLang's memory profile stays as measured (%s)", reason)
            return original(self, *args, **kwargs)
        view = device_view(str(self.device), self.gpu_id, empty_cache=False)
        assert view is not None
        if args:
            pre_load_gib, args = args[0], (view[0] / GiB, *args[1:])
        else:
            pre_load_gib = kwargs[pre_load_name]
            kwargs = {**kwargs, pre_load_name: view[0] / GiB}
        alone = with_globals(original, **{_PROBE: _virtual_probe})
        result = alone(self, *args, **kwargs)
        LAST_PROFILE.update(method=original.__qualname__, result=result,
                            measured_pre_load_gib=float(pre_load_gib),
                            virtual_pre_load_gib=view[0] / GiB)
        _log.info(
            "kvcached: KV memory profiled as if SGLang had the device to itself: %s -> %s "
            "(device %.2f GiB, this process holds %.2f GiB; %.2f GiB was free before the "
            "model loaded)", original.__qualname__, result, view[0] / GiB,
            LAST_PROFILE.get("own_bytes", view[1]) / GiB, float(pre_load_gib))
        return result

    return profile
