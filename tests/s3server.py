"""A real S3-compatible server on loopback for the object-storage tests.

moto's server mode (``python -m moto.server``) runs in its own process on a free port of
127.0.0.1, so stage-in talks to it over HTTP exactly as it would to S3: s3fs -> aiobotocore ->
TCP. Nothing in the test process is mocked. Clients find it through ``AWS_ENDPOINT_URL``,
which botocore (and therefore s3fs) honours; ``FSSPEC_S3_ENDPOINT_URL`` works as well.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = [
    "FlakyProxy",
    "moto_server",
    "s3_client",
    "s3_env",
    "free_port",
    "refusing_proxy",
    "hooked_proxy",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def s3_env(endpoint_url: str) -> dict[str, str]:
    """Environment that points boto/s3fs at the server, with moto's dummy credentials."""
    return {
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "NO_PROXY": "127.0.0.1,localhost",
    }


def s3_client(endpoint_url: str):
    """A boto3 client of the server, with moto's dummy credentials (to set the store up)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


@contextmanager
def moto_server(timeout_s: float = 30.0) -> Iterator[str]:
    """Start moto's S3 server on a free loopback port; yield its endpoint URL; stop it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"moto server exited with code {proc.returncode} before listening"
                )
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"moto server did not listen on port {port} within {timeout_s} s"
                    ) from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class FlakyProxy:
    """A TCP proxy in front of the server that cuts every ``every``-th connection short.

    On a cut connection the client's request goes through but only the first ``cut_bytes`` of
    the response come back before both sockets close: to the client it looks like a server or
    network failure mid-response (a truncated header or body), which must be retried and must
    never produce a short file.
    """

    def __init__(self, upstream_port: int, *, every: int = 3, cut_bytes: int = 1500):
        self.upstream_port = upstream_port
        self.every = every  # (0: never)
        #: While set, the store is away: connections in flight are cut, new ones closed.
        self.down = False
        self.cut_bytes = cut_bytes
        self.connections = 0
        self.cuts = 0
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._threads: list = []
        self._closed = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FlakyProxy:
        import threading

        thread = threading.Thread(target=self._serve, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(self, *exc_info) -> None:
        self._closed = True
        self._listener.close()

    def _serve(self) -> None:
        import threading

        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.down:
                client.close()
                continue
            self.connections += 1
            cut = bool(self.every) and self.connections % self.every == 0
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            limit = self.cut_bytes if cut else None
            if cut:
                self.cuts += 1
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, limit), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data or self.down:
                    break
                if limit is not None and sent + len(data) >= limit:
                    dst.sendall(data[: max(0, limit - sent)])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()


@contextmanager
def refusing_proxy(upstream: str, suffix: str) -> Iterator[str]:
    """An HTTP proxy on loopback in front of ``upstream`` that answers every GET of a key ending
    in ``suffix`` with 503 SlowDown (S3's "reduce your request rate"), and forwards the rest:
    a store that throttles one object's reads while it serves the others. Yields its URL."""

    def refuse(method: str, path: str) -> tuple[int, str, str] | None:
        if method == "GET" and path.endswith(suffix):
            return 503, "SlowDown", "Please reduce your request rate."
        return None

    with hooked_proxy(upstream, refuse) as url:
        yield url


@contextmanager
def hooked_proxy(
    upstream: str, hook: Callable[[str, str], tuple[int, str, str] | None]
) -> Iterator[str]:
    """An HTTP proxy on loopback in front of ``upstream`` that calls ``hook(method, path)``
    before each request (``path`` without its query): None forwards the request (after
    whatever the hook did to the store, e.g. rewrite the object), ``(status, code, message)``
    answers with that S3 error instead. A HEAD keeps the upstream's Content-Length (the
    object's size). Yields its URL."""
    import http.server
    import threading
    import urllib.error
    import urllib.request

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            refusal = hook(self.command, self.path.split("?")[0])
            size = None
            if refusal is not None:
                status, code, message = refusal
                data = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
                headers: dict[str, str] = {}
            else:
                skip = ("host", "content-length")
                sent = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                request = urllib.request.Request(
                    upstream + self.path, data=body, method=self.command, headers=sent
                )
                try:
                    response = urllib.request.urlopen(request)  # noqa: S310 - loopback only
                except urllib.error.HTTPError as exc:
                    response = exc
                status, data = response.status, response.read()
                size = response.headers.get("Content-Length")
                drop = ("content-length", "transfer-encoding", "connection", "server", "date")
                headers = {k: v for k, v in response.headers.items() if k.lower() not in drop}
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            head = self.command == "HEAD" and size is not None
            self.send_header("Content-Length", size if head else str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
