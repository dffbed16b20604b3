"""The original kvcached's environment variables: each honoured with its meaning, or rejected.

Every variable the original kvcached read (its design notes, section 5, plus its
build-time ones) is listed here; the tests go through the real readers: the
engine bootstrap (a real plugin and engine from the ``engine_site`` fixture),
``load_settings``, the IPC timeout reader, the IPC namespace and setup.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvcached_core import legacy_env
from kvcached_core.config import env_setting, load_settings
from kvcached_core.env import env_bool
from kvcached_core.errors import KVCachedConfigError
from kvcached_core.ipc import paths
from kvcached_core.plugins import bootstrap

if TYPE_CHECKING:
    from tests.plugins.conftest import FakeSite

REPO = Path(__file__).resolve().parents[2]

#: Every user-facing variable of the original kvcached (runtime, then build time).
ORIGINAL_RUNTIME = (
    "ENABLE_KVCACHED", "KVCACHED_AUTOPATCH", "KVCACHED_PAGE_SIZE_MB", "KVCACHED_CONTIGUOUS_LAYOUT",
    "KVCACHED_PAGE_PREALLOC_ENABLED", "KVCACHED_MIN_RESERVED_PAGES", "KVCACHED_MAX_RESERVED_PAGES",
    "KVCACHED_GPU_UTILIZATION", "KVCACHED_MAX_CACHED_TOKENS", "KVCACHED_MAX_CACHED_BLOCKS",
    "KVCACHED_SANITY_CHECK", "KVCACHED_IPC_NAME", "KVCACHED_IPC_TIMEOUT", "KVCACHED_LOG_LEVEL",
    "KVCACHED_LOG_COLOR", "KVCACHED_LOG_COLOR_CODE", "KVCACHED_NIXL_CONTIGUOUS_LAYOUT",
)
ORIGINAL_BUILD = ("KVCACHED_USE_CUDA", "KVCACHED_USE_HIP", "KVCACHED_BACKEND")


@pytest.fixture(autouse=True)
def no_original_variables(monkeypatch: pytest.MonkeyPatch):
    """The plugin conftest clears KVCACHED_*; the original's names without that prefix too."""
    monkeypatch.delenv("ENABLE_KVCACHED", raising=False)
    level = logging.getLogger("kvcached").level
    yield
    logging.getLogger("kvcached").setLevel(level)


def test_every_original_variable_is_handled_somewhere():
    aliased = {a.old for aliases in legacy_env.ALIASES.values() for a in aliases}
    handled = aliased | set(legacy_env.SAME_NAME) | set(legacy_env.REJECTED)
    assert [name for name in ORIGINAL_RUNTIME if name not in handled] == []
    setup_py = (REPO / "setup.py").read_text()
    assert [name for name in ORIGINAL_BUILD if f'"{name}"' not in setup_py] == []


# --- ENABLE_KVCACHED / KVCACHED_AUTOPATCH -> KVCACHED_ENABLED ---------------------------------

@pytest.mark.parametrize("name", ["ENABLE_KVCACHED", "KVCACHED_AUTOPATCH"])
def test_original_off_switch_leaves_the_engine_vanilla(engine_site: FakeSite, monkeypatch, name):
    monkeypatch.setenv(name, "false")
    result = bootstrap("kvt")
    assert result.status == "disabled" and not result.active
    assert name in result.reason
    from kvt_engine.core import Engine
    assert Engine().step() == "vanilla"


def test_original_on_switches_keep_kvcached_on(engine_site: FakeSite, monkeypatch):
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.setenv("KVCACHED_AUTOPATCH", "1")
    assert bootstrap("kvt").status == "applied"


def test_either_original_switch_off_is_off(monkeypatch):
    # The original patched only with both on.
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.setenv("KVCACHED_AUTOPATCH", "0")
    assert env_bool("KVCACHED_ENABLED", True) is False


def test_original_switch_that_disagrees_with_the_new_one_is_an_error(engine_site, monkeypatch):
    monkeypatch.setenv("ENABLE_KVCACHED", "false")
    monkeypatch.setenv("KVCACHED_ENABLED", "1")
    with pytest.raises(KVCachedConfigError, match=r"ENABLE_KVCACHED='false' \(the original kvcached's "
                       r"name for KVCACHED_ENABLED\) disagrees with KVCACHED_ENABLED='1'"):
        bootstrap("kvt")


def test_original_switch_that_agrees_with_the_new_one_is_fine(monkeypatch):
    monkeypatch.setenv("ENABLE_KVCACHED", "no")
    monkeypatch.setenv("KVCACHED_ENABLED", "off")
    assert env_bool("KVCACHED_ENABLED", True) is False


def test_malformed_original_switch_names_itself(engine_site, monkeypatch):
    monkeypatch.setenv("ENABLE_KVCACHED", "maybe")
    with pytest.raises(KVCachedConfigError, match=r"ENABLE_KVCACHED='maybe' is not a boolean"):
        bootstrap("kvt")


# --- KVCACHED_PAGE_PREALLOC_ENABLED -> KVCACHED_PREALLOC --------------------------------------

