"""A loopback TCP proxy in front of a manager that goes down on cue: at the first request whose bytes hold `trigger`
(not passed on), it closes that connection and every new one at once, as a manager that died there would, until
`up()`. An outage tied to where a client is in its requests, not to a clock."""

from __future__ import annotations

import contextlib
import socket
import threading


class HttpOutage:
    def __init__(self, manager_port: int, trigger: bytes) -> None:
        self._manager_port = manager_port
        self._trigger = trigger
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.down = threading.Event()
        self._armed = True
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def tripped(self) -> bool:
        """Whether the trigger came (and the outage began)."""
        return not self._armed

    def up(self) -> None:
        """Answer again (the manager came back)."""
        self.down.clear()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            if self.down.is_set():
                client.close()
                continue
            manager = socket.create_connection(("127.0.0.1", self._manager_port))
            threading.Thread(target=self._to_manager, args=(client, manager), daemon=True).start()
            threading.Thread(target=_pass, args=(manager, client), daemon=True).start()

    def _to_manager(self, client: socket.socket, manager: socket.socket) -> None:
        with client, manager:
            while data := _received(client):
                with self._lock:
                    if self._armed and self._trigger in data:
                        self._armed = False
                        self.down.set()
                if self.down.is_set():
                    for end in (client, manager):
                        with contextlib.suppress(OSError):
                            end.shutdown(socket.SHUT_RDWR)
                    return
                manager.sendall(data)


def _pass(source: socket.socket, target: socket.socket) -> None:
    while data := _received(source):
        try:
            target.sendall(data)
        except OSError:
            return


def _received(end: socket.socket) -> bytes:
    try:
        return end.recv(65536)
    except OSError:
        return b""
