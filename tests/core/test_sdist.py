"""kvcached-core's source distribution carries everything the native extension builds from."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sdist_has_every_native_source_and_header(tmp_path):
    egg = tmp_path / "egg"  # a fresh file list, not the one a checkout's earlier build left
    egg.mkdir()
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(egg), "sdist",
                    "-d", str(tmp_path)], cwd=ROOT, check=True, capture_output=True)
    (archive,) = tmp_path.glob("kvcached_core-*.tar.gz")
    with tarfile.open(archive) as tar:
        packed = {Path(name).relative_to(Path(name).parts[0]).as_posix() for name in tar.getnames()
                  if len(Path(name).parts) > 1}
    native = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").iterdir()
              if p.suffix in (".h", ".cpp")}
    assert native and native <= packed, sorted(native - packed)
    assert {"setup.py", "pyproject.toml"} <= packed
