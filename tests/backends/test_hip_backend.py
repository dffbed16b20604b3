"""The HIP backend: built against the system's HIP headers, resolved against the real library."""

from __future__ import annotations

import pytest

from kvcached_core import _native
from kvcached_core.errors import BackendUnavailableError
from kvcached_core.vmm import open_mapper

pytestmark = pytest.mark.skipif(
    "hip" not in _native.compiled_backends(), reason="this build has no hip backend"
)

VMM_ENTRY_POINTS = {
    "hipMemAddressReserve", "hipMemAddressFree", "hipMemCreate", "hipMemRelease",
    "hipMemMap", "hipMemUnmap", "hipMemSetAccess", "hipMemGetAllocationGranularity",
}


def test_every_symbol_resolves_from_the_real_library():
    report = _native.probe_backend("hip")
    assert report["load_error"] == "", report["load_error"]
    assert report["library"].startswith("libamdhip64.so")
    resolved = dict(report["symbols"])
    assert VMM_ENTRY_POINTS <= set(resolved)
    missing = [name for name, ok in resolved.items() if not ok]
    assert missing == []


def test_without_an_amd_gpu_the_error_says_so():
    with pytest.raises(BackendUnavailableError, match="no AMD GPU found"):
        open_mapper("hip:0")
