"""The import hook that loads kvcached into SGLang releases without plugin entry points (< 0.5.11).

Uses a stand-in ``sglang`` package (no real SGLang needed) and the real ``.pth`` line, processed
by ``site.addsitedir`` as at interpreter start-up. ``test_old_sglang_venv.py`` serves a real
SGLang 0.5.9 engine with the adapter's wheel pip-installed into a virtual environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached_testing.sglang_release import ADAPTER_DIST, release_env

CHILD = r"""
import json, site, sys
site.addsitedir(sys.argv[1])                      # runs kvcached_sglang_autoload.pth
from kvcached_sglang import autoload
armed = autoload.installed()
import sglang                                     # the frontend alone: nothing happens
after_sglang = autoload.installed()
import sglang.srt.managers.scheduler              # the trigger
from kvcached_core.plugins import bootstrap_results
res = bootstrap_results().get("sglang")
print("RESULT " + json.dumps({"armed": armed, "after_sglang": after_sglang,
      "after_trigger": autoload.installed(), "bootstrap": res.status if res else None,
      "reason": res.reason if res else None}))
"""


def _fake_sglang(root: Path, version: str) -> Path:
    pkg = root / "sglang"
    (pkg / "srt" / "managers").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (pkg / "srt" / "__init__.py").write_text("")
    (pkg / "srt" / "managers" / "__init__.py").write_text("")
    (pkg / "srt" / "managers" / "scheduler.py").write_text("class Scheduler:\n    pass\n")
    return root


def _run(tmp_path: Path, dist_record: Path, version: str, **env: str) -> dict:
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "kvcached_sglang_autoload.pth").write_text(
        (ADAPTER_DIST / "kvcached_sglang_autoload.pth").read_text())
    fake = _fake_sglang(tmp_path / "fake", version)
    full_env = release_env(None, dist_record, **env)
    full_env["PYTHONPATH"] += f":{fake}"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(site_dir)], env=full_env,
                          capture_output=True, text=True, timeout=60)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[0][7:])


def test_old_release_bootstraps_after_scheduler_import(tmp_path, dist_record):
    out = _run(tmp_path, dist_record, "0.5.4")
    assert out["armed"] and out["after_sglang"] and not out["after_trigger"]
    # The stand-in scheduler lacks the real targets: the set fails and rolls back, but the
    # hook did call the adapter.
    assert out["bootstrap"] == "failed"
    assert "sglang.srt.mem_cache" in out["reason"]


def test_release_with_entry_points_is_left_to_sglang(tmp_path, dist_record):
    out = _run(tmp_path, dist_record, "0.5.12.post1")
    assert out["armed"] and out["bootstrap"] is None


def test_disabled_installs_nothing(tmp_path, dist_record):
    out = _run(tmp_path, dist_record, "0.5.4", KVCACHED_ENABLED="0")
    assert not out["armed"] and out["bootstrap"] is None


@pytest.mark.parametrize("plugins,expected", [("other", None), ("other,kvcached", "failed")])
def test_sglang_plugins_allow_list_is_honoured(tmp_path, dist_record, plugins, expected):
    out = _run(tmp_path, dist_record, "0.5.4", SGLANG_PLUGINS=plugins)
    assert out["bootstrap"] == expected
