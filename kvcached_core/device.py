"""Device strings and the backend that serves each device.

=============  ==========  ===================================================
device string  backend     torch device
=============  ==========  ===================================================
``cpu``        ``host``    ``cpu``
``cuda:N``     ``cuda``    ``cuda:N`` (``hip`` on a ROCm build of torch)
``hip:N``      ``hip``     ``cuda:N`` (PyTorch-ROCm's alias for AMD GPUs)
``TYPE:N``     a plugin's  what that backend says (any other device type)
=============  ==========  ===================================================

Plugins may pick another backend for a device and serve device types this
table does not know, but this module does not ask them: the layer above
installs a *selector* with :func:`set_backend_selector` (the plugin framework
does when it is imported). Without one, the first three rows are the whole
rule and any other device type is an error. This module, like
:mod:`kvcached_core.vmm` and :mod:`kvcached_core.allocator` above it, never
imports :mod:`kvcached_core.plugins`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

from kvcached_core.env import shown
from kvcached_core.errors import BackendUnavailableError, KVCachedConfigError

#: The device types the compiled backends serve; any other needs a plugin's backend.
NATIVE_DEVICE_TYPES = ("cpu", "cuda", "hip")
#: The backends a build may compile in (:func:`compiled_backends` says which it did).
NATIVE_BACKENDS = ("cuda", "hip", "host")
#: What a device type looks like (``xpu`` in ``xpu:0``).
DEVICE_TYPE = re.compile(r"[a-z][a-z0-9_]*")
_DEVICE_RE = re.compile(rf"^({DEVICE_TYPE.pattern})(?::(\d+))?$")
#: The largest device index kvcached accepts (the drivers take a C ``int``).
MAX_DEVICE_INDEX = (1 << 16) - 1


class MapperBackend(Protocol):
    """A backend outside the compiled module: what a selector may answer.

    :class:`kvcached_core.plugins.BackendRecord` is one.
    """

    #: The backend's name: :attr:`Device.backend` and its mappers' ``backend``.
    name: str

    def torch_device_of(self, device: str, index: int) -> str:
        """How torch names ``device`` (the normalised device string, index ``index``)."""

    def open_mapper(self, device: Device, page_size: int) -> Any:
        """A page mapper for ``device`` (the interface of :class:`kvcached_core.vmm.PageMapper`)."""


#: ``selector(device, compiled)``: the normalised device string (``"cuda:0"``)
#: and the compiled backends in; out: a compiled backend's name, a
#: :class:`MapperBackend` that serves the device, or ``None`` (no opinion).
BackendSelector = Callable[[str, tuple[str, ...]], Union[str, MapperBackend, None]]

_selector: BackendSelector | None = None


def set_backend_selector(selector: BackendSelector | None) -> BackendSelector | None:
    """Install the function :func:`parse_device` asks for a device's backend.

    The plugin framework installs one that asks its plugins; ``None`` leaves
    the compiled rule alone in charge.

    Returns:
        The selector installed before.
    """
    global _selector
    previous, _selector = _selector, selector
    return previous


@dataclass(frozen=True)
class Device:
    """A resolved device: which backend serves it and how torch names it.

    ``provider`` is the :class:`MapperBackend` that opens its mappers when the
    backend is not compiled in (``None`` for a compiled backend).
    """

    backend: str
    index: int
    torch_device: str
    provider: MapperBackend | None = field(default=None, compare=False, repr=False)

    @property
    def is_gpu(self) -> bool:
        return self.backend != "host"


def torch_is_rocm() -> bool:
    """Whether the torch in this process is a ROCm build (checked without importing it)."""
    torch = sys.modules.get("torch")
    return bool(getattr(getattr(torch, "version", None), "hip", None))


def compiled_backends() -> tuple[str, ...]:
    from kvcached_core import _native

    return tuple(_native.compiled_backends())


def parse_device(device: Any) -> Device:
    """Resolve a device string (or ``torch.device``, or a bare GPU index).

    A device type outside :data:`NATIVE_DEVICE_TYPES` resolves only when the
    installed selector answers a :class:`MapperBackend` for it.

    Raises:
        KVCachedConfigError: the string is malformed, names a device type that
            no backend serves, or its index is outside ``0..MAX_DEVICE_INDEX``.
        BackendUnavailableError: the backend it needs is not compiled into this build.
    """
    if isinstance(device, bool):
        raise KVCachedConfigError(f"device {device!r} is not a device string")
    if isinstance(device, int):
        if not 0 <= device <= MAX_DEVICE_INDEX:
            raise KVCachedConfigError(
                f"device {shown(str(device))}: GPU index outside 0..{MAX_DEVICE_INDEX}"
            )
        text = f"cuda:{device}"
    else:
        text = str(device).strip().lower()
    match = _DEVICE_RE.match(text)
    selector = _selector
    if match is None or (match.group(1) not in NATIVE_DEVICE_TYPES and selector is None):
        raise _not_understood(device)
    kind, index_text = match.group(1), match.group(2)
    if index_text is not None and (len(index_text) > 6 or int(index_text) > MAX_DEVICE_INDEX):
        raise KVCachedConfigError(
            f"device {shown(str(device), quote=True)}: index {shown(index_text)} is outside "
            f"0..{MAX_DEVICE_INDEX}"
        )
    index = int(index_text) if index_text is not None else 0
    if kind == "cpu":
        if index != 0:
            raise KVCachedConfigError(f"device {device!r}: the host has one device, 'cpu'")
        backend, torch_device = "host", "cpu"
    elif kind in NATIVE_DEVICE_TYPES:
        backend = "hip" if kind == "hip" or torch_is_rocm() else "cuda"
        torch_device = f"cuda:{index}"
    else:
        backend = torch_device = ""
    compiled = compiled_backends()
    chosen = selector(text, compiled) if selector is not None else None
    if chosen is not None and not isinstance(chosen, str):
        return Device(backend=chosen.name, index=index,
                      torch_device=chosen.torch_device_of(text, index), provider=chosen)
    if kind not in NATIVE_DEVICE_TYPES:
        raise _not_understood(device, kind)  # no backend serves this device type
    if chosen is not None:
        backend = chosen
    if backend not in compiled:
        raise BackendUnavailableError(
            f"device {device!r} needs the {backend} backend, which is not compiled into "
            f"this build of kvcached (compiled: {', '.join(compiled)}): it was left out "
            f"with KVCACHED_BACKENDS when kvcached-core was built; reinstall kvcached-core "
            f"without that variable set"
        )
    return Device(backend=backend, index=index, torch_device=torch_device)


def _not_understood(device: Any, kind: str | None = None) -> KVCachedConfigError:
    served = "" if kind is None else f"; no installed plugin serves {kind!r} devices"
    return KVCachedConfigError(
        f"device {device!r} is not a device string kvcached understands "
        f"(use 'cpu', 'cuda:N' or 'hip:N'{served})"
    )
