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
    "ForkedProcessError",
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


class ForkedProcessError(KVCachedError, RuntimeError):
    """A page mapper or allocator was used in a process forked from the one that opened it.

    Mappings, handles and device contexts belong to the process that created
    them; a forked child must open its own mapper (and build its own
    allocator). Not a ``MemoryError``: an allocator never mistakes it for "no space".
    """


class IPCError(KVCachedError, RuntimeError):
    """Cross-process machinery failed: socket directory, shared-memory segment or peer.

    The message names the path involved and what to do about it.
    """


class ProtocolError(IPCError, ValueError):
    """A frame on a kvcached socket is malformed: bad magic, version, type or length."""


class WorkerError(IPCError):
    """A worker did not apply a broadcast request.

    Raised on the scheduler side when a worker's connection is dead or closed,
    a reply does not arrive within the timeout, or the worker answers with an
    error. :attr:`rank`, :attr:`pp_stage` and :attr:`path` name the first
    failing worker and :attr:`cause` says why; :attr:`failures` lists every
    failing ``(rank, pp_stage, cause)`` of the call and :attr:`succeeded` the
    ``(rank, pp_stage)`` pairs that did apply it, so a caller can roll back.
    """

    def __init__(
        self,
        rank: int,
        path: str,
        cause: str,
        *,
        pp_stage: int = 0,
        failures: tuple[tuple[int, int, str], ...] = (),
        succeeded: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self.rank = rank
        self.pp_stage = pp_stage
        self.path = path
        self.cause = cause
        self.failures = failures or ((rank, pp_stage, cause),)
        self.succeeded = succeeded
        where = f"worker rank {rank}" + (f" (pipeline stage {pp_stage})" if pp_stage else "")
        message = f"{where} at {path}: {cause}"
        others = [f"rank {r}" + (f"/stage {s}" if s else "") + f": {c}"
                  for r, s, c in self.failures if (r, s) != (rank, pp_stage)]
        if others:
            message += "; also " + "; ".join(others)
        super().__init__(message)

    def __reduce__(self):  # keep the keyword-only fields through pickling
        return (_rebuild_worker_error, (type(self), self.rank, self.path, self.cause,
                                        self.pp_stage, self.failures, self.succeeded))


class WorkerOutOfMemoryError(WorkerError, MemoryError):
    """Every failing worker ran out of device memory while mapping.

    An allocator treats this as "no space" after unmapping the pages on the
    workers listed in :attr:`succeeded`.
    """


def _rebuild_worker_error(cls, rank, path, cause, pp_stage, failures, succeeded) -> WorkerError:
    return cls(rank, path, cause, pp_stage=pp_stage, failures=failures, succeeded=succeeded)


__all__ += ["IPCError", "ProtocolError", "WorkerError", "WorkerOutOfMemoryError"]
