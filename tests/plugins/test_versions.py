"""Engine version detection and the version matrix."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from hypothesis import given
from hypothesis import strategies as st
from packaging.version import Version

from kvcached_core.errors import KVCachedConfigError, PluginError
from kvcached_core.plugins import (
    EngineAdapter,
    detect_engine_version,
    parse_specifier,
    version_matches,
)
from kvcached_core.plugins.versions import override_variable, parse_version

if TYPE_CHECKING:
    from tests.plugins.conftest import FakeSite


@pytest.mark.parametrize(
    ("version", "specifier", "inside"),
    [
        # local labels are ignored by ranges
        ("0.32.0+cpu", ">=0.27.1,<=0.32.0", True),
        ("0.32.0+cpu", ">=0.27.1,<0.32.0", False),
        ("2.13.0+cpu", ">=2.13", True),
        ("2.13.0+cpu", "==2.13.0", True),
        ("2.13.0+cpu", "<2.13.0", False),
        # pre-releases are included, ordered before their release
        ("0.10.0rc1", ">0.9.2", True),
        ("0.10.0rc1", ">=0.10.0", False),
        ("0.10.0rc1", ">=0.10.0rc1", True),
        ("0.10.0rc1", "<0.11", True),
        # PEP 440: <V excludes V's own pre-releases, so ``<0.10.0`` and
        # ``>=0.10.0`` both leave 0.10.0rc1 out; ``.dev0`` bounds tile the line
        ("0.10.0rc1", ">=0.9,<0.10.0", False),
        ("0.33.0rc1", "<0.33", False),
        ("0.10.0rc1", ">=0.9.0.dev0,<0.10.0.dev0", False),
        ("0.10.0rc1", ">=0.10.0.dev0,<0.11.0.dev0", True),
        # post-releases
        ("0.8.5.post1", ">=0.8.5", True),
        ("0.8.5.post1", "<=0.8.5", False),
        ("0.8.5.post1", ">0.8.5", False),  # PEP 440: >V excludes V's post-releases
        ("0.8.5.post1", ">0.8.4,<0.9.0", True),
        # dev builds sort before their release
        ("0.19.2.dev0+gabc", ">=0.19.2", False),
        ("0.19.2.dev0+gabc", ">=0.19.2.dev0", True),
        ("0.19.2.dev0+gabc", ">=0.19.1,<0.19.2", False),
        ("0.19.2.dev0+gabc", ">=0.19.1,<0.19.2.dev0", False),
        ("0.19.2.dev0+gabc", ">=0.19.2.dev0,<0.20.0.dev0", True),
        # an empty specifier matches everything
        ("0.10.0rc1", "", True),
        ("1!0.1", "", True),
    ],
)
def test_version_matrix(version: str, specifier: str, inside: bool) -> None:
    assert version_matches(specifier, version) is inside
    assert version_matches(parse_specifier(specifier), Version(version)) is inside


_releases = st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3))
_suffixes = st.sampled_from(["", "rc1", "a0", ".post1", ".dev0", ".post2.dev1"])
_locals = st.sampled_from(["", "+cpu", "+cu121", "+gabc.d20240101"])


def _text(release: tuple[int, int, int], suffix: str) -> str:
    return ".".join(map(str, release)) + suffix


@given(_releases, _suffixes, _locals, _releases, _suffixes)
def test_inclusive_bounds_follow_pep440_order(
    release: tuple[int, int, int],
    suffix: str,
    local: str,
    bound: tuple[int, int, int],
    bound_suffix: str,
) -> None:
    version = Version(_text(release, suffix) + local)
    limit = Version(_text(bound, bound_suffix))
    public = Version(version.public)
    assert version_matches(f">={limit}", version) is (public >= limit)
    assert version_matches(f"<={limit}", version) is (public <= limit)


def test_parse_errors_quote_the_text() -> None:
    with pytest.raises(ValueError, match=r"invalid version specifier '>=1.0,<<2'"):
        parse_specifier(">=1.0,<<2")
    with pytest.raises(ValueError, match=r"invalid version 'one.two'"):
        parse_version("one.two")


def test_adapter_rejects_malformed_specifier() -> None:
    with pytest.raises(
        PluginError, match=r"engine adapter 'x': invalid version specifier '>=1,<<2'"
    ):
        EngineAdapter(
            name="x",
            distributions=("x",),
            module="x",
            versions=">=1,<<2",
            patch_sets=lambda v: None,
        )


def test_override_variable_name() -> None:
    assert override_variable("vllm") == "KVCACHED_VLLM_VERSION"
    assert override_variable("my-engine.v2") == "KVCACHED_MY_ENGINE_V2_VERSION"


def test_detect_from_second_distribution_name(site: FakeSite) -> None:
    site.install_engine(version="0.32.0+cpu", dist="kvt-engine-cpu", module_version="9.9.9")
    found = detect_engine_version("kvt", "kvt_engine", ("kvt-engine", "kvt-engine-cpu"))
    assert found.version == Version("0.32.0+cpu")
    assert found.source == "distribution kvt-engine-cpu"
    assert found.known and str(found) == "0.32.0+cpu"


def test_detect_falls_back_to_module_version(site: FakeSite) -> None:
    site.install_engine(dist=None, module_version="0.8.5.post1")
    found = detect_engine_version("kvt", "kvt_engine", ("kvt-engine", "kvt-engine-cpu"))
    assert found.version == Version("0.8.5.post1")
    assert found.source == "module kvt_engine.__version__"


def test_detect_without_import_does_not_import(site: FakeSite) -> None:
    import sys

    site.install_engine(dist=None, module_version="1.0")
    found = detect_engine_version("kvt", "kvt_engine", ("kvt-engine",), import_module=False)
    assert not found.known
    assert "not imported" in found.note
    assert "kvt_engine" not in sys.modules


def test_source_tree_placeholder_is_unknown_and_says_so(site: FakeSite) -> None:
    site.install_engine(dist=None, module_version="0.0.0.dev0")
    found = detect_engine_version("kvt", "kvt_engine", ("kvt-engine",))
    assert found.version is None
    assert found.raw == "0.0.0.dev0"
    assert "placeholder" in found.note
    assert "KVCACHED_KVT_VERSION" in found.note
    assert found.to_dict()["known"] is False


def test_placeholder_metadata_falls_through_to_module(site: FakeSite) -> None:
    site.install_engine(version="0.0.0.dev0", dist="kvt-engine", module_version="0.5.12")
    found = detect_engine_version("kvt", "kvt_engine", ("kvt-engine",))
    assert found.version == Version("0.5.12")
    assert found.source == "module kvt_engine.__version__"
    assert "distribution kvt-engine reports '0.0.0.dev0', a placeholder" in found.note


def test_invalid_module_version_is_unknown(site: FakeSite) -> None:
    site.install_engine(dist=None, module_version="not a version")
    found = detect_engine_version("kvt", "kvt_engine", ())
    assert found.version is None
    assert "not a PEP 440 version" in found.note


def test_nothing_installed() -> None:
    found = detect_engine_version("kvt", "kvt_missing_module", ("kvt-missing",))
    assert found.version is None
    assert "no distribution installed among (kvt-missing)" in found.note
    assert "cannot be imported" in found.note


def test_environment_states_the_version(site: FakeSite, monkeypatch: pytest.MonkeyPatch) -> None:
    site.install_engine(dist=None, module_version="0.0.0.dev0")
    monkeypatch.setenv("KVCACHED_KVT_VERSION", "0.5.12rc1")
    found = detect_engine_version("kvt", "kvt_engine", ())
    assert found.version == Version("0.5.12rc1")
    assert found.source == "env KVCACHED_KVT_VERSION"
    monkeypatch.setenv("KVCACHED_KVT_VERSION", "soon")
    with pytest.raises(
        KVCachedConfigError, match=r"KVCACHED_KVT_VERSION='soon' is not a valid version"
    ):
        detect_engine_version("kvt", "kvt_engine", ())
