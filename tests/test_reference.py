"""The README's strategy and codec tables are what the strategies and codecs declare (`fast reference`)."""

from pathlib import Path

from fast.tools.reference import markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_tables_are_the_declared_reference():
    readme = README.read_text()
    missing = [line for line in markdown().splitlines() if line.strip() and line not in readme]
    assert not missing, "README.md is out of date (run `fast reference`):\n" + "\n".join(missing)
