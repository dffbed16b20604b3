"""Exception classes raised by kvcached.

Every error kvcached raises on purpose derives from :class:`KVCachedError`, so a
caller can catch the whole family with one ``except`` clause.
"""

from __future__ import annotations

__all__ = [
    "KVCachedError",
    "KVCachedConfigError",
    "PluginError",
    "PatchError",
    "DeviceError",
    "DeviceOutOfMemoryError",
    "BackendUnavailableError",
    "MappingError",
]


class KVCachedError(Exception):
    """Base class of every error raised by kvcached."""


class KVCachedConfigError(KVCachedError, ValueError):
    """A configuration value (usually an environment variable) is invalid.

    The message names the setting and the offending value.
    """


class PluginError(KVCachedError):
    """A plugin failed to load, returned an invalid record or conflicts with another.

    The message names the plugin and the distribution that ships it.
    """


class PatchError(PluginError):
    """A patch record is malformed, or a patch set could not be applied or reverted."""


class DeviceError(KVCachedError, RuntimeError):
    """The device driver (CUDA, HIP or the host's mmap) refused a call.

    The message names the driver call, the address or size, and the driver's
    own error name.
    """


class DeviceOutOfMemoryError(DeviceError, MemoryError):
    """No physical memory for a new page. Allocators turn this into "no space"."""


class BackendUnavailableError(KVCachedError, RuntimeError):
    """A backend is not compiled in, its driver library is missing, or no device is there."""


class MappingError(KVCachedError, ValueError):
    """A bad request to the page mapper: page size, page index, double map or unmap."""
