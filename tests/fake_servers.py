"""Test helpers: pipegen's reference server with the fake engine as a real subprocess on a loopback port, the fake
SGLang that takes grouped (batched, streamed) requests,
the recording proxy in front of it, a launcher run with `llm=external`, and small dataset builders.

The launcher stops the servers it starts, so tests that read a server's /pipegen_stats after a run, give
servers different fault flags, or put a proxy in front, start the servers here and attach the launcher
with `llm=external 'llm.urls=[...]'`.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson

from pipegen.launch.servers import ServerProcess
from pipegen.run.layout import RunDir, list_shards

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
FAKE_ENGINE_CLASS = "pipegen.bench.doubles.fake_backend:FakeBackend"


class Proc(ServerProcess):
    """A test server subprocess (pipegen's shared ServerProcess) that reports its port through a file."""

    def __init__(self, name: str, tmp: Path, argv: list[str]):
        tmp.mkdir(parents=True, exist_ok=True)
        self.name = name
        super().__init__(argv, tmp / f"{name}.log", port_file=tmp / f"{name}.port", env={"OMP_NUM_THREADS": "1"},
                         cwd=REPO)
        self.start()

    @property
    def port(self) -> int:
        deadline = time.monotonic() + 60
        while (port := super().port) is None:
            assert self.alive, f"{self.name} exited:\n{self.log_tail()}"
            assert time.monotonic() < deadline, f"{self.name} never bound a port:\n{self.log_tail()}"
            time.sleep(0.02)
        return port

    def get(self, path: str, timeout: float = 10):
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as resp:
            return resp.status, resp.read()

    def wait_ready(self, timeout: float = 60) -> "Proc":
        return super().wait_ready(timeout)


class FakeServer(Proc):
    """`python -m pipegen.cpu_server --engine <the fake engine> ...` (extra flags: --script, --fail-rate, ...)."""

    def __init__(self, name: str, tmp: Path, model: str, *args: str, seed: int = 0, port: int = 0):
        port_file = tmp / f"{name}.port"
        argv = [sys.executable, "-m", "pipegen.cpu_server", "--engine", FAKE_ENGINE_CLASS, "--model-path", model,
                "--host", HOST, "--port", str(port), "--port-file", str(port_file), "--stats-interval", "0",
                "--seed", str(seed), *args]
        super().__init__(name, tmp, argv)

    def stats(self) -> dict:
        return orjson.loads(self.get("/pipegen_stats")[1])


class FakeSGLang(Proc):
    """`python -m pipegen.bench.doubles.fake_sglang`: SGLang's batched, streamed /generate with a per-request
    front-end cost (extra flags: --front-ms, --step-ms, --max-running, --crash-on-request, ...)."""

    def __init__(self, name: str, tmp: Path, *args: str):
        argv = [sys.executable, "-m", "pipegen.bench.doubles.fake_sglang", "--port", "0",
                "--port-file", str(tmp / f"{name}.port"), *args]
        super().__init__(name, tmp, argv)

    def stats(self) -> dict:
        return orjson.loads(self.get("/fake_stats")[1])


class RecordingProxy(Proc):
    """tests/recording_proxy.py in front of one upstream; `entries()` reads its log."""

    def __init__(self, name: str, tmp: Path, upstream: str, *args: str):
        self.log_file = tmp / f"{name}.requests.jsonl"
        argv = [sys.executable, str(REPO / "tests" / "recording_proxy.py"), "--upstream", upstream,
                "--port-file", str(tmp / f"{name}.port"), "--log", str(self.log_file), *args]
        super().__init__(name, tmp, argv)

    def entries(self) -> list[dict]:
        if not self.log_file.exists():
            return []
        return [orjson.loads(line) for line in self.log_file.read_bytes().splitlines() if line]


def pids_where(proc_file: str, matches) -> list[int]:
    """Pids whose /proc/<pid>/<proc_file> ("cmdline" or "environ"), split on NULs, satisfies matches. A role
    forked with verl preloaded (pipegen/launch/forks.py) carries its command as one process title, split here
    into its words as `ps` and `pgrep -f` read it."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / proc_file).read_bytes().split(b"\0")
        except OSError:
            continue
        if proc_file == "cmdline" and len([f for f in fields if f]) == 1:
            fields = [word.encode() for word in shlex.split(fields[0].decode(errors="replace"))]
        if matches(fields):
            found.append(int(d.name))
    return found


def launch_external(out: Path, urls: list[str], *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The real launcher attached to servers started by the test."""
    from conftest import launch

    url_list = ",".join(urls)
    return launch(out, "llm=external", f"llm.urls=[{url_list}]", *overrides, timeout=timeout)


def write_dataset(path: Path, rows: list[dict]) -> str:
    """A verl-format parquet (gsm8k layout) from dicts with at least `content`; returns its path.

    Optional keys per row: `ground_truth` (default "5"), `agent_name`, `data_source` (default openai/gsm8k).
    """
    import pandas as pd

    records = []
    for i, r in enumerate(rows):
        rec = {
            "data_source": r.get("data_source", "openai/gsm8k"),
            "prompt": [{"role": "user", "content": r["content"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(r.get("ground_truth", "5"))},
            "extra_info": {"split": "train", "index": int(r.get("index", i))},
        }
        if "agent_name" in r:
            rec["agent_name"] = r["agent_name"]
        records.append(rec)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(records).to_parquet(path)
    return str(path)


def read_records(out: Path, topic: str = "rollouts") -> list[dict]:
    """Every complete line of every shard of a run's topic, in shard order."""
    recs = []
    shards = list_shards(getattr(RunDir(out), topic))
    for shard in [s for actor in sorted(shards) for s in shards[actor]]:
        for line in shard.read_bytes().splitlines(keepends=True):
            if line.endswith(b"\n"):
                rec = orjson.loads(line)
                rec["_shard"] = f"{shard.parent.name}/{shard.name}"
                recs.append(rec)
    return recs
