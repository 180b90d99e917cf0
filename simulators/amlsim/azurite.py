"""Azurite, Microsoft's Azure Storage emulator (npm `azurite`), as the workspace's blob store: its blob
service only, over HTTPS with the simulator's certificate, in a directory of the test's own."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

ACCOUNT = "devstoreaccount1"  # Azurite's well-known development account and its published key
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
START_TIMEOUT_S = 60.0


class AzuriteNotInstalled(RuntimeError):
    pass


class Azurite:
    def __init__(self, root: Path, cert: Path, key: Path) -> None:
        self.root, self.cert, self.key = root, cert, key
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        executable = shutil.which("azurite-blob")
        if executable is None:
            raise AzuriteNotInstalled("azurite-blob is not on PATH: npm install -g azurite")
        self.root.mkdir(parents=True, exist_ok=True)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._log = (self.root / "azurite.log").open("wb")
        self._process = subprocess.Popen(
            [executable, "--silent", *self._options()],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"azurite exited ({self._process.returncode}): {self.log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"azurite did not listen on port {self.port} within {START_TIMEOUT_S} s: {self.log_tail()}")

    def _options(self) -> list[str]:
        """--skipApiVersionCheck: the SDK may speak a newer storage API version than this Azurite knows."""
        return [
            "--skipApiVersionCheck",
            f"--location={self.root / 'data'}",
            "--blobHost=127.0.0.1",
            f"--blobPort={self.port}",
            f"--cert={self.cert}",
            f"--key={self.key}",
        ]

    @property
    def url(self) -> str:
        """The account's path-style URL (what the simulator itself uses; the SDK uses the account's host name)."""
        return f"https://127.0.0.1:{self.port}/{ACCOUNT}"

    def log_tail(self) -> str:
        path = self.root / "azurite.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
