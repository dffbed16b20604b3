"""The SGLang paged-allocator release lines kvcached covers, and whether its patch is in place.

Below :mod:`kvcached_sglang.patches` (which builds the paged-allocator patches from
:data:`PAGED_LINES`) and the pieces that ask whether they landed
(:mod:`kvcached_sglang.memory_pool`, :mod:`kvcached_sglang.profile`).
"""

from __future__ import annotations

__all__ = ["PAGED_LINES", "paged_allocator_elastic", "paged_patch_name"]

#: Paged-allocator release lines whose every free path kvcached covers:
#: (specifier, module, extra methods). 0.5.16 - 0.5.22 are left out (not checked);
#: their paged pools keep SGLang's buffers.
PAGED_LINES: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    (">=0.4.9.dev0,<0.5.13.dev0", "sglang.srt.mem_cache.allocator", (), ""),
    (">=0.5.13.dev0,<0.5.16.dev0", "sglang.srt.mem_cache.allocator.paged", (), "-pkg"),
    (">=0.5.23.dev0,<0.5.24.dev0", "sglang.srt.mem_cache.allocator.paged",
     ("_release_page_ids",), "-sink"),
)


def paged_patch_name(method: str, suffix: str) -> str:
    """The patch name of a paged-allocator method on one release line of :data:`PAGED_LINES`."""
    return f"elastic-paged-allocator-{method.lstrip('_')}{suffix}"


def paged_allocator_elastic() -> bool:
    """Whether kvcached's paged allocator (``PagedTokenToKVPoolAllocator``) is in place in this
    process: the patch registry's answer for ``alloc_extend`` on any release line."""
    from kvcached_core.plugins import is_applied

    return any(is_applied(paged_patch_name("alloc_extend", suffix)) for *_, suffix in PAGED_LINES)
