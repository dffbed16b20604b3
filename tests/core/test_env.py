"""Environment-variable parsing (kvcached_core.env) and the error classes."""

from __future__ import annotations

import pytest

from kvcached_core import errors
from kvcached_core.env import KVCachedConfigError, env_bool, env_float, env_int, env_list


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("Yes", True),
        (" ON ", True),
        ("0", False),
        ("FALSE", False),
        ("no", False),
        ("off", False),
    ],
)
def test_env_bool_spellings(monkeypatch: pytest.MonkeyPatch, raw: str, expected: bool) -> None:
    monkeypatch.setenv("KVCACHED_ENABLED", raw)
    assert env_bool("KVCACHED_ENABLED", not expected) is expected


@pytest.mark.parametrize("raw", [None, "", "   "])
def test_env_bool_unset_or_blank_gives_default(
    monkeypatch: pytest.MonkeyPatch, raw: str | None
) -> None:
    if raw is None:
        monkeypatch.delenv("KVCACHED_ENABLED", raising=False)
    else:
        monkeypatch.setenv("KVCACHED_ENABLED", raw)
    assert env_bool("KVCACHED_ENABLED", True) is True
    assert env_bool("KVCACHED_ENABLED", False) is False


def test_env_bool_error_names_variable_and_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_ENABLED", "maybe")
    with pytest.raises(KVCachedConfigError) as info:
        env_bool("KVCACHED_ENABLED", True)
    assert str(info.value) == (
        "KVCACHED_ENABLED='maybe' is not a boolean (use 1/0/true/false/yes/no/on/off)"
    )
    assert isinstance(info.value, ValueError)


def test_env_int(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_int("KVCACHED_X", 7) == 7
    monkeypatch.setenv("KVCACHED_X", " -3 ")
    assert env_int("KVCACHED_X", 7) == -3
    with pytest.raises(KVCachedConfigError, match=r"KVCACHED_X=-3 is below the minimum 0"):
        env_int("KVCACHED_X", 7, minimum=0)
    monkeypatch.setenv("KVCACHED_X", "99")
    with pytest.raises(KVCachedConfigError, match=r"KVCACHED_X=99 is above the maximum 10"):
        env_int("KVCACHED_X", 7, maximum=10)
    monkeypatch.setenv("KVCACHED_X", "1.5")
    with pytest.raises(KVCachedConfigError, match=r"KVCACHED_X='1.5' is not an integer"):
        env_int("KVCACHED_X", 7)


def test_env_float(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_float("KVCACHED_F", 0.5) == 0.5
    monkeypatch.setenv("KVCACHED_F", "0.95")
    assert env_float("KVCACHED_F", 0.5, minimum=0.0, maximum=1.0) == 0.95
    for bad, message in [
        ("abc", "is not a finite number"),
        ("nan", "is not a finite number"),
        ("inf", "is not a finite number"),
        ("1.5", "above the maximum"),
    ]:
        monkeypatch.setenv("KVCACHED_F", bad)
        with pytest.raises(KVCachedConfigError, match=f"KVCACHED_F=.*{message}"):
            env_float("KVCACHED_F", 0.5, maximum=1.0)


def test_env_list(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_list("KVCACHED_L") == []
    assert env_list("KVCACHED_L", ["a"]) == ["a"]
    monkeypatch.setenv("KVCACHED_L", " a, b,,a ,c ")
    assert env_list("KVCACHED_L") == ["a", "b", "c"]
    monkeypatch.setenv("KVCACHED_L", " , ")
    assert env_list("KVCACHED_L") == []


def test_error_hierarchy() -> None:
    assert issubclass(errors.KVCachedConfigError, errors.KVCachedError)
    assert issubclass(errors.KVCachedConfigError, ValueError)
    assert issubclass(errors.PluginError, errors.KVCachedError)
    assert issubclass(errors.PatchError, errors.PluginError)
