"""Errors that end a run with exit code 2: the input, not a candidate, is at fault."""


class InputError(Exception):
    """Bad checkpoint, bad option or bad plugin spec. The message is one line and names
    the file or option at fault; the CLI prints it without a traceback."""
