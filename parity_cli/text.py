"""Text from files is data, never terminal control: a tensor name, a config's model_type or a
saved report's layer name may hold ESC sequences (colours, OSC 8 hyperlinks, a cleared screen),
bidi overrides that reorder what a reader sees, or characters XML 1.0 forbids. Every such
character is shown as a visible escape (ESC -> '\\x1b') before the text is printed or written.
And what parity prints is parity's: third-party import noise is kept off the screen."""

from __future__ import annotations

import re

# C0 (\n, \r and \t included: every field is one line), DEL and C1; the bidi embeddings,
# overrides and isolates, the marks and the line/paragraph separators; lone surrogates (a JSON
# '\ud800' has no UTF-8 form: writing it raised); U+FFFE/U+FFFF, which XML 1.0 forbids.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                          "\ud800-\udfff\ufffe\uffff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _visible(match: re.Match) -> str:
    ch = match.group()
    code = ord(ch)
    return _NAMED.get(ch) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def printable(text) -> str:
    """`text` as one line of inert characters: each control, bidi or unencodable character
    becomes its escape ('\\x1b', '\\u202e', '\\n'). Applying it twice changes nothing more."""
    text = str(text)
    return _UNPRINTABLE.sub(_visible, text) if _UNPRINTABLE.search(text) else text


def printable_tree(value):
    """Every string in a report (dict keys too) through printable(), as a copy: what the
    renderers read. A loop, not recursion: a saved report may nest as deep as the JSON parser
    allows, deeper than Python's call stack in frames."""
    out = [None]
    stack = [(value, out, 0)]  # (item, the copy's container, where it goes there)
    tuples = []  # lists that stand for tuples, parents before children
    while stack:
        item, into, at = stack.pop()
        if isinstance(item, str):
            into[at] = printable(item)
        elif isinstance(item, dict):
            into[at] = copy = {}
            for k, v in item.items():
                k = printable(k) if isinstance(k, str) else k
                copy[k] = None
                stack.append((v, copy, k))
        elif isinstance(item, (list, tuple)):
            into[at] = copy = [None] * len(item)
            if isinstance(item, tuple):
                tuples.append((into, at))
            stack.extend((v, copy, i) for i, v in enumerate(item))
        else:
            into[at] = item
    for into, at in reversed(tuples):  # children first: a tuple copies its items as they are now
        into[at] = tuple(into[at])
    return out[0]


def layer_count(n: int) -> str:
    """'1 layer', '5 layers': how every message counts layers."""
    return f"{n} layer" + ("" if n == 1 else "s")


# loggers whose warnings are noise on every machine they import on: torchao (which transformers and
# ExecuTorch import when it is installed) warns for each CUDA extension a CPU machine cannot load,
# and torch warns for each enum torchao registers as a pytree constant
NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_third_party() -> None:
    """Raise the noisy libraries' loggers to ERROR: what parity prints (and a candidate's captured
    output) stays parity's findings. Cheap: logging only, nothing imported."""
    import logging

    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
