"""Every numeric setting is range-checked: a value outside its range, a
non-finite or an overflowing one is a KVCachedConfigError naming the variable
and the value, never an OverflowError or TypeError later."""

from __future__ import annotations

import pytest

from kvcached_core.allocator import KVLayout, KVTensors, PageAllocator
from kvcached_core.config import (
    DEFAULT_IPC_TIMEOUT_S,
    RANGES,
    env_setting,
    load_settings,
    max_cached_tokens,
    parse_size,
)
from kvcached_core.errors import KVCachedConfigError
from kvcached_core.ipc.broadcast import WorkerGroup

HUGE = "9" * 300
PAGE = 64 << 10


def _read(var: str) -> None:
    """Read the setting ``var`` the way kvcached does."""
    if var == "KVCACHED_MAX_CACHED_TOKENS":
        max_cached_tokens()
    elif var.startswith("KVCACHED_IPC_"):
        env_setting(var, DEFAULT_IPC_TIMEOUT_S)
    else:
        load_settings()


def _bad_values(var: str) -> list[str]:
    lo, hi = RANGES[var]
    values = [HUGE, "-" + HUGE, "1e400", "inf", "-inf", "nan", str(hi * 10 + 1)]
    if lo is not None:
        values.append(str(lo - 1))
    return values


@pytest.mark.parametrize("var", sorted(RANGES))
def test_every_out_of_range_value_names_the_variable_and_value(monkeypatch, var):
    for value in _bad_values(var):
        monkeypatch.setenv(var, value)
        with pytest.raises(KVCachedConfigError) as err:
            _read(var)
        text = str(err.value)
        assert var in text, text
        assert value[:20] in text, text
        assert len(text) < 400, "a huge value is abbreviated in the message"


@pytest.mark.parametrize("var", sorted(RANGES))
def test_range_ends_are_accepted(monkeypatch, var):
    lo, hi = RANGES[var]
    for value in (lo, hi):
        if var == "KVCACHED_MEMORY_LIMIT":
            value = str(value)
        monkeypatch.setenv(var, str(value))
        if var == "KVCACHED_MIN_RESERVED_PAGES":
            monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", str(hi))
        if var == "KVCACHED_MAX_RESERVED_PAGES":
            monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
        _read(var)


@pytest.mark.parametrize(
    "var, value",
    [
        ("KVCACHED_MEMORY_LIMIT", "1" * 400),
        ("KVCACHED_MEMORY_LIMIT", "1" * 400 + "T"),
        ("KVCACHED_PAGE_SIZE_MB", "99999999999999999999"),
        ("KVCACHED_IDLE_TRIM_S", "1e10"),
    ],
)
def test_issue_values_are_config_errors(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(KVCachedConfigError, match=var):
        load_settings()


@pytest.mark.parametrize("var", ["KVCACHED_IPC_TIMEOUT_S", "KVCACHED_IPC_CONNECT_TIMEOUT_S"])
def test_ipc_timeouts_are_bounded(monkeypatch, var):
    monkeypatch.setenv(var, "1e10")
    with pytest.raises(KVCachedConfigError, match=var + "=1e"):
        WorkerGroup(["/tmp/kvcached-no-such.sock"])


@pytest.mark.parametrize("kw", ["timeout", "connect_timeout"])
def test_explicit_ipc_timeouts_are_bounded(kw):
    for bad in (1e10, float("inf"), float("nan"), -1.0):
        with pytest.raises(KVCachedConfigError, match=kw):
            WorkerGroup(["/tmp/kvcached-no-such.sock"], **{kw: bad})


def test_an_explicit_idle_trim_beyond_the_range_is_refused():
    kv = KVTensors.open("cpu", KVLayout(1, 4 * PAGE, PAGE, 1, False))
    for bad in (1e10, float("inf"), float("nan")):
        with pytest.raises(KVCachedConfigError, match="idle_trim_s"):
            PageAllocator(kv, idle_trim_s=bad)


@pytest.mark.parametrize("text", ["1" * 400, "1" * 400 + "T", "100000000000T", "1e3", "inf"])
def test_sizes_beyond_the_range_are_config_errors(text):
    with pytest.raises(KVCachedConfigError, match="SIZE="):
        parse_size(text, "SIZE")


def test_sizes_keep_exact_integers():
    assert parse_size(str((1 << 53) + 1)) == (1 << 53) + 1
    assert parse_size("0.5K") == 512
    assert parse_size("1.5GiB") == 3 << 29
