"""Files parity writes (the report set, a capture): all or nothing, through links and never
over one, never into /proc or onto a device. Below every stage, so that a capture and a report
are written by the same rules."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path


def json_text(data: dict) -> str:
    """The one serialisation of a report: strict JSON (non-finite numbers are already strings).

    Indented, except that each layer is one line: json's C encoder writes those, where an
    indented dump runs the pure-Python encoder over every value (0.37 s of a 3.5 s check of
    253 layers, all of it after the work is done); a layer per line also greps and diffs well."""
    layers = data.get("layers")
    if not isinstance(layers, list) or not layers:
        return json.dumps(data, indent=2, allow_nan=False) + "\n"
    marker = "\n  \"layers\": []"  # the top-level key only: nested keys are indented further
    text = json.dumps({**data, "layers": []}, indent=2, allow_nan=False)
    rows = ",\n    ".join(json.dumps(layer, allow_nan=False) for layer in layers)
    return text.replace(marker, "\n  \"layers\": [\n    " + rows + "\n  ]", 1) + "\n"


def write_json(data: dict, path: str | Path) -> None:
    write_files({path: json_text(data)})


def write_bytes(path, data: bytes) -> None:
    write_files({path: data})


MAX_LINKS = 40  # as the kernel's own limit on links followed in one lookup


def output_target(path: str | Path, flag: str = "output") -> Path:
    """The file an output name leads to, its links followed one at a time: a link is written
    through, onto the file it names, and never replaced itself. Refused, one line naming the
    path: a name that leads into /proc (/dev/stdout is /proc/self/fd/1: renaming onto it replaced
    the machine's link, and the redirected log got nothing), a device, FIFO, socket, terminal or
    directory, a loop of links, a name past NAME_MAX."""
    from parity_cli.errors import InputError

    p = Path(os.path.abspath(os.fspath(path)))
    for _ in range(MAX_LINKS):
        try:
            p = Path(os.path.realpath(p.parent)) / p.name
            if _in_proc(p):
                raise InputError(f"{path}: {flag} leads to {p}, a process's file descriptor or state, not a file; "
                                 "refused" + (" (use --json - for stdout)" if flag == "--json" else ""))
            st = os.lstat(p)
        except FileNotFoundError:
            break  # a new file: its directory is checked by the caller
        except OSError as exc:
            raise InputError(f"{path}: {flag}: {exc.strerror or exc}") from None
        except ValueError:  # an embedded NUL
            raise InputError(f"{path}: {flag}: not a usable file name") from None
        if not stat.S_ISLNK(st.st_mode):
            if not stat.S_ISREG(st.st_mode):
                raise InputError(f"{path}: {flag} must name a regular file, not a device, FIFO, socket, terminal or "
                                 "directory" + (" (use --json - for stdout)" if flag == "--json" else ""))
            break
        try:
            p = Path(os.path.normpath(p.parent / os.readlink(p)))
        except OSError as exc:
            raise InputError(f"{path}: {flag}: {exc.strerror or exc}") from None
    else:
        raise InputError(f"{path}: {flag}: too many levels of symbolic links")
    return p


def _in_proc(p: Path) -> bool:
    return p.parts[:2] == ("/", "proc")


def write_files(outputs: dict, what: str = "report") -> None:
    """All or nothing: every output goes to a temporary file next to the file it lands on (through
    a link: the link's target), then all are renamed, so an interrupted or failed run leaves no
    partial report and no half of the set. A failure names the output, not the temporary file:
    ENOSPC from write() carries no file name at all."""
    from parity_cli.errors import InputError

    staged = []
    current = None
    try:
        targets = [(output_target(path), path, text) for path, text in outputs.items()]
        for target, path, text in targets:
            current = path
            staged.append((_stage(text, target), target, path))
        with _signals_held():
            for tmp, target, path in staged:
                current = path
                os.replace(tmp, target)
    except OSError as exc:
        raise InputError(f"{current}: cannot write {what}: {exc.strerror or exc}") from None
    finally:
        for tmp, _, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)


class _signals_held:
    """Ctrl-C or SIGTERM between two renames would leave half a set: for the few renames the
    handlers only take note, and the first signal noted is acted on right after, with the set
    complete. (Masking would not do: the kernel hands a process signal to any thread, and torch
    has threads.) Outside the main thread handlers cannot be changed, and nothing is held."""

    def __enter__(self):
        import signal
        import threading

        self.noted, self.saved = [], {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.saved[sig] = signal.signal(sig, lambda signum, frame: self.noted.append((signum, frame)))
        return self

    def __exit__(self, *exc):
        import signal

        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        if self.noted and exc[0] is None:
            signum, frame = self.noted[0]
            handler = self.saved.get(signum)
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)
        return False


def _stage(text: str, path: Path) -> str:
    """The content in a temporary file beside `path`: a short name (the output's own may be near
    NAME_MAX), the mode the file has if it exists (a rename would otherwise change it), else what
    a new file gets (0666 & ~umask, not mkstemp's 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:64]}.", suffix=".tmp", dir=path.parent)
    try:
        with (os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8")) as fh:
            fh.write(text)
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        return tmp
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
