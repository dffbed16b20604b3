"""``kvctl doctor``: the JSON schema (run as a real subprocess), text output, in-process report."""

from __future__ import annotations

import json
import subprocess
from typing import TYPE_CHECKING, Any

import pytest

from kvcached_core.cli import kvctl
from kvcached_core.plugins import bootstrap
from kvcached_core.plugins.doctor import SCHEMA, build_report

if TYPE_CHECKING:
    from tests.plugins.conftest import FakeSite

OPT_STR = (str, type(None))
OPT_BOOL = (bool, type(None))

#: The documented layout of schema "kvcached.doctor/1": key -> type, nested dict, or [item layout].
LAYOUT: dict[str, Any] = {
    "schema": str,
    "kvcached_core": {"version": str, "path": str},
    "python": str,
    "pid": int,
    "enabled": OPT_BOOL,
    "strict": OPT_BOOL,
    "env": dict,
    "entry_point_group": str,
    "plugins": [
        {
            "name": str,
            "distribution": OPT_STR,
            "distribution_version": OPT_STR,
            "value": OPT_STR,
            "status": str,
            "hooks": [str],
            "error": OPT_STR,
        }
    ],
    "engines": [
        {
            "name": str,
            "distributions": [str],
            "module": OPT_STR,
            "versions": OPT_STR,
            "description": str,
            "covered": [str],
            "plugin": OPT_STR,
            "distribution": OPT_STR,
            "installed": OPT_BOOL,
            "version": (dict, type(None)),
            "in_range": OPT_BOOL,
            "nearest_covered": OPT_STR,
            "patches": [
                {
                    "name": str,
                    "target": str,
                    "kind": str,
                    "versions": str,
                    "required": bool,
                    "plugin": OPT_STR,
                    "distribution": OPT_STR,
                    "verdict": str,
                    "reason": str,
                }
            ],
            "bootstrap": (dict, type(None)),
        }
    ],
    "backends": [
        {
            "name": str,
            "devices": [str],
            "description": str,
            "plugin": OPT_STR,
            "distribution": OPT_STR,
        }
    ],
    "problems": [str],
    "ok": bool,
}


def _check(value: Any, layout: Any, where: str = "report") -> None:
    if isinstance(layout, dict):
        assert isinstance(value, dict), where
        assert set(value) == set(layout), f"{where}: keys {sorted(value)} != {sorted(layout)}"
        for key, sub in layout.items():
            _check(value[key], sub, f"{where}.{key}")
    elif isinstance(layout, list):
        assert isinstance(value, list), where
        for index, item in enumerate(value):
            _check(item, layout[0], f"{where}[{index}]")
    else:
        assert isinstance(value, layout) and not (
            layout is int and isinstance(value, bool)
        ), f"{where}: {value!r} is not {layout}"


