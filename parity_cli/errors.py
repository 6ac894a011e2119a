"""Errors that end a run with exit code 2: the input, not a candidate, is at fault."""


class InputError(Exception):
    """Bad checkpoint, bad option or bad plugin spec. The message is one line and names
    the file or option at fault; the CLI prints it without a traceback."""


class AdapterError(InputError):
    """parity's adapter of a runtime and the runtime's own public path disagree on the same layer and
    probes: the fault is parity's, never the runtime's (exit 2, as any error of the tool's input)."""
