"""The front page fits a screen, and every link of README.md and docs/ leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_the_front_page_fits_a_screen():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 80, f"README.md has {len(lines)} lines; the reference parts go in docs/"
    assert lines[0] == "# kvcached" and "bash scripts/setup.sh" in "\n".join(lines[:20])


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_link_leads_somewhere(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"
