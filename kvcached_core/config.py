"""kvcached's settings, read from ``KVCACHED_*`` environment variables.

==============================  =======  =============  ======================================
variable                        default  range          meaning
==============================  =======  =============  ======================================
KVCACHED_PAGE_SIZE_MB           2        1..1024        physical page per layer buffer (MiB)
KVCACHED_CONTIGUOUS_LAYOUT      off                     one tensor for all layers
KVCACHED_PREALLOC               on                      keep a reserve of mapped pages
KVCACHED_MAP_AHEAD              on                      map the pages queued requests will take
                                                        before they ask (engines that know)
KVCACHED_MIN_RESERVED_PAGES     2        0..65536       refill the reserve below this many pages
KVCACHED_MAX_RESERVED_PAGES     8        0..65536       never keep more mapped-but-unused pages
KVCACHED_IDLE_TRIM_S            5        0..604800      trim the reserve after this long idle
                                                        (0: never)
KVCACHED_IDLE_KEEP_PAGES        0        0..65536       reserved pages the idle trim leaves
KVCACHED_CACHE_IDLE_S           30       0..604800      evict unused prefix-cached pages after
                                                        this long idle (0: never)
KVCACHED_MEMORY_LIMIT           none     0..1 EiB       cap on mapped KV bytes per pool (2G)
KVCACHED_GPU_UTILIZATION        0.95     0.05..1        leave (1-x) of the memory free
KVCACHED_DEVICE_BUDGET          none     0..1 EiB,      KV bytes all engines of this user may
                                         0..100%        map on a device together (2G, 40%);
                                                        see ipc.budget
KVCACHED_MAX_CACHED_TOKENS      -1       -1..2^31-1     cap on prefix-cached tokens kept while
                                                        unused (-1: no cap, the engine's own)
KVCACHED_IPC_TIMEOUT_S          60       0.001..86400   bound on one call to the workers
KVCACHED_IPC_CONNECT_TIMEOUT_S  60       0..86400       bound on connecting to a worker
KVCACHED_FAULTS                 off      rules          fault injection for tests
                                                        (see kvcached_core.faults)
==============================  =======  =============  ======================================

Every numeric setting has an accepted range (:data:`RANGES`, docs/settings.md's
settings table lists the same); a value outside it, a non-finite one or one
too large to represent is a :class:`KVCachedConfigError` naming the variable
and the value, raised when the setting is read.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from kvcached_core import legacy_env
from kvcached_core.env import env_bool, env_float, env_int, shown
from kvcached_core.errors import KVCachedConfigError

MiB = 1 << 20
#: The largest size :func:`parse_size` accepts: 1 EiB (fits a signed 64-bit word).
MAX_SIZE = 1 << 60

#: The accepted range, both ends included, of every numeric ``KVCACHED_*`` setting.
RANGES: dict[str, tuple[int | float, int | float]] = {
    "KVCACHED_PAGE_SIZE_MB": (1, 1024),
    "KVCACHED_MIN_RESERVED_PAGES": (0, 1 << 16),
    "KVCACHED_MAX_RESERVED_PAGES": (0, 1 << 16),
    "KVCACHED_IDLE_TRIM_S": (0.0, 7 * 86400.0),
    "KVCACHED_IDLE_KEEP_PAGES": (0, 1 << 16),
    "KVCACHED_CACHE_IDLE_S": (0.0, 7 * 86400.0),
    "KVCACHED_MEMORY_LIMIT": (0, MAX_SIZE),
    "KVCACHED_GPU_UTILIZATION": (0.05, 1.0),
    "KVCACHED_MAX_CACHED_TOKENS": (-1, (1 << 31) - 1),
    "KVCACHED_IPC_TIMEOUT_S": (0.001, 86400.0),
    "KVCACHED_IPC_CONNECT_TIMEOUT_S": (0.0, 86400.0),
}

_SIZE_RE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_MAX_SIZE_DIGITS = 30  # a longer integer part is out of range whatever the unit


def parse_size(text: str, name: str = "size") -> int:
    """Parse a byte count such as ``512M``, ``2G``, ``1.5GiB`` or ``1048576``.

    Exact (no floating point); a fraction of a byte is dropped.

    Raises:
        KVCachedConfigError: ``text`` is not a size, or it is above :data:`MAX_SIZE`.
    """
    match = _SIZE_RE.match(str(text))
    if match is None:
        raise KVCachedConfigError(
            f"{name}={shown(text, quote=True)} is not a size (use e.g. 512M, 2G, 1048576)"
        )
    whole, frac, unit = match.group(1), match.group(2) or "", match.group(3).lower()
    if len(whole.lstrip("0")) > _MAX_SIZE_DIGITS:
        size = MAX_SIZE + 1
    else:
        scale = _UNITS[unit]
        frac = frac[:_MAX_SIZE_DIGITS]
        size = int(whole) * scale + (int(frac) * scale // 10 ** len(frac) if frac else 0)
    if size > MAX_SIZE:
        raise KVCachedConfigError(
            f"{name}={shown(str(text).strip())} is above the maximum {MAX_SIZE} bytes (1 EiB)"
        )
    return size


def check_range(what: str, value: float, setting: str) -> float:
    """Return ``value`` if it is finite and in the range of ``setting``, else raise.

    For values passed in code rather than read from the environment:
    ``what`` names the argument (e.g. ``"idle_trim_s"``) and ``setting`` the
    variable whose range applies.

    Raises:
        KVCachedConfigError: naming ``what``, the value and the range.
    """
    lo, hi = RANGES[setting]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and lo <= value <= hi):
        raise KVCachedConfigError(
            f"{what}={shown(repr(value))} is outside {lo!r}..{hi!r} (the range of {setting})"
        )
    return value


def env_setting(name: str, default: int | float) -> int | float:
    """Read the numeric setting ``name`` within its range in :data:`RANGES`.

    The type of ``default`` picks the parser (an integer or a finite float).
    """
    lo, hi = RANGES[name]
    if isinstance(default, int) and not isinstance(default, bool):
        return env_int(name, default, minimum=int(lo), maximum=int(hi))
    return env_float(name, float(default), minimum=float(lo), maximum=float(hi))


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
    cache_idle_s: float = 30.0
    map_ahead: bool = True


#: Built-in defaults of :func:`load_settings` (an engine adapter may pass its own).
DEFAULTS = dict(page_size_mb=2, min_reserved_pages=2, max_reserved_pages=8, idle_trim_s=5.0,
                idle_keep_pages=0, gpu_utilization=0.95, cache_idle_s=30.0)


def load_settings(**defaults: float) -> Settings:
    """Read every setting now; a bad value raises naming the variable.

    Keyword arguments replace the built-in :data:`DEFAULTS` (an engine adapter's
    own defaults, e.g. ``idle_trim_s=1.0``); a variable that is set wins.

    The original kvcached's variables are honoured or rejected here too
    (:mod:`kvcached_core.legacy_env`).

    Raises:
        KVCachedConfigError: A variable's value is bad, ``defaults`` names
            an unknown setting, or a variable of the original kvcached has no
            equivalent here.
    """
    unknown = set(defaults) - set(DEFAULTS)
    if unknown:
        raise KVCachedConfigError(f"unknown kvcached settings {sorted(unknown)}")
    legacy_env.check_environment()
    d = {**DEFAULTS, **defaults}
    page_mb = env_setting("KVCACHED_PAGE_SIZE_MB", int(d["page_size_mb"]))
    layout = os.environ.get("KVCACHED_CONTIGUOUS_LAYOUT", "").strip()
    min_res = env_setting("KVCACHED_MIN_RESERVED_PAGES", int(d["min_reserved_pages"]))
    max_res = env_setting("KVCACHED_MAX_RESERVED_PAGES", int(d["max_reserved_pages"]))
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
        map_ahead=env_bool("KVCACHED_MAP_AHEAD", True),
        min_reserved_pages=min_res,
        max_reserved_pages=max_res,
        idle_trim_s=env_setting("KVCACHED_IDLE_TRIM_S", float(d["idle_trim_s"])),
        memory_limit=parse_size(limit_text, "KVCACHED_MEMORY_LIMIT") if limit_text else None,
        gpu_utilization=env_setting("KVCACHED_GPU_UTILIZATION", float(d["gpu_utilization"])),
        idle_keep_pages=env_setting("KVCACHED_IDLE_KEEP_PAGES", int(d["idle_keep_pages"])),
        cache_idle_s=env_setting("KVCACHED_CACHE_IDLE_S", float(d["cache_idle_s"])),
        device_budget=(parse_size_spec(budget_text, "KVCACHED_DEVICE_BUDGET")
                       if budget_text and budget_text.lower() != "none" else None),
    )


#: Default of ``KVCACHED_IPC_TIMEOUT_S`` and ``KVCACHED_IPC_CONNECT_TIMEOUT_S`` (seconds).
DEFAULT_IPC_TIMEOUT_S = 60.0


def contiguous_layout() -> bool:
    """Per-layer buffers by default; ``KVCACHED_CONTIGUOUS_LAYOUT`` wins when set.

    Per-layer is the default everywhere (and must be on ROCm, whose attention
    kernels misread the strided views of the contiguous layout).
    """
    return bool(load_settings().contiguous_layout)


#: Default cap on prefix-cached tokens an engine keeps mapped while nothing uses them:
#: none (the engine's own prefix cache; see :func:`max_cached_tokens`).
DEFAULT_MAX_CACHED_TOKENS = -1


def max_cached_tokens() -> int | None:
    """``KVCACHED_MAX_CACHED_TOKENS``: an explicit cap on prefix-cached tokens kept mapped
    while unused.

    By default (``None``, ``-1``) there is no cap: cached blocks stay mapped as
    in the engine without kvcached, so its prefix-cache hits are the engine's
    own while memory is not contended, and they go back when there is a
    reason (the pool idles for ``KVCACHED_CACHE_IDLE_S``, another pool or the
    device budget asks, a limit is set, the device's free memory falls below
    the ``KVCACHED_GPU_UTILIZATION`` headroom; see
    :mod:`kvcached_core.allocator.page_allocator`). With a cap, engines evict
    cached prefixes beyond this many tokens on every free (vLLM) or when idle
    (SGLang), whole pages first.
    """
    tokens = env_setting("KVCACHED_MAX_CACHED_TOKENS", DEFAULT_MAX_CACHED_TOKENS)
    return None if tokens < 0 else tokens
