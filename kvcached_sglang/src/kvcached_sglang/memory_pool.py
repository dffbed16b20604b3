"""Elastic SGLang KV pools backed by kvcached (SGLang's ``mem_cache/memory_pool.py``).

A pool (``MHATokenToKVPool``, ``MLATokenToKVPool``) keeps its class and its
API; only where its buffers come from changes. The patched buffer factory
reserves the buffers as kvcached virtual tensors (MHA: one per layer and K/V,
``(size + page_size, H, D)``; MLA: one per layer, ``(size + page_size, 1,
kv_lora_rank + qk_rope_head_dim)``, K and V packed) and records an
:class:`ElasticKV` on the pool as ``pool._kvcached``. The token allocators
(:mod:`kvcached_sglang.allocator`) draw slots from that record's
:class:`~kvcached_core.allocator.KVBlockManager`; a pool without the record
(a layout or subclass kvcached does not back) keeps SGLang's own allocator
behaviour, so one process can hold both.

Slot geometry: a kvcached *block* is one SGLang page of ``page_size`` token
rows; block ``b`` holds token slots ``b*page_size .. (b+1)*page_size - 1``. Block
0 is kvcached's null block, which is exactly SGLang's padded slot 0 (page 0),
never handed out. With ``page_size == 1`` blocks are token slots.

Counts: ``available_size()`` is the smaller of the *logical* free count
(``size - allocated``, what a static pool would report) and what kvcached can
back now (memory limit, device memory). Inside SGLang's leak check
(:mod:`kvcached_sglang.leakcheck`) it is the logical count alone.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

from kvcached_core.errors import KVCachedConfigError

from kvcached_sglang.leakcheck import in_leak_check_view
from kvcached_sglang.paged_lines import paged_allocator_elastic

__all__ = [
    "ElasticKV",
    "elastic_of",
    "sglang_namespace",
    "make_create_buffers",
    "make_mla_create_buffers",
    "make_mla_init",
]

_log = logging.getLogger("kvcached")


class ElasticKV:
    """kvcached's stack behind one SGLang KV pool: virtual buffers, pages and blocks.

    Args:
        device: SGLang's device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        size: Token slots SGLang sized the pool for (``max_total_num_tokens``).
        page_size: SGLang's page size in tokens.
        row_bytes: Bytes of one token in one layer buffer (``H * D * itemsize``).
        num_layers: Layers in the pool.
        num_buffers: 2 (K and V) or 1 (MLA latent).
        name: For logs (``"mha"``, ``"mla"``).

    Raises:
        KVCachedConfigError: A page of tokens does not fit in a kvcached page
            (the message names ``KVCACHED_PAGE_SIZE_MB``).
    """

    def __init__(
        self,
        device: Any,
        *,
        size: int,
        page_size: int,
        row_bytes: int,
        num_layers: int,
        num_buffers: int = 2,
        name: str = "mha",
    ) -> None:
        from kvcached_core.allocator import KVLayout
        from kvcached_core.config import load_settings
        from kvcached_core.pool import ElasticPool

        settings = load_settings()
        self.name = name
        self.size = int(size)
        self.page_size = int(page_size)
        self.row_bytes = int(row_bytes)
        self.rows = self.size + self.page_size
        self.num_blocks = self.rows // self.page_size
        block_bytes = self.page_size * self.row_bytes
        layout = KVLayout.for_blocks(
            self.num_blocks,
            block_bytes,
            num_layers=num_layers,
            page_size=max(settings.page_size, 1),
            num_buffers=num_buffers,
            contiguous=False,  # SGLang indexes per-layer, contiguous (rows, H, D) buffers
        )
        ns, record = _record_name(name)
        try:
            #: kvcached-core's pool: backing, pages, blocks, usage record, budget slot.
            self.pool = ElasticPool.local(_kvcached_device(device), layout,
                                          block_bytes=block_bytes, num_blocks=self.num_blocks,
                                          reserve_null_block=True, namespace=ns,
                                          name=record or name, settings=settings)
        except BaseException:
            _POOL_NAMES.discard(record)
            raise
        if record is not None:  # the name is free again once the pool is gone
            weakref.finalize(self.pool, _POOL_NAMES.discard, record)
        self.kv = self.pool.backing
        self.pages = self.pool.pages
        self.blocks = self.pool.blocks
        self.namespace = ns
        self._backups: list[set[int]] = []  # open backup_state() journals
        #: Token slots of one kvcached page (what evicting a page's worth of cache frees).
        self.tokens_per_page = max(1, layout.page_size // block_bytes) * self.page_size
        self._evict_ask = 0  # pages of prefix cache a budget ask or a lowered limit wants
        self._budget_ask = 0  # the budget ask among them (its generation)
        self.pool.set_evictor(self._ask_eviction)
        _log.info(
            "kvcached: elastic SGLang %s pool: %d tokens (page %d) x %d layers x %d buffers, "
            "%.1f MiB virtual, backed on demand in %d-byte pages",
            name, self.size, self.page_size, num_layers, num_buffers,
            layout.total_bytes / (1 << 20), layout.page_size,
        )

    def __repr__(self) -> str:
        return (
            f"<ElasticKV {self.name} size={self.size} page_size={self.page_size} "
            f"used={self.used_tokens()} mapped_bytes={self.mapped_bytes()}>"
        )

    def view(self, layer: int, kind: int, dtype: Any, shape: tuple[int, ...]) -> Any:
        """Layer ``layer``'s buffer ``kind`` as a ``(rows, *shape)`` tensor (zero copy)."""
        import math

        flat = self.kv.buffer(layer, kind, dtype)
        return flat[: self.rows * math.prod(shape)].view(self.rows, *shape)

    # ------------------------------------------------------------- giveback

    def _ask_eviction(self, pages: int) -> int:
        """Another engine wants memory (or a lower limit does): ``pages`` whole pages of
        prefix cache should go. Called on the allocator's background thread, where
        SGLang's radix cache cannot be touched: the scheduler evicts at its next idle
        moment (:func:`kvcached_sglang.prefix_cache.trim_prefix_cache`), so nothing is
        freed now."""
        self._evict_ask = max(self._evict_ask, int(pages))
        self._budget_ask = self.pool.budget_ask() or self._budget_ask
        return 0

    def take_eviction_ask(self) -> tuple[int, int]:
        """Tokens of prefix cache asked back since the last call (0: none), and the budget
        ask they answer (0: a lowered limit asked)."""
        pages, self._evict_ask = self._evict_ask, 0
        ask, self._budget_ask = self._budget_ask, 0
        return pages * self.tokens_per_page, ask

    # ---------------------------------------------------------------- counts

    def used_blocks(self) -> int:
        """Blocks handed out to SGLang (the null block excluded)."""
        return self.blocks.num_allocated - (self.blocks.null_block is not None)

    def used_tokens(self) -> int:
        return self.used_blocks() * self.page_size

    def logical_free_tokens(self) -> int:
        """What a static pool of ``size`` slots would report free."""
        return self.size - self.used_tokens()

    def available_tokens(self) -> int:
        """Free token slots SGLang may schedule on (see the module docstring)."""
        logical = self.logical_free_tokens()
        if in_leak_check_view():
            return logical
        return min(logical, self.blocks.available_size() * self.page_size)

    def mapped_bytes(self) -> int:
        """Physical bytes mapped for this pool now (in use plus kvcached's reserve)."""
        return self.pages.stats().mapped_bytes

    # ------------------------------------------------------------ alloc/free

    def alloc_blocks(self, n: int) -> list[int] | None:
        """``n`` block ids, or ``None`` when kvcached cannot back them now."""
        if n <= 0:
            return []
        if n * self.page_size > self.logical_free_tokens():
            return None
        ids = self.blocks.alloc(n)
        if ids is not None and self._backups:
            for journal in self._backups:
                journal.update(ids)
        return ids

    def free_blocks(self, ids: list[int]) -> None:
        """Give blocks back; SGLang's padded slot 0 (kvcached's null block) is never freed.

        SGLang frees slot 0 in places (a window pool's cleared peers read as slot 0),
        which its static free list tolerates; kvcached ignores it the same way.
        """
        null = self.blocks.null_block
        if null in ids:
            ids = [i for i in ids if i != null]
        if ids:
            self.blocks.free(ids)
            for journal in self._backups:
                journal.difference_update(ids)

    # ------------------------------------------------------- backup / restore

    def backup(self) -> set[int]:
        """Start recording allocations; :meth:`restore` frees what was allocated since.

        SGLang's ``backup_state()`` / ``restore_state()`` (speculative decoding's
        draft slots) snapshot a static allocator's free list; an elastic pool
        keeps a journal of the blocks allocated after the backup and not freed.
        """
        journal: set[int] = set()
        self._backups.append(journal)
        return journal

    def restore(self, journal: set[int]) -> None:
        """Free the blocks allocated since ``journal``'s backup (once; later calls do nothing)."""
        if not any(j is journal for j in self._backups):
            return
        self._backups = [j for j in self._backups if j is not journal]
        if journal:
            ids = sorted(journal)
            self.blocks.free(ids)
            for other in self._backups:
                other.difference_update(ids)

    def clear(self) -> None:
        """Free every slot SGLang holds (SGLang's ``allocator.clear()``)."""
        self.blocks.clear()
        self._backups = []

    def close(self) -> None:
        """Stop kvcached's background work, release the records (tests; SGLang never calls it)."""
        self.pool.close()


