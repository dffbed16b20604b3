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
#: Reads every release's source, whichever vLLM is installed: once, in the newest environment.
pytestmark = pytest.mark.newest_vllm
SOURCES = ROOT / ".vllm-src"
sys.path.insert(0, str(ROOT / "kvcached_vllm" / "src"))  # the adapter imports without vLLM

from kvcached_core.plugins.patching import parse_target  # noqa: E402
from kvcached_vllm import COVERED_RELEASES, SUPPORTED_VERSIONS  # noqa: E402
from kvcached_vllm.patches import build_patches  # noqa: E402
from packaging.specifiers import SpecifierSet  # noqa: E402
from packaging.version import Version  # noqa: E402

COVERED = COVERED_RELEASES


def test_covered_releases_are_the_declared_range():
    spec = SpecifierSet(SUPPORTED_VERSIONS)
    assert all(Version(v) in spec for v in COVERED)
    assert Version("0.34.0") in spec and Version("0.34.0rc1") in spec
    for outside in ("0.24.0", "0.34.1", "0.35.0.dev0", "0.35.0"):
        assert Version(outside) not in spec, outside


def test_doctor_names_the_nearest_covered_release():
    """An engine newer than the range is pointed at the newest covered release (``kvctl doctor``)."""
    from kvcached_vllm.plugin import kvcached_engine_adapters

    adapter = kvcached_engine_adapters()
    assert adapter.covered == COVERED and adapter.covered[-1] == "0.34.0"
    assert adapter.nearest_covered("0.35.0") == "0.34.0"
    assert adapter.nearest_covered("0.34.2") == "0.34.0"
    assert adapter.nearest_covered("0.24.0") == "0.25.0"
    note = adapter.outside_note("0.35.0")
    assert "the nearest covered release is vllm 0.34.0: pip install 'vllm==0.34.0'" in note


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


def _has_module(version: str, module: str) -> bool:
    try:
        _module(version, module)
    except LookupError:
        return False
    return True


V1_INIT = "vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache_tensors"
V2_INIT = "vllm.v1.worker.gpu.model_runner:init_kv_cache"
STANDALONE_CPU_INIT = "vllm.v1.worker.cpu.standalone_model_runner:init_kv_cache"
BUFFERS = {"elastic-allocate-kv-cache", "elastic-allocate-kv-cache-tensors",
           "elastic-allocate-kv-cache-v2", "elastic-allocate-kv-cache-v2-raw",
           "elastic-kv-cache-buffer"}


def _imported_from(version: str, module: str, name: str) -> str | None:
    """The module ``module`` imports ``name`` from at its top level."""
    node = _top(_module(version, module), name)
    if not isinstance(node, ast.ImportFrom):
        return None
    return node.module if node.level == 0 else _relative(module, node)


def _runner_kv_inits(version: str, device_type: str) -> set[str]:
    """Where the KV cache of each model runner the worker builds by default is set up.

    GPU: the V1 runner while it exists, and the V2 runner. CPU: the class
    ``cpu_worker`` imports as ``CPUModelRunner`` is a V1 runner (``cpu_model_runner``,
    < 0.34) or a V2 one (``cpu/model_runner``, 0.34); from 0.34 the worker picks
    the standalone CPU runner on CPUs without Triton that are not x86.
    """
    v1 = _has_module(version, "vllm.v1.worker.gpu_model_runner")
    if device_type == "cuda":
        return ({V1_INIT} if v1 else set()) | {V2_INIT}
    worker = "vllm.v1.worker.cpu_worker"
    runner = _imported_from(version, worker, "CPUModelRunner")
    base = _imported_from(version, runner, "GPUModelRunner")
    inits = {V1_INIT if base == "vllm.v1.worker.gpu_model_runner" else V2_INIT}
    if "vllm.v1.worker.cpu.standalone_model_runner" in {
            n.module for n in ast.walk(_module(version, worker)) if isinstance(n, ast.ImportFrom)}:
        inits.add(STANDALONE_CPU_INIT)
    return inits


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_every_patch_target_exists(release, device_type):
    patches = [p for p in build_patches(Version(release), device_type)
               if p.matches(Version(release))]
    missing = [p.name for p in patches if not _resolves(release, p.target)]
    assert not missing, f"vLLM {release} ({device_type}): targets missing for {missing}"
    names = {p.name for p in patches}
    assert BUFFERS & names
    # Every runner the worker builds by default has its KV set-up wrapped: no runner of a
    # covered release allocates its KV cache behind kvcached's back.
    targets = {p.target for p in patches}
    assert _runner_kv_inits(release, device_type) <= targets, (release, device_type)


def test_wrapped_signatures(release):
    sched = "vllm.v1.core.sched.scheduler"
    assert {"vllm_config", "kv_cache_config"} <= set(_params(_method(release, sched, "Scheduler",
                                                                     "__init__")))
    assert _params(_method(release, sched, "Scheduler", "update_from_output"))[1] == \
        "scheduler_output"
    runner = "vllm.v1.worker.gpu_model_runner"
    if _has_module(release, runner):  # the V1 runner (< 0.34)
        assert "kv_cache_config" in _params(_method(release, runner, "GPUModelRunner",
                                                    "initialize_kv_cache_tensors"))
    inits = [_function(release, "vllm.v1.worker.gpu.attn_utils", "init_kv_cache")]
    if Version(release) >= Version("0.34.0.dev0"):
        inits.append(_function(release, "vllm.v1.worker.cpu.attn_utils", "init_kv_cache"))
    for init in inits:
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
    if _has_module(release, runner):  # the V1 runner (< 0.34)
        init = _method(release, runner, "GPUModelRunner", "initialize_kv_cache_tensors")
        wanted = ("allocate_kv_cache" if v >= Version("0.29.0.dev0")
                  else "self._allocate_kv_cache_tensors")
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


