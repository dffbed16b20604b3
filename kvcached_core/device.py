"""Device strings and the backend that serves each device.

=============  ==========  ===================================================
device string  backend     torch device
=============  ==========  ===================================================
``cpu``        ``host``    ``cpu``
``cuda:N``     ``cuda``    ``cuda:N`` (``hip`` on a ROCm build of torch)
``hip:N``      ``hip``     ``cuda:N`` (PyTorch-ROCm's alias for AMD GPUs)
=============  ==========  ===================================================

Plugins may pick another backend for a device (the ``kvcached_select_backend``
hook), but this module does not ask them: the layers above install a selector
with :func:`set_backend_selector` (the plugin framework does when it is
imported). Without one, the table above is the whole rule. This module, like
:mod:`kvcached_core.vmm` and :mod:`kvcached_core.allocator` above it, never
imports :mod:`kvcached_core.plugins`.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from kvcached_core.env import shown
from kvcached_core.errors import BackendUnavailableError, KVCachedConfigError

_DEVICE_RE = re.compile(r"^(cpu|cuda|hip)(?::(\d+))?$")
#: The largest device index kvcached accepts (the drivers take a C ``int``).
MAX_DEVICE_INDEX = (1 << 16) - 1

#: ``selector(device, compiled)``: the normalised device string (``"cuda:0"``) and
#: the compiled backends in, a backend name (or ``None``: no opinion) out.
BackendSelector = Callable[[str, tuple[str, ...]], "str | None"]

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
    """A resolved device: which backend serves it and how torch names it."""

    backend: str
    index: int
    torch_device: str

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

    Raises:
        KVCachedConfigError: the string is malformed, names an unknown device
            type, or its index is outside ``0..MAX_DEVICE_INDEX``.
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
    if match is None:
        raise KVCachedConfigError(
            f"device {device!r} is not a device string kvcached understands "
            "(use 'cpu', 'cuda:N' or 'hip:N')"
        )
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
    else:
        backend = "hip" if kind == "hip" or torch_is_rocm() else "cuda"
        torch_device = f"cuda:{index}"
    compiled = compiled_backends()
    selector = _selector
    chosen = selector(text, compiled) if selector is not None else None
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
