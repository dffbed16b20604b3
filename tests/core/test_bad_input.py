"""Each bad input gets a clear error naming the value."""

from __future__ import annotations

import pytest

from kvcached_core import _native
from kvcached_core.config import load_settings, parse_size
from kvcached_core.device import parse_device
from kvcached_core.errors import (
    BackendUnavailableError,
    KVCachedConfigError,
    MappingError,
)
from kvcached_core.vmm import open_mapper

PAGE = 2 << 20


def test_page_size_not_a_multiple_of_granularity():
    with pytest.raises(MappingError, match=r"page size 12345 bytes .* granularity of 4096"):
        open_mapper("cpu", 12345)


@pytest.mark.parametrize("device", ["gpu:0", "cuda:-1", "cuda:x", "", "cuda:0:1", "tpu", "cpu:1"])
def test_unknown_or_malformed_device_string(device):
    with pytest.raises(KVCachedConfigError, match="device"):
        parse_device(device)


def test_device_strings_resolve():
    assert parse_device("cpu").backend == "host"
    assert parse_device("CUDA:1").torch_device == "cuda:1"
    if "hip" not in _native.compiled_backends():
        with pytest.raises(BackendUnavailableError, match="hip backend"):
            parse_device("hip:2")
        return
    hip = parse_device("hip:2")
    assert (hip.backend, hip.index, hip.torch_device) == ("hip", 2, "cuda:2")


def test_unknown_backend_name():
    with pytest.raises(MappingError, match="unknown backend 'metal'"):
        _native.PageMapper("metal", 0, PAGE)


def test_backend_not_compiled_in(monkeypatch):
    # What a build made with KVCACHED_BACKENDS=cuda,host holds.
    monkeypatch.setattr("kvcached_core.device.compiled_backends", lambda: ("cuda", "host"))
    with pytest.raises(BackendUnavailableError,
                       match="needs the hip backend, which is not compiled.*KVCACHED_BACKENDS"):
        parse_device("hip:0")


def test_cuda_driver_library_missing_says_so():
    if "cuda" not in _native.compiled_backends():
        pytest.skip("this build has no cuda backend")
    report = _native.probe_backend("cuda")
    if not report["load_error"]:
        pytest.skip("an NVIDIA driver is installed here")
    with pytest.raises(BackendUnavailableError, match=r"cannot load libcuda\.so\.1"):
        open_mapper("cuda:0", PAGE)


def test_mapping_outside_a_reservation():
    mapper = open_mapper("cpu", PAGE)
    vt = mapper.reserve(4 * PAGE)
    with pytest.raises(MappingError, match=r"page 4 \(offset 8388608\).*outside"):
        mapper.map([vt], [4])
    with pytest.raises(MappingError, match="outside"):
        mapper.map([vt], [-1])


def test_double_map_and_double_unmap():
    mapper = open_mapper("cpu", PAGE)
    vt = mapper.reserve(4 * PAGE)
    mapper.map([vt], [1])
    with pytest.raises(MappingError, match="page 1 .* already mapped"):
        mapper.map([vt], [1])
    with pytest.raises(MappingError, match="appears twice"):
        mapper.map([vt], [2, 2])
    mapper.unmap([vt], [1])
    with pytest.raises(MappingError, match="page 1 .* not mapped"):
        mapper.unmap([vt], [1])


def test_tensor_of_another_mapper_is_refused():
    a, b = open_mapper("cpu", PAGE), open_mapper("cpu", PAGE)
    vt = b.reserve(PAGE)
    with pytest.raises(MappingError, match="another page mapper"):
        a.map([vt], [0])


def test_reservation_not_a_multiple_of_the_page():
    with pytest.raises(MappingError, match="size 100 bytes"):
        open_mapper("cpu", PAGE).reserve(100)


@pytest.mark.parametrize(
    "var, value, message",
    [
        ("KVCACHED_PAGE_SIZE_MB", "two", "KVCACHED_PAGE_SIZE_MB='two' is not an integer"),
        ("KVCACHED_PAGE_SIZE_MB", "0", "KVCACHED_PAGE_SIZE_MB=0 is below"),
        ("KVCACHED_MEMORY_LIMIT", "lots", "KVCACHED_MEMORY_LIMIT='lots' is not a size"),
        ("KVCACHED_CONTIGUOUS_LAYOUT", "sometimes", "KVCACHED_CONTIGUOUS_LAYOUT='sometimes'"),
        ("KVCACHED_GPU_UTILIZATION", "1.5", "KVCACHED_GPU_UTILIZATION=1.5 is above"),
        ("KVCACHED_IDLE_KEEP_PAGES", "-1", "KVCACHED_IDLE_KEEP_PAGES=-1 is below"),
    ],
)
def test_bad_environment_values(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(KVCachedConfigError) as err:
        load_settings()
    assert message in str(err.value)


def test_sizes_parse():
    assert parse_size("512M") == 512 << 20
    assert parse_size("2G") == 2 << 30
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("4096") == 4096


@pytest.mark.parametrize("device", ["cuda:2147483648", "cuda:" + "9" * 40, "hip:4294967296"])
def test_device_index_beyond_the_range_is_a_config_error(device):
    with pytest.raises(KVCachedConfigError, match=r"device .* index .* outside 0\.\."):
        parse_device(device)
    with pytest.raises(KVCachedConfigError, match="index"):
        open_mapper(device, PAGE)


def test_bare_gpu_index_beyond_the_range_is_a_config_error():
    with pytest.raises(KVCachedConfigError, match="index"):
        parse_device(1 << 40)
    with pytest.raises(KVCachedConfigError, match="index"):
        parse_device(-1)


@pytest.mark.parametrize("size", [1 << 64, 1 << 70, -PAGE, 0, 2.5, "2M"])
def test_page_size_beyond_the_range_is_a_config_error(size):
    with pytest.raises(KVCachedConfigError, match="page_size"):
        open_mapper("cpu", size)

