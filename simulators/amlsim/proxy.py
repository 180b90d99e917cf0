"""An HTTP CONNECT proxy standing in for DNS: the SDK addresses the workspace's storage account as
`https://<account>.blob.<storage suffix>` (it builds that name itself), a name no resolver here knows;
the proxy tunnels any CONNECT to the one local port behind it (Azurite), bytes untouched (TLS end to end)."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading


class _Tunnel(socketserver.BaseRequestHandler):
    server: ConnectProxy

    def handle(self) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.request.recv(4096)
            if not chunk:
                return
            head += chunk
        method = head.split(b" ", 1)[0]
        if method != b"CONNECT":
            self.request.sendall(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
            return
        upstream = socket.create_connection(("127.0.0.1", self.server.target_port))
        self.request.sendall(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        rest = head.split(b"\r\n\r\n", 1)[1]
        if rest:
            upstream.sendall(rest)
        pump = threading.Thread(target=_copy, args=(upstream, self.request), daemon=True)
        pump.start()
        _copy(self.request, upstream)
        pump.join()


def _copy(source: socket.socket, target: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            target.sendall(data)
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)


class ConnectProxy(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, target_port: int) -> None:
        super().__init__(("127.0.0.1", 0), _Tunnel)
        self.target_port = target_port
        self.port = self.server_address[1]
        self._thread = threading.Thread(target=self.serve_forever, name="amlsim-proxy", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
