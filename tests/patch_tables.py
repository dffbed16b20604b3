"""Holding an adapter's patch table (the reST table in its ``patches`` module docstring)
equal to the patches it registers.

A table has a ``patch`` column (a name, or a family with ``<placeholder>`` parts that a
sentence under the table spells out: ``<alloc>`` stands for ``available_size alloc``)
and a column of engine versions, where a row says:

* ``all``: the adapter's whole range;
* ``< X`` / ``>= X``: below / from ``X`` (``X`` counts from its first development build);
* ``X - Y``: ``X`` up to every release of ``Y`` (``0.29 - 0.33``: 0.33.x too;
  ``0.5.4 - 0.5.10``: 0.5.10 and its post releases); ``X`` alone: ``X - X``;
* ``(CPU)`` / ``(GPU)``: only on that platform's patch list; ``(optional)``: not required.

The versions a row names and the patch's gate must agree on every covered release and
at every bound either of them draws (inside the adapter's range).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kvcached_core.plugins import Patch, version_matches

_BORDER = re.compile(r"^\s*=+(?: +=+)+\s*$")
_MARK = re.compile(r"\((CPU|GPU|optional)\)")
_LEGEND = re.compile(r"``<(\w+)>``[^`]*``([\w ]+)``")


@dataclass(frozen=True)
class Row:
    """One row of a patch table: its ``patch`` cell and its versions cell (marks split off)."""

    patch: str
    versions: str
    devices: frozenset[str]  # {"CPU"}, {"GPU"} or empty (both)
    optional: bool

    def label(self) -> str:
        return f"row {self.patch!r} ({self.versions!r})"


def table_rows(doc: str, versions_column: str) -> list[Row]:
    """The rows of the reST simple table in ``doc`` whose header starts with ``patch``.

    A line whose first cell is empty continues the row above it.
    """
    lines = doc.splitlines()
    borders = [i for i, line in enumerate(lines) if _BORDER.match(line)]
    for top, _mid, bottom in zip(borders[0::3], borders[1::3], borders[2::3]):
        starts = [m.start() for m in re.finditer(r"=+", lines[top])]
        header = _cells(lines[top + 1], starts)
        if header[0] != "patch":
            continue
        column = header.index(versions_column)
        cells: list[list[str]] = []
        for line in lines[_mid + 1:bottom]:
            parts = _cells(line, starts)
            if parts[0]:
                cells.append(parts)
            elif cells and any(parts):
                cells[-1] = [f"{a} {b}".strip() for a, b in zip(cells[-1], parts)]
        rows = []
        for parts in cells:
            text = parts[column]
            marks = set(_MARK.findall(text))
            rows.append(Row(parts[0].strip("`"), _MARK.sub("", text).strip(),
                            frozenset(marks & {"CPU", "GPU"}), "optional" in marks))
        return rows
    raise AssertionError(f"no table with a 'patch' column in the docstring:\n{doc[:300]}")


def _cells(line: str, starts: Sequence[int]) -> list[str]:
    ends = [*starts[1:], None]
    return [line[a:b].strip() if len(line) > a else "" for a, b in zip(starts, ends)]


def placeholders(doc: str) -> dict[str, tuple[str, ...]]:
    """``<name>`` -> the words it stands for, from sentences like
    ``<alloc>`` stands for ``available_size alloc free``."""
    return {name: tuple(words.split()) for name, words in _LEGEND.findall(doc)}


def expand(pattern: str, legend: Mapping[str, Sequence[str]]) -> list[str]:
    """The patch names a row's ``patch`` cell stands for."""
    parts = re.split(r"<(\w+)>", pattern)
    choices = [[text] if i % 2 == 0 else list(legend.get(text, (f"<{text}>",)))
               for i, text in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def _bump(release: str) -> str:
    *head, last = release.split(".")
    return ".".join([*head, str(int(last) + 1)])


def row_specifier(text: str, whole: SpecifierSet) -> SpecifierSet:
    """What a versions cell means (the grammar in the module docs)."""
    text = " ".join(text.split())
    if text == "all":
        return whole
    release = r"(\d+(?:\.\d+)+)"
    if m := re.fullmatch(rf"<\s*{release}", text):
        return SpecifierSet(f"<{m[1]}.dev0")
    if m := re.fullmatch(rf">=\s*{release}", text):
        return SpecifierSet(f">={m[1]}.dev0")
    if m := re.fullmatch(rf"{release}(?:\s*-\s*{release})?", text):
        return SpecifierSet(f">={m[1]}.dev0,<{_bump(m[2] or m[1])}.dev0")
    raise AssertionError(f"versions {text!r}: not 'all', '< X', '>= X', 'X - Y' or 'X'")


def _probes(specs: Iterable[SpecifierSet], covered: Iterable[str]) -> list[Version]:
    found = {Version(v) for v in covered}
    for spec in specs:
        for one in spec:
            bound = Version(one.version)
            found |= {bound, Version(bound.base_version)}
    return sorted(found)


def differences(doc: str, versions_column: str, lists: Mapping[str, Sequence[Patch]],
                whole: str, covered: Sequence[str]) -> list[str]:
    """Every way the docstring table differs from the patches, one sentence each.

    Args:
        doc: The ``patches`` module docstring.
        versions_column: The header of the versions column (``"vLLM"``).
        lists: The registered patches per platform (``{"CPU": [...], "GPU": [...]}``,
            or one list under ``""`` for an adapter without platform lists).
        whole: The adapter's declared range.
        covered: The adapter's covered releases.
    """
    whole_spec = SpecifierSet(whole)
    platforms = {name: {p.name: p for p in patches} for name, patches in lists.items()}
    patches: dict[str, Patch] = {}
    for by_name in platforms.values():
        patches.update(by_name)
    legend = placeholders(doc)
    problems: list[str] = []
    seen: dict[str, str] = {}
    for row in table_rows(doc, versions_column):
        names = expand(row.patch, legend)
        try:
            spec = row_specifier(row.versions, whole_spec)
        except AssertionError as exc:
            problems.append(f"{row.label()}: {exc}")
            continue
        for name in names:
            if name in seen:
                problems.append(f"{row.label()}: {name!r} is already listed by {seen[name]}")
                continue
            seen[name] = row.label()
            patch = patches.get(name)
            if patch is None:
                problems.append(f"{row.label()}: no patch is named {name!r}")
                continue
            problems += _row_differs(row, name, spec, patch, platforms, whole_spec, covered)
    for name in patches:
        if name not in seen:
            patch = patches[name]
            problems.append(f"patch {name!r} ({patch.versions or 'every version'}) has no row "
                            "in the table")
    return problems


def assert_no_differences(problems: Sequence[str], module: str) -> None:
    """Fail naming every row of ``module``'s table that differs (see :func:`differences`)."""
    assert not problems, f"{module}'s table differs from build_patches():\n" + "\n".join(problems)


def _row_differs(row: Row, name: str, spec: SpecifierSet, patch: Patch,
                 platforms: Mapping[str, Mapping[str, Patch]], whole: SpecifierSet,
                 covered: Sequence[str]) -> list[str]:
    problems = []
    gate = SpecifierSet(str(patch.versions))
    for version in _probes((spec, gate, whole), covered):
        if not version_matches(whole, version):
            continue
        if version_matches(spec, version) != version_matches(gate, version):
            problems.append(f"{row.label()}: {name!r} is gated '{gate}', which "
                            f"{'includes' if version_matches(gate, version) else 'excludes'} "
                            f"{version}; the row says otherwise")
            break
    if len(platforms) > 1:
        holds = {platform for platform, by_name in platforms.items() if name in by_name}
        says = set(row.devices) or set(platforms)
        if holds != says:
            problems.append(f"{row.label()}: {name!r} is in the {'/'.join(sorted(holds))} "
                            f"patch list, the row says {'/'.join(sorted(says))}")
    if row.optional == patch.required:
        problems.append(f"{row.label()}: {name!r} is "
                        f"{'required' if patch.required else 'optional'}, the row says "
                        f"{'optional' if row.optional else 'required'}")
    return problems
