"""The README is a front door, and every relative link in it and in docs/ leads somewhere.

A link's file must exist, and its ``#anchor`` must be a heading of that file, as GitHub names
headings (lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .procs import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of a page (a repeated one gets -1, -2, ...)."""
    found: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text(encoding="utf-8")), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        name, n = slug, 0
        while name in found:
            n += 1
            name = f"{slug}-{n}"
        found.add(name)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_heading(page: Path) -> None:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https://, mailto: ...
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target} leads to no file"
        if anchor:
            assert anchor in anchors(linked), f"{page.name}: {target} names no heading"


def test_the_readme_is_a_front_door() -> None:
    """At most 20 KB, with code to run in its first 60 lines; the rest is in docs/, linked."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) <= 20_000
    assert "```python" in text.splitlines()[:60]
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(text)}
    assert {p.name for p in PAGES[1:]} <= linked  # every page of docs/ is reachable from it
