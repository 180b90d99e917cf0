"""A loopback TCP proxy in front of a redis-server that loses the answer of a transaction on demand: armed, it
passes the next EXEC on to the server, then closes the client's connection instead of passing on the reply. The
transaction ran; the client never heard, and sends it again."""

from __future__ import annotations

import contextlib
import socket
import threading

from tests.support.loopback_proxy import LoopbackProxy, received

EXEC = b"EXEC\r\n"


class ReplyDropper(LoopbackProxy):
    def __init__(self, redis_port: int) -> None:
        self._armed = threading.Event()
        self.dropped = 0  # answers lost so far
        self._lock = threading.Lock()
        super().__init__(redis_port)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def arm(self) -> None:
        """Lose the answer of the next transaction any client sends through the proxy."""
        self._armed.set()

    def serve(self, client: socket.socket) -> None:
        server = self.upstream()
        swallow = threading.Event()  # set once this connection's EXEC went out armed: its answer is lost
        threading.Thread(target=self._to_server, args=(client, server, swallow), daemon=True).start()
        threading.Thread(target=self._to_client, args=(server, client, swallow), daemon=True).start()

    def _to_server(self, client: socket.socket, server: socket.socket, swallow: threading.Event) -> None:
        with client, server:
            while data := received(client):
                with self._lock:
                    if EXEC in data and self._armed.is_set():
                        self._armed.clear()
                        swallow.set()
                server.sendall(data)

    def _to_client(self, server: socket.socket, client: socket.socket, swallow: threading.Event) -> None:
        while data := received(server):
            if swallow.is_set():  # the transaction's replies (its QUEUEDs and EXEC's answer): none reaches the client
                with self._lock:
                    self.dropped += 1
                for end in (client, server):
                    with contextlib.suppress(OSError):  # the other direction may have closed it already
                        end.shutdown(socket.SHUT_RDWR)
                return
            try:
                client.sendall(data)
            except OSError:
                return
