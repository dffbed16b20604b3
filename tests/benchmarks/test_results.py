"""The committed benchmark results say how they were made and name no path of the machine
they ran on (``benchmarks/_timing.py`` writes them through ``portable``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

RESULTS = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "results").glob("*.json"))
#: A path under a home, work or temporary folder: a checkout, an output folder, a socket.
LOCAL_PATH = re.compile(r"(?<![\w.$])/(?:work|root|home|tmp|var/tmp)/")


def _strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_a_result_names_its_command_and_no_local_path(path):
    data = json.loads(path.read_text())
    runs = data.get("runs")  # a file gathering several runs: each says what made it
    runs = list(runs.values()) if isinstance(runs, dict) else runs
    made = [data] if data.get("command") or data.get("run") else runs or [data]
    assert all(r.get("command") or r.get("run") for r in made), \
        f"{path.name} does not say what made it"
    local = sorted({m for s in _strings(data) for m in re.findall(rf"{LOCAL_PATH.pattern}\S*", s)})
    assert not local, f"{path.name} names paths of the machine it ran on: {local[:5]}"


def test_the_check_finds_a_local_path():
    assert LOCAL_PATH.search("python bench.py --out /root/out/x.json")
    assert LOCAL_PATH.search('"/work/main/kvcached_core/__init__.py"')
    assert not LOCAL_PATH.search("$LOCAL/out/x.json $KVCACHED_IPC_DIR/g1 /usr/local/cuda")
