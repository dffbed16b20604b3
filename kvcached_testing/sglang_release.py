"""Running an SGLang release from ``.sglang/`` in a subprocess.

Each SGLang release lives in its own target directory, ``.sglang/<version>``
(``scripts/setup_sglang.sh``), beside the shared light packages in
``.sglang/_common``. Nothing is installed into the main venv: a process that
needs a release runs with a ``PYTHONPATH`` that holds the shims
(``sglang_shims/``), a generated ``kvcached-sglang`` distribution record (so
entry points are discovered exactly as after ``pip install``), the adapter
source, the release and the common packages.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

__all__ = ["ADAPTER_DIST", "ADAPTER_SRC", "ROOT", "SGLANG_DIR", "SHIMS", "release_env", "release_installed",
           "write_dist_record"]

ROOT = Path(__file__).resolve().parents[1]
SGLANG_DIR = ROOT / ".sglang"
SHIMS = Path(__file__).resolve().parent / "sglang_shims"
ADAPTER_DIST = ROOT / "kvcached_sglang"  # the distribution: pyproject.toml, the .pth line
ADAPTER_SRC = ADAPTER_DIST / "src"  # what goes on sys.path: the kvcached_sglang package


def release_installed(version: str) -> bool:
    return (SGLANG_DIR / version / ".done").is_file() and (SGLANG_DIR / "_common" / ".done").is_file()


def write_dist_record(dest: Path) -> Path:
    """A ``kvcached_sglang-<v>.dist-info`` with the entry points from the adapter's pyproject."""
    meta = tomllib.loads((ADAPTER_DIST / "pyproject.toml").read_text())["project"]
    info = dest / f"kvcached_sglang-{meta['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    lines = []
    for group, eps in meta["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in eps.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    return dest


def release_env(version: str | None, dist_dir: Path, **extra: str) -> dict[str, str]:
    """Environment for a subprocess that runs SGLang ``version`` (None: no SGLang)."""
    paths = [str(SHIMS), str(dist_dir), str(ADAPTER_SRC), str(ROOT)]
    if version is not None:
        paths += [str(SGLANG_DIR / version), str(SGLANG_DIR / "_common")]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVCACHED_", "SGLANG_")) and k != "PYTHONPATH"}
    env.update(PYTHONPATH=os.pathsep.join(paths), SGLANG_USE_CPU_ENGINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env
