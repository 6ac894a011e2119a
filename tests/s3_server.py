"""A local S3 endpoint for the tests: moto's ThreadedMotoServer on 127.0.0.1 and a free port, in this process.

    with S3Server() as s3:
        s3.put_tree("ckpts", "llama", checkpoint_dir)
        subprocess.run([...], env=s3.environ())   # or os.environ.update(s3.env()) for an in-process client
        assert s3.bytes_sent() < size // 100

It sets nothing global: no environment variable, no moto mock, no logging handler. A WSGI layer in front of moto's app
records every request (method, path with its query string, Range header) and counts the object bytes that GETs of keys
sent back, so a test can assert how little of a checkpoint a reader fetched.

Credentials: moto checks none, so this layer does what S3 does with the access key ID (not the signature): a request
signed with another key ID gets 403 InvalidAccessKeyId, an unsigned one 403 AccessDenied (s3fs: PermissionError).

moto keeps its buckets in process-wide state: two servers running at once in one process see the same buckets. When
the last server of the process stops, moto's state is reset, so the next one starts empty.
"""

from __future__ import annotations

import os
import re
import threading
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from urllib.parse import unquote

from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"

# query parameters that make a GET on a key something other than reading its bytes (?tagging, ?acl, ?attributes...)
_OBJECT_READ_PARAMS = {"versionId", "partNumber", "x-id", "response-content-type", "response-content-disposition",
                       "response-cache-control", "response-content-encoding", "response-content-language",
                       "response-expires"}
_SIGNED_KEY = re.compile(r"Credential=([^/,\s]+)/")
_ERROR = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
          "<RequestId>s3-server</RequestId></Error>")


class _QuietHandler(MotoRequestHandler):
    """moto's request handler without werkzeug's line per request on stderr."""

    def log_request(self, code="-", size="-"):
        pass


class _Recorder:
    """The WSGI layer in front of moto: request log, byte counts of object reads, the access key check."""

    def __init__(self, app, access_key: str):
        self.app = app
        self.access_key = access_key
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, str | None]] = []
        self.object_bytes = 0
        self.response_bytes = 0

    def __call__(self, environ, start_response):
        method = environ["REQUEST_METHOD"]
        path = environ.get("PATH_INFO", "")
        query = environ.get("QUERY_STRING", "")
        with self.lock:
            self.requests.append((method, path + (f"?{query}" if query else ""), environ.get("HTTP_RANGE")))
        if not path.startswith("/moto-api"):
            denied = self._denied(environ, query)
            if denied:
                body = _ERROR.format(code=denied[0], message=denied[1]).encode()
                start_response("403 Forbidden", [("Content-Type", "application/xml"),
                                                 ("Content-Length", str(len(body)))])
                return [b""] if method == "HEAD" else [body]
        status: list[str] = []

        def recording_start_response(status_line, headers, exc_info=None):
            status.append(status_line)
            return start_response(status_line, headers, exc_info)

        result = self.app(environ, recording_start_response)
        is_read = method == "GET" and _is_key(path) and _is_object_read(query)
        return self._count(result, status, is_read)

    def _denied(self, environ, query: str) -> tuple[str, str] | None:
        signed = _SIGNED_KEY.search(environ.get("HTTP_AUTHORIZATION", "")) or _SIGNED_KEY.search(
            "Credential=" + unquote(_query_value(query, "X-Amz-Credential") or ""))
        if signed is None:
            return "AccessDenied", "Access Denied"
        if signed.group(1) != self.access_key:
            return "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records."
        return None

    def _count(self, result: Iterable[bytes], status: list[str], is_read: bool) -> Iterator[bytes]:
        try:
            for chunk in result:
                with self.lock:
                    self.response_bytes += len(chunk)
                    if is_read and status and status[0][:3] in ("200", "206"):
                        self.object_bytes += len(chunk)
                yield chunk
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.object_bytes = 0
            self.response_bytes = 0


def _is_key(path: str) -> bool:
    """Path-style addressing (botocore uses it for an IP endpoint): /bucket/key..., not /bucket or /bucket/."""
    bucket, _, key = path.lstrip("/").partition("/")
    return bool(bucket) and bool(key)


