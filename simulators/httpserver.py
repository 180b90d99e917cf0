"""What the simulators' HTTP servers share: a threaded server on a free loopback port, served from a daemon thread
until stopped, and a quiet HTTP/1.1 handler that reads a request's body and answers with one."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

JSON = "application/json; charset=utf-8"


class LoopbackServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer on 127.0.0.1 and a port the kernel picks; `start()` serves it from a daemon thread."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def start(self, name: str | None = None, poll_interval: float = 0.5) -> None:
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": poll_interval}, name=name, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class QuietHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 (keep-alive, as the real services), no access log (each simulator keeps the requests it was sent
    for its tests), the body read by its Content-Length, and an answer with its Content-Type and Content-Length."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return

    def read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def answer(
        self, status: int, payload: bytes, content_type: str = JSON, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)
