"""Build hook: ship ``kvcached_sglang_autoload.pth`` at the root of the wheel.

SGLang releases before 0.5.11 have no plugin entry point, so kvcached-sglang installs one
``.pth`` line that puts an inert import finder in place (see ``kvcached_sglang/autoload.py``).
Everything else is declared in ``pyproject.toml``.
"""

from __future__ import annotations

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "kvcached_sglang_autoload.pth"


class BuildWithPth(build_py):
    """``build_py`` that also copies the ``.pth`` file next to the package (site-packages)."""

    def run(self) -> None:
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        shutil.copyfile(os.path.join(here, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildWithPth})
