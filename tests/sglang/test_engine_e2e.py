"""End to end on this CPU: a real SGLang engine serving a tiny local Llama, with and without kvcached.

For each release below, two engine runs (one subprocess each, one at a time) serve every
check: ``engine_run.py serve`` with kvcached installed (its ``sglang.srt.plugins`` entry
point on the path, as after ``pip install kvcached-sglang``) and without it. A second,
test-only entry point (``engine_probe.py``) reads the elastic pool's own page counters and
the scheduler's RSS from inside the scheduler process and, in the kvcached run, leaks one
request slot at the very end.

Engine settings (see the reference notes on SGLang on CPU): ``SGLANG_USE_CPU_ENGINE=1``,
``device="cpu"``, ``torch_native`` attention, no CUDA graphs, page size 1, token ids in and
out (``skip_tokenizer_init``), 65536 KV slots; kvcached with 1 MiB pages (4096 tokens of the
tiny model per page id, 4 MiB mapped per page id over 2 layers x K/V), a 40 MiB memory limit
(10 page ids, so at idle kvcached can back fewer slots than SGLang's static count) and
strict idle memory checks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcached_testing.sglang_release import SGLANG_DIR, release_env, write_dist_record
from tests.sglang.conftest import run_engine_process, skip_unless_installed

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "engine_run.py"
RELEASES = ("0.5.12.post1", "0.5.23")
#: Packages a release's engine processes import beyond what ``scripts/setup_sglang.sh`` pins
#: for its pool and scheduler modules (module -> requirement), by release. 0.5.23's
#: detokenizer imports ``function_call`` -> ``inkling_detector`` -> ``xgrammar``.
ENGINE_EXTRAS = {"0.5.23": {"xgrammar": "xgrammar==0.2.7"}}
PAGE_IDS_PER_BURST = 4  # 8 x 2532 tokens over 4096-token page ids: at least 5 page ids
CACHE_CAP = 4096  # prefix-cached tokens kept once idle (one page id)
KV_ENV = dict(KVCACHED_PAGE_SIZE_MB="1", KVCACHED_IDLE_TRIM_S="0.5",
              KVCACHED_MEMORY_LIMIT=str(40 << 20), KVCACHED_MAX_CACHED_TOKENS=str(CACHE_CAP))
TIMEOUT_S = 900

pytestmark = [pytest.mark.engine, pytest.mark.parametrize("version", RELEASES)]


def _skip_unless_servable(version: str) -> None:
    skip_unless_installed(version)
    missing = [req for mod, req in ENGINE_EXTRAS.get(version, {}).items()
               if not (SGLANG_DIR / version / mod).exists()]
    if missing:
        pytest.skip(f"SGLang {version}'s engine needs {' '.join(missing)} in .sglang/{version}; "
                    f"scripts/setup_sglang.sh {version} installs it once its pins list it")


def _probe_record(dest: Path) -> Path:
    info = dest / "kvcached_sglang_e2e_probe-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvcached-sglang-e2e-probe\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nkvcached_e2e_probe = tests.sglang.engine_probe:register\n")
    return dest


def _run(version: str, dist: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    return run_engine_process([sys.executable, str(RUNNER), *args],
                              release_env(version, dist, **env), HERE.parents[1], TIMEOUT_S)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``kvcached_testing/tiny_model.py``'s Llama, built with an installed release's transformers."""
    version = next((v for v in RELEASES if (SGLANG_DIR / v / ".done").is_file()), None)
    if version is None:
        pytest.skip("no SGLang release installed; run scripts/setup_sglang.sh "
                    + " ".join(RELEASES))
    out = tmp_path_factory.mktemp("tiny-llama")
    empty = tmp_path_factory.mktemp("no_dist")
    res = _run(version, empty, ["build", str(out)])
    assert res.returncode == 0, res.stderr[-4000:]
    return out


_runs: dict[tuple[str, bool], dict[str, Any]] = {}


