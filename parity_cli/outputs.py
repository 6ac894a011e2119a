"""Files parity writes (the report set, a capture): all or nothing, never through a link nor
over one, never into /proc or onto a device; a missing directory on the name given is made as
the set is written (as pytest's --junitxml does), and taken back if the set is not. Below every
stage, so that a capture and a report are written by the same rules."""

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


def output_target(path: str | Path, flag: str = "output") -> Path:
    """The file an output name leads to: its directory's links resolved (the user's choice of a
    directory), its own name never a link. A link there is refused, not written through and not
    replaced: in a checked-out repository a planted `report.json -> ~/.bashrc` would choose which file
    a CI job overwrites (issue 48). Refused too, one line naming the path: a name that leads into
    /proc, a device, FIFO, socket, terminal or directory, a name past NAME_MAX."""
    from parity_cli.errors import InputError

    stdout = " (use --json - for stdout)" if flag == "--json" else ""
    p = Path(os.path.abspath(os.fspath(path)))
    try:
        p = Path(os.path.realpath(p.parent)) / p.name
        if _in_proc(p):
            raise InputError(f"{path}: {flag} leads to {p}, a process's file descriptor or state, not a file; "
                             f"refused{stdout}")
        st = os.lstat(p)
    except FileNotFoundError:
        return p  # a new file: its directory is checked by the caller
    except OSError as exc:
        raise InputError(f"{path}: {flag}: {exc.strerror or exc}") from None
    except ValueError:  # an embedded NUL
        raise InputError(f"{path}: {flag}: not a usable file name") from None
    if stat.S_ISLNK(st.st_mode):
        try:
            to = os.readlink(p)
        except OSError:
            to = "?"
        raise InputError(f"{path}: {flag} is a symbolic link (to {to}); parity never writes through a link nor "
                         f"replaces one, so a link cannot choose which file a run overwrites: name the file itself; "
                         f"refused{stdout}")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{path}: {flag} must name a regular file, not a device, FIFO, socket, terminal or "
                         f"directory{stdout}")
    return p


def _in_proc(p: Path) -> bool:
    return p.parts[:2] == ("/", "proc")


# kernel and device trees: no directory of a report is ever made there (as root, mkdir in /dev succeeds)
_SYSTEM_TREES = ("proc", "sys", "dev")
NAME_MAX = 255  # where pathconf cannot say


def new_directories(path: str | Path, flag: str = "output") -> list[Path]:
    """The directories an output's name needs that do not exist yet, outermost first, where they
    will be made (pytest's --junitxml makes them too); [] when its directory exists. Only the
    name as given is extended: the nearest existing directory on it may be reached through a link
    (a link to a larger disk), but a link to nothing, a file on the way, a name past NAME_MAX, an
    unwritable directory and anything under /proc, /sys or /dev are refused, one line naming the
    output. Nothing is made here: make_directories does that, when the output is written."""
    from parity_cli.errors import InputError

    p = Path(os.path.abspath(os.fspath(path)))
    missing: list[str] = []
    d = p.parent
    while True:
        try:
            st = os.lstat(d)
        except (FileNotFoundError, NotADirectoryError):  # the root always exists: this ends
            missing.append(d.name)
            d = d.parent
            continue
        except OSError as exc:
            raise InputError(f"{path}: {flag}: {exc.strerror or exc}") from None
        except ValueError:  # an embedded NUL
            raise InputError(f"{path}: {flag}: not a usable file name") from None
        break
    missing.reverse()
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(d)
        except OSError:
            raise InputError(f"{path}: {flag}: {d} is a link to {os.readlink(d)}, which does not exist; parity "
                             "makes no directory through a link") from None
    if not stat.S_ISDIR(st.st_mode):
        raise InputError(f"{path}: {flag}: {d} is a file, not a directory")
    if not missing:
        return []
    base = Path(os.path.realpath(d))
    top = base.parts[1] if len(base.parts) > 1 else missing[0]
    if top in _SYSTEM_TREES:
        raise InputError(f"{path}: {flag}: {base / missing[0]} would be made under /{top}, a kernel or device "
                         "tree; refused")
    try:
        limit = os.pathconf(base, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = NAME_MAX
    for name in [*missing, p.name]:
        if len(os.fsencode(name)) > limit:
            raise InputError(f"{path}: {flag}: '{name[:40]}...' is longer than the {limit} bytes a name may have")
    if not os.access(base, os.W_OK | os.X_OK):
        raise InputError(f"{path}: {flag}: directory {base} is not writable, so {missing[0]} cannot be made in it")
    made, at = [], base
    for name in missing:
        at = at / name
        made.append(at)
    return made


def make_directories(path: str | Path, flag: str = "output") -> list[Path]:
    """Make the directories new_directories names (checked again: time has passed since the
    run's preflight), one at a time, mode 0777 & ~umask as mkdir -p; returns those this call
    made, so that a failed write can take them back. A name that appears meanwhile is accepted
    only as a real directory, never as a link or a file."""
    from parity_cli.errors import InputError

    made = []
    for d in new_directories(path, flag):
        try:
            os.mkdir(d)
            made.append(d)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                raise InputError(f"{path}: {flag}: {d} appeared as something other than a directory; "
                                 "refused") from None
    return made


def remove_directories(made: list[Path]) -> None:
    """Take back directories make_directories made, innermost first, each only if still empty."""
    for d in reversed(made):
        try:
            os.rmdir(d)
        except OSError:
            pass


def write_files(outputs: dict, what: str = "report") -> None:
    """All or nothing: every output goes to a temporary file next to the file it lands on, then all
    are renamed (a link that appears at the name meanwhile is replaced, never written through), so an interrupted or failed run leaves no
    partial report and no half of the set. A failure names the output, not the temporary file:
    ENOSPC from write() carries no file name at all."""
    from parity_cli.errors import InputError

    staged = []
    made: list[Path] = []  # directories made for this set: taken back (if empty) when it is not written
    written = False
    current = None
    try:
        for path in outputs:
            current = path
            made += make_directories(path)
        targets = [(output_target(path), path, text) for path, text in outputs.items()]
        for target, path, text in targets:
            current = path
            staged.append((_stage(text, target), target, path))
        with _signals_held():
            for tmp, target, path in staged:
                current = path
                os.replace(tmp, target)
        written = True
    except OSError as exc:
        raise InputError(f"{current}: cannot write {what}: {exc.strerror or exc}") from None
    finally:
        for tmp, _, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if not written:
            remove_directories(made)


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
