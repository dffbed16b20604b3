"""The cuda backend on a real GPU (run with ``pytest -m gpu`` on a GPU machine)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvcached_core import _native  # noqa: E402
from kvcached_core.errors import DeviceOutOfMemoryError, MappingError  # noqa: E402
from kvcached_core.vmm import as_tensor, open_mapper  # noqa: E402

pytestmark = pytest.mark.gpu
PAGE = 2 << 20


@pytest.fixture(scope="module")
def mapper():
    torch.cuda.init()
    return open_mapper("cuda:0", PAGE)


def test_driver_symbols_resolve():
    report = _native.probe_backend("cuda")
    assert report["load_error"] == ""
    assert all(ok for _, ok in report["symbols"]), report["symbols"]


def test_tensor_is_a_cuda_tensor_at_the_reserved_address(mapper):
    vt = mapper.reserve(8 * PAGE)
    mapper.map([vt], [0, 1])
    t = as_tensor(vt, torch.float16)
    assert t.device == torch.device("cuda:0") and t.data_ptr() == vt.address
    t[: PAGE] = 2.5  # pages 0 and 1
    torch.cuda.synchronize()
    assert float(t[: PAGE].float().sum()) == 2.5 * PAGE
    mapper.unmap([vt], [0, 1])


def test_write_read_and_matmul_through_elastic_memory(mapper):
    n = 1024
    vt = mapper.reserve(4 * PAGE)  # 8 MiB: two n x n fp32 matrices
    mapper.map([vt], list(range(4)))
    buf = as_tensor(vt, torch.float32)
    a = buf[: n * n].view(n, n)
    b = buf[n * n : 2 * n * n].view(n, n)
    ref_a = torch.randn(n, n, device="cuda")
    ref_b = torch.randn(n, n, device="cuda")
    a.copy_(ref_a)
    b.copy_(ref_b)
    assert torch.equal(a, ref_a) and torch.equal(b, ref_b)
    assert torch.equal(a @ b, ref_a @ ref_b)
    mapper.unmap([vt], list(range(4)))


def test_recycled_handle_keeps_working(mapper):
    vt = mapper.reserve(2 * PAGE)
    created = mapper.stats().handles_created
    mapper.map([vt], [0])
    mapper.unmap([vt], [0])
    mapper.map([vt], [0])
    assert mapper.stats().handles_created - created <= 1
    t = as_tensor(vt, torch.int32)
    t[: PAGE // 4].fill_(7)
    assert int(t[: PAGE // 4].sum()) == 7 * (PAGE // 4)
    mapper.unmap([vt], [0])


def test_attention_over_elastic_kv_matches_plain_tensors(mapper):
    """A paged-attention read of K/V through elastic tensors equals the same read on plain tensors."""
    torch.manual_seed(0)
    layers, blocks, block, heads, dim = 4, 64, 16, 8, 128
    block_bytes = block * heads * dim * 2  # fp16
    per_layer = blocks * block_bytes  # 16 MiB = 8 pages
    pages = per_layer // PAGE
    k_vts = [mapper.reserve(per_layer) for _ in range(layers)]
    v_vts = [mapper.reserve(per_layer) for _ in range(layers)]
    mapper.map(k_vts + v_vts, list(range(pages)))
    shape = (blocks, block, heads, dim)
    k_el = [as_tensor(v, torch.float16).view(shape) for v in k_vts]
    v_el = [as_tensor(v, torch.float16).view(shape) for v in v_vts]
    k_pl = [torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(layers)]
    v_pl = [torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(layers)]
    for e, p in zip(k_el + v_el, k_pl + v_pl):
        e.copy_(p)
    block_table = torch.randperm(blocks, device="cuda")[:24]
    q = torch.randn(1, heads, 7, dim, device="cuda", dtype=torch.float16)

    def attend(ks, vs):
        outs = []
        for k, v in zip(ks, vs):
            kk = k[block_table].reshape(-1, heads, dim).transpose(0, 1).unsqueeze(0)
            vv = v[block_table].reshape(-1, heads, dim).transpose(0, 1).unsqueeze(0)
            outs.append(torch.nn.functional.scaled_dot_product_attention(q, kk, vv))
        return torch.stack(outs)

    assert torch.equal(attend(k_el, v_el), attend(k_pl, v_pl))
    mapper.unmap(k_vts + v_vts, list(range(pages)))


def test_out_of_memory_is_an_exception_and_the_batch_rolls_back(mapper):
    free, total = mapper.mem_info()
    batch = 512  # 1 GiB per batch
    pages = (total // PAGE) + 2 * batch
    vt = mapper.reserve(pages * PAGE)
    mapped = 0
    with pytest.raises(DeviceOutOfMemoryError, match="cuMemCreate"):
        while True:
            mapper.map([vt], list(range(mapped, mapped + batch)))
            mapped += batch
    assert vt.mapped_pages == mapped  # the failed batch left nothing behind
    assert mapped * PAGE <= free
    mapper.unmap([vt], list(range(mapped)))
    mapper.trim_pool(0)
    assert mapper.stats().mapped_pages == 0 and mapper.stats().pooled_handles == 0
    # after release the device has its memory back
    assert mapper.mem_info()[0] >= free - 64 * PAGE


def test_mapping_errors_name_the_page(mapper):
    vt = mapper.reserve(2 * PAGE)
    with pytest.raises(MappingError, match="outside"):
        mapper.map([vt], [2])
    mapper.map([vt], [0])
    with pytest.raises(MappingError, match="already mapped"):
        mapper.map([vt], [0])
    mapper.unmap([vt], [0])


def test_page_size_below_granularity_is_refused():
    with pytest.raises(MappingError, match="granularity"):
        open_mapper("cuda:0", 4096)