_POOL_NAMES: set[str] = set()


def sglang_namespace() -> str:
    """The IPC namespace of this SGLang engine: ``KVCACHED_IPC_NAME`` when set, else
    ``sglang-<pid>`` of the process that launched the engine's schedulers (every rank
    of one engine shares it)."""
    import os

    from kvcached_core.ipc.paths import namespace

    return namespace(f"sglang-{os.getppid()}")


def _rank() -> int:
    import sys

    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        pass
    return 0


def _record_name(kind: str) -> tuple[str | None, str | None]:
    """The namespace and name under which a pool publishes its usage record and joins
    its device's budget, like a vLLM engine's: ``kvctl`` / ``kvtop`` / Prometheus read it
    and ``kvctl limit`` reaches the pool through it.

    The pool is named ``<kind>-tp<rank>`` (``mha-tp0``), with ``.1``, ``.2``, ...
    for further pools of one process. ``(None, None)`` when the namespace setting is
    unusable (the pool then works unpublished).
    """
    try:
        ns = sglang_namespace()
    except KVCachedConfigError as exc:
        _log.warning("kvcached: SGLang pool not published, kvctl will not see it (%s)", exc)
        return None, None
    base = f"{kind}-tp{_rank()}"
    name, k = base, 0
    while name in _POOL_NAMES:
        k += 1
        name = f"{base}.{k}"
    _POOL_NAMES.add(name)
    return ns, name


