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

__all__ = ["ADAPTER_DIST", "ADAPTER_SRC", "DEFAULT_TESTED", "ROOT", "SGLANG_DIR", "SHIMS",
           "TESTED_ENV", "release_env", "release_installed", "tested_releases", "write_dist_record"]

ROOT = Path(__file__).resolve().parents[1]
SGLANG_DIR = ROOT / ".sglang"
SHIMS = Path(__file__).resolve().parent / "sglang_shims"
ADAPTER_DIST = ROOT / "kvcached_sglang"  # the distribution: pyproject.toml, the .pth line
ADAPTER_SRC = ADAPTER_DIST / "src"  # what goes on sys.path: the kvcached_sglang package

#: The releases the suite tests unless told otherwise (CI): one of each class of releases the
#: adapter's gates and the tests' expectations tell apart - the oldest (leak-check layout A,
#: MLA patched in ``__init__``, the first metrics hook, no hybrid-linear pool, no NSA), 0.5.3
#: (the common metrics hook, NSA, Triton's interpreter refused), 0.5.4 (layout B, the last
#: MLA ``__init__``), 0.5.9 (MLA ``_create_buffers``, the last ``.pth``-only release), 0.5.12.post1
#: (layout C, plugin entry points, the HTTP server's metrics binding), 0.5.13 (layout D, DSA, the
#: allocator package) and the newest (``release_page_ids``, no backup state, no profiling
#: method). The other covered releases each repeat one of these classes; they run with
#: ``KVCACHED_TEST_SGLANG_RELEASES=all`` (``scripts/sglang_release_matrix.sh``).
DEFAULT_TESTED = ("0.4.9.post6", "0.5.3", "0.5.4", "0.5.9", "0.5.12.post1", "0.5.13", "0.5.23")
#: ``all``, or releases separated by commas or spaces; unset or empty: :data:`DEFAULT_TESTED`.
TESTED_ENV = "KVCACHED_TEST_SGLANG_RELEASES"


def tested_releases(covered: tuple[str, ...], value: str | None = None) -> tuple[str, ...]:
    """The releases to test, in ``covered``'s order, from ``$KVCACHED_TEST_SGLANG_RELEASES``."""
    value = (os.environ.get(TESTED_ENV, "") if value is None else value).strip()
    if value == "all":
        return tuple(covered)
    wanted = value.replace(",", " ").split() or list(DEFAULT_TESTED)
    unknown = [v for v in wanted if v not in covered]
    if unknown:
        raise ValueError(f"{TESTED_ENV}={value!r}: {', '.join(unknown)} not among the releases "
                         f"kvcached-sglang covers ({', '.join(covered)}); give 'all' or some of "
                         "those")
    return tuple(v for v in covered if v in wanted)


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


if __name__ == "__main__":  # the releases to install: scripts/setup.sh
    import sys

    sys.path.insert(0, str(ADAPTER_SRC))
    from kvcached_sglang import COVERED_RELEASES

    print(" ".join(tested_releases(COVERED_RELEASES)))
