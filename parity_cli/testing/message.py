"""The failure message of parity_cli.testing: the CLI's grouped finding for the one layer checked
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
    return lines