def test_034_runners_allocate_through_the_buffer_helper(release):
    """0.34: every runner's KV buffer comes from ``_allocate_kv_cache_buffer`` unless vLLM's
    extensible KV cache passes its ``allocate`` hook, which kvcached refuses."""
    if Version(release) < Version("0.34.0.dev0"):
        pytest.skip("vLLM < 0.34 allocates inside allocate_kv_cache")
    utils = "vllm.v1.worker.utils"
    alloc = _function(release, utils, "allocate_kv_cache")
    assert "allocate" in _params(alloc)
    assert _calls(alloc, "_allocate_kv_cache_buffer") and _calls(alloc, "allocate")
    for module in ("vllm.v1.worker.gpu.attn_utils", "vllm.v1.worker.cpu.attn_utils"):
        assert _imported_from(release, module, "allocate_kv_cache") == utils, module
        init = _function(release, module, "init_kv_cache")
        assert _calls(init, "allocate_kv_cache")
    for module in ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.cpu.standalone_model_runner"):
        assert _imported_from(release, module, "init_kv_cache") is not None, module
    # The hook reaches init_kv_cache by the keyword the wrapper reads, and only from vLLM's
    # extensible KV cache.
    gpu_init = _function(release, "vllm.v1.worker.gpu.attn_utils", "init_kv_cache")
    assert "allocate" in [a.arg for a in gpu_init.args.kwonlyargs]
    v2 = _method(release, "vllm.v1.worker.gpu.model_runner", "GPUModelRunner",
                 "initialize_kv_cache")
    call = next(n for n in ast.walk(v2)
                if isinstance(n, ast.Call) and ast.unparse(n.func) == "init_kv_cache")
    assert [ast.unparse(k.value) for k in call.keywords if k.arg == "allocate"] == ["allocate_fn"]
    assert _mentions(v2, "self.extensible_kv_cache.allocate")


def test_034_extensible_kv_cache_asks_the_workers_first(release):
    """0.34: the engine core asks every worker why the extensible KV cache cannot be used
    before it sizes and allocates the KV cache; a reason turns it off everywhere."""
    if Version(release) < Version("0.34.0.dev0"):
        pytest.skip("vLLM < 0.34 has no extensible KV cache")
    worker = "vllm.v1.worker.gpu_worker"
    assert _params(_method(release, worker, "Worker",
                           "extensible_kv_cache_unsupported_reason")) == ["self"]
    disable = _method(release, worker, "Worker", "disable_extensible_kv_cache")
    assert _mentions(disable, "self.cache_config.enable_extensible_kv_cache")
    assert _calls(disable, "self._resolve_requested_memory")  # request_memory, wrapped
    resolve = _method(release, worker, "Worker", "_resolve_requested_memory")
    assert _calls(resolve, "request_memory")
    executor = _method(release, "vllm.v1.executor.abstract", "Executor",
                       "extensible_kv_cache_unsupported_reason")
    rpc = next(n for n in ast.walk(executor)
               if isinstance(n, ast.Call) and ast.unparse(n.func) == "self.collective_rpc")
    assert ast.literal_eval(rpc.args[0]) == "extensible_kv_cache_unsupported_reason"
    text = ast.unparse(_method(release, "vllm.v1.engine.core", "EngineCore",
                               "_initialize_kv_caches"))
    asked = text.index("executor.extensible_kv_cache_unsupported_reason(")
    assert asked < text.index("executor.disable_extensible_kv_cache(reason)")
    assert asked < text.index("self.model_executor.determine_available_memory()")
    assert asked < text.index("self.model_executor.initialize_from_config(")
    # The worker allocates the extensible KV cache only while it is on.
    init = ast.unparse(_method(release, worker, "Worker", "initialize_from_config"))
    assert "if self.cache_config.enable_extensible_kv_cache:" in init and "extensible=True" in init


def test_034_cpu_worker_warms_up_through_execute_model(release):
    """0.34's CPU worker runs the V2 kernel warm-up on made-up requests: the window maps them."""
    if Version(release) < Version("0.34.0.dev0"):
        pytest.skip("vLLM < 0.34 CPU workers warm the V1 runner up without requests")
    warm = _method(release, "vllm.v1.worker.cpu_worker", "CPUWorker", "compile_or_warm_up_model")
    assert _calls(warm, "warmup_kernels") and _mentions(warm, "self.execute_model")


def test_block_pool_generation_matches_the_pool_class(release):
    """0.34 blocks name their pool through ``weakref.ref`` and ``free_blocks`` takes
    ``evict_first``: the patch set builds ElasticBlockPool034 exactly there."""
    v = Version(release)
    init = ast.unparse(_method(release, "vllm.v1.core.block_pool", "BlockPool", "__init__"))
    free = _params(_method(release, "vllm.v1.core.block_pool", "BlockPool", "free_blocks"))
    weak = "self._weak_self = weakref.ref(self)" in init
    if weak:
        assert "KVCacheBlock(idx, pool=self._weak_self)" in init
        assert free == ["self", "ordered_blocks", "evict_first"]
    else:
        assert "_weak_self" not in init and free == ["self", "ordered_blocks"]
    pools = {p.wrapper.__name__ for p in build_patches(v, "cpu")
             if p.matches(v) and p.target.endswith(":BlockPool")}
    assert pools == ({"wrap_block_pool_weakref"} if weak else {"wrap_block_pool"})
    for name in ("_maybe_evict_cached_block", "evict_blocks", "reset_prefix_cache"):
        assert _method(release, "vllm.v1.core.block_pool", "BlockPool", name)


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
