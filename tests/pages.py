"""The README and the docs pages as the tests read them: each page's text once, and its fenced
blocks (tests/test_readme.py, test_docs.py, test_examples.py)."""

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8") for path in sorted((ROOT / "docs").rglob("*.md"))}
PAGES = {"README.md": README, **DOCS}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def fenced(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block of a page."""
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]


@cache
def blocks() -> tuple[tuple[str, str, str], ...]:
    """(page, info string, body) of every fenced block of the README and the docs."""
    return tuple((page, lang, body) for page, text in PAGES.items() for lang, body in fenced(text))


SAMPLE = re.compile(r"^<!-- output of: (.+?) -->\n```[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


@cache
def samples() -> dict[str, tuple[str, str]]:
    """{what prints it: (page, the output the page shows)} for every block a page marks with
    `<!-- output of: COMMAND -->` on the line before it (invisible on the site)."""
    found = {}
    for page, text in PAGES.items():
        for m in SAMPLE.finditer(text):
            assert m.group(1) not in found, f"{m.group(1)!r} shown twice ({found[m.group(1)][0]}, {page})"
            found[m.group(1)] = (page, m.group(2))
    return found
