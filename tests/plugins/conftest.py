"""Fixtures for the plugin-framework tests.

``site`` builds real importable modules and real distributions (``*.dist-info``
with ``METADATA`` and ``entry_points.txt``) in a temporary directory put on
``sys.path``, so entry points and versions go through the real
:mod:`importlib.metadata`.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from kvcached_core.plugins import reset_bootstrap, reset_plugin_manager

REPO = Path(__file__).resolve().parents[2]


#: An engine package: ``kvt_engine`` with ``__version__`` and ``kvt_engine.core.Engine``.
ENGINE_CORE = """
    class Engine:
        def step(self):
            return "vanilla"

        def allocate(self, n):
            return ["block"] * n
"""

#: A kvcached plugin with an adapter for ``kvt_engine`` (versions ``>=1.0,<2``).
ADAPTER_PLUGIN = """
    from kvcached_core import hookimpl
    from kvcached_core.plugins import EngineAdapter, Patch, PatchSet

    def elastic(original):
        def step(self):
            return ("kvcached", original(self))
        return step

    def patch_sets(version):
        return PatchSet("kvt", [
            Patch("kvt_engine.core:Engine.step", versions=">=1.0", wrapper=elastic, name="elastic-step"),
            Patch("kvt_engine.core:Engine.allocate", versions=">=1.5",
                  replacement=lambda self, n: ["elastic"] * n, name="elastic-allocate"),
        ])

    @hookimpl
    def kvcached_engine_adapters():
        return [EngineAdapter(name="kvt", distributions=("kvt-engine", "kvt-engine-cpu"),
                              module="kvt_engine", versions=">=1.0,<2", patch_sets=patch_sets,
                              description="test engine", covered=("1.5.0", "1.0.0"))]
"""


class FakeSite:
    """A directory on ``sys.path`` holding modules and distributions written by a test."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.top_level: set[str] = set()

    def module(self, dotted: str, source: str = "") -> Path:
        """Write module ``dotted`` (packages on the way get an empty ``__init__.py``)."""
        parts = dotted.split(".")
        self.top_level.add(parts[0])
        directory = self.root
        for part in parts[:-1]:
            directory = directory / part
            directory.mkdir(exist_ok=True)
            init = directory / "__init__.py"
            if not init.exists():
                init.write_text("")
        path = directory / f"{parts[-1]}.py"
        if (directory / parts[-1]).is_dir():
            path = directory / parts[-1] / "__init__.py"
        path.write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        return path

    def package(self, dotted: str, source: str = "") -> Path:
        """Write package ``dotted`` with ``source`` as its ``__init__.py``."""
        (self.root / dotted.replace(".", "/")).mkdir(parents=True, exist_ok=True)
        return self.module(dotted, source)

    def distribution(
        self,
        name: str,
        version: str,
        entry_points: Mapping[str, Mapping[str, str]] | None = None,
    ) -> Path:
        """Write ``<name>-<version>.dist-info`` with metadata and entry points."""
        info = self.root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        if entry_points:
            lines = []
            for group, entries in entry_points.items():
                lines.append(f"[{group}]")
                lines.extend(f"{key} = {value}" for key, value in entries.items())
                lines.append("")
            (info / "entry_points.txt").write_text("\n".join(lines))
        importlib.invalidate_caches()
        return info

    def plugin(
        self, dist: str, name: str, module: str, source: str, version: str = "0.1.0"
    ) -> None:
        """A distribution ``dist`` whose ``kvcached.engines`` entry point ``name`` is ``module``."""
        self.module(module, source)
        self.distribution(dist, version, {"kvcached.engines": {name: module}})

    def install_engine(
        self,
        version: str = "1.2.0+cpu",
        dist: str | None = "kvt-engine-cpu",
        module_version: str | None = None,
    ) -> None:
        """Install the test engine ``kvt_engine`` (and, unless ``dist`` is None, a distribution)."""
        init = f"__version__ = {module_version!r}\n" if module_version else ""
        self.package("kvt_engine", init)
        self.module("kvt_engine.core", ENGINE_CORE)
        if dist is not None:
            self.distribution(dist, version)

    def install_adapter(
        self, dist: str = "kvcached-kvt", name: str = "kvt", module: str = "kvt_plugin"
    ) -> None:
        """Install the adapter plugin for the test engine."""
        self.plugin(dist, name, module, ADAPTER_PLUGIN)

    def forget_modules(self) -> None:
        """Drop every module imported from this site."""
        for name in list(sys.modules):
            if name.split(".")[0] in self.top_level:
                del sys.modules[name]
        importlib.invalidate_caches()

    def python(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """Run ``python *args`` in a fresh interpreter that sees this site, with extra ``env``."""
        return subprocess.run(
            [sys.executable, *args],
            env={**self.env(), **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    def env(self) -> dict[str, str]:
        """An environment for a subprocess that sees this site and the repository."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
        env["PYTHONPATH"] = os.pathsep.join([str(self.root), str(REPO)])
        return env


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No ``KVCACHED_*`` variable, no plugin manager and nothing bootstrapped, before and after."""
    for name in list(os.environ):
        if name.startswith("KVCACHED_"):
            monkeypatch.delenv(name)
    reset_bootstrap()
    reset_plugin_manager()
    yield
    reset_bootstrap()
    reset_plugin_manager()


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSite]:
    """A fresh :class:`FakeSite` on ``sys.path``."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    fake = FakeSite(root)
    yield fake
    reset_bootstrap()
    reset_plugin_manager()
    fake.forget_modules()


@pytest.fixture
def engine_site(site: FakeSite) -> FakeSite:
    """A site with the test engine 1.2.0+cpu (as ``kvt-engine-cpu``) and its adapter plugin."""
    site.install_engine()
    site.install_adapter()
    return site
