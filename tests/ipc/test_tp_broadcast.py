"""TP=2: one scheduler drives two worker processes through cross-process map/unmap.

Each worker owns one device (rank ``r`` on ``cuda:{r % GPUs}``, or the host
backend for ``cpu``) and elastic K/V tensors there; the scheduler (this
process) maps pages on both through a :class:`WorkerGroup`, then has each
rank run kernels over its shard through those tensors. The ``cuda`` variant
runs with ``pytest -m gpu`` on a GPU machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from kvcached_core.errors import WorkerError  # noqa: E402
from kvcached_core.ipc import WorkerGroup  # noqa: E402
from kvcached_testing.tp_worker import GROUP, TPWorkers, expected, start_workers  # noqa: E402

TIMEOUT_S = 2.0  # per broadcast: a dead worker must be reported well within 3 s
PAGES = [0, 1, 2, 5, 17, 40, 63]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def tp(request: pytest.FixtureRequest) -> Iterator[TPWorkers]:
    """Two TP workers of one device kind, shared by the module's tests."""
    base = tempfile.mkdtemp(prefix="kvtp-", dir="/tmp")  # 0700, short for socket paths
    workers = start_workers(2, request.param, base)
    yield workers
    workers.shutdown()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def group(tp: TPWorkers) -> Iterator[WorkerGroup]:
    with WorkerGroup(tp.paths, timeout=TIMEOUT_S, connect_timeout=10) as g:
        yield g


def test_ranks_get_their_devices(tp: TPWorkers) -> None:
    if tp.devices[0] == "cpu":
        assert tp.devices == ["cpu", "cpu"]
    else:
        import torch

        n = torch.cuda.device_count()
        assert tp.devices == [f"cuda:{r % n}" for r in range(2)]


def test_map_compute_unmap_on_both_ranks(tp: TPWorkers, group: WorkerGroup) -> None:
    assert group.query(GROUP) == [[], []]
    group.map(GROUP, PAGES)
    assert group.query(GROUP) == [PAGES, PAGES]  # every page, on both ranks
    assert group.query(GROUP, [3, 5, 63]) == [[5, 63], [5, 63]]

    for rank in (0, 1):
        tp.compute(rank, "write", PAGES)
    results = [tp.compute(rank, "read", PAGES) for rank in (0, 1)]
    for rank, got in enumerate(results):
        assert got == expected(rank, PAGES), f"rank {rank} read back the wrong shard"
    assert results[0]["sums"] != results[1]["sums"]  # each rank has its own shard

    sub = PAGES[2:5]  # a second read of part of the shard: still intact
    assert tp.compute(1, "read", sub) == expected(1, sub)
    with pytest.raises(RuntimeError, match=r"pages \[3\] are not mapped"):
        tp.compute(0, "read", [3])

    group.unmap(GROUP, PAGES)
    assert group.query(GROUP) == [[], []]
    with pytest.raises(RuntimeError, match="not mapped"):
        tp.compute(1, "write", PAGES[:1])

    group.map(GROUP, PAGES[:2])  # pages come back (from the pool) and work again
    for rank in (0, 1):
        tp.compute(rank, "write", PAGES[:2])
        assert tp.compute(rank, "read", PAGES[:2]) == expected(rank, PAGES[:2])
    group.unmap(GROUP, PAGES[:2])
    assert group.query(GROUP) == [[], []]


def test_killed_worker_is_reported_within_the_timeout(tp: TPWorkers, group: WorkerGroup) -> None:
    """Last in the module: it kills rank 1 of the shared workers."""
    group.map(GROUP, [7])
    tp.kill(1)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        group.map(GROUP, [8])
    elapsed = time.monotonic() - t0
    assert elapsed < 3.0, f"the failure took {elapsed:.2f} s to surface"
    err = info.value
    assert err.rank == 1 and err.path == tp.paths[1] and "rank 1" in str(err)
    assert err.succeeded == ((0, 0),)  # rank 0 mapped page 8: the caller rolls it back
    with WorkerGroup(tp.paths[:1], timeout=TIMEOUT_S, connect_timeout=10) as rank0:
        rank0.unmap(GROUP, [7, 8])
        assert rank0.query(GROUP) == [[]]
    assert os.path.exists(tp.paths[0])
