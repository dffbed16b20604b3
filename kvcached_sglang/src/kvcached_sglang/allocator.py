"""Elastic SGLang token allocators backed by kvcached (SGLang's ``mem_cache/allocator``).

``TokenToKVPoolAllocator`` (page size 1) and ``PagedTokenToKVPoolAllocator``
(page size > 1) keep their classes; kvcached replaces the methods named in
:data:`ALLOCATOR_METHODS`, :data:`PAGED_ALLOCATOR_METHODS` and
:data:`BACKUP_METHODS`. Each replacement looks up the
:class:`~kvcached_sglang.memory_pool.ElasticKV` of the allocator's pool
(``allocator._kvcache``) and draws slots from it; an allocator whose pool
kvcached does not back runs SGLang's own method. Slot geometry and counts:
see :mod:`kvcached_sglang.memory_pool`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from kvcached_core.errors import KVCachedConfigError

from kvcached_sglang.memory_pool import ElasticKV, elastic_of

__all__ = [
    "ALLOCATOR_METHODS",
    "PAGED_ALLOCATOR_METHODS",
    "BACKUP_METHODS",
    "elastic_allocator_method",
]


def _slots(state: ElasticKV, blocks: list[int], device: Any) -> Any:
    import torch

    ids = torch.tensor(blocks, dtype=torch.int64)
    if state.page_size > 1:
        offs = torch.arange(state.page_size, dtype=torch.int64)
        ids = (ids[:, None] * state.page_size + offs[None, :]).reshape(-1)
    return ids.to(device)


def _blocks_of(state: ElasticKV, slots: Any) -> list[int]:
    import torch

    flat = slots.reshape(-1).to("cpu", torch.int64)
    if state.page_size > 1:
        flat = torch.unique(flat // state.page_size)
    return flat.tolist()


#: Token-allocator methods kvcached replaces (page size 1).
ALLOCATOR_METHODS = ("available_size", "alloc", "free", "clear")
#: Paged-allocator methods kvcached replaces (page size > 1); SGLang's Triton
#: kernels still lay out the slots, from pages kvcached hands them.
PAGED_ALLOCATOR_METHODS = ("available_size", "alloc", "alloc_extend", "alloc_decode", "free",
                           "clear")
#: Both allocators, releases that snapshot a static free list (speculative decoding).
BACKUP_METHODS = ("backup_state", "restore_state")


def _in_free_group(allocator: Any) -> bool:
    """Whether SGLang is batching frees (``free_group_begin`` .. ``free_group_end``)."""
    flag = getattr(allocator, "is_not_in_free_group", None)
    if flag is not None:  # older releases: a flag beside an always-present list
        return not flag
    return getattr(allocator, "free_group", None) is not None  # 0.5.23: the list or None


def _new_pages(state: ElasticKV, args: Any, *, decode: bool) -> int:
    """Pages an ``alloc_extend`` / ``alloc_decode`` call takes (SGLang's own formula)."""
    import torch

    given = args.get("num_new_pages")
    if given is not None:
        return int(given)
    ps = state.page_size
    seq = args.get("seq_lens_cpu")
    seq = (args["seq_lens"] if seq is None else seq).to("cpu", torch.int64)
    if decode:
        before = seq - 1
    else:
        before = args.get("prefix_lens_cpu")
        before = (args["prefix_lens"] if before is None else before).to("cpu", torch.int64)
    return int(((seq + ps - 1) // ps - (before + ps - 1) // ps).sum())


def _paged_alloc(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``alloc_extend`` / ``alloc_decode``: SGLang's kernel over pages drawn from kvcached.

    The kernel takes the request's new pages from the front of ``free_pages``
    and the method drops them from it; kvcached puts exactly the pages needed
    there for the call and takes back any the kernel left.
    """
    import inspect

    sig = inspect.signature(original)
    decode = name == "alloc_decode"
    counts = "num_new_pages" in sig.parameters

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = elastic_of(getattr(self, "_kvcache", None))
        if state is None:
            return original(self, *args, **kwargs)
        import torch

        bound = sig.bind(self, *args, **kwargs)
        need = _new_pages(state, bound.arguments, decode=decode)
        blocks = state.alloc_blocks(need)
        if blocks is None:
            return None
        if counts and "num_new_pages" not in bound.arguments:
            kwargs = {**kwargs, "num_new_pages": need}  # SGLang need not count them again
        self.free_pages = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        try:
            out = original(self, *args, **kwargs)
        except BaseException:
            self.free_pages = self.free_pages[:0]
            state.free_blocks(blocks)
            raise
        # Pages the kernel did not take go back to kvcached (len() needs no device sync).
        rest = self.free_pages.tolist() if len(self.free_pages) else []
        self.free_pages = self.free_pages[:0]
        if out is None:
            state.free_blocks(blocks)
            raise RuntimeError(
                f"kvcached: SGLang's {name} refused the {len(blocks)} pages its own formula "
                "asks for; its page accounting no longer matches the kvcached gate")
        if rest:
            state.free_blocks(rest)
        return out

    return method


class _Backup:
    """What an elastic allocator's ``backup_state()`` returns: its open journal."""

    __slots__ = ("journal",)

    def __init__(self, journal: set[int]) -> None:
        self.journal = journal


def elastic_allocator_method(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """The elastic replacement of the token allocator's method ``name``.

    Each replacement serves allocators whose pool kvcached backs and calls
    SGLang's ``original`` for any other allocator. The same replacements serve
    the paged allocator (``alloc`` hands out whole pages; ``free`` frees the
    pages its slots lie in).
    """

    def state_of(self: Any) -> ElasticKV | None:
        return elastic_of(getattr(self, "_kvcache", None))

    def available_size(self: Any) -> int:
        state = state_of(self)
        if state is None:
            return original(self)
        return state.available_tokens()

    def alloc(self: Any, need_size: int) -> Any:
        state = state_of(self)
        if state is None:
            return original(self, need_size)
        if need_size % state.page_size:
            raise KVCachedConfigError(
                f"alloc({need_size}) is not a whole number of {state.page_size}-token pages"
            )
        blocks = state.alloc_blocks(need_size // state.page_size)
        if blocks is None:
            return None
        return _slots(state, blocks, self.device)

    def free(self: Any, free_index: Any) -> None:
        state = state_of(self)
        if state is None:
            return original(self, free_index)
        if free_index.numel() == 0:
            return None
        if _in_free_group(self):
            copy = getattr(self, "_copy_for_free_group", None)
            self.free_group.append(free_index if copy is None else copy(free_index))
        else:
            state.free_blocks(_blocks_of(state, free_index))
        return None

    def release_page_ids(self: Any, *page_ids: Any) -> None:
        """0.5.23's sink of every paged free (``free_page_ids``, ``free_segment``, groups)."""
        state = state_of(self)
        if state is None:
            return original(self, *page_ids)
        import torch

        ids = [t.reshape(-1) for t in page_ids if t.numel()]
        if ids:
            state.free_blocks(torch.cat(ids).to("cpu", torch.int64).tolist())
        return None

    def backup_state(self: Any) -> Any:
        state = state_of(self)
        if state is None:
            return original(self)
        return _Backup(state.backup())

    def restore_state(self: Any, backup: Any) -> None:
        if not isinstance(backup, _Backup):  # SGLang's own snapshot (a pool kvcached does not back)
            return original(self, backup)
        state = state_of(self)
        if state is not None:
            state.restore(backup.journal)
        return None

    def clear(self: Any) -> None:
        original(self)  # SGLang's own bookkeeping (free groups, counters)
        state = state_of(self)
        if state is not None:
            import torch

            state.clear()
            empty = torch.empty((0,), dtype=torch.int64, device=self.device)
            self.free_pages = empty
            self.release_pages = empty

    made: dict[str, Callable[..., Any]] = {
        "available_size": available_size,
        "alloc": alloc,
        "free": free,
        "clear": clear,
        "_release_page_ids": release_page_ids,
        "backup_state": backup_state,
        "restore_state": restore_state,
    }
    fn = _paged_alloc(name, original) if name in ("alloc_extend", "alloc_decode") else made[name]
    functools.update_wrapper(fn, original)
    return fn
