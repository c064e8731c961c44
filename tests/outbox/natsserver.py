"""A NATS server with JetStream of the test's own: a free port, a temporary store, restartable mid-run.

Tests never touch a NATS server the machine may already run (on 4222 or elsewhere): each starts
Debian's ``nats-server -js`` (``make nats`` installs it) on a port of its own with its own store
directory, so it can kill and restart the stream engine and find the stream's file store again.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def nats_server_binary() -> str:
    """The nats-server executable; skips the test when it is not installed (``make nats`` installs it)."""
    found = shutil.which("nats-server") or (
        "/usr/sbin/nats-server" if os.access("/usr/sbin/nats-server", os.X_OK) else None
    )
    if found is None:
        pytest.skip("Debian's nats-server is not installed (make test installs it: apt-get install -y nats-server)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    """``nats-server -js`` on 127.0.0.1:<free port> with its store in ``store_dir``; ``kill()``/``start()`` at will."""

    def __init__(self, store_dir: Path):
        self.binary = nats_server_binary()
        self.store_dir = Path(store_dir)
        self.port = _free_port()
        self.process: subprocess.Popen | None = None
        self.log_path = self.store_dir / "nats-server.log"
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        """Start the server (the same port and store as before); returns once it accepts connections."""
        assert self.process is None or self.process.poll() is not None, "already running"
        self.store_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store_dir)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server did not start: {self.log_path.read_text()[-2000:]}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server (the stream engine crashes: nothing is flushed on purpose)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def restart(self, down_s: float = 0.0) -> None:
        """Kill, stay down ``down_s``, start again on the same port and store."""
        self.kill()
        time.sleep(down_s)
        self.start()
        self.restarts += 1

    def stop(self) -> None:
        self.kill()


@pytest.fixture
def nats_server(tmp_path):
    """A running :class:`NatsServer` of this test's own, stopped at the end."""
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()
