"""A run's storage in a real S3-compatible object store (SeaweedFS on loopback, one server for the module): every
unit committed there exactly once through create-if-absent segments, across writer kills between the object PUT
and the segment PUT and a store stopped for 30 s, and read back (verify, status, the merge, verl's DataProto) from
the store alone with every scratch folder deleted. Wrong credentials and a missing bucket are refused in one line
before anything generates."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FAKE_ENGINE, FAST, REPO
from pipegen.bench.doubles.seaweed import BUCKET, Seaweed

# FAST's batches of 4 rows; the quiet period left at a minute so each run commits exactly its full batches
STORE_RUN = [o for o in FAST if not o.startswith("generation.partial_batch_quiet_s")] + [
    FAKE_ENGINE, "generation.partial_batch_quiet_s=60", "storage.writer_id=node-0"]
UNITS = 12  # FAST: 6 prompts x n=2


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    server = Seaweed(tmp_path_factory.mktemp("seaweed"))
    server.start()
    yield server
    server.stop()


def pipegen(module: str, *args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


def store_of(seaweed: Seaweed, prefix: str):
    os.environ.update(seaweed.env())  # this process reads the store as a user's script would
    from pipegen.transport.object_store import Store

    return Store(f"s3://{BUCKET}/{prefix}")


def assert_exact_in_store(seaweed: Seaweed, prefix: str, units: int = UNITS) -> None:
    """Every unit of the run in exactly one committed segment, and `pipegen verify` passes from the store alone."""
    from pipegen.run.store import resolve

    segments = store_of(seaweed, prefix).segments()
    assert not any(dropped for _, dropped in resolve(segments)), "a unit is committed twice"
    assert sorted(k for seg in segments for k in seg.unit_keys()) == list(range(units))
    verified = pipegen("pipegen.status", f"s3://{BUCKET}/{prefix}", "--verify", env=seaweed.env())
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "every committed unit exactly once" in verified.stdout
    # a healthy store run's shards are on its nodes, not "damaged or removed"
    assert "damaged or removed" not in verified.stdout, verified.stdout
    assert "the shards stay in each node's scratch folder" in verified.stdout, verified.stdout


def test_a_store_run_whose_writer_is_killed_while_publishing_is_exact_from_the_store_alone(seaweed, tmp_path):
    """output_dir=s3://... with its scratch folder; the writer SIGKILLed twice between a batch object's PUT and its
    segment's PUT (each restarted life is killed at its second publish): every unit once. Then the scratch folder
    is deleted, and verify, status, the merge and verl's DataProto work from the store alone."""
    url, scratch = f"s3://{BUCKET}/kills", tmp_path / "scratch"
    env = seaweed.env(PIPEGEN_WRITER_FAULT="after_object_put:2")
    done = pipegen("pipegen.launch", f"output_dir={url}", f"storage.scratch_dir={scratch}", *STORE_RUN, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"committed to {url} (this node's scratch folder: {scratch})" in done.stdout
    # the closing summary names the output where the run keeps it, the store, beside this node's copy
    assert f"  trajectories: {url}/trajectories.pkl (this node's copy: {scratch.resolve()}/trajectories.pkl)" in \
        done.stdout, done.stdout
    # ... and keeps the rewards and responses lines (the committed rows say them)
    assert re.search(r"^  rewards:      mean -?[0-9.]+ over \d+ samples; pass@", done.stdout, re.M), done.stdout
    assert re.search(r"^  responses:    \d+ of \d+ reached the response limit", done.stdout, re.M), done.stdout

    store = store_of(seaweed, "kills")
    lives = {key.split("/")[2] for key in store.list("writers/node-0/") if "/manifest/" not in key}
    named = {seg.batch for seg in store.segments()}
    orphans = [key for key in store.list("writers/node-0/") if "/batch_" in key and key not in named]
    assert len(lives) >= 3 and len(orphans) >= 2, (lives, orphans)  # two lives died between object and segment
    shutil.rmtree(scratch)

    assert_exact_in_store(seaweed, "kills")
    status = pipegen("pipegen.status", url, env=seaweed.env())
    assert status.returncode == 0, status.stderr
    assert f"{UNITS}/{UNITS} samples committed" in status.stdout, status.stdout
    # merged in the store: status names it there, never "not merged: generation.final_merge=false"
    assert "not merged" not in status.stdout and f"trajectories: {url}/trajectories.pkl" in status.stdout, status.stdout
    store.delete("trajectories.pkl")  # the merge again, from the store alone
    merged = pipegen("pipegen.writer", f"output_dir={url}", env=seaweed.env())
    assert merged.returncode == 0, merged.stderr[-2000:]
    # `pipegen replay` on the store url: the run read back from the store alone, replayed into a local folder
    objects = store.list("")
    replayed = pipegen("pipegen.replay", url, "--units", "3", env=seaweed.env())
    assert replayed.returncode == 0 and "3 of 3 units identical" in replayed.stdout, replayed.stdout + replayed.stderr
    assert store.list("") == objects, "the replay wrote into the run's store"

    # a node thought lost that came back: its late segment commits units node-0 committed first; every reader keeps
    # node-0's copy ("node-0" sorts before "node-1"), so the run stays exact, and a filtered copy is a readable batch
    from pipegen.run.batchfile import read_batch
    from pipegen.run.store import Segment, resolve, segment_key
    from pipegen.transport.store_read import _without_units

    first = store.segments()[0]
    store.create(segment_key("node-1", 0), Segment(**{**first.__dict__, "writer": "node-1", "seq": 0}).to_bytes())
    assert [dropped for _, dropped in resolve(store.segments())][-1] == set(first.unit_keys())
    again = pipegen("pipegen.status", url, "--verify", env=seaweed.env())
    assert again.returncode == 0 and "every committed unit exactly once" in again.stdout, again.stdout
    kept, rows = _without_units(store.get(first.batch), {min(first.unit_keys())}, 2)
    (tmp_path / "kept.arrow").write_bytes(kept)
    assert len(read_batch(tmp_path / "kept.arrow").non_tensor["index"]) == rows == first.rows - 1

    # README's two lines: the merged output from the store, as verl's DataProto
    import pickle, obstore; from obstore.store import S3Store  # noqa: E401, E702 (as README has them)
    data = pickle.loads(obstore.get(S3Store.from_url(url, client_options={"allow_http": True}),
                                    "trajectories.pkl").bytes())
    assert type(data).__name__ == "DataProto" and len(data) == UNITS
    assert sorted(zip(data.non_tensor_batch["index"].tolist(), data.non_tensor_batch["sample"].tolist())) == sorted(
        {(int(i), int(s)) for i, s in zip(data.non_tensor_batch["index"], data.non_tensor_batch["sample"])})


def test_the_store_stopped_for_30_s_mid_run_loses_nothing_and_status_says_what_waits(seaweed, tmp_path):
    """storage.url beside a local output_dir; the store is stopped once the first batch is published and started
    again 30 s later on the same data folder: the actors keep streaming locally meanwhile, `pipegen status` says the
    store is unreachable and how many batches wait, and the run ends with every unit once in the store."""
    out, url = tmp_path / "run", f"s3://{BUCKET}/outage"
    slow = ["actors.concurrency=2", "llm.max_batch=2", "llm.engine_args=[--token-latency,0.1,--eos-prob,0]"]
    cmd = [sys.executable, "-m", "pipegen.launch", f"output_dir={out}", f"storage.url={url}",
           *[o for o in STORE_RUN if o not in ("actors.concurrency=8", "llm.max_batch=8")], *slow]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **seaweed.env()})
    try:
        deadline = time.monotonic() + 240
        while '"published": 1' not in _read(out / "publish.json"):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0][-3000:]
            time.sleep(0.2)
        seaweed.stop()
        stopped, lines_then = time.monotonic(), _lines(out)
        said = ""
        while not said and time.monotonic() - stopped < 28:
            status = pipegen("pipegen.status", str(out), env={})
            if "store unreachable for" in status.stdout and "waiting to publish" in status.stdout:
                said = next(line for line in status.stdout.splitlines() if "store unreachable" in line)
            time.sleep(1)
        time.sleep(max(0.0, 30 - (time.monotonic() - stopped)))
        assert said, status.stdout
        assert _lines(out) > lines_then  # the actors went on streaming while the store was away
        seaweed.start()
        output = launcher.communicate(timeout=300)[0]
        assert launcher.returncode == 0, output[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if seaweed.proc is None:
            seaweed.start()
    assert_exact_in_store(seaweed, "outage")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _lines(out: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in (out / "streams" / "rollouts").rglob("*.jsonl"))


@pytest.mark.parametrize("problem, env_change, bucket", [
    ("refused the credentials", {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, BUCKET),
    ("does not exist", {}, "no-such-bucket"),
])
def test_wrong_credentials_or_a_missing_bucket_are_refused_in_one_line_before_generating(seaweed, tmp_path, problem,
                                                                                           env_change, bucket):
    out = tmp_path / "run"
    refused = pipegen("pipegen.launch", f"output_dir={out}", f"storage.url=s3://{bucket}/x", *STORE_RUN,
                      env=seaweed.env(**env_change), timeout=120)
    assert refused.returncode == 2
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and problem in lines[0], refused.stderr
    assert not out.exists()  # nothing written, nothing started


def test_the_store_bench_writer_pass_commits_its_shard_once_in_objects_of_the_default_batch(seaweed, tmp_path):
    """The `store` bench scenario's writer pass (the real Writer and its publisher, fed a pre-written shard), twice
    under one prefix as writers w0 and w1: every record is in the store exactly once, each object holds the default
    64 records, and the gateway's own request count (what the scenario reports per record) saw each object and
    segment PUT. No timing is judged."""
    from pipegen.bench import store_writers as bench
    from pipegen.inputs.dataset import load_tokenizer
    from pipegen.writer.batches import BatchBuilder

    os.environ.update(seaweed.env())  # the pass runs in this process, as in the scenario's writer processes
    url, count, factory, builder = f"s3://{BUCKET}/bench-smoke", 128, None, None
    before = seaweed.requests()
    for i in range(2):
        cfg, run, factory = bench.prepare_writer(tmp_path / f"w{i}", i, count, url, factory, tokens=32)
        builder = builder or BatchBuilder(cfg, load_tokenizer(cfg))
        done = bench.writer_pass(cfg, run, builder, url, f"w{i}")
        assert done.records == count and done.end > done.start
    after = seaweed.requests()
    assert bench.check(url, 2 * count)["rows"] == [64] * 4  # raises if a unit is missing or committed twice
    assert after.get("PUT", 0) - before.get("PUT", 0) >= 2 * 4  # 4 objects and 4 segments, beside the conf copies
