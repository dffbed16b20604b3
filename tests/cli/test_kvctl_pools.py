"""kvctl list / limit against real shared-memory segments."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcached_core.ipc.shm import PoolSegment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kvctl(*args: str, shm_dir) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVCACHED_SHM_DIR=str(shm_dir), PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "kvcached_core.cli.kvctl", *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_list_shows_the_pool_and_limit_reaches_the_owner(tmp_path):
    seg = PoolSegment.create("engine-a", "kv0", capacity=8 << 30, directory=tmp_path)
    try:
        seg.update(used=3 << 20, reserved=2 << 20)
        listed = kvctl("list", "--json", shm_dir=tmp_path)
        assert listed.returncode == 0, listed.stderr
        pools = json.loads(listed.stdout)["pools"]
        assert [(p["namespace"], p["pool"], p["used"], p["limit"]) for p in pools] == [
            ("engine-a", "kv0", 3 << 20, None)]
        text = kvctl("list", shm_dir=tmp_path).stdout
        assert "engine-a" in text and "3.0 MiB" in text

        done = kvctl("limit", "engine-a", "kv0", "512M", shm_dir=tmp_path)
        assert done.returncode == 0, done.stderr
        assert seg.poll_limit() == 512 << 20  # the owner sees the new limit

        lifted = kvctl("limit", "engine-a", "kv0", "none", shm_dir=tmp_path)
        assert lifted.returncode == 0 and "limit none" in lifted.stdout
    finally:
        seg.close()


def test_limit_errors_name_the_value(tmp_path):
    bad_size = kvctl("limit", "engine-a", "kv0", "lots", shm_dir=tmp_path)
    assert bad_size.returncode == 2 and "SIZE='lots' is not a size" in bad_size.stderr
    missing = kvctl("limit", "no-such-engine", "kv0", "1G", shm_dir=tmp_path)
    assert missing.returncode == 2 and "no-such-engine" in missing.stderr
    for args in (("-5%",), ("-5%", "--json"), ("--json", "-1G")):  # sizes that look like options
        negative = kvctl("limit", "engine-a", "kv0", *args, shm_dir=tmp_path)
        size = next(a for a in args if a != "--json")
        assert negative.returncode == 2 and f"SIZE={size!r}" in negative.stderr, negative.stderr


def test_limit_beyond_the_range_is_an_error_not_a_traceback(tmp_path):
    seg = PoolSegment.create("engine-b", "kv0", capacity=8 << 30, directory=tmp_path)
    try:
        for size in ("100000000000T", "1" * 400, "1" * 400 + "G"):
            done = kvctl("limit", "engine-b", "kv0", size, shm_dir=tmp_path)
            assert done.returncode == 2, done.stderr
            assert "Traceback" not in done.stderr and "SIZE=" in done.stderr, done.stderr
        assert seg.poll_limit() is None  # nothing was written
    finally:
        seg.close()


def test_set_limit_refuses_values_beyond_int64(tmp_path):
    from kvcached_core.errors import KVCachedConfigError
    from kvcached_core.ipc.shm import set_limit

    seg = PoolSegment.create("engine-c", "kv0", capacity=8 << 30, directory=tmp_path)
    try:
        with pytest.raises(KVCachedConfigError, match="limit"):
            set_limit("engine-c", "kv0", 1 << 70, directory=tmp_path)
    finally:
        seg.close()
