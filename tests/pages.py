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
