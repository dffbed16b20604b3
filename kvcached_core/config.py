"""kvcached's settings, read from ``KVCACHED_*`` environment variables.

============================  =======  =========================================
variable                      default  meaning
============================  =======  =========================================
KVCACHED_PAGE_SIZE_MB         2        physical page size per layer buffer (MiB)
KVCACHED_CONTIGUOUS_LAYOUT    off      one tensor for all layers (compound pages)
KVCACHED_PREALLOC             on       keep a reserve of mapped pages (background)
KVCACHED_MIN_RESERVED_PAGES   2        refill the reserve below this many pages
KVCACHED_MAX_RESERVED_PAGES   8        never keep more mapped-but-unused pages
KVCACHED_IDLE_TRIM_S          5        trim the reserve after this long idle (0: never)
KVCACHED_IDLE_KEEP_PAGES      0        reserved pages the idle trim leaves mapped
KVCACHED_MEMORY_LIMIT         none     cap on mapped KV bytes per pool (e.g. 2G, 512M)
KVCACHED_GPU_UTILIZATION      0.95     leave (1-x) of device memory free when mapping
KVCACHED_DEVICE_BUDGET        none     KV bytes all engines of this user may map on a
                                       device together (2G, 40%); see ipc.budget
============================  =======  =========================================
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from kvcached_core.env import env_bool, env_float, env_int
from kvcached_core.errors import KVCachedConfigError

MiB = 1 << 20
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, name: str = "size") -> int:
    """Parse a byte count such as ``512M``, ``2G``, ``1.5GiB`` or ``1048576``."""
    match = _SIZE_RE.match(str(text))
    if match is None:
        raise KVCachedConfigError(f"{name}={text!r} is not a size (use e.g. 512M, 2G, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


_PERCENT_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*%\s*$")


@dataclass(frozen=True)
class SizeSpec:
    """A size given in bytes or as a share of a device (``512M``, ``2G``, ``40%``)."""

    nbytes: int | None = None
    fraction: float | None = None

    def resolve(self, total: int) -> int:
        """Bytes, taking a percentage of ``total`` (the device's size).

        Raises:
            KVCachedConfigError: A percentage and the device's size is unknown.
        """
        if self.nbytes is not None:
            return self.nbytes
        if total <= 0:
            raise KVCachedConfigError(
                f"{self} is a share of the device, but the device's size is unknown; give bytes")
        return int(total * (self.fraction or 0.0))

    def __str__(self) -> str:
        return f"{self.nbytes} bytes" if self.nbytes is not None else f"{(self.fraction or 0) * 100:g}%"


def parse_size_spec(text: str, name: str = "size") -> SizeSpec:
    """Parse ``512M``, ``2G``, ``1048576`` or a percentage of the device ``0``..``100%``.

    Raises:
        KVCachedConfigError: Not a size, or a percentage outside 0..100.
    """
    match = _PERCENT_RE.match(str(text))
    if match is not None:
        pct = float(match.group(1))
        if not 0 <= pct <= 100:
            raise KVCachedConfigError(f"{name}={text!r}: a percentage must be within 0..100%")
        return SizeSpec(fraction=pct / 100)
    if str(text).strip().startswith("-"):
        raise KVCachedConfigError(f"{name}={text!r} is negative; sizes are >= 0")
    return SizeSpec(nbytes=parse_size(text, name))


@dataclass(frozen=True)
class Settings:
    page_size: int
    contiguous_layout: bool | None  # None: the device's default
    prealloc: bool
    min_reserved_pages: int
    max_reserved_pages: int
    idle_trim_s: float
    memory_limit: int | None
    gpu_utilization: float
    idle_keep_pages: int = 0
    device_budget: SizeSpec | None = None


#: Built-in defaults of :func:`load_settings` (an engine adapter may pass its own).
DEFAULTS = dict(page_size_mb=2, min_reserved_pages=2, max_reserved_pages=8, idle_trim_s=5.0,
                idle_keep_pages=0, gpu_utilization=0.95)


def load_settings(**defaults: float) -> Settings:
    """Read every setting now; a bad value raises naming the variable.

    Keyword arguments replace the built-in :data:`DEFAULTS` (an engine adapter's
    own defaults, e.g. ``idle_trim_s=1.0``); a variable that is set wins.

    Raises:
        KVCachedConfigError: A variable's value is bad, or ``defaults`` names
            an unknown setting.
    """
    unknown = set(defaults) - set(DEFAULTS)
    if unknown:
        raise KVCachedConfigError(f"unknown kvcached settings {sorted(unknown)}")
    d = {**DEFAULTS, **defaults}
    page_mb = env_int("KVCACHED_PAGE_SIZE_MB", int(d["page_size_mb"]), minimum=1)
    layout = os.environ.get("KVCACHED_CONTIGUOUS_LAYOUT", "").strip()
    min_res = env_int("KVCACHED_MIN_RESERVED_PAGES", int(d["min_reserved_pages"]), minimum=0)
    max_res = env_int("KVCACHED_MAX_RESERVED_PAGES", int(d["max_reserved_pages"]), minimum=0)
    if max_res < min_res:
        raise KVCachedConfigError(
            f"KVCACHED_MAX_RESERVED_PAGES={max_res} is below KVCACHED_MIN_RESERVED_PAGES={min_res}"
        )
    limit_text = os.environ.get("KVCACHED_MEMORY_LIMIT", "").strip()
    budget_text = os.environ.get("KVCACHED_DEVICE_BUDGET", "").strip()
    return Settings(
        page_size=page_mb * MiB,
        contiguous_layout=env_bool("KVCACHED_CONTIGUOUS_LAYOUT", False) if layout else None,
        prealloc=env_bool("KVCACHED_PREALLOC", True),
        min_reserved_pages=min_res,
        max_reserved_pages=max_res,
        idle_trim_s=env_float("KVCACHED_IDLE_TRIM_S", float(d["idle_trim_s"]), minimum=0.0),
        memory_limit=parse_size(limit_text, "KVCACHED_MEMORY_LIMIT") if limit_text else None,
        gpu_utilization=env_float("KVCACHED_GPU_UTILIZATION", float(d["gpu_utilization"]),
                                  minimum=0.05, maximum=1.0),
        idle_keep_pages=env_int("KVCACHED_IDLE_KEEP_PAGES", int(d["idle_keep_pages"]),
                                minimum=0),
        device_budget=(parse_size_spec(budget_text, "KVCACHED_DEVICE_BUDGET")
                       if budget_text and budget_text.lower() != "none" else None),
    )


def contiguous_layout() -> bool:
    """Per-layer buffers by default; ``KVCACHED_CONTIGUOUS_LAYOUT`` wins when set.

    Per-layer is the default everywhere (and must be on ROCm, whose attention
    kernels misread the strided views of the contiguous layout).
    """
    return bool(load_settings().contiguous_layout)


#: Default cap on prefix-cached tokens an engine keeps mapped while nothing uses them.
DEFAULT_MAX_CACHED_TOKENS = 8192


def max_cached_tokens() -> int | None:
    """``KVCACHED_MAX_CACHED_TOKENS``: prefix-cached tokens kept mapped when unused.

    Engines with an elastic pool evict cached prefixes beyond this many tokens
    (whole pages first), so memory returns after a burst while hot prefixes
    stay. ``None`` (a negative value) means no cap: the cache keeps what the
    engine would keep.
    """
    tokens = env_int("KVCACHED_MAX_CACHED_TOKENS", DEFAULT_MAX_CACHED_TOKENS)
    return None if tokens < 0 else tokens
