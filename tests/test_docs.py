"""Every relative link of the front page and the docs leads somewhere: the file exists, and a `#anchor` names a heading
of its target as GitHub writes heading anchors. Links inside code are not links, and web addresses are not checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^()\s]+)\)")  # [text](target), ![alt](target)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.S)


def prose(text: str) -> str:
    """The text without its code blocks and code spans (kept as blanks, so that nothing else moves)."""
    text = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)
    return CODE.sub(lambda m: " " * len(m.group()), text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text as rendered, lower case, without punctuation, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (not of lines in code blocks); a repeated heading's get -1, -2, ... as on
    GitHub."""
    found: set[str] = set()
    fence = None
    for line in page.read_text(encoding="utf-8").splitlines():
        marker = re.match(r"^(```|~~~)", line)
        if marker:
            fence = marker.group(1) if fence is None else (None if fence == marker.group(1) else fence)
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading and fence is None:
            base = anchor = slug(heading.group(1))
            n = 0
            while anchor in found:
                n += 1
                anchor = f"{base}-{n}"
            found.add(anchor)
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every link of a page that is not a web address."""
    text = prose(page.read_text(encoding="utf-8"))
    found = []
    for match in LINK.finditer(text):
        target = match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        found.append((text.count("\n", 0, match.start()) + 1, target))
    return found


def test_the_pages_are_there():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/README.md", "docs/configuration.md", "docs/benchmarks.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path):
    broken = []
    for line, target in links(page):
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{line}: {target}"
        if not destination.exists():
            broken.append(f"{where}: no file {path}")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{where}: {destination.name} has no heading with the anchor #{anchor}")
        elif ROOT not in destination.parents and destination != ROOT:
            broken.append(f"{where}: outside the repository")
    assert not broken, "\n".join(broken)


def test_slugs_are_githubs():
    assert slug("`[run]`") == "run"
    assert slug("FAST — Flexible (A)synchronous Scalable Training") == "fast--flexible-asynchronous-scalable-training"
    assert slug("Predicting before training: `fast predict`") == "predicting-before-training-fast-predict"
    assert (
        slug("Membership: who may read and write the run's store") == "membership-who-may-read-and-write-the-runs-store"
    )
    assert slug("Against DDP, torchft and hivemind") == "against-ddp-torchft-and-hivemind"
