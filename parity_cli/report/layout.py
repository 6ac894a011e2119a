"""Terminal layout: how wide the output may be, and tables that fit it without cutting a number.

A cell is never shortened with '…': at a width where the one-line row does not fit, each row
becomes the name on one line and `label value` pairs on the next, wrapped between pairs."""

from __future__ import annotations

import os
from dataclasses import dataclass

from parity_cli.text import printable

DEFAULT_WIDTH = 160  # only when nothing is known: a CI log should not cut a layer name at 80
MIN_WIDTH = 40


def terminal_width(stderr: bool = False) -> int:
    """COLUMNS first (pipes included), then the terminal on the output stream, then any terminal
    the user sits at (`parity check | tee log` still has one on stderr), else 160."""
    raw = os.environ.get("COLUMNS", "").strip()
    if raw.isdigit() and int(raw) > 0:
        return max(MIN_WIDTH, int(raw))
    for fd in ((2, 1, 0) if stderr else (1, 2, 0)):
        try:
            if os.isatty(fd):
                return max(MIN_WIDTH, os.get_terminal_size(fd).columns)
        except OSError:
            continue
    return DEFAULT_WIDTH


def console(stderr: bool = False, width: int | None = None):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, width=width or terminal_width(stderr), soft_wrap=False)


@dataclass(frozen=True)
class Column:
    header: str
    label: str = ""  # in the folded layout: `label value`; empty: the value alone
    right: bool = False
    with_name: bool = False  # folded: on the name's line (a status), not among the pairs
    optional: bool = False  # folded: left out where the row's pairs would take a second line


def table(columns: list[Column], rows: list[list], width: int, indent: int = 1) -> list:
    """rich Text lines. A cell is a string or (string, style). The first column is the row's
    name; in the folded layout it heads the row, the others follow as `label value` pairs. A
    cell is plain text, never markup; its control characters are shown escaped."""
    from rich.text import Text

    def cell(c):
        return (printable(c[0]), c[1]) if isinstance(c, tuple) else (printable(c), "")

    cells = [[cell(c) for c in row] for row in rows]
    widths = [max([len(col.header)] + [len(r[i][0]) for r in cells]) for i, col in enumerate(columns)]
    gap = 2
    if indent + sum(widths) + gap * (len(columns) - 1) <= width:
        out = []
        head = Text(" " * indent)
        for i, col in enumerate(columns):
            head.append((col.header.rjust(widths[i]) if col.right else col.header.ljust(widths[i])), style="bold")
            head.append(" " * gap if i < len(columns) - 1 else "")
        out.append(_rstrip(head))
        for row in cells:
            line = Text(" " * indent)
            for i, (text, style) in enumerate(row):
                pad = widths[i] - len(text)
                if columns[i].right:
                    line.append(" " * pad)
                line.append(text, style=style or None)
                if not columns[i].right:
                    line.append(" " * pad)
                line.append(" " * gap if i < len(columns) - 1 else "")
            out.append(_rstrip(line))
        return out
    out = []
    for row in cells:
        name, style = row[0]
        lines = _folded_name(name, style, width, indent)
        for col, (text, st) in zip(columns[1:], row[1:]):
            if col.with_name:
                if len(lines[-1]) + 2 + len(text) > width:
                    lines.append(Text(" " * (indent + 4)))
                else:
                    lines[-1].append("  ")
                lines[-1].append(text, style=st or None)
        out.extend(lines)
        pairs = []
        for col, (text, st) in zip(columns[1:], row[1:]):
            if col.with_name or (text in ("", "-") and col.label):
                continue
            piece = Text()
            if col.label:
                piece.append(col.label + " ", style="dim")
            piece.append(text, style=st or None)
            pairs.append((piece, col.optional))
        flowed = _flow([p for p, _ in pairs], width, indent + 4)
        while len(flowed) > 1 and any(opt for _, opt in pairs):  # a row is two lines: name, figures
            last = max(k for k, (_, opt) in enumerate(pairs) if opt)
            pairs.pop(last)
            flowed = _flow([p for p, _ in pairs], width, indent + 4)
        out.extend(flowed)
    return out


def _rstrip(text):
    text.rstrip()
    return text


def _folded_name(name: str, style: str, width: int, indent: int) -> list:
    """A layer name longer than the line is folded at '.', never cut."""
    from rich.text import Text

    room = max(10, width - indent - 1)  # a continuation line starts one further in
    lines, current = [], ""
    for part in name.split(".")[:-1]:
        piece = part + "."
        if current and len(current) + len(piece) > room:
            lines.append(current)
            current = ""
        current += piece
    last = name.split(".")[-1]
    if current and len(current) + len(last) > room:
        lines.append(current)
        current = ""
    current += last
    lines.append(current)
    out = []
    for k, text in enumerate(lines):
        chunks = [text[i:i + room] for i in range(0, len(text), room)] or [""]  # a single part wider than the line
        out.extend(Text(" " * indent + (" " if k else "") + c, style=style or None) for c in chunks)
    return out


def _flow(pieces: list, width: int, indent: int, sep: str = "  ") -> list:
    """Pieces on lines of at most `width`, broken between pieces only."""
    from rich.text import Text

    out, line = [], None
    for piece in pieces:
        if len(piece) > width - indent:  # a long list (model types): wrapped on its own lines
            if line is not None:
                out.append(line)
                line = None
            out.extend(wrap(piece, width, indent=indent, hanging=2))
            continue
        if line is not None and len(line) + len(sep) + len(piece) <= width:
            line.append(sep)
            line.append_text(piece)
            continue
        if line is not None:
            out.append(line)
        line = Text(" " * indent)
        line.append_text(piece)
    if line is not None:
        out.append(line)
    return out


def wrap(text, width: int, indent: int = 0, hanging: int = 4) -> list:
    """A paragraph (str with rich markup, or Text) wrapped at spaces, continuation lines indented.
    Data inside the markup is the caller's to escape (terminal._e); a control character left in
    is shown escaped here all the same."""
    from rich.text import Text

    if isinstance(text, str):
        text = Text.from_markup(printable(text))
    words = []  # (piece, whether it continues the word before: a fold, never joined by a space)
    for word in text.split(" ", allow_blank=True):
        pieces = _fold_word(word, max(10, width - indent - hanging))
        words.extend((piece, k > 0) for k, piece in enumerate(pieces))
    out, line = [], Text(" " * indent)
    start = len(line)
    for word, folded in words:
        if len(line) > start and (folded or len(line) + 1 + len(word) > width):
            out.append(line)
            line = Text(" " * (indent + hanging))
            start = len(line)
        elif len(line) > start:
            line.append(" ")
        line.append_text(word)
    out.append(line)
    return out


def _fold_word(word, room: int) -> list:
    """A word wider than the line (a long name pattern, a path) broken after ',', '.' or '/',
    where names break naturally, else at the width; a number is never that wide. A loop and one
    divide: a name of 300 KB was 3,000 nested calls (RecursionError) and as many copies."""
    if len(word) <= room:
        return [word]
    plain = word.plain
    cuts, start = [], 0
    while len(plain) - start > room:
        cut = max(plain.rfind(ch, start, start + room) for ch in ",./") + 1
        start = cut if cut > start else start + room
        cuts.append(start)
    return list(word.divide(cuts))
