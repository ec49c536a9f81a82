"""docs/configuration.md is what `fast reference` writes from the schema and the strategies' and codecs' declarations:
a key added, renamed or given a new default fails here until the page is written again."""

import difflib
from pathlib import Path

from fast.tools.reference import MEANINGS, key_rows, markdown, tables

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"


def test_the_configuration_page_is_the_one_the_schema_writes():
    written, committed = markdown(), PAGE.read_text(encoding="utf-8")
    if written != committed:
        diff = difflib.unified_diff(committed.splitlines(), written.splitlines(), "docs/configuration.md",
                                    "fast reference", lineterm="", n=0)  # fmt: skip
        shown = "\n".join(list(diff)[:40])
        raise AssertionError(f"docs/configuration.md differs from the schema: run `fast reference > "
                             f"docs/configuration.md`\n{shown}")  # fmt: skip


def test_every_key_has_a_meaning_and_every_meaning_a_key():
    """The page's words for keys whose schema has no description name keys that exist (a renamed key fails)."""
    keys = {f"{table}.{row[0]}": row[3] for table, model in tables() for row in key_rows(table, model)}
    assert sorted(set(MEANINGS) - set(keys)) == []
    unexplained = [key for key, meaning in keys.items() if not meaning]
    assert not unexplained, f"give these keys a `description` in src/fast/config: {unexplained}"