@pytest.fixture(scope="session")
def engine_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """``engine_run(version, kvcached)``: the report of one engine run (cached per session)."""

    def get(version: str, kvcached: bool) -> dict[str, Any]:
        _skip_unless_servable(version)
        key = (version, kvcached)
        if key not in _runs:
            tag = f"{version}-{'kvcached' if kvcached else 'vanilla'}"
            dist = _probe_record(tmp_path_factory.mktemp(f"dist-{tag}"))
            env = dict(KVCACHED_E2E_DIR=str(tmp_path_factory.mktemp(f"work-{tag}")),
                       SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1")
            if kvcached:
                write_dist_record(dist)  # installed = active (entry point)
                env.update(KV_ENV)
                # A device budget record of this run's own (the giveback phase sets one).
                env["KVCACHED_SHM_DIR"] = str(tmp_path_factory.mktemp(f"shm-{tag}"))
            args = ["serve", str(tiny_model), env["KVCACHED_E2E_DIR"]] + (
                ["--leak"] if kvcached else [])
            res = _run(version, dist, args, **env)
            lines = [ln for ln in res.stdout.splitlines() if ln.startswith("ENGINE-JSON ")]
            if not lines:
                pytest.fail(f"SGLang {version} ({tag}) did not serve (rc={res.returncode}):\n"
                            f"{res.stdout[-3000:]}\n{res.stderr[-8000:]}")
            rep = json.loads(lines[-1][len("ENGINE-JSON "):])
            rep.update(rc=res.returncode, stdout=res.stdout[-4000:], stderr=res.stderr[-20000:],
                       leaked=_read_json(Path(env["KVCACHED_E2E_DIR"]) / "leaked.json"))
            _runs[key] = rep
        return _runs[key]

    return get


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- checks


def test_kvcached_backs_the_engine_pool(engine_run, version):
    kv, plain = engine_run(version, True), engine_run(version, False)
    assert kv["sglang_version"] == plain["sglang_version"] == version
    start = kv["start"]
    assert start.get("size") == 65536, start  # the probe saw kvcached's pool in the scheduler
    assert start["mapped"] <= 2, start  # only the null block's page (plus a small reserve)
    assert start["limit_pages"] == 10 and start["page_bytes"] == 4 << 20, start
    assert "mapped" not in plain["start"], plain["start"]  # vanilla: SGLang's static pool


def test_memory_profile_taken_as_if_the_engine_were_alone(engine_run, version):
    prof = engine_run(version, True)["start"]["profile"]
    assert prof["method"].endswith("_profile_available_bytes"), prof
    # SGLang's code ran with the device's total as the pre-load figure (what it would have
    # measured alone), not the free memory it measured with everything else running.
    assert prof["virtual_pre_load_gib"] == prof["total_bytes"] / (1 << 30), prof
    assert prof["measured_pre_load_gib"] < prof["virtual_pre_load_gib"], prof
    assert 0 < prof["own_bytes"] < prof["total_bytes"], prof
    assert prof["result"] > 0, prof


def test_greedy_tokens_identical_with_and_without_kvcached(engine_run, version):
    kv, plain = engine_run(version, True), engine_run(version, False)
    for ids in plain["short"] + plain["burst"]:
        assert len(set(ids)) > len(ids) // 4, f"degenerate greedy output {ids}"
    assert kv["short"] == plain["short"]
    assert kv["short_again"] == plain["short"]  # served from the radix cache
    assert kv["burst"] == plain["burst"]
    assert kv["after_idle"] == plain["short"][:1]


def test_kv_memory_grows_under_burst_and_falls_back(engine_run, version):
    kv = engine_run(version, True)
    base, samples, flushed = kv["before_burst"], kv["burst_samples"], kv["after_flush"]
    peak = max(samples, key=lambda s: s.get("mapped", 0))
    assert max(s.get("used_tokens", 0) for s in samples) >= 8 * 2500
    assert peak["mapped"] >= base["mapped"] + PAGE_IDS_PER_BURST, (base, peak)
    assert peak["mapped"] <= peak["limit_pages"]
    # Once the scheduler is idle, kvcached trims the radix cache to the cap (the most
    # recent prefixes stay cached) and the emptied page ids are unmapped: no flush needed.
    idle = kv["after_burst"]
    assert idle["used_tokens"] <= CACHE_CAP, idle
    assert idle["mapped"] <= idle["in_use"] + 1 and idle["mapped"] < peak["mapped"], (idle, peak)
    # A flush empties the cache: every page id but the null block's is unmapped again.
    assert kv["flushed"]
    assert flushed["used_tokens"] == 0 and flushed["in_use"] == 1, flushed
    assert flushed["mapped"] <= base["mapped"], (base, flushed)
    # The scheduler process gives the memory back too (RSS, noisy: half of it suffices).
    unmapped = (peak["mapped"] - flushed["mapped"]) * peak["page_bytes"]
    peak_rss = max(s["rss"] for s in samples + [kv["after_burst"]])
    print(f"SGLang {version}: page ids mapped {base['mapped']} -> peak {peak['mapped']} "
          f"(used tokens {peak.get('used_tokens')}) -> idle, cache trimmed "
          f"{kv['after_burst']['mapped']} -> flushed {flushed['mapped']}; scheduler RSS MiB "
          f"{base['rss'] >> 20} -> {peak_rss >> 20} -> {flushed['rss'] >> 20}; "
          f"startup {kv['startup_s']} s")
    assert peak_rss - flushed["rss"] >= unmapped // 2, (peak_rss, flushed["rss"], unmapped)


def test_an_idle_engine_gives_memory_back_to_another_pool_and_to_a_lower_limit(engine_run,
                                                                               version):
    """The device budget is full and the engine idles with a prefix cache: another pool's
    miss asks, and the engine's scheduler evicts cached pages and unmaps them. A lower
    ``kvctl limit`` on the idle engine is met the same way."""
    g = engine_run(version, True)["giveback"]
    page = g["engine_before"]["page_bytes"]
    assert g["granted"], g
    (engine,) = [s for name, s in g["slots"].items() if name.endswith("/mha-tp0")]
    assert engine["mapped"] <= g["held_before"] - page, g
    assert g["held_after"] <= g["capacity"], g
    before, after = g["engine_before"], g["engine_after"]
    assert after["used_tokens"] < before["used_tokens"], (before, after)  # cache evicted
    lim = engine_run(version, True)["limit"]  # kvctl limit: one page id, on the idle engine
    assert lim["engine_before"]["mapped"] > 1, lim  # it held cached pages
    assert lim["under_limit_ms"] is not None and lim["under_limit_ms"] < 1000, lim
    assert lim["engine_limited"]["mapped"] <= 1, lim
    print(f"SGLang {version}: limit of one page id reached in {lim['under_limit_ms']} ms "
          f"({lim['engine_before']['mapped']} page ids before)")
    print(f"SGLang {version}: giveback to another pool in {g['waited_ms']} ms, engine "
          f"{g['held_before'] >> 20} -> {engine['mapped'] >> 20} MiB mapped, cached tokens "
          f"{before['used_tokens']} -> {after['used_tokens']}")


def test_idle_leak_check_runs_and_passes_with_kvcached(engine_run, version):
    kv = engine_run(version, True)
    idle = kv["idle"]
    # SGLang's idle check evaluated the elastic pool (inside kvcached's leak-check view)...
    assert kv["idle_view_calls"] > 0
    # ... where kvcached could back fewer slots than the static identity expects, so the
    # unwrapped check would have reported a leak (strict mode: the engine would be gone) ...
    assert idle["view_available"] < idle["view_logical"] == 65536, idle
    # ... and it passed: the engine still serves, with the same tokens.
    assert kv["alive_after_idle"] and kv["after_idle"] == kv["short"][:1]


def test_leaked_request_slot_is_still_reported(engine_run, version):
    kv = engine_run(version, True)
    assert kv["leaked"] is not None, "the probe never leaked a request slot"
    assert "req_to_token_pool memory leak detected" in kv["stderr"], kv["stderr"][-4000:]
    assert "LEAK-NOT-REPORTED" not in kv["stdout"], (kv["rc"], kv["stderr"][-3000:])
    assert kv["rc"] != 0  # strict mode: SGLang takes the engine down
