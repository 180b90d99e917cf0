"""Free loopback ports, for the servers tests start themselves."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000
_PICK = random.SystemRandom()  # not `random`: pytest-randomly seeds it alike in every xdist worker


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range. The kernel hands ports of that range to
    every outgoing connection (the suite opens thousands, to Redis above all) and to every bind to port 0, so
    one found free there could be taken before the server it is for binds it (ci48: Docker's `address already
    in use`)."""
    ephemeral = int(_EPHEMERAL.read_text().split()[0]) if _EPHEMERAL.exists() else 32768
    while True:
        port = _PICK.randrange(_LOWEST, ephemeral)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
