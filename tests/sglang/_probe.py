"""Runs inside one SGLang release (a subprocess set up by conftest.py) and reports JSON.

``_probe.py release <version>`` checks, against the real SGLang source:
version detection, that kvcached's patch set applies completely and reverts
exactly, that the patched pools and allocator run on the CPU host backend, and
the idle leak check on the release's layout (consistent elastic pool passes, a
request-slot leak and a genuine KV leak still fail). ``_probe.py gates`` checks
bad input (out-of-range, unknown version) without SGLang.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import traceback
from typing import Any
from unittest import mock

REPORT: dict[str, Any] = {}


def section(name: str):
    def deco(fn):
        try:
            REPORT[name] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            REPORT[name] = {"error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()[-3000:]}
        return fn
    return deco


def resolve(target: str) -> tuple[Any, str, Any]:
    import importlib

    mod, _, qual = target.partition(":")
    obj = importlib.import_module(mod)
    *owners, attr = qual.split(".")
    for part in owners:
        obj = getattr(obj, part)
    return obj, attr, obj.__dict__.get(attr, None) if isinstance(obj, type) else getattr(obj, attr)


def call_filtered(fn, **kwargs):
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


# --------------------------------------------------------------------------- release


def release(version: str) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"
    from kvcached_core.plugins import bootstrap, detect_engine_version, teardown
    from kvcached_sglang.patches import build_patches, leak_check_layout

    import sglang

    REPORT["sglang_version"] = sglang.__version__
    det = detect_engine_version("sglang", "sglang", ("sglang",))
    REPORT["detected"] = {"value": str(det.version), "source": det.source, "known": det.known}
    layout = leak_check_layout(det.version)
    REPORT["layout"] = layout

    # Originals of every patch target that exists, before anything is patched.
    before: dict[str, Any] = {}
    for p in build_patches(det.version):
        try:
            owner, attr, own = resolve(p.target)
            before[p.target] = (attr in getattr(owner, "__dict__", {}), own)
        except Exception:
            pass

    res = bootstrap("sglang", strict=False)
    ps = res.patch_set
    REPORT["bootstrap"] = {"status": res.status, "reason": res.reason,
                           "applied": list(ps.applied) if ps else [],
                           "failed": [list(x) for x in ps.failed] if ps else []}

    @section("pool")
    def _pool():
        return check_pool()

    @section("mla")
    def _mla():
        return check_mla_pool()

    @section("swa")
    def _swa():
        return check_swa()

    @section("hybrid_linear")
    def _hybrid_linear():
        return check_hybrid_linear()

    @section("leak")
    def _leak():
        return check_leak(layout)

    @section("profile")
    def _profile():
        return check_profile(det.version)

    @section("revert")
    def _revert():
        rev = teardown("sglang")
        mismatched = []
        for target, (was_own, original) in before.items():
            owner, attr, own = resolve(target)
            now_own = attr in owner.__dict__ if isinstance(owner, type) else True
            if now_own != was_own or (was_own and own is not original):
                mismatched.append(target)
        return {"conflicts": [str(c) for c in rev.conflicts] if rev else None,
                "restored": len(rev.restored) if rev else 0, "mismatched": mismatched}

    @section("mla_signature")
    def _mla_signature():
        return check_mla_signature_change(before)


def make_pool(size: int, page_size: int = 1):
    import torch
    from sglang.srt.mem_cache import memory_pool as mp

    pool = call_filtered(
        mp.MHATokenToKVPool, size=size, page_size=page_size, dtype=torch.bfloat16, head_num=8,
        head_dim=128, layer_num=2, device="cpu", enable_memory_saver=False, start_layer=None,
        end_layer=None, enable_alt_stream=False, enable_kv_cache_copy=False)
    return pool


def _find(name: str, modules: tuple[str, ...]):
    import importlib

    for mod in modules:
        try:
            found = getattr(importlib.import_module(mod), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise ImportError(f"{name} not in {modules}")


_MC = "sglang.srt.mem_cache"


def allocator_cls():
    return _find("TokenToKVPoolAllocator", (f"{_MC}.allocator.token", f"{_MC}.allocator"))


def make_allocator(pool):
    import torch

    return call_filtered(allocator_cls(), size=pool.size, dtype=torch.bfloat16, device="cpu",
                         kvcache=pool, need_sort=False)


def first_slots(pool, state, out: dict[str, Any]):
    """An allocator over ``pool`` and its first 5 slots; free counts before and after."""
    alloc = make_allocator(pool)
    mapped0 = state.mapped_bytes()
    out["available0"] = alloc.available_size()
    idx = alloc.alloc(5)
    out["alloc5"] = idx.tolist()
    out["available1"] = alloc.available_size()
    return alloc, idx, mapped0


def check_pool() -> dict[str, Any]:
    import torch

    pool = make_pool(4096)
    state = getattr(pool, "_kvcached", None)
    out: dict[str, Any] = {"elastic": state is not None,
                           "k_shape": list(pool.k_buffer[0].shape)}
    if state is None:
        return out
    alloc, idx, mapped0 = first_slots(pool, state, out)
    out["mapped_grew"] = state.mapped_bytes() >= mapped0 and state.mapped_bytes() > 0
    val = torch.full((5, 8, 128), 3.0, dtype=torch.bfloat16)
    pool.k_buffer[1][idx] = val
    out["readback"] = bool(torch.equal(pool.k_buffer[1][idx], val))
    if hasattr(alloc, "backup_state"):  # speculative decoding's draft slots, up to 0.5.15
        before = alloc.available_size()
        backup = alloc.backup_state()
        draft = alloc.alloc(7)
        alloc.free(draft[:2])  # freed inside the window: not freed twice by the restore
        alloc.restore_state(backup)
        out["restore_frees_draft"] = alloc.available_size() == before
        out["restore_kept_older"] = state.used_tokens() == 5
    big = alloc.alloc(1500)  # spans pages
    out["pages_in_use"] = state.pages.stats().in_use
    alloc.free(big)
    alloc.free(idx)
    out["available2"] = alloc.available_size()
    out["pages_in_use_after"] = state.pages.stats().in_use
    out["size"] = pool.size
    state.close()
    return out


def paged_allocator_cls():
    return _find("PagedTokenToKVPoolAllocator", (f"{_MC}.allocator.paged", f"{_MC}.allocator"))


def check_paged(ps: int = 16) -> dict[str, Any]:
    """Page size 16: SGLang's own Triton kernels lay out the slots of pages drawn from kvcached.

    Run by ``_probe.py paged`` under ``TRITON_INTERPRET=1``: this CPU has no Triton backend,
    and Triton's interpreter runs the same kernels on CPU tensors.
    """
    import torch

    from kvcached_sglang.paged_lines import paged_allocator_elastic

    pool = make_pool(4096, page_size=ps)
    state = getattr(pool, "_kvcached", None)
    out: dict[str, Any] = {"elastic": state is not None, "patched": paged_allocator_elastic()}
    if state is None:
        return out
    alloc = call_filtered(paged_allocator_cls(), size=pool.size, page_size=ps,
                          dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=False)
    out["available0"] = alloc.available_size()
    first = alloc.alloc(ps)  # request B's cached prefix: 5 tokens of one page
    # A: 0 -> 32 tokens (2 new pages); B: 5 -> 40 (11 slots in its page, 2 new pages).
    prefix, seq = torch.tensor([0, 5]), torch.tensor([32, 40])
    ext = call_filtered(alloc.alloc_extend, prefix_lens=prefix, prefix_lens_cpu=prefix,
                        seq_lens=seq, seq_lens_cpu=seq, last_loc=torch.tensor([-1, int(first[4])]),
                        extend_num_tokens=int((seq - prefix).sum()))
    a, b = ext[:32], ext[32:]
    held = set(state.blocks.allocated_ids())
    out["extend"] = {
        "n": len(ext), "unique": len(set(ext.tolist())) == len(ext),
        "b_continues_prefix": b[:11].tolist() == first[5:].tolist(),
        "positions_match": all(int(x) % ps == i % ps for i, x in enumerate(a.tolist()))
        and all(int(x) % ps == (5 + i) % ps for i, x in enumerate(b.tolist())),
        "pages_from_kvcached": {int(x) // ps for x in ext.tolist()} <= held,
        "new_pages": len({int(x) // ps for x in ext.tolist()} - {int(first[0]) // ps}),
    }
    out["available1"] = alloc.available_size()
    val = torch.full((len(ext), 8, 128), 2.0, dtype=torch.bfloat16)
    pool.k_buffer[0][ext] = val
    out["readback"] = bool(torch.equal(pool.k_buffer[0][ext], val))
    # Decode: A's 33rd token opens a page, B's 41st continues its last page.
    seq2 = torch.tensor([33, 41])
    dec = call_filtered(alloc.alloc_decode, seq_lens=seq2, seq_lens_cpu=seq2,
                        last_loc=torch.tensor([int(a[-1]), int(b[-1])]))
    out["decode"] = {"a_new_page": int(dec[0]) % ps == 0 and int(dec[0]) // ps not in
                     {int(x) // ps for x in a.tolist()},
                     "b_next_slot": int(dec[1]) == int(b[-1]) + 1}
    out["available2"] = alloc.available_size()
    out["pages_in_use"] = state.pages.stats().in_use
    alloc.free_group_begin()
    alloc.free(a)  # A's two full pages
    out["deferred_in_group"] = alloc.available_size() == out["available2"]
    alloc.free_group_end()
    out["freed_at_group_end"] = alloc.available_size() == out["available2"] + 2 * ps
    rest = torch.cat([first, b, dec])  # B's slots share its first page
    if hasattr(alloc, "free_page_ids"):  # 0.5.23: page-id frees end in _release_page_ids
        alloc.free_page_ids(torch.unique(rest // ps))
        out["via"] = "free_page_ids"
    else:
        alloc.free(rest)
        out["via"] = "free"
    out["available3"] = alloc.available_size()
    out["pages_in_use_after"] = state.pages.stats().in_use
    out["free_pages_left"] = len(alloc.free_pages)
    state.close()
    return out


def _named_only(cls, forward: dict[str, Any] | None = None, **kwargs):
    """``cls(**kwargs)`` with the keyword arguments its ``__init__`` names, plus ``forward``
    when it also takes ``**kwargs``."""
    params = inspect.signature(cls.__init__).parameters
    args = {k: v for k, v in kwargs.items() if k in params}
    if forward and any(p.kind is p.VAR_KEYWORD for p in params.values()):
        args.update(forward)
    return cls(**args)


def check_swa() -> dict[str, Any]:
    """The sliding-window hybrid pool: both of its MHA pools and both sub-allocators on kvcached."""
    import torch

    from kvcached_sglang.memory_pool import elastic_of

    pool_cls = _find("SWAKVPool", (f"{_MC}.swa_memory_pool", f"{_MC}.memory_pool"))
    alloc_cls = _find("SWATokenToKVPoolAllocator",
                      (f"{_MC}.allocator.swa", f"{_MC}.swa_memory_pool", f"{_MC}.allocator"))
    mha = dict(dtype=torch.bfloat16, head_num=8, head_dim=128, device="cpu")
    pool = _named_only(pool_cls, size=4096, size_swa=1024, page_size=1,
                       swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1],
                       enable_kvcache_transpose=False, **mha,
                       # 0.5.3 - 0.5.4 take the MHA pools' arguments through **kwargs
                       forward=mha)
    full, swa = (getattr(pool.full_kv_pool, "_kvcached", None),
                 getattr(pool.swa_kv_pool, "_kvcached", None))
    out: dict[str, Any] = {"elastic": [full is not None, swa is not None]}
    if full is None or swa is None:
        return out
    out["found_by_wrapper"] = elastic_of(pool) is full
    alloc = _named_only(alloc_cls, size=4096, size_swa=1024, page_size=1, dtype=torch.bfloat16,
                        device="cpu", kvcache=pool, need_sort=False)
    def available():  # (0.4.x's combined available_size is not implemented)
        return [alloc.full_available_size(), alloc.swa_available_size()]

    out["available0"] = available()
    idx = alloc.alloc(300)
    out["after_alloc"] = [full.used_tokens(), swa.used_tokens()]
    out["mapped"] = [full.mapped_bytes() > 0, swa.mapped_bytes() > 0]
    layer = pool.full_kv_pool.k_buffer[0]
    val = torch.full((300, 8, 128), 5.0, dtype=torch.bfloat16)
    layer[idx] = val
    out["readback"] = bool(torch.equal(layer[idx], val))
    alloc.free_swa(idx[:200])  # the window moved past these tokens
    out["after_free_swa"] = [full.used_tokens(), swa.used_tokens()]
    if hasattr(alloc, "free_full"):  # 0.5.23: slots without a window peer go to free_full
        alloc.free_full(idx[:200])
        alloc.free(idx[200:])
    else:  # earlier: free() skips the peers free_swa already released
        alloc.free(idx)
    out["after_free"] = [full.used_tokens(), swa.used_tokens()]
    out["available1"] = available()
    out["pages_in_use"] = [full.pages.stats().in_use, swa.pages.stats().in_use]
    full.close()
    swa.close()
    return out


def check_hybrid_linear() -> dict[str, Any]:
    """The Mamba / linear-attention hybrid: its full-attention KV pool on kvcached (the
    per-request state pool stays SGLang's)."""
    import torch

    from kvcached_sglang.memory_pool import elastic_of

    try:
        pool_cls = _find("HybridLinearKVPool", (f"{_MC}.memory_pool",))
    except ImportError:
        return {"skipped": "no HybridLinearKVPool in this release"}
    pool = _named_only(pool_cls, size=2048, dtype=torch.bfloat16, page_size=1, head_num=8,
                       head_dim=128, full_attention_layer_ids=[1, 3],
                       enable_kvcache_transpose=False, device="cpu", mamba_pool=None)
    state = elastic_of(pool)
    out: dict[str, Any] = {"elastic": state is not None and state is pool.full_kv_pool._kvcached}
    if state is None:
        return out
    alloc = make_allocator(pool)
    out["available0"] = alloc.available_size()
    idx = alloc.alloc(100)
    out["used"] = state.used_tokens()
    buf = pool.get_key_buffer(3)  # global layer 3: the second full-attention layer
    val = torch.full((100, 8, 128), 7.0, dtype=torch.bfloat16)
    buf[idx] = val
    out["readback"] = bool(torch.equal(pool.full_kv_pool.k_buffer[1][idx], val))
    alloc.free(idx)
    out["available1"] = alloc.available_size()
    out["pages_in_use"] = state.pages.stats().in_use
    state.close()
    return out


MLA_DIM = (512, 64)  # kv_lora_rank, qk_rope_head_dim (DeepSeek's)


def make_mla_pool(size: int, cls=None, **extra):
    import torch
    from sglang.srt.mem_cache import memory_pool as mp

    rank, rope = MLA_DIM
    return call_filtered(
        cls or mp.MLATokenToKVPool, size=size, page_size=1, dtype=torch.bfloat16,
        kv_lora_rank=rank, qk_rope_head_dim=rope, layer_num=2, device="cpu",
        enable_memory_saver=False, start_layer=None, end_layer=None, **extra)


def no_dcp() -> None:
    """Process-group state only a launched engine publishes: no decode context parallelism."""
    import types

    from sglang.srt.mem_cache import memory_pool as mp

    if hasattr(mp, "get_parallel"):
        mp.get_parallel = lambda: types.SimpleNamespace(dcp_enabled=False, attn_dcp_size=1)
    if hasattr(mp, "dcp_enabled"):
        mp.dcp_enabled = lambda: False


def check_mla_pool() -> dict[str, Any]:
    """An MLA pool on kvcached: slots through the token allocator, writes that read back."""
    import types

    import torch
    from sglang.srt.mem_cache import memory_pool as mp

    no_dcp()
    pool = make_mla_pool(4096)
    state = getattr(pool, "_kvcached", None)
    out: dict[str, Any] = {"elastic": state is not None, "kv_shape": list(pool.kv_buffer[0].shape),
                           "layers": len(pool.kv_buffer), "size": pool.size}
    if state is None:
        return out
    out["buffers"] = state.kv.layout.num_buffers
    out["virtual"] = all(b.data_ptr() == state.view(i, 0, b.dtype, (1, b.shape[-1])).data_ptr()
                         for i, b in enumerate(pool.kv_buffer))
    if hasattr(pool, "data_ptrs"):
        out["data_ptrs_match"] = pool.data_ptrs.tolist() == [b.data_ptr() for b in pool.kv_buffer]
    out["mem_usage_gb"] = pool.mem_usage
    alloc, idx, mapped0 = first_slots(pool, state, out)
    rank, rope = MLA_DIM
    layer = types.SimpleNamespace(layer_id=1, tp_k_head_num=1, tp_v_head_num=1,
                                  head_dim=rank + rope, v_head_dim=rank, k_scale=None,
                                  v_scale=None)
    cache_k = torch.randn(5, 1, rank + rope).to(torch.bfloat16)
    cache_v = cache_k[..., :rank]
    pool.set_kv_buffer(layer, idx, cache_k, cache_v)
    out["readback_key"] = bool(torch.equal(pool.get_key_buffer(1)[idx], cache_k))
    out["readback_value"] = bool(torch.equal(pool.get_value_buffer(1)[idx], cache_v))
    out["other_layer_untouched"] = bool(torch.count_nonzero(pool.get_key_buffer(0)[idx]) == 0)
    big = alloc.alloc(1500)  # 1500 rows of 1152 bytes span two 1 MiB pages
    out["pages_in_use"] = state.pages.stats().in_use
    out["mapped_grew"] = state.mapped_bytes() > mapped0
    out["ids_below_rows"] = int(big.max()) < pool.size + pool.page_size
    alloc.free(big)
    alloc.free(idx)
    out["available2"] = alloc.available_size()
    out["pages_in_use_after"] = state.pages.stats().in_use
    state.close()

    # Pools kvcached leaves to SGLang entirely: a subclass (NSA/DSA indexer caches, FP4
    # scales, ... add buffers) and the NSA/DSA flag where the release has one.
    class Sub(mp.MLATokenToKVPool):
        pass

    sub = make_mla_pool(64, cls=Sub)
    out["subclass_static"] = sub._kvcached is None and list(sub.kv_buffer[0].shape) == [65, 1, 576]
    params = inspect.signature(mp.MLATokenToKVPool.__init__).parameters
    flag = next((f for f in ("use_dsa", "use_nsa") if f in params), None)
    out["dsa_flag"] = flag
    if flag is not None:
        dsa = make_mla_pool(64, **{flag: True})
        out["dsa_static"] = dsa._kvcached is None and list(dsa.kv_buffer[0].shape) == [65, 1, 576]
    return out


def check_mla_signature_change(before: dict[str, Any]) -> dict[str, Any]:
    """A release whose ``MLATokenToKVPool.__init__`` lost ``kv_lora_rank``: the set rolls back."""
    from kvcached_core.plugins import bootstrap, reset_bootstrap
    from sglang.srt.mem_cache import memory_pool as mp

    cls = mp.MLATokenToKVPool
    real = cls.__dict__["__init__"]

    def __init__(self, size, page_size, dtype, latent_dim, layer_num, device,
                 enable_memory_saver, start_layer=None, end_layer=None):
        raise AssertionError("never called")

    reset_bootstrap()
    cls.__init__ = __init__
    try:
        res = bootstrap("sglang", strict=False)
    finally:
        cls.__init__ = real
    ps = res.patch_set
    untouched = [t for t, (was_own, original) in before.items()
                 if was_own and resolve(t)[2] is not original]
    reset_bootstrap()
    return {"status": res.status, "reason": res.reason,
            "applied": list(ps.applied) if ps else [], "not_restored": untouched}


# --------------------------------------------------------------------------- leak check

FALSY = ("is_hybrid", "is_hybrid_swa", "is_hybrid_ssm", "enable_hierarchical_cache",
         "enable_metrics", "enable_hisparse", "enable_unified_memory", "enable_hicache_storage",
         "enable_lmcache", "current_scheduler_metrics_enabled", "enable_priority_scheduling",
         "spec_algorithm_is_none")


def fake_tree(evictable: int):
    tree = mock.MagicMock(name="tree_cache")
    for name in ("evictable_size", "full_evictable_size"):
        getattr(tree, name).return_value = evictable
    for name in ("protected_size", "full_protected_size", "swa_protected_size",
                 "session_held_tokens", "session_held_full_tokens", "session_held_swa_tokens",
                 "session_held_req_count"):
        getattr(tree, name).return_value = 0
    for name in ("is_tree_cache", "supports_mamba", "supports_swa", "supports_prefix_sharing"):
        getattr(tree, name).return_value = False
    tree.session_records.return_value = {}
    tree.page_size = 1
    return tree


def build_dataclass(cls, known: dict[str, Any]):
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in known:
            kwargs[f.name] = known[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs[f.name] = False if f.name.startswith(("is_", "enable_")) else mock.MagicMock(name=f.name)
    return cls(**kwargs)


def make_scheduler(state: dict[str, Any]):
    """A Scheduler instance without __init__: real check methods, mocks for the rest."""
    from sglang.srt.managers.scheduler import Scheduler

    class Probe(Scheduler):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            if name in FALSY or name.startswith(("is_hybrid", "enable_")):
                return False
            value = mock.MagicMock(name=name)
            object.__setattr__(self, name, value)
            return value

    sched = Probe.__new__(Probe)
    for name in FALSY:
        try:
            object.__setattr__(sched, name, False)
        except Exception:
            pass
    from sglang.srt.disaggregation.utils import DisaggregationMode

    fields = dict(state, disaggregation_mode=DisaggregationMode.NULL, page_size=1,
                  is_fully_idle=lambda: True, last_batch=None, running_batch=None,
                  sessions={}, init_new_token_ratio=0.5, count_memory_leak_warnings=0,
                  count_req_pool_leak_warnings=0)
    for k, v in fields.items():
        object.__setattr__(sched, k, v)
    try:
        from sglang.srt.managers.scheduler_components.invariant_checker import (
            SchedulerInvariantChecker,
        )
        from sglang.srt.managers.scheduler_components.pool_stats_observer import (
            SchedulerPoolStatsObserver,
        )
    except ImportError:
        return sched
    import types

    from sglang.srt.managers.scheduler_components import invariant_checker as ic

    if hasattr(ic, "get_parallel"):
        # Process-group state only a launched engine publishes (0.5.2x): no DCP here.
        ic.get_parallel = lambda: types.SimpleNamespace(dcp_enabled=False)

    known = dict(fields, get_last_batch=lambda: None, get_running_batch=lambda: None,
                 session_controller=types.SimpleNamespace(sessions={}), hisparse_coordinator=None,
                 server_args=types.SimpleNamespace(dcp_size=1, speculative_eagle_topk=None),
                 full_tokens_per_layer=None, swa_tokens_per_layer=None)
    observer = build_dataclass(SchedulerPoolStatsObserver, known) if dataclasses.is_dataclass(
        SchedulerPoolStatsObserver) else None
    if observer is not None:
        for meth in ("session_held_tokens", "session_held_req_count",
                     "session_held_full_tokens", "session_held_swa_tokens"):
            if hasattr(type(observer), meth):
                try:
                    setattr(observer, meth, lambda: 0)
                except Exception:  # frozen / slots dataclass: its own accounting is used
                    pass
    known["pool_stats_observer"] = observer
    checker = build_dataclass(SchedulerInvariantChecker, known)
    object.__setattr__(sched, "pool_stats_observer", observer)
    object.__setattr__(sched, "invariant_checker", checker)
    return sched


def idle_check(sched, layout: str, *, patched: bool = True) -> None:
    from sglang.srt.managers.scheduler import Scheduler

    fn = {"A": "check_memory", "B": "check_memory", "C": "on_idle", "D": "on_idle"}[layout]
    method = getattr(Scheduler, fn)
    if not patched:
        method = getattr(method, "__wrapped__", method)
    method(sched)


def check_leak(layout: str | None) -> dict[str, Any]:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    assert layout is not None
    pool = make_pool(4096)
    state = pool._kvcached
    assert state is not None, "pool is not elastic"
    # Two 1 MiB pages per buffer (2 layers x K/V): 2 pages of 512 tokens are backable now.
    state.pages.set_memory_limit(2 * state.pages.page_bytes)
    alloc = make_allocator(pool)
    req_pool = call_filtered(ReqToTokenPool, size=4, max_context_len=32, device="cpu",
                             enable_memory_saver=False)
    if not hasattr(req_pool, "pre_alloc_size"):
        req_pool.pre_alloc_size = 0
    cached = alloc.alloc(100)  # a finished request's KV, now held by the radix cache
    tree = fake_tree(evictable=100)
    sched = make_scheduler(dict(token_to_kv_pool_allocator=alloc, tree_cache=tree,
                                max_total_num_tokens=pool.size, req_to_token_pool=req_pool))
    out: dict[str, Any] = {"available": alloc.available_size(),
                           "logical": state.logical_free_tokens()}

    def outcome(**kw) -> str:
        try:
            idle_check(sched, layout, **kw)
            return "passed"
        except ValueError as exc:
            return f"ValueError: {str(exc)[:300]}"

    out["unpatched_consistent"] = outcome(patched=False)
    out["patched_consistent"] = outcome()
    slot = req_pool.free_slots.pop()
    out["patched_req_leak"] = outcome()
    if isinstance(req_pool.free_slots, list):
        req_pool.free_slots.append(slot)
    else:
        import torch
        req_pool.free_slots = torch.cat([req_pool.free_slots, torch.tensor([slot])])
    out["patched_consistent_again"] = outcome()
    leaked = alloc.alloc(7)  # allocated, held by no request and not in the tree
    out["patched_kv_leak"] = outcome()
    alloc.free(leaked)
    alloc.free(cached)
    state.close()
    return out


# --------------------------------------------------------------------------- profile


def single_rank_world() -> None:
    """SGLang's own process-group setup for one rank (gloo, CPU): what its profile reads."""
    import socket

    from sglang.srt.distributed import parallel_state as ps

    if getattr(ps, "_WORLD", None) is not None:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    ps.initialize_model_parallel(backend="gloo")  # TP = PP = 1 (attention TP from 0.5.9)
    # Attention TP of one rank, as initialize_dp_attention leaves it without DP attention
    # (its signature changes from release to release; the values do not).
    from sglang.srt.layers import dp_attention as dp

    for name, value in (("_ATTN_TP_SIZE", 1), ("_ATTN_TP_RANK", 0), ("_ATTN_DP_SIZE", 1),
                        ("_ATTN_DP_RANK", 0)):
        if hasattr(dp, name) and getattr(dp, name) is None:
            setattr(dp, name, value)


def check_profile(version) -> dict[str, Any]:
    """The release's profiling method, patched, on a runner with a tiny MHA model's geometry.

    Up to 0.5.15 the method lives on ``ModelRunner`` and reads only the runner's fields
    and SGLang's world group; 0.5.16+ (``KVCacheConfigurator``) reads the launched
    engine's global state and is run by the engine test instead.
    """
    import types

    import psutil
    import torch

    from kvcached_core.plugins import patch_of
    from kvcached_sglang import profile as kprofile
    from sglang.srt.model_executor import model_runner as runner_module
    from sglang.srt.model_executor.model_runner import ModelRunner

    name = next((n for n in ("profile_max_num_token", "_profile_available_bytes")
                 if n in dir(ModelRunner)), None)
    if name is None:
        return {"skipped": "no profiling method on ModelRunner"}
    patched = getattr(ModelRunner, name)
    single_rank_world()

    class Runner(ModelRunner):
        def __init__(self, **fields):  # only what the profile reads
            for key, value in fields.items():
                if isinstance(getattr(ModelRunner, key, None), property):
                    continue  # computed by SGLang from the model config
                self.__dict__[key] = value

    from transformers import LlamaConfig

    hf = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                     num_hidden_layers=2, intermediate_size=256, vocab_size=512,
                     architectures=["LlamaForCausalLM"])
    cfg = types.SimpleNamespace(get_num_kv_heads=lambda tp: 2, head_dim=64, context_len=2048,
                                hf_config=hf, hf_text_config=hf, num_hidden_layers=2,
                                v_head_dim=64, is_hybrid_swa=False, is_hybrid=False)
    args = types.SimpleNamespace(page_size=1, enable_hierarchical_cache=False)
    fields = dict(device="cpu", gpu_id=0, is_draft_worker=False, num_effective_layers=2,
                  use_mla_backend=False, model_config=cfg, kv_cache_dtype=torch.bfloat16,
                  mem_fraction_static=0.5, server_args=args, mambaish_config=None,
                  is_hybrid=False, page_size=1, spec_algorithm=None, tp_size=1, pp_size=1,
                  # the lazily resolved linear-attention config (0.5.13+): not resolved yet
                  _linear_attn_registry_cache=getattr(runner_module, "_UNSET", None))
    pre_load_gib = psutil.virtual_memory().available / (1 << 30)
    virtual = patched(Runner(**fields), pre_load_gib)
    seen = dict(kprofile.LAST_PROFILE)
    real = patched.__wrapped__(Runner(**fields), pre_load_gib)
    rest = (seen["total_bytes"] - seen["own_bytes"]) / (1 << 30) \
        - seen["total_bytes"] / (1 << 30) * (1 - 0.5)
    cell = 2 * 64 * 2 * 2 * 2  # heads x head_dim x layers x (K, V) x bf16
    expected = int(rest * (1 << 30) // cell) if name == "profile_max_num_token" \
        else int(rest * (1 << 30))
    # The same runner with the hierarchical cache (static pools) keeps SGLang's measured profile.
    fields.update(server_args=types.SimpleNamespace(page_size=1, enable_hierarchical_cache=True))
    kprofile.LAST_PROFILE.clear()
    static = patched(Runner(**fields), pre_load_gib)
    return {"method": name, "virtual": virtual, "expected": expected, "real": real,
            "patched": (patch_of(patched) or (None, None))[1],
            "recorded": seen.get("method"), "static": static,
            "static_recorded": bool(kprofile.LAST_PROFILE)}


# --------------------------------------------------------------------------- gates


def gates() -> None:
    """Bad input without SGLang: out-of-range and unknown versions."""
    from kvcached_core.errors import PluginError
    from kvcached_core.plugins import bootstrap, reset_bootstrap

    for label, value in (("out_of_range", "0.6.0"), ("too_old", "0.4.8")):
        os.environ["KVCACHED_SGLANG_VERSION"] = value
        reset_bootstrap()
        res = bootstrap("sglang", strict=False)
        REPORT[label] = {"status": res.status, "reason": res.reason}
        reset_bootstrap()
        try:
            bootstrap("sglang", strict=True)
            REPORT[label + "_strict"] = "started"
        except PluginError as exc:
            REPORT[label + "_strict"] = f"refused: {exc}"
    del os.environ["KVCACHED_SGLANG_VERSION"]
    reset_bootstrap()

    # A source tree without scm metadata: no distribution, __version__ = "0.0.0.dev0".
    import importlib
    import tempfile

    from kvcached_core.plugins import detect_engine_version

    tmp = tempfile.mkdtemp()
    os.makedirs(os.path.join(tmp, "src", "sglang"))
    with open(os.path.join(tmp, "src", "sglang", "__init__.py"), "w") as f:
        f.write('__version__ = "0.0.0.dev0"\n')
    sys.path.insert(0, os.path.join(tmp, "src"))
    res = bootstrap("sglang", strict=False)
    REPORT["placeholder"] = {"status": res.status, "reason": res.reason}
    reset_bootstrap()
    try:
        bootstrap("sglang", strict=True)
        REPORT["placeholder_strict"] = "started"
    except PluginError as exc:
        REPORT["placeholder_strict"] = f"refused: {exc}"
    reset_bootstrap()

    # A module without __version__, installed with metadata: the distribution answers.
    sys.modules.pop("sglang", None)
    with open(os.path.join(tmp, "src", "sglang", "__init__.py"), "w") as f:
        f.write("")
    info = os.path.join(tmp, "src", "sglang-0.5.12.post1.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.12.post1\n")
    importlib.invalidate_caches()
    det = detect_engine_version("sglang", "sglang", ("sglang",))
    REPORT["no_module_version"] = {"value": str(det.version), "source": det.source}


def paged(version: str) -> None:
    """The paged allocator after a real bootstrap, its kernels run by Triton's interpreter."""
    from kvcached_core.plugins import bootstrap

    import sglang

    REPORT["sglang_version"] = sglang.__version__
    res = bootstrap("sglang", strict=False)
    REPORT["bootstrap"] = {"status": res.status, "reason": res.reason}

    @section("paged")
    def _paged():
        return check_paged()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "release":
        release(sys.argv[2])
    elif mode == "paged":
        paged(sys.argv[2])
    elif mode == "gates":
        gates()
    print("PROBE-JSON " + json.dumps(REPORT, default=str))
