"""The plumbing of a loopback TCP proxy in front of a server of this machine: a listener on a free port, and each
connection it accepts handed to the proxy's `serve`, which decides what passes each way."""

from __future__ import annotations

import socket
import threading


class LoopbackProxy:
    """Subclasses set their own state, then call this constructor last: it starts accepting at once."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def upstream(self) -> socket.socket:
        """A new connection to the server behind the proxy."""
        return socket.create_connection(("127.0.0.1", self.upstream_port))

    def serve(self, client: socket.socket) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            self.serve(client)


def received(end: socket.socket) -> bytes:
    """What came on `end`; nothing once it is closed."""
    try:
        return end.recv(65536)
    except OSError:
        return b""
