"""Suite-wide fixtures and markers.

Tests marked ``gpu`` need a CUDA GPU: they are skipped elsewhere and run on a
GPU machine with ``pytest -m gpu``.

Hypothesis profiles: ``ci`` (the default, 60 examples) and ``nightly`` (2000,
longer sequences), chosen with ``KVCACHED_HYPOTHESIS_PROFILE``.
"""

from __future__ import annotations

import os

import pytest

try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # an environment without the test extra
    _hypothesis_settings = None

if _hypothesis_settings is not None:
    # Property tests: a quick pass in CI, many examples nightly
    # (KVCACHED_HYPOTHESIS_PROFILE=nightly, or pytest --hypothesis-profile nightly).
    _hypothesis_settings.register_profile("ci", max_examples=60, stateful_step_count=30)
    _hypothesis_settings.register_profile("nightly", max_examples=2000, stateful_step_count=80)
    _hypothesis_settings.load_profile(os.environ.get("KVCACHED_HYPOTHESIS_PROFILE", "ci"))


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


@pytest.fixture
def shm_base(monkeypatch, tmp_path):
    """A private (0700) directory as ``KVCACHED_SHM_DIR``: pool and budget records."""
    path = tmp_path / "shm"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(path))
    return path
