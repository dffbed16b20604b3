"""Patch records and all-or-nothing, reversible patch sets, on real classes and modules."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from kvcached_core.errors import PatchError
from kvcached_core.plugins import Patch, PatchSet, active_patches, parse_target

if TYPE_CHECKING:
    from tests.plugins.conftest import FakeSite

HERE = __name__


class Base:
    def greet(self) -> str:
        return "base"

    @staticmethod
    def shout(text: str) -> str:
        return text.upper()


class Engine(Base):
    limit = 10

    def step(self) -> str:
        return "vanilla"

    @staticmethod
    def util(x: int) -> int:
        return x

    @classmethod
    def make(cls) -> Engine:
        return cls()

    @property
    def size(self) -> int:
        return 1


def module_func() -> str:
    return "original"


def _snapshot() -> dict[str, Any]:
    return {
        "Engine": dict(Engine.__dict__),
        "Base": dict(Base.__dict__),
        "module_func": module_func,
    }


@pytest.fixture
def sets() -> Iterator[Callable[..., PatchSet]]:
    """Make patch sets that are reverted after the test, and check the module is pristine."""
    before = _snapshot()
    made: list[PatchSet] = []

    def make(*patches: Patch, **kwargs: Any) -> PatchSet:
        patch_set = PatchSet("kvt", patches, **kwargs)
        made.append(patch_set)
        return patch_set

    yield make
    for patch_set in reversed(made):
        patch_set.revert()
    assert _snapshot() == before


def _wrap_step(original: Callable[[Engine], str]) -> Callable[[Engine], tuple[str, str]]:
    def step(self: Engine) -> tuple[str, str]:
        return ("kvcached", original(self))

    return step


def _all_kinds() -> list[Patch]:
    return [
        Patch(f"{HERE}:Engine.step", wrapper=_wrap_step, name="step"),
        Patch(f"{HERE}:Engine.util", replacement=lambda x: x * 2, name="util"),
        Patch(
            f"{HERE}:Engine.make", wrapper=lambda orig: lambda cls: ("made", orig(cls)), name="make"
        ),
        Patch(f"{HERE}:Engine.greet", replacement=lambda self: "elastic", name="inherited"),
        Patch(
            f"{HERE}:Engine.shout",
            wrapper=lambda orig: lambda t: orig(t) + "!",
            name="inherited-static",
        ),
        Patch(f"{HERE}:Engine.limit", replacement=99, name="limit"),
        Patch(
            f"{HERE}:Engine.size",
            wrapper=lambda prop: property(lambda self: prop.fget(self) + 1),
            name="size",
        ),
        Patch(f"{HERE}:module_func", replacement=lambda: "patched", name="module-func"),
    ]


def test_apply_then_revert_restores_identity_on_real_classes(sets: Callable[..., PatchSet]) -> None:
    before = _snapshot()
    patch_set = sets(*_all_kinds())
    result = patch_set.apply("1.0")
    assert result.status == "applied"
    assert len(result.applied) == 8 and not result.failed

    engine = Engine()
    assert engine.step() == ("kvcached", "vanilla")
    assert Engine.util(3) == 6 and engine.util(3) == 6
    made: Any = Engine.make()
    assert made[0] == "made" and isinstance(made[1], Engine)
    assert engine.greet() == "elastic"
    assert Engine.shout("hi") == "HI!"
    assert Engine.limit == 99
    assert engine.size == 2
    assert sys.modules[HERE].module_func() == "patched"
    # descriptor kinds preserved
    assert isinstance(Engine.__dict__["util"], staticmethod)
    assert isinstance(Engine.__dict__["make"], classmethod)
    assert isinstance(Engine.__dict__["shout"], staticmethod)
    # inherited attributes are set on the patched class only
    assert Base().greet() == "base" and Base.__dict__["shout"] is before["Base"]["shout"]

    reverted = patch_set.revert()
    assert reverted.ok and len(reverted.restored) == 8
    after = _snapshot()
    for key, value in before["Engine"].items():
        assert after["Engine"][key] is value, key
    assert set(after["Engine"]) == set(before["Engine"])
    assert "greet" not in Engine.__dict__ and "shout" not in Engine.__dict__
    assert sys.modules[HERE].module_func is before["module_func"]
    assert Engine().step() == "vanilla"


def test_patch_a_class_in_a_module_created_in_tmp_path(
    site: FakeSite, sets: Callable[..., PatchSet]
) -> None:
    site.module(
        "kvt_stdlike.queues",
        """
        class Queue:
            def put(self, item):
                return ("put", item)

            @classmethod
            def create(cls):
                return cls()
        """,
    )
    site.module("kvt_stdlike.user", "from kvt_stdlike.queues import Queue\n")
    import kvt_stdlike.queues as queues
    import kvt_stdlike.user as user

    original_class, original_put = queues.Queue, queues.Queue.__dict__["put"]

    class ElasticQueue(queues.Queue):
        pass

    patch_set = sets(
        Patch(
            "kvt_stdlike.queues:Queue.put", wrapper=lambda orig: lambda self, i: orig(self, i * 2)
        ),
        Patch(
            "kvt_stdlike.queues:Queue",
            replacement=ElasticQueue,
            also_rebind=("kvt_stdlike.user:Queue",),
        ),
    )
    assert patch_set.apply("1.0").status == "applied"
    assert queues.Queue is ElasticQueue and user.Queue is ElasticQueue
    assert ElasticQueue().put(2) == ("put", 4)

    assert patch_set.revert().ok
    assert queues.Queue is original_class and user.Queue is original_class
    assert original_class.__dict__["put"] is original_put


def test_failure_in_the_middle_rolls_the_whole_set_back(
    sets: Callable[..., PatchSet], caplog: pytest.LogCaptureFixture
) -> None:
    before = _snapshot()
    patch_set = sets(
        Patch(f"{HERE}:Engine.step", wrapper=_wrap_step, name="first"),
        Patch(f"{HERE}:Engine.util", replacement=lambda x: -x, name="second"),
        Patch(f"{HERE}:Engine.no_such_method", replacement=lambda self: None, name="broken"),
        Patch(f"{HERE}:module_func", replacement=lambda: "never", name="after"),
    )
    with caplog.at_level(logging.INFO, logger="kvcached"):
        result = patch_set.apply("1.0")
    assert result.status == "failed" and not result.ok
    assert result.applied == ()
    assert result.rolled_back == ("second", "first")
    assert result.failed[0][0] == "broken"
    assert "does not exist" in result.failed[0][1]
    assert _snapshot() == before
    assert not patch_set.is_applied
    lines = [r.getMessage() for r in caplog.records if r.name == "kvcached"]
    assert len(lines) == 1
    assert lines[0].startswith("kvcached: kvt 1.0 patch set: 0 applied, 0 skipped, 1 failed")
    assert "engine left vanilla" in lines[0]


def test_a_raising_wrapper_rolls_back(sets: Callable[..., PatchSet]) -> None:
    def explode(original: Any) -> Any:
        raise RuntimeError("boom")

    before = _snapshot()
    patch_set = sets(
        Patch(f"{HERE}:module_func", replacement=lambda: "x", name="ok"),
        Patch(f"{HERE}:Engine.step", wrapper=explode, name="explodes"),
    )
    result = patch_set.apply("1.0")
    assert result.failed == (("explodes", "RuntimeError: boom"),)
    assert _snapshot() == before


def test_strict_raises_naming_patch_target_plugin_and_distribution(
    sets: Callable[..., PatchSet], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _snapshot()
    patch_set = sets(
        Patch(f"{HERE}:Engine.step", wrapper=_wrap_step, name="first"),
        Patch(f"{HERE}:Engine.missing", replacement=1, name="broken"),
        plugin="kvt",
        distribution="kvcached-kvt",
    )
    monkeypatch.setenv("KVCACHED_STRICT", "1")
    with pytest.raises(PatchError) as info:
        patch_set.apply("1.0")
    message = str(info.value)
    for part in (
        "'broken'",
        f"'{HERE}:Engine.missing'",
        "plugin 'kvt'",
        "distribution 'kvcached-kvt'",
        "rolled back",
        "KVCACHED_STRICT=1",
    ):
        assert part in message
    assert _snapshot() == before
    with pytest.raises(PatchError):
        patch_set.apply("1.0", strict=True)
    assert patch_set.apply("1.0", strict=False).status == "failed"


def test_apply_is_idempotent(
    sets: Callable[..., PatchSet], caplog: pytest.LogCaptureFixture
) -> None:
    patch_set = sets(Patch(f"{HERE}:Engine.step", wrapper=_wrap_step))
    with caplog.at_level(logging.INFO, logger="kvcached"):
        first = patch_set.apply("1.0")
        second = patch_set.apply("1.0")
    assert not first.repeated and second.repeated
    assert second.applied == first.applied
    assert Engine().step() == ("kvcached", "vanilla")  # wrapped once
    assert len([r for r in caplog.records if "patch set" in r.getMessage()]) == 1


def test_another_set_with_the_same_patch_does_not_stack(sets: Callable[..., PatchSet]) -> None:
    patch = Patch(f"{HERE}:Engine.step", wrapper=_wrap_step, name="step")
    first = sets(patch, plugin="kvt")
    second = sets(patch, plugin="kvt")
    assert first.apply("1.0").status == "applied"
    result = second.apply("1.0")
    assert result.status == "skipped"
    assert result.skipped == (("step", "already applied in this process by another patch set"),)
    assert Engine().step() == ("kvcached", "vanilla")
    assert (("kvt", "step", f"{HERE}:Engine.step")) in active_patches()


def test_revert_does_not_clobber_a_later_patch(sets: Callable[..., PatchSet]) -> None:
    original = Engine.__dict__["step"]
    patch_set = sets(Patch(f"{HERE}:Engine.step", wrapper=_wrap_step, name="step"))
    patch_set.apply("1.0")

    def someone_else(self: Engine) -> str:
        return "theirs"

    Engine.step = someone_else  # type: ignore[method-assign]
    try:
        result = patch_set.revert()
        assert result.restored == ()
        assert result.conflicts[0][0] == "step"
        assert "not the value patch 'step' set; left in place" in result.conflicts[0][1]
        assert Engine.__dict__["step"] is someone_else
    finally:
        Engine.step = original  # type: ignore[method-assign]


def test_version_gating(sets: Callable[..., PatchSet]) -> None:
    patch_set = sets(
        Patch(f"{HERE}:Engine.step", versions=">=0.9,<0.10", wrapper=_wrap_step, name="old"),
        Patch(f"{HERE}:Engine.limit", versions=">=0.27.1,<=0.32.0", replacement=5, name="new"),
    )
    result = patch_set.apply("0.32.0+cpu")
    assert result.applied == ("new",)
    assert result.skipped == (("old", "version 0.32.0+cpu not in '<0.10,>=0.9'"),)
    assert Engine.limit == 5 and Engine().step() == "vanilla"
    patch_set.revert()
    result = patch_set.apply("0.5")
    assert result.status == "skipped" and not patch_set.is_applied


def test_unknown_version_skips_loudly(
    sets: Callable[..., PatchSet], caplog: pytest.LogCaptureFixture
) -> None:
    patch_set = sets(Patch(f"{HERE}:Engine.step", wrapper=_wrap_step, name="step"))
    with caplog.at_level(logging.WARNING, logger="kvcached"):
        result = patch_set.apply(None)
    assert result.status == "skipped"
    assert result.skipped == (("step", "engine version unknown"),)
    assert "engine version unknown, engine left vanilla" in caplog.text
    with pytest.raises(PatchError, match="engine version unknown"):
        patch_set.apply(None, strict=True)


def test_optional_patch_failure_is_skipped(sets: Callable[..., PatchSet]) -> None:
    patch_set = sets(
        Patch("kvt_no_such_module:thing", replacement=1, name="optional", required=False),
        Patch(f"{HERE}:Engine.limit", replacement=7, name="limit"),
    )
    result = patch_set.apply("1.0")
    assert result.status == "applied" and result.applied == ("limit",)
    name, reason = result.skipped[0]
    assert name == "optional"
    assert reason.startswith(
        "optional patch not applied: cannot import module 'kvt_no_such_module'"
    )


def test_create_adds_and_revert_deletes(sets: Callable[..., PatchSet]) -> None:
    patch_set = sets(Patch(f"{HERE}:Engine.elastic", replacement=True, create=True))
    patch_set.apply("1.0")
    assert Engine.elastic is True  # type: ignore[attr-defined]
    patch_set.revert()
    assert not hasattr(Engine, "elastic")


class Slotted:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = "original"


SLOTTED = Slotted()


def test_patch_an_instance_attribute_without_a_dict(sets: Callable[..., PatchSet]) -> None:
    patch_set = sets(Patch(f"{HERE}:SLOTTED.value", wrapper=lambda orig: orig + "+kvcached"))
    patch_set.apply("1.0")
    assert SLOTTED.value == "original+kvcached"
    assert patch_set.revert().ok
    assert SLOTTED.value == "original"


def test_replacement_none_is_a_value(sets: Callable[..., PatchSet]) -> None:
    patch_set = sets(Patch(f"{HERE}:Engine.limit", replacement=None))
    patch_set.apply("1.0")
    assert Engine.limit is None


def _alias_modules(site: FakeSite) -> None:
    site.module("kvt_alias.defs", "def allocate():\n    return 'original'\n")
    site.module("kvt_alias.user", "from kvt_alias.defs import allocate\n")


def test_stale_alias_reported_at_apply(
    site: FakeSite, sets: Callable[..., PatchSet], caplog: pytest.LogCaptureFixture
) -> None:
    _alias_modules(site)
    import kvt_alias.user  # noqa: F401

    patch_set = sets(Patch("kvt_alias.defs:allocate", replacement=lambda: "elastic", name="alloc"))
    with caplog.at_level(logging.INFO, logger="kvcached"):
        result = patch_set.apply("1.0")
    assert result.status == "applied"
    assert result.warnings == (
        "kvt_alias.user:allocate still holds the original of 'kvt_alias.defs:allocate' "
        "(patch 'alloc'); add it to also_rebind",
    )
    assert "kvt_alias.user:allocate still holds the original" in caplog.text

    patch_set.revert()
    rebinding = sets(
        Patch(
            "kvt_alias.defs:allocate",
            replacement=lambda: "elastic",
            also_rebind=["kvt_alias.user:allocate"],
        )
    )
    result = rebinding.apply("1.0")
    assert result.warnings == ()
    assert sys.modules["kvt_alias.user"].allocate() == "elastic"
    rebinding.revert()
    assert sys.modules["kvt_alias.user"].allocate() == "original"


def test_stale_alias_reported_at_revert(site: FakeSite, sets: Callable[..., PatchSet]) -> None:
    _alias_modules(site)
    patch_set = sets(Patch("kvt_alias.defs:allocate", replacement=lambda: "elastic", name="alloc"))
    patch_set.apply("1.0")
    import kvt_alias.user as user  # imported after the patch: holds the replacement

    assert user.allocate() == "elastic"
    result = patch_set.revert()
    assert result.restored == ("alloc",)
    assert result.stale_aliases == ("kvt_alias.user:allocate",)
    assert not result.ok


def test_also_rebind_must_hold_the_original(site: FakeSite, sets: Callable[..., PatchSet]) -> None:
    site.module("kvt_alias.defs", "def allocate():\n    return 'original'\n")
    site.module("kvt_alias.other", "def allocate():\n    return 'other'\n")
    import kvt_alias.defs as defs

    original = defs.allocate
    patch_set = sets(
        Patch(
            "kvt_alias.defs:allocate",
            replacement=lambda: "x",
            also_rebind=["kvt_alias.other:allocate"],
            name="alloc",
        )
    )
    result = patch_set.apply("1.0")
    assert result.status == "failed"
    assert (
        "also_rebind 'kvt_alias.other:allocate' does not hold the original" in result.failed[0][1]
    )
    assert defs.allocate is original


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"target": "no_colon.Engine.step", "replacement": 1},
            "invalid target 'no_colon.Engine.step'",
        ),
        ({"target": "pkg:Engine..step", "replacement": 1}, "invalid target 'pkg:Engine..step'"),
        ({"target": "pkg-x:Engine", "replacement": 1}, "invalid target 'pkg-x:Engine'"),
        (
            {"target": "pkg:Engine", "versions": ">=1.0,<<2", "replacement": 1},
            "invalid version specifier '>=1.0,<<2'",
        ),
        ({"target": "pkg:Engine"}, "give exactly one of replacement= and wrapper="),
        (
            {"target": "pkg:Engine", "replacement": 1, "wrapper": lambda o: o},
            "give exactly one of replacement= and wrapper=",
        ),
        ({"target": "pkg:Engine", "wrapper": 3}, "wrapper must be callable"),
        (
            {"target": "pkg:Engine", "wrapper": lambda o: o, "create": True},
            "create=True needs a replacement",
        ),
        (
            {"target": "pkg:Engine", "replacement": 1, "also_rebind": ["nocolon"]},
            "invalid target 'nocolon'",
        ),
    ],
)
def test_malformed_patch_records(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(
        PatchError, match="^patch '.*': " + message.replace("(", r"\(").replace(".", r"\.")
    ):
        Patch(**kwargs)


def test_parse_target() -> None:
    assert parse_target("a.b:C.d") == ("a.b", ("C", "d"))
    assert parse_target("a:f") == ("a", ("f",))


def test_duplicate_patch_names_rejected() -> None:
    with pytest.raises(PatchError, match="two patches are named 'x'"):
        PatchSet(
            "kvt", [Patch("a:b", replacement=1, name="x"), Patch("a:c", replacement=1, name="x")]
        )


def test_plan_reports_verdicts(sets: Callable[..., PatchSet]) -> None:
    patch_set = sets(
        Patch(f"{HERE}:Engine.step", versions=">=1", wrapper=_wrap_step, name="step"),
        Patch(f"{HERE}:Engine.nothing", versions=">=1", replacement=1, name="missing"),
        Patch(f"{HERE}:Engine.limit", versions="<1", replacement=1, name="old"),
    )
    plans = {p.name: p for p in patch_set.plan("1.5", resolve=True)}
    assert plans["step"].verdict == "would-apply" and plans["step"].kind == "wrapper"
    assert plans["missing"].verdict == "unresolvable"
    assert plans["old"].verdict == "skip"
    assert {p.verdict for p in patch_set.plan(None)} == {"skip"}
    patch_set = sets(Patch(f"{HERE}:Engine.step", wrapper=_wrap_step, name="step"))
    patch_set.apply("1.5")
    assert [p.verdict for p in patch_set.plan("1.5")] == ["applied"]


def test_the_registry_answers_which_patch_is_applied(sets: Callable[..., PatchSet]) -> None:
    """``is_applied`` / ``patch_of``: one way to ask, by name or by the value at hand."""
    import kvcached_core.plugins as plugins

    vanilla_step = Engine.step
    assert not plugins.is_applied("step") and plugins.patch_of(vanilla_step) is None
    patch_set = sets(*_all_kinds(), plugin="kvt")
    patch_set.apply("1.0")
    assert plugins.is_applied("step") and plugins.is_applied("step", plugin="kvt")
    assert not plugins.is_applied("step", plugin="other") and not plugins.is_applied("nothing")
    step = ("kvt", "step", f"{HERE}:Engine.step")
    assert plugins.patch_of(Engine.step) == step  # the class attribute
    assert plugins.patch_of(Engine().step) == step  # a bound method: its function
    assert plugins.patch_of(Engine.util)[1] == "util"  # a staticmethod's function
    assert plugins.patch_of(Engine.make)[1] == "make"  # a classmethod, bound to the class
    assert plugins.patch_of(Engine.__dict__["size"])[1] == "size"  # a property
    copy = sys.modules[HERE].module_func  # what ``from X import module_func`` would hold
    assert plugins.patch_of(copy) == ("kvt", "module-func", f"{HERE}:module_func")
    assert plugins.patch_of(Engine.limit) is None  # 99: identity means nothing for numbers
    assert plugins.patch_of(vanilla_step) is None and plugins.patch_of(None) is None

    patch_set.revert()
    assert not plugins.is_applied("step") and plugins.patch_of(copy) is None
