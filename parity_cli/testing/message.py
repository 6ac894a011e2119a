"""The failure message of parity_cli.testing: the CLI's grouped finding for the one layer checked, its
cause first (no "FAIL: ", which the AssertionError says)
(parity_cli.report.terminal.summary_lines: the verdict with its cause, each failing group with its
worst element), so a kernel's test and `parity check` say the same words."""

from __future__ import annotations

WIDTH = 160  # an assertion message is read in a log, as the CLI writes one without a terminal


def finding_lines(d: dict, width: int = WIDTH) -> list[str]:
    """The CLI's lines; one layer is checked here, so its count ('1 of 1 layer: ') goes."""
    from parity_cli.report import terminal

    lines = list(terminal.summary_lines(d, width))
    for count in ("1 of 1 layer: ", "1 of 1 layer fails"):
        lines[0] = lines[0].replace(count, "", 1)
    # an AssertionError is the failure already: the cause comes first, where pytest's one-line summary
    # at 80 columns still shows it after a long test id ("AssertionError: eps_mismatch (behaves as ...")
    lines[0] = lines[0].removeprefix("FAIL: ")
    return lines
