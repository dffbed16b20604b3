"""Every gate of the vLLM patch set, checked against the source of each covered release.

``scripts/fetch_vllm_sources.sh`` extracts the ``vllm/v1`` modules of each
release's wheel into ``.vllm-src/<version>/``; this test reads them with
``ast`` (no vLLM import, no GPU), so the GPU-only patches (the V2 runner, the
GPU worker) are checked as well as the CPU ones, for every release at once.
For each release and each platform it resolves every patch that applies to
that release and checks what the wrappers rely on: the parameter names they
bind, the ``torch.zeros`` the allocation wrappers serve, and the call order
the fallback to vLLM's own KV cache depends on.
"""

from __future__ import annotations

import ast
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / ".vllm-src"
sys.path.insert(0, str(ROOT / "kvcached_vllm"))  # the adapter imports without vLLM

from kvcached_core.plugins.patching import parse_target  # noqa: E402
from kvcached_vllm import COVERED_RELEASES, SUPPORTED_VERSIONS  # noqa: E402
from kvcached_vllm.patches import build_patches  # noqa: E402
from packaging.specifiers import SpecifierSet  # noqa: E402
from packaging.version import Version  # noqa: E402

COVERED = COVERED_RELEASES


def test_covered_releases_are_the_declared_range():
    spec = SpecifierSet(SUPPORTED_VERSIONS)
    assert all(Version(v) in spec for v in COVERED)
    assert Version("0.24.0") not in spec and Version("0.34.0") not in spec


@lru_cache(maxsize=None)
def _module(version: str, module: str) -> ast.Module:
    base = SOURCES / version / Path(*module.split("."))
    path = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
    if not path.exists():
        raise LookupError(f"vLLM {version} has no module {module}")
    return ast.parse(path.read_text(), str(path))


def _top(tree: ast.Module, name: str) -> ast.AST | None:
    """The module-level definition of ``name`` (def, class, assignment or import)."""
    found = None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                found = node
        elif isinstance(node, ast.ImportFrom):
            if any((a.asname or a.name) == name for a in node.names):
                found = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found = node
    return found


def _member(cls: ast.ClassDef, name: str) -> ast.AST | None:
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def _function(version: str, module: str, name: str) -> ast.FunctionDef:
    """A function by name, following one ``from X import name`` to its definition."""
    node = _top(_module(version, module), name)
    if isinstance(node, ast.ImportFrom):
        source = node.module if node.level == 0 else _relative(module, node)
        original = next(a.name for a in node.names if (a.asname or a.name) == name)
        node = _top(_module(version, source), original)
    assert isinstance(node, ast.FunctionDef), f"{module}:{name} is not a function in {version}"
    return node


def _relative(module: str, node: ast.ImportFrom) -> str:
    parts = module.split(".")[: -node.level]
    return ".".join(parts + ([node.module] if node.module else []))


