"""A loopback TCP proxy in front of a manager that goes down on cue: at the first request whose bytes hold `trigger`
(not passed on), it closes that connection and every new one at once, as a manager that died there would, until
`up()`. An outage tied to where a client is in its requests, not to a clock."""

from __future__ import annotations

import contextlib
import socket
import threading

from tests.support.loopback_proxy import LoopbackProxy, received


class HttpOutage(LoopbackProxy):
    def __init__(self, manager_port: int, trigger: bytes) -> None:
        self._trigger = trigger
        self.down = threading.Event()
        self._armed = True
        self._lock = threading.Lock()
        super().__init__(manager_port)

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

    def serve(self, client: socket.socket) -> None:
        if self.down.is_set():
            client.close()
            return
        manager = self.upstream()
        threading.Thread(target=self._to_manager, args=(client, manager), daemon=True).start()
        threading.Thread(target=_pass, args=(manager, client), daemon=True).start()

    def _to_manager(self, client: socket.socket, manager: socket.socket) -> None:
        with client, manager:
            while data := received(client):
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
    while data := received(source):
        try:
            target.sendall(data)
        except OSError:
            return
