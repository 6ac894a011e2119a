"""Issue 48, memory and time: every HTTP response, headers and body, error and redirect alike, is
bounded in bytes (never decoded) and in time. Each case runs `parity check hf://...` against a server
that lies (tests/liar_server.py) and asserts one line, exit 2; a gzip bomb's runs are processes of
their own, so that the memory it would cost is read from that process's rusage (os.wait4), against a
plain 404's."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys

import pytest
from conftest import SLOW

from tests.liar_server import Liar, gzip_bomb, response

ENV = {"PARITY_HTTP_TIMEOUT": "1", "PARITY_HTTP_RETRIES": "1", "PARITY_HTTP_BACKOFF": "0.01", "HF_TOKEN": "",
       "HF_HUB_OFFLINE": ""}


def _run(liar: Liar, tmp_path, target="hf://acme/liar"):
    """(exit code, stderr, stdout) of one `parity check`, in this process (conftest.run_parity)."""
    from tests.conftest import run_parity

    r = run_parity("check", target, "-q", env={**ENV, "HF_ENDPOINT": liar.url, "PARITY_CACHE": str(tmp_path / "cache"),
                                                "HF_HOME": str(tmp_path / "hf")})
    return r.returncode, r.stderr, r.stdout


def _peak_rss_mib(liar: Liar, tmp_path) -> tuple[int, str, float]:
    """The same run, reaped with os.wait4 for its own peak RSS."""
    env = {**os.environ, **ENV, "HF_ENDPOINT": liar.url, "PARITY_CACHE": str(tmp_path / "cache"),
           "HF_HOME": str(tmp_path / "hf")}
    with open(tmp_path / "err", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "parity_cli", "check", "hf://acme/liar", "-q"], env=env,
                                stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, (tmp_path / "err").read_text(), usage.ru_maxrss / 1024


def _one_line(code, err):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("parity: error: "), (code, err)
    assert "internal error" not in err and "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def bomb_bytes():
    """1 GiB of zeros, gzipped twice: a few KiB on the wire (made when a test asks, not at collection)."""
    # the construction, decoded whole at 32 MiB (gzip checks the CRC and the length in the trailer)
    assert gzip.decompress(gzip.decompress(gzip_bomb(1 << 25))) == bytes(1 << 25)
    return gzip_bomb(1 << 30)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The peak RSS of the same run given a plain 404, measured once."""
    def plain(path):
        yield response("404 Not Found", {"Content-Length": 2}, b"{}"), 0

    with Liar(plain) as liar:
        code, err, peak = _peak_rss_mib(liar, tmp_path_factory.mktemp("plain"))
    _one_line(code, err)
    return peak


@pytest.mark.parametrize("status", ["404 Not Found", "302 Found", "500 Internal Server Error"])
def test_a_gzip_bomb_in_an_error_or_redirect_body_is_never_decoded(tmp_path, status, baseline, bomb_bytes):
    """`Content-Encoding: gzip, gzip` on a 404, a 302 or a 500 (13 KB -> 8 GiB reached 6 GiB RSS): the
    body is never decoded. The run's peak memory stays within 256 MiB of the same run given a plain
    404 (a decoded bomb would add 1 GiB)."""
    assert len(bomb_bytes) < 64 << 10  # small enough that a client drains it to reuse the connection
    headers = {"Content-Encoding": "gzip, gzip", "Content-Length": len(bomb_bytes), "Content-Type": "application/json"}
    if status.startswith("302"):
        headers["Location"] = "/api/models/acme/liar/revision/main"

    def bomb(path):
        yield response(status, headers, bomb_bytes), 0

    with Liar(bomb) as liar:
        code, err, peak = _peak_rss_mib(liar, tmp_path)
    line = _one_line(code, err)
    assert peak < baseline + 256, (peak, baseline, line)
    # the status's own words: an error's or a redirect's body is drained raw, never read as the answer
    said = {"404": "repository not found", "302": "redirects; refused", "500": "HTTP 500"}[status.split()[0]]
    assert said in line, line


def test_an_encoded_200_body_is_refused(tmp_path):
    body = b'{"sha": "' + b"0" * 40 + b'"}'
    import zlib

    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    gz = c.compress(body) + c.flush()

    def answer(path):
        yield response("200 OK", {"Content-Encoding": "gzip", "Content-Length": len(gz)}, gz), 0

    with Liar(answer) as liar:
        code, err, _ = _run(liar, tmp_path)
    assert "encoded as 'gzip'" in _one_line(code, err)


@SLOW
def test_headers_dripped_forever_end_in_one_line(tmp_path):
    """A byte of header every 0.25 s, inside the 1 s read timeout, forever: the whole-read deadline
    ends each try (it ran past 150 s with PARITY_HTTP_TIMEOUT=5)."""
    def answer(path):
        yield b"HTTP/1.1 200 OK\r\n", 0
        while True:
            yield b"X", 0.25

    with Liar(answer) as liar:
        code, err, _ = _run(liar, tmp_path)
    line = _one_line(code, err)
    assert "no response headers within 2 s" in line and "2 tries" in line, line


@pytest.mark.parametrize("status", [pytest.param("404 Not Found", marks=SLOW), "302 Found"])
def test_a_dripped_error_or_redirect_body_ends_in_one_line(tmp_path, status):
    """Content-Length 60000, one byte every 0.5 s: the body has the deadline every body has."""
    headers = {"Content-Length": 60000}
    if status.startswith("302"):
        headers["Location"] = "/elsewhere"

    def answer(path):
        if path == "/elsewhere":  # where the redirect leads: a plain answer, so one dripped body is the case
            yield response("404 Not Found", {"Content-Length": 2}, b"{}"), 0
            return
        yield response(status, headers), 0
        for _ in range(60000):
            yield b" ", 0.5

    with Liar(answer) as liar:
        code, err, _ = _run(liar, tmp_path)
    _one_line(code, err)


def test_json_nested_a_hundred_thousand_deep_is_one_line(tmp_path):
    body = b"[" * 100_000 + b"]" * 100_000

    def answer(path):
        yield response("200 OK", {"Content-Length": len(body), "Content-Type": "application/json"}, body), 0

    with Liar(answer) as liar:
        code, err, _ = _run(liar, tmp_path)
    assert "nested too deeply" in _one_line(code, err)