def test_page_prealloc_enabled_is_prealloc(monkeypatch):
    assert load_settings().prealloc is True
    monkeypatch.setenv("KVCACHED_PAGE_PREALLOC_ENABLED", "false")
    assert load_settings().prealloc is False
    monkeypatch.setenv("KVCACHED_PAGE_PREALLOC_ENABLED", "sometimes")
    with pytest.raises(KVCachedConfigError, match=r"KVCACHED_PAGE_PREALLOC_ENABLED='sometimes'"):
        load_settings()


# --- KVCACHED_IPC_TIMEOUT -> KVCACHED_IPC_TIMEOUT_S ---------------------------------------------

def test_ipc_timeout_is_the_bound_in_seconds(monkeypatch):
    monkeypatch.setenv("KVCACHED_IPC_TIMEOUT", "7.5")
    assert env_setting("KVCACHED_IPC_TIMEOUT_S", 60.0) == 7.5


@pytest.mark.parametrize("value", ["0", "-1"])
def test_ipc_timeout_without_a_bound_is_rejected_naming_the_new_setting(monkeypatch, value):
    monkeypatch.setenv("KVCACHED_IPC_TIMEOUT", value)
    with pytest.raises(KVCachedConfigError, match=rf"KVCACHED_IPC_TIMEOUT={value}: .*KVCACHED_IPC_TIMEOUT_S"):
        env_setting("KVCACHED_IPC_TIMEOUT_S", 60.0)


def test_ipc_timeout_out_of_range_names_the_original_variable(monkeypatch):
    monkeypatch.setenv("KVCACHED_IPC_TIMEOUT", "100000")
    with pytest.raises(KVCachedConfigError, match=r"^KVCACHED_IPC_TIMEOUT \(the original .* above the maximum"):
        env_setting("KVCACHED_IPC_TIMEOUT_S", 60.0)


# --- the same names -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, value, field, expected", [
    ("KVCACHED_PAGE_SIZE_MB", "4", "page_size", 4 << 20),
    ("KVCACHED_CONTIGUOUS_LAYOUT", "true", "contiguous_layout", True),
    ("KVCACHED_MIN_RESERVED_PAGES", "5", "min_reserved_pages", 5),
    ("KVCACHED_MAX_RESERVED_PAGES", "10", "max_reserved_pages", 10),
    ("KVCACHED_GPU_UTILIZATION", "0.9", "gpu_utilization", 0.9),
])
def test_same_name_settings_keep_their_meaning(monkeypatch, name, value, field, expected):
    monkeypatch.setenv(name, value)
    assert getattr(load_settings(), field) == expected


def test_same_name_max_cached_tokens_and_ipc_name(monkeypatch):
    from kvcached_core.config import max_cached_tokens

    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", "16000")
    assert max_cached_tokens() == 16000
    monkeypatch.setenv("KVCACHED_IPC_NAME", "kvcached_vLLM_1234")
    assert paths.namespace() == "kvcached_vLLM_1234"


def test_log_level_sets_the_kvcached_logger(monkeypatch):
    monkeypatch.setenv("KVCACHED_LOG_LEVEL", "DEBUG")
    legacy_env.check_environment()
    assert logging.getLogger("kvcached").level == logging.DEBUG
    monkeypatch.setenv("KVCACHED_LOG_LEVEL", "loud")
    with pytest.raises(KVCachedConfigError, match=r"KVCACHED_LOG_LEVEL='loud' is not a log level"):
        load_settings()


def test_sanity_check_on_is_what_happens_anyway_and_off_is_rejected(monkeypatch):
    monkeypatch.setenv("KVCACHED_SANITY_CHECK", "1")
    load_settings()
    monkeypatch.setenv("KVCACHED_SANITY_CHECK", "0")
    with pytest.raises(KVCachedConfigError, match=r"KVCACHED_SANITY_CHECK='0': .*unset KVCACHED_SANITY_CHECK"):
        load_settings()


# --- rejected ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, new", [
    ("KVCACHED_MAX_CACHED_BLOCKS", "KVCACHED_MAX_CACHED_TOKENS"),
    ("KVCACHED_LOG_COLOR", "KVCACHED_LOG_LEVEL"),
    ("KVCACHED_LOG_COLOR_CODE", "KVCACHED_LOG_LEVEL"),
    ("KVCACHED_NIXL_CONTIGUOUS_LAYOUT", "KVCACHED_CONTIGUOUS_LAYOUT"),
])
def test_variables_without_an_equivalent_stop_the_engine_naming_the_new_setting(
        engine_site: FakeSite, monkeypatch, name, new):
    monkeypatch.setenv(name, "1")
    with pytest.raises(KVCachedConfigError, match=rf"^{name}='1' .*{new}"):
        bootstrap("kvt")
    with pytest.raises(KVCachedConfigError, match=rf"^{name}='1' .*{new}"):
        load_settings()


@pytest.mark.parametrize("name", ORIGINAL_BUILD)
def test_build_variables_are_rejected_naming_kvcached_backends(name):
    env = {k: v for k, v in os.environ.items() if k not in ORIGINAL_BUILD}
    env[name] = "1"
    result = subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"{name}='1'" in result.stderr and "KVCACHED_BACKENDS" in result.stderr