def _kvcached_device(device: Any) -> str:
    text = str(device)
    if text in ("cuda", "hip"):
        import torch

        return f"{text}:{torch.cuda.current_device()}"
    return text


def elastic_of(kvcache: Any) -> ElasticKV | None:
    """The :class:`ElasticKV` behind an SGLang pool (or a hybrid wrapper's full pool)."""
    state = getattr(kvcache, "_kvcached", None)
    if state is None:
        full = getattr(kvcache, "full_kv_pool", None)
        state = getattr(full, "_kvcached", None)
    return state


# --------------------------------------------------------------------- pools


def _nhd_eligible(pool: Any) -> str | None:
    """Why kvcached leaves this MHA pool's buffers to SGLang, or ``None`` to back them."""
    if getattr(pool, "use_hnd", False):
        return "HND layout"
    if getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        return f"{pool.kv_cache_layout} layout"
    if getattr(pool, "enable_custom_mem_pool", False):
        return "custom memory pool"
    if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
        return "K and V head dims differ"
    return _paged_reason(pool.page_size)


def _paged_reason(page_size: int) -> str | None:
    if page_size != 1 and not paged_allocator_elastic():
        return "page size > 1 and this release's paged allocator is not elastic"
    return None


def _open_elastic(pool: Any, dtype: Any, row_elems: int, num_buffers: int, name: str) -> ElasticKV:
    """Reserve ``pool``'s buffers in kvcached and record the stack as ``pool._kvcached``."""
    import torch

    item = torch.empty((), dtype=dtype).element_size()
    state = ElasticKV(
        pool.device,
        size=pool.size,
        page_size=pool.page_size,
        row_bytes=row_elems * item,
        num_layers=pool.layer_num,
        num_buffers=num_buffers,
        name=name,
    )
    pool._kvcached = state
    return state


def _keep_sglang_buffers(pool: Any, reason: str) -> None:
    _log.info("kvcached: %s keeps SGLang's own buffers (%s)", type(pool).__name__, reason)
    pool._kvcached = None


def make_create_buffers(original: Callable[..., Any], *, finish: bool) -> Callable[..., Any]:
    """The elastic replacement of ``MHATokenToKVPool._create_buffers`` (or ``_normal``).

    Args:
        original: SGLang's method, used for pools kvcached does not back.
        finish: Also set the pointer/stride tables SGLang's ``_create_buffers``
            sets after the buffers (releases before the 0.5.16 dispatcher).
    """

    @functools.wraps(original)
    def _create_buffers(self: Any) -> None:
        reason = _nhd_eligible(self)
        if reason is not None:
            _keep_sglang_buffers(self, reason)
            return original(self)
        dtype = getattr(self, "store_dtype", None) or self.dtype
        state = _open_elastic(self, dtype, self.head_num * self.head_dim, 2, "mha")
        shape = (self.head_num, self.head_dim)
        self.k_buffer = [state.view(i, 0, dtype, shape) for i in range(self.layer_num)]
        self.v_buffer = [state.view(i, 1, dtype, shape) for i in range(self.layer_num)]
        if finish:
            _finish_tables(self)

    return _create_buffers


# ------------------------------------------------------------------------ MLA


