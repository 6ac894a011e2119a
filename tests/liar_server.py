"""A Hub endpoint that lies: every request is answered by a script, byte by byte, so that a test can
drip headers, drip a body, send a gzip bomb on an error or a redirect, or nest JSON a hundred
thousand deep (issue 48). It never reads more than the request's head."""

from __future__ import annotations

import socketserver
import threading
import time


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server = self.server
        self.request.settimeout(30)
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = self.request.recv(4096)
                if not chunk:
                    return
                head += chunk
            path = head.split(b" ", 2)[1].decode("latin-1")
            server.liar.paths.append(path)
            for piece, wait in server.liar.answer(path):
                if server.liar.stopping.is_set():
                    return
                if wait:
                    time.sleep(wait)
                self.request.sendall(piece)
        except (OSError, IndexError):
            return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class Liar:
    """`answer(path) -> iterable of (bytes, seconds to wait before sending them)`; the url to give
    HF_ENDPOINT; the paths asked for, in order."""

    def __init__(self, answer):
        self.answer, self.paths, self.stopping = answer, [], threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.liar = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()


def response(status: str, headers: dict, body: bytes = b"") -> bytes:
    lines = [f"HTTP/1.1 {status}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def gzip_bomb(decoded: int, layers: int = 2) -> bytes:
    """`decoded` zero bytes (a multiple of 16 MiB) gzipped `layers` times (Content-Encoding: gzip,
    gzip): kilobytes on the wire, `decoded` bytes in the memory of a client that decodes it. The
    first layer is one 16 MiB block deflated once and repeated (a full flush leaves no history
    between copies), with gzip's header and trailer written around it: a tenth of a second where
    deflating every block took five."""
    import struct
    import zlib

    def gz(data: bytes) -> bytes:
        c = zlib.compressobj(9, zlib.DEFLATED, 31)
        return c.compress(data) + c.flush()

    block, copies = bytes(1 << 24), decoded >> 24
    if copies < 1 or decoded != copies << 24:  # the trailer's length would lie about the body
        raise ValueError(f"gzip_bomb: {decoded} bytes is not a whole number of 16 MiB blocks")
    raw = zlib.compressobj(9, zlib.DEFLATED, -15)
    repeated = raw.compress(block) + raw.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(copies):
        crc = zlib.crc32(block, crc)
    last = zlib.compressobj(9, zlib.DEFLATED, -15).flush()  # the final (empty) block
    out = (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + repeated * copies + last
           + struct.pack("<II", crc, (copies << 24) & 0xFFFFFFFF))
    for _ in range(layers - 1):
        out = gz(out)
    return out

