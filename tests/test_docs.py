"""The README is a front page and docs/ holds the rest: the front page reads in two minutes, says in
its first 300 words how to judge an engine, and every relative link of README.md and docs/*.md
names a file of the checkout (and an anchor that its page has)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but '-' and '_' dropped,
    spaces as '-'."""
    text = page.read_text(encoding="utf-8")
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_names_a_file_of_the_checkout(page: Path):
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert broken == [], f"{page.relative_to(REPO)}: links to nothing: {broken}"


def test_the_front_page_reads_in_two_minutes_and_starts_with_the_recipe():
    words = (REPO / "README.md").read_text(encoding="utf-8").split()
    assert len(words) <= 1500
    first = " ".join(words[:300])
    for needed in ("pip install decodespec", "decodespec conform --preset", "report.html", "forced checkpoints"):
        assert needed in first, needed
