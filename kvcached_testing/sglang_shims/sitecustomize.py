"""Start-up hook for the SGLang test environment (on PYTHONPATH only where
``kvcached_testing.sglang_release`` runs a release: tests/sglang, benchmarks/bench_vllm_share.py).

Every interpreter, spawned engine processes included, runs this at start-up. It only installs
import shims for modules that cannot exist on a CPU-only machine; see README.md.
"""

from __future__ import annotations

import sys


def _install() -> None:
    # A permissive stand-in for PyPI's CUDA-only torchvision build.
    import _torchvision_stub

    _torchvision_stub.install()
    # torch 2.13 dropped this private probe; SGLang 0.4.x calls it at import time.
    # Patched lazily when torch is imported, so interpreters that never import torch pay nothing.
    _torchvision_stub.when_imported("torch", _torch_compat)


def _torch_compat(torch) -> None:
    cpu = getattr(torch._C, "_cpu", None)
    if cpu is not None and not hasattr(cpu, "_is_amx_tile_supported"):
        cpu._is_amx_tile_supported = lambda: False


if "torchvision" not in sys.modules:
    _install()
