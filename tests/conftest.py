"""Suite-wide fixtures and markers.

Tests marked ``gpu`` need a CUDA GPU: they are skipped elsewhere and run on a
GPU machine with ``pytest -m gpu``.
"""

from __future__ import annotations

import pytest


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and not getattr(torch.version, "hip", None)


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