def _is_object_read(query: str) -> bool:
    names = {part.partition("=")[0] for part in query.split("&") if part}
    return names <= _OBJECT_READ_PARAMS


def _query_value(query: str, name: str) -> str | None:
    for part in query.split("&"):
        key, _, value = part.partition("=")
        if key == name:
            return value
    return None


class _CountingMotoServer(ThreadedMotoServer):
    """ThreadedMotoServer whose WSGI app is moto's behind the recorder, and which logs nothing."""

    def __init__(self, recorder_factory, ip_address: str):
        super().__init__(ip_address=ip_address, port=0, verbose=False)
        self._recorder_factory = recorder_factory

    def _server_entry(self) -> None:
        app = self._recorder_factory(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(self._ip_address, self._port, app, True, request_handler=_QuietHandler)
        self._server_ready_event.set()
        self._server.serve_forever()


class S3Server:
    """A moto S3 endpoint on 127.0.0.1 and a free port; a context manager (``with S3Server() as s3:``)."""

    _running = 0
    _running_lock = threading.Lock()

    def __init__(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY, region: str = REGION):
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.endpoint = ""
        self._server: _CountingMotoServer | None = None
        self._recorder: _Recorder | None = None

    def start(self) -> S3Server:
        if self._server is not None:
            return self
        server = _CountingMotoServer(self._make_recorder, "127.0.0.1")
        server.start()
        host, port = server.get_host_and_port()
        self._server = server
        self.endpoint = f"http://{host}:{port}"
        with S3Server._running_lock:
            S3Server._running += 1
        return self

    def _make_recorder(self, app) -> _Recorder:
        self._recorder = _Recorder(app, self.access_key)
        return self._recorder

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        with S3Server._running_lock:
            S3Server._running -= 1
            last = S3Server._running == 0
        if last:
            urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST"), timeout=30)
        server.stop()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what a client needs ---------------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The variables a client process needs to talk to this server (botocore >= 1.31 reads AWS_ENDPOINT_URL),
        with ~/.aws out of the way and no instance-metadata lookups."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (os.environ by default) without any AWS_* variable of its own (AWS_PROFILE would name a profile
        that AWS_CONFIG_FILE=/dev/null lacks; AWS_SESSION_TOKEN would ride along with the test keys), plus env():
        the whole environment for a subprocess."""
        base = os.environ if base is None else base
        merged = {k: v for k, v in base.items() if not k.startswith("AWS_")}
        merged.update(self.env())
        return merged

    # -- content -----------------------------------------------------------------------------------------------------

    def _client(self):
        import boto3

        return boto3.session.Session(
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key, region_name=self.region
        ).client("s3", endpoint_url=self.endpoint)

    def put_tree(self, bucket: str, prefix: str, directory: Path) -> list[str]:
        """Create ``bucket`` if needed and upload every file under ``directory`` to ``prefix/<relative path>``;
        return the keys written. The upload's requests are not left in the counts (reset_counts() runs after it)."""
        if self._server is None:
            raise RuntimeError("S3Server.put_tree before start()")
        client = self._client()
        existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if bucket not in existing:
            client.create_bucket(Bucket=bucket)
        directory = Path(directory)
        prefix = prefix.strip("/")
        keys = []
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            key = "/".join(filter(None, [prefix, path.relative_to(directory).as_posix()]))
            with path.open("rb") as fh:
                client.put_object(Bucket=bucket, Key=key, Body=fh)
            keys.append(key)
        self.reset_counts()
        return keys

    # -- what the clients did ---------------------------------------------------------------------------------------

    def bytes_sent(self) -> int:
        """Bytes of object bodies sent (GETs of keys answered 200/206) since start() or reset_counts()."""
        return self._recorder.object_bytes if self._recorder else 0

    def response_bytes(self) -> int:
        """Every response body byte since start() or reset_counts(): listings, errors and object bodies."""
        return self._recorder.response_bytes if self._recorder else 0

    @property
    def requests(self) -> list[tuple[str, str, str | None]]:
        """(method, path with '?query' when there is one, Range header or None) of every request since start() or
        reset_counts(), in arrival order."""
        if self._recorder is None:
            return []
        with self._recorder.lock:
            return list(self._recorder.requests)

    def reset_counts(self) -> None:
        if self._recorder is not None:
            self._recorder.reset()