def _mla_eligible(pool: Any, cls: type) -> str | None:
    """Why kvcached leaves this MLA pool's buffers to SGLang, or ``None`` to back them.

    Only ``MLATokenToKVPool`` itself: its subclasses (NSA/DSA indexer caches, FP4
    scales, NPU, page-interleaved, unified pools) add buffers or layouts kvcached
    does not back, and a half-elastic pool is worse than a static one.
    """
    return _mla_reason(
        type(pool), cls, pool.page_size,
        dsa=getattr(pool, "use_dsa", False) or getattr(pool, "use_nsa", False),
        custom_pool=getattr(pool, "custom_mem_pool", None) is not None,
        sharded=getattr(pool, "layer_shard_enabled", False),
    )


def _mla_reason(kind: type, cls: type, page_size: int, *, dsa: bool, custom_pool: bool = False,
                sharded: bool = False) -> str | None:
    if kind is not cls:
        return f"subclass of {cls.__name__} with its own buffers"
    if dsa:
        return "NSA/DSA indexer buffers"
    if custom_pool:
        return "custom memory pool"
    if sharded:
        return "layer-sharded pool"
    return _paged_reason(page_size)


def _mla_kv_buffer(pool: Any, dim: int) -> None:
    """``pool.kv_buffer``: one ``(size + page_size, 1, dim)`` kvcached tensor per layer."""
    dtype = getattr(pool, "store_dtype", None) or pool.dtype
    state = _open_elastic(pool, dtype, dim, 1, "mla")
    pool.kv_buffer = [state.view(i, 0, dtype, (1, dim)) for i in range(pool.layer_num)]


def make_mla_create_buffers(original: Callable[..., Any], cls: type) -> Callable[..., Any]:
    """The elastic replacement of ``MLATokenToKVPool._create_buffers`` (0.5.6+).

    SGLang's ``__init__`` sets ``kv_cache_dim`` (K and V packed,
    ``kv_lora_rank + qk_rope_head_dim``) before and the data pointers after it.
    """

    @functools.wraps(original)
    def _create_buffers(self: Any) -> None:
        reason = _mla_eligible(self, cls)
        if reason is not None:
            _keep_sglang_buffers(self, reason)
            return original(self)
        _mla_kv_buffer(self, self.kv_cache_dim)

    return _create_buffers


def make_mla_init(original: Callable[..., Any], cls: type) -> Callable[..., Any]:
    """The elastic replacement of ``MLATokenToKVPool.__init__`` (0.4.9-0.5.4).

    These releases create ``kv_buffer`` inline in ``__init__``. SGLang's own
    ``__init__`` runs unchanged for an eligible pool, but for ``size=0`` (one
    padding row per layer, so nothing of the real size is allocated); then the
    pool gets its real ``size``, kvcached buffers, their data pointers and
    ``mem_usage``. The patch gate checks that ``size`` enters nothing else.
    A pool that turns out ineligible (custom memory pool) is initialised again
    with the caller's arguments.
    """
    import inspect

    sig = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arg = bound.arguments
        reason = _mla_reason(type(self), cls, arg["page_size"], dsa=bool(arg.get("use_nsa")))
        if reason is not None:
            _keep_sglang_buffers(self, reason)
            return original(self, *args, **kwargs)
        size = arg["size"]
        arg["size"] = 0
        original(*bound.args, **bound.kwargs)
        self.size = size
        reason = _mla_eligible(self, cls)
        if reason is not None:
            _keep_sglang_buffers(self, reason)
            return original(self, *args, **kwargs)
        _mla_kv_buffer(self, self.kv_buffer[0].shape[-1])
        if hasattr(self, "data_ptrs"):
            import torch

            self.data_ptrs = torch.tensor(
                [x.data_ptr() for x in self.kv_buffer], dtype=torch.uint64, device=self.device
            )
        self.mem_usage = self.get_kv_size_bytes() / (1 << 30)
        return None

    return __init__


def _finish_tables(pool: Any) -> None:
    """Pointer and stride tables SGLang (0.4.9-0.5.15) sets after creating buffers."""
    import torch

    buffers = pool.k_buffer + pool.v_buffer
    pool.token_stride = pool.head_num * pool.head_dim
    pool.k_data_ptrs = torch.tensor(
        [x.data_ptr() for x in pool.k_buffer], dtype=torch.uint64, device=pool.device
    )
    pool.v_data_ptrs = torch.tensor(
        [x.data_ptr() for x in pool.v_buffer], dtype=torch.uint64, device=pool.device
    )
    pool.data_ptrs = torch.cat([pool.k_data_ptrs, pool.v_data_ptrs], dim=0)
    pool.data_strides = torch.tensor(
        [x[0].numel() * x.element_size() for x in buffers], device=pool.device
    )
