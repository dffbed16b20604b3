"""A test-only SGLang plugin that lets ``engine_run.py`` look inside the scheduler process.

``test_engine_e2e.py`` registers :func:`register` as a second ``sglang.srt.plugins``
entry point (a generated dist-info beside the kvcached-sglang one), so SGLang's own
``load_plugins()`` runs it in every engine process, exactly like kvcached's. It changes
nothing SGLang computes; it only observes, through class attributes:

* ``ReqToTokenPool.__init__``: writes ``<dir>/scheduler.pid`` (the process that owns the
  KV pools, for RSS sampling; works with and without kvcached);
* ``kvcached_sglang.memory_pool.ElasticKV.__init__``: starts a daemon thread that writes the
  pool's own counters (pages in use / reserved / mapped, tokens held) to
  ``<dir>/stats.json`` every 50 ms;
* ``kvcached_sglang.profile.LAST_PROFILE``: the memory profile kvcached took (in the same
  ``stats.json``);
* ``ElasticKV.available_tokens``: counts calls made inside kvcached's leak-check view
  (SGLang's idle check evaluating the pool) and the smallest count reported outside it;
* ``ReqToTokenPool.free``: once ``<dir>/leak_req_slot`` exists, the next freed request
  slot is dropped instead of returned (a deliberate request-slot leak, reported in
  ``<dir>/leaked.json``).

SGLang releases before 0.5.11 call no ``sglang.srt.plugins`` entry point. There the probe
is a kvcached plugin instead (``kvcached.engines`` entry point, ``test_old_sglang_venv.py``):
:func:`kvcached_extra_patches` returns the same observers as patch records, which kvcached
applies with its own SGLang patch set wherever its auto-load bootstraps it (the scheduler
process included). The vanilla run of such a release has no probe; ``engine_run.py`` then
finds the scheduler by its process title.

Inert unless ``KVCACHED_E2E_DIR`` is set.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from pathlib import Path

_STATE = {"view_calls": 0, "view_logical": None, "min_available": None, "view_available": None}
_POOLS: list = []


def _dir() -> Path | None:
    text = os.environ.get("KVCACHED_E2E_DIR")
    return Path(text) if text else None


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _snapshot() -> dict:
    pools = []
    for ref in list(_POOLS):
        state = ref()
        if state is None:
            continue
        st = state.pages.stats()
        pools.append({"size": state.size, "used_tokens": state.used_tokens(),
                      "in_use": st.in_use, "reserved": st.reserved, "mapped": st.mapped,
                      "mapped_bytes": st.mapped_bytes, "page_bytes": st.page_bytes,
                      "limit_pages": st.limit_pages, "num_pages": st.num_pages})
    try:
        from kvcached_sglang.profile import LAST_PROFILE

        profile = {k: v for k, v in LAST_PROFILE.items() if isinstance(v, (int, float, str))}
    except ImportError:
        profile = {}
    return {"pid": os.getpid(), "t": time.time(), "pools": pools, "profile": profile, **_STATE}


def _writer(out: Path) -> None:
    while True:
        try:
            _write(out / "stats.json", _snapshot())
        except Exception:  # never disturb the engine
            pass
        time.sleep(0.05)


def _wrap_elastic_init(init):
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _POOLS.append(weakref.ref(self))
        out = _dir()
        if out is not None and len(_POOLS) == 1:
            threading.Thread(target=_writer, args=(out,), daemon=True,
                             name="kvcached-e2e-probe").start()

    return __init__


def _wrap_available_tokens(available):
    from kvcached_sglang.leakcheck import in_leak_check_view

    def available_tokens(self):
        n = available(self)
        if in_leak_check_view():
            _STATE["view_calls"] += 1
            _STATE["view_logical"] = n
            _STATE["view_available"] = min(n, self.blocks.available_size() * self.page_size)
        else:
            low = _STATE["min_available"]
            _STATE["min_available"] = n if low is None else min(low, n)
        return n

    return available_tokens


def _wrap_req_init(init):
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        out = _dir()
        if out is not None:
            (out / "scheduler.pid").write_text(str(os.getpid()))

    return __init__


def _wrap_req_free(free):
    leaked: list[int] = []

    def free_(self, *args, **kwargs):
        before = len(self.free_slots)
        result = free(self, *args, **kwargs)
        out = _dir()
        if (not leaked and out is not None and (out / "leak_req_slot").exists()
                and len(self.free_slots) == before + 1):
            leaked.append(self.free_slots.pop())
            _write(out / "leaked.json", {"slot": leaked[0], "pid": os.getpid(),
                                         "free_slots": len(self.free_slots)})
        return result

    return free_


def _patch_elastic() -> None:
    try:
        from kvcached_sglang import memory_pool
    except ImportError:
        return
    cls = memory_pool.ElasticKV
    if getattr(cls, "__e2e_probe__", False):
        return
    cls.__init__ = _wrap_elastic_init(cls.__init__)
    cls.available_tokens = _wrap_available_tokens(cls.available_tokens)
    cls.__e2e_probe__ = True


def _patch_req_pool() -> None:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    if getattr(ReqToTokenPool, "__e2e_probe__", False):
        return
    ReqToTokenPool.__init__ = _wrap_req_init(ReqToTokenPool.__init__)
    ReqToTokenPool.free = _wrap_req_free(ReqToTokenPool.free)
    ReqToTokenPool.__e2e_probe__ = True


def register() -> None:
    """``sglang.srt.plugins`` entry point (test only)."""
    if _dir() is None:
        return
    _patch_elastic()
    _patch_req_pool()


try:
    from kvcached_core import hookimpl
except ImportError:  # pragma: no cover - kvcached-core is always there in these tests
    hookimpl = lambda f: f  # noqa: E731


@hookimpl
def kvcached_extra_patches(engine, version):
    """``kvcached.engines`` plugin hook (test only): the observers as kvcached patches."""
    if engine != "sglang" or _dir() is None:
        return None
    from kvcached_core.plugins.patching import Patch

    pool, sglang_pool = "kvcached_sglang.memory_pool:ElasticKV", \
        "sglang.srt.mem_cache.memory_pool:ReqToTokenPool"
    return [
        Patch(f"{pool}.__init__", wrapper=_wrap_elastic_init, name="e2e-probe-pool-init"),
        Patch(f"{pool}.available_tokens", wrapper=_wrap_available_tokens,
              name="e2e-probe-available-tokens"),
        Patch(f"{sglang_pool}.__init__", wrapper=_wrap_req_init, name="e2e-probe-req-init"),
        Patch(f"{sglang_pool}.free", wrapper=_wrap_req_free, name="e2e-probe-req-free"),
    ]
