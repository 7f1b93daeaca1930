"""A real redis-server on a free loopback port for the streams=redis tests, with AOF persistence (appendonly yes,
appendfsync always) in its own folder, so a test can SIGKILL it and start it again on the same port and data.

Debian's redis-server is installed by `./launch.sh --tests` where apt-get can run; elsewhere `redis_server()`
skips the test and says why.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

SKIP_WHY = ("redis-server is not installed: ./launch.sh --tests installs Debian's redis-server where apt-get can "
            "run (as root), or apt-get install redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """redis-server on 127.0.0.1:`port`, its data (the AOF) in `folder`."""

    def __init__(self, folder: Path, appendonly: bool = True):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip(SKIP_WHY)
        self.binary = binary
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.appendonly = appendonly
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always", "--save", ""]
        log = open(self.folder / "redis.log", "ab")
        self.process = subprocess.Popen(argv, stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        while True:
            try:
                if self.client().ping():
                    return
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {(self.folder / 'redis.log').read_text()[-800:]}")
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no shutdown save; what survives is what the AOF holds."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