def _doctor(site: FakeSite, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return site.python("-m", "kvcached_core.cli.kvctl", "doctor", *args, **env)


BACKEND_PLUGIN = """
    from kvcached_core import hookimpl
    from kvcached_core.plugins import BackendRecord

    @hookimpl
    def kvcached_backends():
        return BackendRecord(name="xpu", devices=("xpu",), description="Level Zero")
"""


def test_doctor_json_schema(engine_site: FakeSite) -> None:
    engine_site.plugin("kvcached-xpu", "xpu", "kvt_xpu", BACKEND_PLUGIN)
    done = _doctor(engine_site, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    _check(report, LAYOUT)
    assert report["schema"] == SCHEMA == "kvcached.doctor/1"
    assert report["ok"] is True and report["problems"] == []
    assert report["enabled"] is True and report["strict"] is False
    assert {p["name"]: p["status"] for p in report["plugins"]} == {"kvt": "loaded", "xpu": "loaded"}
    [engine] = report["engines"]
    assert engine["name"] == "kvt" and engine["distribution"] == "kvcached-kvt"
    assert engine["distributions"] == ["kvt-engine", "kvt-engine-cpu"]
    assert engine["version"] == {
        "value": "1.2.0+cpu",
        "raw": "1.2.0+cpu",
        "source": "distribution kvt-engine-cpu",
        "known": True,
        "note": "",
    }
    assert engine["in_range"] is True and engine["installed"] is True
    verdicts = {p["name"]: p["verdict"] for p in engine["patches"]}
    assert verdicts == {"elastic-step": "would-apply", "elastic-allocate": "skip"}
    assert engine["bootstrap"] is None  # nothing is applied in the doctor's own process
    assert report["backends"] == [
        {
            "name": "xpu",
            "devices": ["xpu"],
            "description": "Level Zero",
            "plugin": "xpu",
            "distribution": "kvcached-xpu",
        }
    ]


def test_doctor_reports_problems_with_exit_status_1(engine_site: FakeSite) -> None:
    engine_site.plugin(
        "kvcached-broken", "broken", "kvt_broken", "raise ImportError('no driver')\n"
    )
    done = _doctor(engine_site, "--json", KVCACHED_STRICT="sometimes")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    _check(report, LAYOUT)
    assert report["ok"] is False and report["strict"] is None
    assert report["env"]["KVCACHED_STRICT"] == "sometimes"
    assert any(
        "plugin 'broken' (distribution 'kvcached-broken') failed to load" in p
        for p in report["problems"]
    )
    assert any("KVCACHED_STRICT='sometimes' is not a boolean" in p for p in report["problems"])
    broken = next(p for p in report["plugins"] if p["name"] == "broken")
    assert broken["status"] == "failed" and "ImportError: no driver" in broken["error"]


def test_doctor_with_an_unknown_allow_list_name_still_lists_plugins(engine_site: FakeSite) -> None:
    done = _doctor(engine_site, "--json", KVCACHED_PLUGINS="nope")
    report = json.loads(done.stdout)
    assert done.returncode == 1
    assert [p["name"] for p in report["plugins"]] == ["kvt"]
    assert "KVCACHED_PLUGINS names 'nope'" in report["problems"][0]


def test_doctor_text_output(engine_site: FakeSite) -> None:
    done = _doctor(engine_site)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "enabled: yes   strict: no" in text
    assert "kvt" in text and "kvcached-kvt 0.1.0" in text and "loaded" in text
    assert "found 1.2.0+cpu (distribution kvt-engine-cpu) supported" in text
    assert "would-apply  elastic-step  ->  kvt_engine.core:Engine.step" in text
    assert "no problems found" in text


def test_doctor_in_process_shows_what_bootstrap_applied(engine_site: FakeSite) -> None:
    bootstrap("kvt")
    report = build_report()
    _check(report, LAYOUT)
    [engine] = report["engines"]
    assert engine["bootstrap"]["status"] == "applied"
    assert {p["name"]: p["verdict"] for p in engine["patches"]}["elastic-step"] == "applied"


def test_doctor_bootstrap_without_adapter_keeps_the_layout(engine_site: FakeSite) -> None:
    bootstrap("ghost")
    report = build_report()
    _check(report, LAYOUT)
    ghost = next(e for e in report["engines"] if e["name"] == "ghost")
    assert ghost["bootstrap"]["status"] == "no-adapter"


def test_doctor_import_engines_resolves_targets(site: FakeSite) -> None:
    site.install_engine(dist=None, module_version="1.3")  # only __version__ tells the version
    site.plugin(
        "kvcached-kvt",
        "kvt",
        "kvt_plugin",
        """
        from kvcached_core import hookimpl
        from kvcached_core.plugins import EngineAdapter, Patch

        @hookimpl
        def kvcached_engine_adapters():
            return EngineAdapter(name="kvt", distributions=("kvt-engine",), module="kvt_engine",
                                 versions=">=1", patch_sets=lambda v: [
                                     Patch("kvt_engine.core:Engine.step", replacement=None, name="ok"),
                                     Patch("kvt_engine.core:Engine.gone", replacement=None, name="gone")])
    """,
    )
    shallow = build_report()
    [engine] = shallow["engines"]
    assert engine["version"]["known"] is False and engine["installed"] is True
    assert any("run" not in p and "cannot tell which kvt version" in p for p in shallow["problems"])

    deep = build_report(import_engines=True)
    [engine] = deep["engines"]
    assert engine["version"]["value"] == "1.3"
    verdicts = {p["name"]: (p["verdict"], p["reason"]) for p in engine["patches"]}
    assert verdicts["ok"] == ("would-apply", "")
    assert verdicts["gone"] == ("unresolvable", "'kvt_engine.core:Engine.gone' does not exist")
    assert "patch 'gone' of kvt: 'kvt_engine.core:Engine.gone' does not exist" in deep["problems"]


def test_doctor_unsupported_engine_version(site: FakeSite) -> None:
    site.install_engine(version="2.1.0", dist="kvt-engine")
    site.install_adapter()
    report = build_report()
    [engine] = report["engines"]
    assert engine["in_range"] is False and engine["patches"] == []
    assert engine["covered"] == ["1.0.0", "1.5.0"] and engine["nearest_covered"] == "1.5.0"
    assert report["problems"] == [
        "kvt 2.1.0 (distribution kvt-engine) is outside the versions plugin 'kvt' "
        "(distribution 'kvcached-kvt') supports (<2,>=1.0); the nearest covered release is "
        "kvt 1.5.0: pip install 'kvt-engine==1.5.0', or a kvcached-kvt release that covers 2.1.0"
    ]


def test_doctor_names_the_oldest_covered_release_for_an_older_engine(site: FakeSite) -> None:
    site.install_engine(version="0.9.2", dist="kvt-engine-cpu")
    site.install_adapter()
    [engine] = build_report()["engines"]
    assert engine["nearest_covered"] == "1.0.0"
    [problem] = build_report()["problems"]
    assert problem.endswith("the nearest covered release is kvt 1.0.0: "
                            "pip install 'kvt-engine-cpu==1.0.0'")


def test_kvctl_without_a_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvctl.main([]) == 2
    assert "doctor" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kvctl.main(["doctor", "--bogus"])
