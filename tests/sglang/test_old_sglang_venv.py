"""An SGLang release without plugin entry points (0.5.9), with kvcached-sglang pip-installed.

SGLang before 0.5.11 calls no ``sglang.srt.plugins`` entry point; kvcached reaches its
spawned scheduler process only through the ``kvcached_sglang_autoload.pth`` line that the
kvcached-sglang wheel puts into site-packages (``docs/sglang.md``, "How it loads"). These
checks install it as a user does and serve a tiny Llama end to end on the CPU:

* a real virtual environment (``python -m venv --without-pip`` from the test interpreter);
* "``pip install sglang==0.5.9``": SGLang's CUDA wheels cannot install on this machine, so one
  ``.pth`` in the venv's site-packages puts what ``scripts/setup_sglang.sh`` installed on the
  path instead: the shims for CUDA-only modules, ``.sglang/0.5.9``, ``.sglang/_common``, the
  test interpreter's site-packages (CPU torch) and the checkout (kvcached-core, whose native
  extension is built there, and the test-only probe);
* ``pip install --no-deps``: the kvcached-sglang wheel, built from ``kvcached_sglang/``, is
  installed into the venv by pip, so its ``.pth`` lands in site-packages and ``site`` runs it
  at every interpreter start, SGLang's spawned scheduler included.

kvcached-core comes from the checkout rather than from its wheel: what is under test is the
adapter's auto-load; building kvcached-core's wheel compiles the native extension (minutes on
a small machine), and ``tests/packaging`` covers that wheel. With
``KVCACHED_TEST_WHEELHOUSE=DIR`` (wheels of ``scripts/build_wheels.sh``, as in
``tests/packaging``) both wheels are pip-installed from there instead.

Nothing SGLang-specific is on ``PYTHONPATH``. The probe (``engine_probe.py``) cannot ride
SGLang's plugin group here, so it is installed as a kvcached plugin (a ``kvcached.engines``
entry point): it is loaded only where kvcached's auto-load bootstrapped kvcached. The vanilla
run is the same venv with ``KVCACHED_ENABLED=0`` (the ``.pth`` then installs nothing).
Engine settings and the kvcached configuration are ``test_engine_e2e.py``'s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from kvcached_testing.sglang_release import ADAPTER_DIST, ROOT, SGLANG_DIR, SHIMS
from tests.sglang.conftest import run_engine_process, skip_unless_installed

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "engine_run.py"
VERSION = "0.5.9"  # leak-check layout B, virtual-profile-tokens; no sglang.srt.plugins
PTH = "kvcached_sglang_autoload.pth"
PAGE_IDS_PER_BURST = 4
CACHE_CAP = 4096
KV_ENV = dict(KVCACHED_PAGE_SIZE_MB="1", KVCACHED_IDLE_TRIM_S="0.5",
              KVCACHED_MEMORY_LIMIT=str(40 << 20), KVCACHED_MAX_CACHED_TOKENS=str(CACHE_CAP))
TIMEOUT_S = 900

pytestmark = pytest.mark.engine


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                   check=True, timeout=300)


def _site_packages(venv: Path) -> Path:
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, env=_env())
    return Path(out.stdout.strip())


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVCACHED_", "SGLANG_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A venv with SGLang 0.5.9 on its path and kvcached-sglang installed by pip."""
    skip_unless_installed(VERSION)
    top = tmp_path_factory.mktemp("old-sglang-venv")
    env_dir = top / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True,
                   timeout=120)
    site = _site_packages(env_dir)
    runner_site = sysconfig.get_paths()["purelib"]  # this interpreter's: CPU torch, pluggy
    (site / "_sglang_release.pth").write_text("\n".join(map(str, [
        SHIMS, SGLANG_DIR / VERSION, SGLANG_DIR / "_common", runner_site, ROOT])) + "\n")
    house = os.environ.get("KVCACHED_TEST_WHEELHOUSE")
    if house:  # the released artifacts: both wheels
        tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
        wheels = [sorted(Path(house).glob(pattern))[-1] for pattern in (
            f"kvcached_core-*-{tag}-{tag}-manylinux*_x86_64.whl", "kvcached_sglang-*.whl")]
    else:  # the adapter's wheel, built from a copy of its source (nothing lands in the checkout)
        src = top / "src" / "kvcached_sglang"
        shutil.copytree(ADAPTER_DIST, src, ignore=shutil.ignore_patterns(
            "__pycache__", "build", "*.egg-info"))
        _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", str(src),
             "-w", str(top / "wheels"))
        wheels = list((top / "wheels").glob("kvcached_sglang-*.whl"))
    _pip("--python", str(env_dir / "bin" / "python"), "install", "--no-deps", "--no-index",
         *map(str, wheels))
    # The test-only probe, as an installed kvcached plugin.
    info = site / "kvcached_sglang_e2e_probe-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvcached-sglang-e2e-probe\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[kvcached.engines]\nkvcached_e2e_probe = tests.sglang.engine_probe\n")
    model = top / "tiny-llama"
    res = _run(env_dir, ["build", str(model)], _env())
    assert res.returncode == 0, res.stderr[-4000:]
    return {"dir": env_dir, "site": site, "model": model, "top": top}