def _method(version: str, module: str, cls: str, name: str) -> ast.FunctionDef:
    klass = _top(_module(version, module), cls)
    assert isinstance(klass, ast.ClassDef), f"{module}:{cls} is not a class in {version}"
    method = _member(klass, name)
    assert isinstance(method, ast.FunctionDef), f"{module}:{cls}.{name} missing in {version}"
    return method


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def _calls(fn: ast.AST, dotted: str) -> bool:
    """Whether ``fn`` calls ``dotted`` (``torch.zeros``, ``self.execute_model``, a name)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            text = ast.unparse(node.func)
            if text == dotted:
                return True
    return False


def _mentions(fn: ast.AST, dotted: str) -> bool:
    return any(ast.unparse(n) == dotted for n in ast.walk(fn)
               if isinstance(n, (ast.Attribute, ast.Name)))


def _resolves(version: str, target: str) -> bool:
    module, path = parse_target(target)
    node = _top(_module(version, module), path[0])
    for attr in path[1:]:
        if not isinstance(node, ast.ClassDef):
            return False
        node = _member(node, attr)
    return node is not None


def _releases() -> list[str]:
    have = [v for v in COVERED if (SOURCES / v / "vllm" / "v1").is_dir()]
    if not have:
        pytest.skip("no vLLM release sources: run scripts/fetch_vllm_sources.sh")
    return have


@pytest.fixture(params=COVERED)
def release(request) -> str:
    if request.param not in _releases():
        pytest.skip(f"vLLM {request.param} sources not fetched (scripts/fetch_vllm_sources.sh)")
    return request.param


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_every_patch_target_exists(release, device_type):
    patches = [p for p in build_patches(Version(release), device_type)
               if p.matches(Version(release))]
    missing = [p.name for p in patches if not _resolves(release, p.target)]
    assert not missing, f"vLLM {release} ({device_type}): targets missing for {missing}"
    names = {p.name for p in patches}
    assert ({"elastic-allocate-kv-cache", "elastic-allocate-kv-cache-tensors"} & names) and (
        device_type == "cpu" or {"elastic-allocate-kv-cache-v2",
                                 "elastic-allocate-kv-cache-v2-raw"} & names)


def test_wrapped_signatures(release):
    sched = "vllm.v1.core.sched.scheduler"
    assert {"vllm_config", "kv_cache_config"} <= set(_params(_method(release, sched, "Scheduler",
                                                                     "__init__")))
    assert _params(_method(release, sched, "Scheduler", "update_from_output"))[1] == \
        "scheduler_output"
    runner = "vllm.v1.worker.gpu_model_runner"
    assert "kv_cache_config" in _params(_method(release, runner, "GPUModelRunner",
                                                "initialize_kv_cache_tensors"))
    init = _function(release, "vllm.v1.worker.gpu.attn_utils", "init_kv_cache")
    assert {"kv_cache_config", "device", "vllm_config"} <= set(_params(init))
    if "runner_kv_caches" in _params(init):  # the list a retry must empty first
        assert _mentions(init, "runner_kv_caches")
    assert _params(_function(release, "vllm.v1.worker.gpu_worker", "request_memory"))[0] == \
        "init_snapshot"
    assert _params(_function(release, "vllm.v1.engine.core", "get_kv_cache_configs"))[:3] == [
        "vllm_config", "kv_cache_specs", "available_memory"]


def test_allocation_wrappers_serve_torch_zeros(release):
    """The functions whose ``torch`` kvcached rebinds allocate with ``torch.zeros``."""
    v = Version(release)
    for patch in build_patches(v, "cuda"):
        if patch.wrapper.__name__ != "_wrap_allocation" or not patch.matches(v):
            continue
        module, path = parse_target(patch.target)
        fn = (_method(release, module, *path) if len(path) == 2
              else _function(release, module, path[0]))
        assert _calls(fn, "torch.zeros"), f"{patch.target} in {release}"


def test_runners_call_what_is_patched(release):
    v = Version(release)
    runner = "vllm.v1.worker.gpu_model_runner"
    init = _method(release, runner, "GPUModelRunner", "initialize_kv_cache_tensors")
    wanted = "allocate_kv_cache" if v >= Version("0.29.0.dev0") else "self._allocate_kv_cache_tensors"
    assert _calls(init, wanted)
    v2 = _method(release, "vllm.v1.worker.gpu.model_runner", "GPUModelRunner",
                 "initialize_kv_cache")
    assert _calls(v2, "init_kv_cache")
    init_v2 = _function(release, "vllm.v1.worker.gpu.attn_utils", "init_kv_cache")
    assert _calls(init_v2, "allocate_kv_cache" if v >= Version("0.29.0.dev0")
                  else "_allocate_kv_cache")
    # The warm-up reaches execute_model through the worker instance (the window shadows it),
    # itself or in a method of the worker it delegates to (0.33: _compile_or_warm_up_model).
    warm = _method(release, "vllm.v1.worker.gpu_worker", "Worker", "compile_or_warm_up_model")
    delegates = {ast.unparse(n.func)[len("self."):] for n in ast.walk(warm)
                 if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("self._")}
    assert _mentions(warm, "self.execute_model") or any(
        _mentions(_method(release, "vllm.v1.worker.gpu_worker", "Worker", d), "self.execute_model")
        for d in delegates)
    coordinator = _module(release, "vllm.v1.core.kv_cache_coordinator")
    assert any(isinstance(n, ast.Call) and ast.unparse(n.func) == "BlockPool"
               for n in ast.walk(coordinator))


def test_workers_set_their_kv_cache_up_before_the_scheduler_exists(release):
    """The scheduler finds out whether the workers serve pages by looking: they must be done."""
    init = _method(release, "vllm.v1.engine.core", "EngineCore", "__init__")
    text = ast.unparse(init)
    assert text.index("self._initialize_kv_caches(") < text.index("self.scheduler: SchedulerInterface")


def test_kv_cache_tensor_fields(release):
    """geometry.py tells the two KVCacheTensor generations apart by ``layer_stride``."""
    klass = _top(_module(release, "vllm.v1.kv_cache_interface"), "KVCacheTensor")
    fields = {n.target.id for n in klass.body if isinstance(n, ast.AnnAssign)}
    if Version(release) >= Version("0.29.0.dev0"):
        assert {"size", "layers", "layer_stride", "block_stride", "offset"} <= fields
    else:
        assert {"size", "shared_by", "block_stride"} <= fields and "layer_stride" not in fields
