"""Deferred patches: applied when their module is first imported, all or nothing for the set."""

from __future__ import annotations

import inspect
import logging
import sys
from typing import TYPE_CHECKING

import pytest

from kvcached_core.errors import PatchError
from kvcached_core.plugins import Patch, PatchSet, bootstrap, bootstrap_results, import_hooks

if TYPE_CHECKING:
    from tests.plugins.conftest import FakeSite

RUNNER = """
    class Runner:
        def allocate(self):
            return "vanilla"
"""
SCHEDULER = """
    class Scheduler:
        def schedule(self):
            return "vanilla"
"""


def _tag(original):
    def method(self):
        return ("kvcached", original(self))

    return method


def _two_sides(site: FakeSite) -> tuple[Patch, Patch]:
    """A scheduler module (imported now) and a runner module (not imported yet)."""
    site.module("kvt_deferred.scheduler", SCHEDULER)
    site.module("kvt_deferred.runner", RUNNER)
    import kvt_deferred.scheduler  # noqa: F401

    return (
        Patch("kvt_deferred.scheduler:Scheduler.schedule", wrapper=_tag, name="sched",
              deferred=True),
        Patch("kvt_deferred.runner:Runner.allocate", wrapper=_tag, name="runner", deferred=True),
    )


def test_a_deferred_patch_waits_for_its_module_and_lands_on_import(
    site: FakeSite, caplog: pytest.LogCaptureFixture
) -> None:
    sched, runner = _two_sides(site)
    patch_set = PatchSet("kvt", [sched, runner])
    result = patch_set.apply("1.0")
    assert result.status == "applied"
    assert result.applied == ("sched",) and result.deferred == ("runner",)
    assert "kvt_deferred.runner" not in sys.modules  # applying imported nothing
    assert [p.verdict for p in patch_set.plan("1.0")] == ["applied", "deferred"]
    assert import_hooks.pending_modules() == ["kvt_deferred.runner"]

    with caplog.at_level(logging.INFO, logger="kvcached"):
        from kvt_deferred.runner import Runner
    assert Runner().allocate() == ("kvcached", "vanilla")
    assert patch_set.result is not None
    assert patch_set.result.applied == ("sched", "runner") and patch_set.result.deferred == ()
    assert "deferred patches applied on import of kvt_deferred.runner" in caplog.text
    assert import_hooks.pending_modules() == []

    module = sys.modules["kvt_deferred.runner"]  # the engine's own loader stays in place
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert module.__spec__.loader is module.__loader__
    assert "class Runner" in inspect.getsource(module)

    assert patch_set.revert().restored == ("runner", "sched")
    assert Runner().allocate() == "vanilla"


def test_a_module_already_imported_is_patched_at_once(site: FakeSite) -> None:
    sched, _ = _two_sides(site)
    patch_set = PatchSet("kvt", [sched])
    assert patch_set.apply("1.0").applied == ("sched",)
    assert import_hooks.pending_modules() == []
    patch_set.revert()


def test_revert_before_the_import_cancels_the_wait(site: FakeSite) -> None:
    sched, runner = _two_sides(site)
    patch_set = PatchSet("kvt", [sched, runner])
    patch_set.apply("1.0")
    assert patch_set.revert().restored == ("sched",)
    assert import_hooks.pending_modules() == []
    from kvt_deferred.runner import Runner

    assert Runner().allocate() == "vanilla"


def test_a_deferred_failure_rolls_the_whole_set_back(
    site: FakeSite, caplog: pytest.LogCaptureFixture
) -> None:
    sched, _ = _two_sides(site)
    broken = Patch("kvt_deferred.runner:Runner.missing", wrapper=_tag, name="broken",
                   deferred=True)
    patch_set = PatchSet("kvt", [sched, broken])
    assert patch_set.apply("1.0", strict=False).deferred == ("broken",)
    from kvt_deferred.scheduler import Scheduler

    assert Scheduler().schedule() == ("kvcached", "vanilla")
    with caplog.at_level(logging.WARNING, logger="kvcached"):
        from kvt_deferred.runner import Runner  # the import itself still works
    assert Runner().allocate() == "vanilla"
    assert Scheduler().schedule() == "vanilla"  # rolled back: the process runs vanilla
    result = patch_set.result
    assert result is not None and result.status == "failed" and not patch_set.is_applied
    assert result.rolled_back == ("sched",)
    assert result.failed[0][0] == "broken" and "does not exist" in result.failed[0][1]
    assert "engine left vanilla" in caplog.text


def test_strict_makes_the_import_fail_loudly(site: FakeSite) -> None:
    sched, _ = _two_sides(site)
    broken = Patch("kvt_deferred.runner:Runner.missing", wrapper=_tag, name="broken",
                   deferred=True)
    patch_set = PatchSet("kvt", [sched, broken])
    patch_set.apply("1.0", strict=True)
    with pytest.raises(PatchError, match="'broken'.*KVCACHED_STRICT=1 refuses"):
        import kvt_deferred.runner  # noqa: F401
    assert "kvt_deferred.runner" not in sys.modules
    from kvt_deferred.scheduler import Scheduler

    assert Scheduler().schedule() == "vanilla"


def test_bootstrap_reports_deferred_patches_as_they_land(site: FakeSite) -> None:
    site.install_engine()
    site.module("kvt_engine.worker", RUNNER)
    site.plugin("kvcached-kvt", "kvt", "kvt_plugin", """
        from kvcached_core import hookimpl
        from kvcached_core.plugins import EngineAdapter, Patch

        def tag(original):
            return lambda self: ("kvcached", original(self))

        def patch_sets(version):
            return [Patch("kvt_engine.core:Engine.step", wrapper=tag, name="step"),
                    Patch("kvt_engine.worker:Runner.allocate", wrapper=tag, name="worker",
                          deferred=True)]

        @hookimpl
        def kvcached_engine_adapters():
            return EngineAdapter(name="kvt", distributions=("kvt-engine-cpu",),
                                 module="kvt_engine", versions=">=1.0,<2", patch_sets=patch_sets)
    """)
    first = bootstrap("kvt")
    assert first.active and first.patch_set.deferred == ("worker",)
    assert "kvt_engine.worker" not in sys.modules
    from kvt_engine.worker import Runner

    assert Runner().allocate() == ("kvcached", "vanilla")
    now = bootstrap_results()["kvt"]
    assert now.active and now.patch_set.applied == ("step", "worker")
    assert now.patch_set.deferred == ()
    assert bootstrap("kvt").patch_set == now.patch_set


def test_a_process_that_never_imports_the_module_never_loads_it(site: FakeSite) -> None:
    _two_sides(site)
    code = (
        "import sys\n"
        "from kvcached_core.plugins import Patch, PatchSet\n"
        "p = Patch('kvt_deferred.runner:Runner.allocate', replacement=lambda s: 1, deferred=True)\n"
        "r = PatchSet('kvt', [p]).apply('1.0')\n"
        "print(r.status, r.deferred, 'kvt_deferred.runner' in sys.modules)\n"
    )
    proc = site.python("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0] == "applied ('kvt_deferred.runner:Runner.allocate',) False"
