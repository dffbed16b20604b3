"""Two real vLLM engines on the CPU sharing one device budget.

One run (two engine starts) of ``kvcached_testing.shared_budget``'s scenario, the one
``benchmarks/bench_vllm_share.py`` records: A idles holding a large prefix cache; B's
burst needs more than the budget leaves it. B misses, A gives its cached pages back,
and B's burst completes without a preemption while the budget is never exceeded. Then
a ``kvctl`` limit reaches idle B within 200 ms and lifting it restores growth.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvcached_testing.shared_budget import BUNDLE, run_share  # noqa: E402

#: The budget and giveback are the core's (tests/ipc, tests/allocator); the adapter's
#: patches that carry them run in every release through test_engine.py and test_faults.py.
pytestmark = [pytest.mark.engine, pytest.mark.newest_vllm]


@pytest.fixture(scope="module")
def shared(tiny_model, tmp_path_factory):
    return run_share(tiny_model, tmp_path_factory.mktemp("share"))


def test_engines_run_this_checkout(shared):
    root = Path(__file__).resolve().parents[2]
    assert shared["imported_from"] == [str(root)]
    adapter = root / "kvcached_vllm" / "src" / "kvcached_vllm"
    files = shared["kvcached_vllm_files"]
    assert len(files) == 2 and all(Path(f).resolve().parent == adapter for f in files), files


def test_b_burst_completes_without_preemption_because_a_gave_back(shared):
    a, b = shared["a"], shared["b"]
    assert shared["budget_respected"], shared["peak_mapped_bytes"]
    assert b["all_completed"] and b["preemptions"] == 0
    assert b["misses"] >= 1  # B did run short of budget ...
    assert a["given_back_bytes"] >= BUNDLE  # ... and A gave memory back
    assert a["mapped_after_b_bytes"] < a["mapped_before_b_bytes"]
    # Pages in use fell: A evicted cached blocks, it did not only drop its reserve.
    assert a["used_after_b_bytes"] < a["used_before_b_bytes"]
    assert a["giveback_ms_max"] < 200


def test_live_limit_reaches_an_idle_engine_and_lifting_restores_growth(shared):
    lim = shared["limit"]
    assert lim["reserved_limited_bytes"] == 0
    assert lim["used_limited_bytes"] < lim["used_before_bytes"]
    assert lim["used_limited_bytes"] + lim["reserved_limited_bytes"] <= lim["limit_bytes"]
    assert lim["applied_ms"] is not None and lim["applied_ms"] < 200  # within the limit by then
    assert lim["served_after_lift"]
    assert lim["used_after_lift_bytes"] > lim["limit_bytes"]  # grew past what the limit allowed