def _run(env_dir: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return run_engine_process([str(env_dir / "bin" / "python"), str(RUNNER), *args], env, HERE,
                              TIMEOUT_S)


_runs: dict[bool, dict[str, Any]] = {}


@pytest.fixture(scope="module")
def engine_run(venv):
    """``engine_run(kvcached)``: the report of one engine run of the venv's python."""

    def get(kvcached: bool) -> dict[str, Any]:
        if kvcached not in _runs:
            tag = "kvcached" if kvcached else "vanilla"
            work = venv["top"] / f"work-{tag}"
            env = _env(KVCACHED_E2E_DIR=str(work), SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1")
            if kvcached:
                env.update(KV_ENV, KVCACHED_SHM_DIR=str(venv["top"] / "shm"))
                (venv["top"] / "shm").mkdir(mode=0o700)
            else:
                env["KVCACHED_ENABLED"] = "0"  # installed, switched off: the .pth arms nothing
            args = ["serve", str(venv["model"]), str(work)] + (["--leak"] if kvcached else [])
            res = _run(venv["dir"], args, env)
            lines = [ln for ln in res.stdout.splitlines() if ln.startswith("ENGINE-JSON ")]
            if not lines:
                pytest.fail(f"SGLang {VERSION} ({tag}) did not serve (rc={res.returncode}):\n"
                            f"{res.stdout[-3000:]}\n{res.stderr[-8000:]}")
            rep = json.loads(lines[-1][len("ENGINE-JSON "):])
            try:
                leaked = json.loads((work / "leaked.json").read_text())
            except (OSError, ValueError):
                leaked = None
            rep.update(rc=res.returncode, stdout=res.stdout[-4000:], stderr=res.stderr[-20000:],
                       leaked=leaked)
            _runs[kvcached] = rep
        return _runs[kvcached]

    return get


# --------------------------------------------------------------------------- checks


def test_pip_put_the_autoload_pth_into_the_venv_site_packages(venv):
    site = venv["site"]
    assert (site / PTH).read_text() == (ADAPTER_DIST / PTH).read_text()
    (info,) = site.glob("kvcached_sglang-*.dist-info")
    assert PTH in (info / "RECORD").read_text()  # pip installed it (and would uninstall it)
    assert (info / "INSTALLER").read_text().strip() == "pip"
    # SGLang 0.5.9 has no plugin group: the .pth is the only way in.
    assert not (SGLANG_DIR / VERSION / "sglang" / "srt" / "plugins").exists()


def test_the_autoload_brings_kvcached_into_the_scheduler(engine_run, venv):
    kv, plain = engine_run(True), engine_run(False)
    assert kv["sglang_version"] == plain["sglang_version"] == VERSION
    inst = kv["installation"]
    assert inst["prefix"] == str(venv["dir"]) != inst["base_prefix"], inst  # a real venv
    assert inst["kvcached_sglang"].startswith(str(venv["site"])), inst  # the installed adapter
    core_home = venv["site"] if os.environ.get("KVCACHED_TEST_WHEELHOUSE") else ROOT
    assert inst["kvcached_core"].startswith(str(core_home)), inst
    assert inst["bootstrap"] == "applied", inst  # the launcher imported the scheduler module
    assert plain["installation"]["bootstrap"] is None, plain["installation"]
    # The scheduler process built kvcached's pool (the probe, a kvcached plugin, saw it there).
    start = kv["start"]
    assert start.get("size") == 65536, start
    assert start["mapped"] <= 2, start
    assert start["limit_pages"] == 10 and start["page_bytes"] == 4 << 20, start
    assert "mapped" not in plain["start"], plain["start"]
    prof = start["profile"]  # 0.5.9: SGLang's profile_max_num_token, run as if alone
    assert prof["method"].endswith("profile_max_num_token"), prof
    assert prof["virtual_pre_load_gib"] == prof["total_bytes"] / (1 << 30), prof
    assert prof["result"] > 0, prof


def test_greedy_tokens_identical_with_and_without_kvcached(engine_run):
    kv, plain = engine_run(True), engine_run(False)
    for ids in plain["short"] + plain["burst"]:
        assert len(set(ids)) > len(ids) // 4, f"degenerate greedy output {ids}"
    assert kv["short"] == plain["short"]
    assert kv["short_again"] == plain["short"]  # served from the radix cache
    assert kv["burst"] == plain["burst"]
    assert kv["after_idle"] == plain["short"][:1] == plain["after_idle"]


def test_kv_memory_grows_under_burst_and_falls_back(engine_run):
    kv = engine_run(True)
    base, samples, flushed = kv["before_burst"], kv["burst_samples"], kv["after_flush"]
    peak = max(samples, key=lambda s: s.get("mapped", 0))
    assert max(s.get("used_tokens", 0) for s in samples) >= 8 * 2500
    assert peak["mapped"] >= base["mapped"] + PAGE_IDS_PER_BURST, (base, peak)
    assert peak["mapped"] <= peak["limit_pages"]
    idle = kv["after_burst"]  # idle: the radix cache trimmed to the cap, pages unmapped
    assert idle["used_tokens"] <= CACHE_CAP, idle
    assert idle["mapped"] <= idle["in_use"] + 1 and idle["mapped"] < peak["mapped"], (idle, peak)
    assert kv["flushed"]
    assert flushed["used_tokens"] == 0 and flushed["in_use"] == 1, flushed
    assert flushed["mapped"] <= base["mapped"], (base, flushed)
    unmapped = (peak["mapped"] - flushed["mapped"]) * peak["page_bytes"]
    peak_rss = max(s["rss"] for s in samples + [idle])
    print(f"SGLang {VERSION} (venv, .pth): page ids mapped {base['mapped']} -> peak "
          f"{peak['mapped']} -> idle {idle['mapped']} -> flushed {flushed['mapped']}; "
          f"scheduler RSS MiB {base['rss'] >> 20} -> {peak_rss >> 20} -> {flushed['rss'] >> 20}")
    assert peak_rss - flushed["rss"] >= unmapped // 2, (peak_rss, flushed["rss"], unmapped)


def test_an_idle_engine_gives_memory_back_to_another_pool_and_to_a_lower_limit(engine_run):
    """Another pool's miss against a full device budget, then ``kvctl limit`` of one page
    id: each time the idle 0.5.9 scheduler evicts cached pages and unmaps them."""
    g = engine_run(True)["giveback"]
    page = g["engine_before"]["page_bytes"]
    assert g["granted"], g
    (engine,) = [s for name, s in g["slots"].items() if name.endswith("/mha-tp0")]
    assert engine["mapped"] <= g["held_before"] - page and engine["given"] >= page, g
    before, after = g["engine_before"], g["engine_after"]
    assert after["used_tokens"] < before["used_tokens"], (before, after)  # cache evicted
    assert after["mapped"] < before["mapped"], (before, after)  # and its pages unmapped
    print(f"SGLang {VERSION} (venv, .pth): giveback to another pool in {g['waited_ms']} ms, "
          f"engine gave {engine['given'] >> 20} MiB, cached tokens {before['used_tokens']} -> "
          f"{after['used_tokens']}")
    lim = engine_run(True)["limit"]  # kvctl limit: one page id, on the idle engine
    assert lim["engine_before"]["mapped"] > 1, lim  # it held cached pages
    assert lim["under_limit_ms"] is not None and lim["under_limit_ms"] < 1000, lim
    assert lim["engine_limited"]["mapped"] <= 1, lim
    print(f"SGLang {VERSION} (venv, .pth): limit of one page id reached in "
          f"{lim['under_limit_ms']} ms ({lim['engine_before']['mapped']} page ids before)")


def test_idle_leak_check_passes_with_kvcached(engine_run):
    kv = engine_run(True)
    idle = kv["idle"]
    assert kv["idle_view_calls"] > 0  # SGLang's check_memory (layout B) read the elastic pool
    assert idle["view_available"] < idle["view_logical"] == 65536, idle
    assert kv["alive_after_idle"] and kv["after_idle"] == kv["short"][:1]


def test_a_leaked_request_slot_is_still_reported(engine_run):
    kv = engine_run(True)
    assert kv["leaked"] is not None, "the probe never leaked a request slot"
    assert "req_to_token_pool memory leak detected" in kv["stderr"], kv["stderr"][-4000:]
    assert "LEAK-NOT-REPORTED" not in kv["stdout"], (kv["rc"], kv["stderr"][-3000:])
    assert kv["rc"] != 0
