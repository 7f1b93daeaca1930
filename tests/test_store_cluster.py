"""A Ray cluster with no shared folder (issue 44): two generation nodes on loopback, each with its own HOME and
scratch root, the head with its own, and one real S3-compatible store (SeaweedFS, one server for the module). Every
node runs its own writer, which commits its node's batches to the store; the head follows the store and merges from
it. The runs end exact in the store, `verify` passes from the store alone and verl's DataProto reads the merged
output; a node lost after some of its batches were committed has its uncommitted units run again by the other node,
and its committed ones stay committed once. With streams=redis (a real redis-server, AOF on), a node's writer killed
before its XACK and a Redis restart mid-run give the files run's trajectories, and generation.keep_streams=false
deletes each node's stream once what its writer committed is in the store.

How "no role writes outside its own scratch and the store" is checked: every process of a node gets that node's
HOME and PIPEGEN_NODE_SCRATCH (through its raylet's environment, as `ray start` would give them), the launcher the
head's HOME and storage.scratch_dir. After a run, each node's scratch holds only runner folders whose shards are
that runner's own actors', no two nodes hold the same runner, the head's scratch holds no shard, runner log or node
record, and the default locations under the test's real HOME (~/.cache/pipegen/{scratch,nodes,store}/<bucket>/
<prefix>) were never made; under the module's folder nothing exists but the head's and the nodes' own folders."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import FAKE_ENGINE, FAST, REPO, assert_same_trajectories
from test_status import kill_orphans_of, wait_for
from test_store import assert_exact_in_store, pipegen, seaweed, store_of  # noqa: F401 (seaweed: the module's server)

from pipegen.bench.doubles.loopback_cluster import LOOPBACK_ENV, add_generation_node
from pipegen.bench.doubles.seaweed import BUCKET, Seaweed
from pipegen.run.layout import RunDir

NODE_RESOURCE = "pipegen_store_node"
# FAST's small prompts and batches of 4, at the default quiet period (300 s): a node's last partial batch is
# committed because the launcher asks its runner to flush, not by a timer
CLUSTER_RUN = [o for o in FAST if not o.startswith("generation.partial_batch_quiet_s")] + [
    FAKE_ENGINE, "cluster=ray", f"cluster.node_resource={NODE_RESOURCE}", "generation.show_progress=false"]


@pytest.fixture(scope="module")
def nodes(seaweed, tmp_path_factory):  # noqa: F811
    """A loopback Ray cluster (a head without the resource) and two generation nodes, each with its own folders."""
    from pipegen.bench.doubles.loopback_cluster import loopback_cluster

    root = tmp_path_factory.mktemp("cluster")
    with loopback_cluster() as cluster:
        added = []
        for k in range(2):
            home, scratch = root / f"node{k}" / "home", root / f"node{k}" / "scratch"
            home.mkdir(parents=True)
            env = {**seaweed.env(), "HOME": str(home), "PIPEGEN_NODE_SCRATCH": str(scratch)}
            added.append((add_generation_node(cluster, NODE_RESOURCE, env), scratch))
        cluster.wait_for_nodes()
        yield cluster, added, root


def start_head(seaweed: Seaweed, cluster, root: Path, prefix: str, model: str,  # noqa: F811
               *overrides: str) -> tuple[subprocess.Popen, Path]:
    head_home, head_scratch = root / "head" / "home", root / "head" / prefix
    head_home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **LOOPBACK_ENV, **seaweed.env(), "HOME": str(head_home), "RAY_ADDRESS": cluster.address}
    log = open(root / f"launcher-{prefix}.log", "w+")
    launcher = subprocess.Popen([sys.executable, "-m", "pipegen.launch", f"output_dir=s3://{BUCKET}/{prefix}",
                                 f"storage.scratch_dir={head_scratch}", f"model_path={model}", *CLUSTER_RUN, *overrides], cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    launcher.log = log
    return launcher, head_scratch


def finish(launcher: subprocess.Popen, timeout: float) -> str:
    try:
        launcher.wait(timeout=timeout)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        kill_orphans_of(launcher.pid)
        launcher.log.seek(0)
    return launcher.log.read()


def runners_of(scratch: Path, prefix: str) -> list[Path]:
    return sorted(p for p in (scratch / prefix).iterdir()) if (scratch / prefix).exists() else []


def assert_each_role_kept_to_its_own_folders(nodes, prefix: str, head_scratch: Path,
                                             shards: bool = True) -> list[list[str]]:
    """See the module docstring. Returns each node's runner names. `shards`: the run's lines went through shard files
    (streams=files), each runner's own actors'; else no runner holds a shard."""
    _, added, root = nodes
    seen = []
    for _, scratch in added:
        names = []
        for runner in runners_of(scratch, prefix):
            names.append(runner.name)
            if shards:
                actors = {p.name for p in (runner / "streams" / "rollouts").iterdir()}
                assert actors and all(a.startswith(f"actor_{runner.name}-") for a in actors), (runner, actors)
            else:
                assert not list(runner.glob("streams/rollouts/*/*.jsonl")), f"a shard in {runner}"
        seen.append(names)
    assert all(seen) and not set(seen[0]) & set(seen[1]), seen  # each node ran a runner of its own
    head = RunDir(head_scratch)
    assert not head.rollouts.exists() or not any(head.rollouts.rglob("*.jsonl")), "a shard in the head's scratch"
    assert not head.nodes.exists() and not list(head.logs.glob("runner_*")), "a node wrote into the head's scratch"
    for place in ("scratch", "nodes", "store"):
        assert not (Path.home() / ".cache" / "pipegen" / place / BUCKET / prefix).exists(), place
    allowed = {root / "head", *(root / f"node{k}" for k in range(len(added)))}
    strays = [p for p in root.iterdir() if p not in allowed and not p.name.startswith("launcher-")]
    assert not strays, strays
    return seen


def units_of(data) -> list[tuple[int, int]]:
    return sorted((int(i), int(s)) for i, s in zip(data.non_tensor_batch["index"], data.non_tensor_batch["sample"]))


# two units at a time per node, ~2 s each: a node that starts seconds after the other still finds leased units it
# has not started (taken back for it), so both nodes' writers commit, whatever the machine's load. The fake engine
# answers by seed and context alone, so every run with these settings has the same trajectories.
TWO_NODE_RUN = ["actors.concurrency=2", "llm.engine_args=[--token-latency,0.08,--eos-prob,0]"]


@pytest.fixture(scope="module")
def two_node_run(seaweed, nodes, tiny_model) -> tuple[str, Path, subprocess.Popen, str]:  # noqa: F811
    """The two-node run with the files medium (the default): prefix, head scratch, launcher, console."""
    cluster, _, root = nodes
    prefix = f"two-nodes-{uuid.uuid4().hex[:6]}"  # a name no earlier run left in ~/.cache
    launcher, head_scratch = start_head(seaweed, cluster, root, prefix, tiny_model, *TWO_NODE_RUN)
    console = finish(launcher, 400)
    return prefix, head_scratch, launcher, console


def trajectories_in_store(prefix: str):
    import pickle, obstore; from obstore.store import S3Store  # noqa: E401, E702 (as README has them)
    return pickle.loads(obstore.get(S3Store.from_url(f"s3://{BUCKET}/{prefix}", client_options={"allow_http": True}),
                                    "trajectories.pkl").bytes())


@pytest.mark.timeout(600)
def test_two_nodes_with_no_shared_folder_commit_every_unit_once_to_the_store(seaweed, nodes, two_node_run):  # noqa: F811
    prefix, head_scratch, launcher, console = two_node_run
    assert launcher.returncode == 0, console[-4000:]
    writers = {seg.writer for seg in store_of(seaweed, prefix).segments()}
    assert len(writers) == 2, writers  # both nodes' writers committed to the store
    runners = assert_each_role_kept_to_its_own_folders(nodes, prefix, head_scratch)
    assert writers == {name for names in runners for name in names}
    assert_exact_in_store(seaweed, prefix)

    data = trajectories_in_store(prefix)  # README's two lines: verl's DataProto from the store
    assert type(data).__name__ == "DataProto"
    assert units_of(data) == [(i, s) for i in range(6) for s in range(2)]
    # the closing line counts the nodes' tokens, though their actors' stats stay on the nodes' disks
    counts = re.search(r"done: 12 samples \(12 trajectories\), (\d+) output tokens \(as each node's runner counted "
                       r"its actors when it stopped\); this launch: (\d+) samples, (\d+) output tokens", console)
    kept = int(data.batch["response_mask"].sum())
    assert counts and int(counts[1]) == int(counts[3]) == kept and int(counts[2]) == 12, (kept, console[-3000:])
    # the summary names the store's objects and keeps the rewards and responses lines (the lines stay on the nodes:
    # the committed rows say them)
    assert f"  trajectories: s3://{BUCKET}/{prefix}/trajectories.pkl (this node's copy: " in console, console[-3000:]
    assert re.search(r"^  rewards:      mean -?[0-9.]+ over 12 samples; pass@2 ", console, re.M), console[-3000:]
    assert re.search(r"^  responses:    \d+ of 12 reached the response limit \(24 tokens\)", console, re.M), \
        console[-3000:]
    from pipegen.observe.run_status import gather, render

    shown = render(gather(RunDir(head_scratch)))  # `pipegen status` in the head's folder: each node's own counts
    per_node = [int(t) for t in re.findall(r"its actors had completed \d+ sample\(s\), (\d+) output tokens", shown)]
    assert len(per_node) == 2 and sum(per_node) == kept, shown


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    from support.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


def node_streams(added, prefix: str) -> dict[Path, str]:
    """streams=redis: each runner start's scratch folder and its rollout stream, named in that folder's
    conf/streams.json (made there by the first of its processes that asks)."""
    found = {}
    for _, scratch in added:
        for runner in runners_of(scratch, prefix):
            if RunDir(runner).streams_file.exists():
                found[runner] = RunDir(runner).stream_key("rollouts")
    return found


@pytest.mark.timeout(600)
def test_redis_streams_on_two_nodes_give_the_files_output_through_a_writer_killed_before_its_xack_and_a_redis_restart(
        seaweed, nodes, tiny_model, two_node_run, redis_server):  # noqa: F811
    """streams=redis on the two-node cluster with no shared folder: each runner start's actors XADD to a stream of
    its own, which that node's writer reads as a consumer group. A node's writer SIGKILLed while it holds entries it
    read and has not acknowledged, then Redis SIGKILLed and started again on its AOF: the store holds every unit
    once, with the same trajectories as the files run. generation.keep_streams=false: each node's writer deletes its
    stream at its end, once what it committed is in the store."""
    from pipegen.run.ownership import lock_holder

    cluster, added, root = nodes
    prefix = f"redis-{uuid.uuid4().hex[:6]}"
    launcher, head_scratch = start_head(seaweed, cluster, root, prefix, tiny_model, *TWO_NODE_RUN, "streams=redis",
                                        f"streams.redis_url={redis_server.url}", "generation.keep_streams=false")
    client = redis_server.client()
    try:
        def a_writer_holding_unacknowledged_entries() -> tuple[Path, int] | None:
            for runner, key in node_streams(added, prefix).items():
                try:
                    pending = int(client.xpending(key, "pipegen-writers")["pending"])
                except Exception:  # the group is not made yet
                    continue
                pid = lock_holder(RunDir(runner).writer_lock) if pending else None
                if pid is not None:
                    return runner, pid
            return None

        killed, pid = wait_for(a_writer_holding_unacknowledged_entries, 300, "a node's writer holding unacknowledged "
                               "entries", launcher, poll=0.02)
        os.kill(pid, signal.SIGKILL)
        redis_server.kill()  # what it acknowledged is in its AOF (appendfsync always)
        time.sleep(3)  # units finish meanwhile: their actors hold the lines and retry
        redis_server.start()  # the same port and folder
    finally:
        console = finish(launcher, 400)
    assert launcher.returncode == 0, console[-4000:]
    # the summary names no stream of the head's own (it holds nothing): each node's, and that they are gone
    assert (f"/streams/ (stats); each node's own Redis stream at "
            f"{redis_server.url}, each deleted by its writer once its commits were in the store "
            f"(generation.keep_streams=false)") in console, console[-3000:]
    assert_each_role_kept_to_its_own_folders(nodes, prefix, head_scratch, shards=False)
    assert_exact_in_store(seaweed, prefix)  # (its verify makes the read cache under HOME: after the check above)
    streams = node_streams(added, prefix)
    assert len(set(streams.values())) == len(streams) >= 2, streams  # one stream per runner start
    logs = {runner: "".join(p.read_text() for p in (runner / "logs").glob("*.log")) for runner in streams}
    # generation.keep_streams=false: each node's writer deleted its rollout stream once its commits were in the store
    assert not any(client.exists(key) for key in streams.values()), logs
    assert "read by an earlier writer and never acknowledged (XPENDING)" in logs[killed], "the restarted writer"
    assert any("is unreachable" in text and "line(s) held in memory" in text for text in logs.values())
    files_prefix, _, files_launcher, files_console = two_node_run
    assert files_launcher.returncode == 0, files_console[-4000:]
    assert_same_trajectories(trajectories_in_store(prefix), trajectories_in_store(files_prefix))


@pytest.mark.timeout(600)
def test_a_node_lost_after_committing_has_its_uncommitted_units_run_elsewhere_and_keeps_its_commits_once(
        seaweed, nodes, tiny_model):  # noqa: F811
    cluster, added, root = nodes
    prefix = f"node-lost-{uuid.uuid4().hex[:6]}"
    units = 16 * 2
    # ~2.4 s a unit, two at a time per node: one node alone needs ~40 s for the 32 units, time for the other's runner
    # to start beside a loaded machine (at 1 s a unit, beside the suite and a CPU hog, one node did them all first)
    launcher, head_scratch = start_head(seaweed, cluster, root, prefix, tiny_model, "max_samples=16", "actors.concurrency=2",
                                        "llm.max_batch=2", "llm.engine_args=[--token-latency,0.1,--eos-prob,0]")
    store = store_of(seaweed, prefix)
    try:
        def committed_by_both() -> dict:
            segments = store.segments()
            by_writer = {}
            for seg in segments:
                by_writer.setdefault(seg.writer, []).append(seg)
            return by_writer if len(by_writer) == 2 and len(segments) * 4 < units - 8 else {}

        by_writer = wait_for(committed_by_both, 300, "a committed batch from each node's writer", launcher)
        lost_writer = sorted(by_writer)[0]
        lost = next(k for k, (_, scratch) in enumerate(added) if (scratch / prefix / lost_writer).exists())
        cluster.remove_node(added[lost][0], allow_graceful=False)
        kept = [seg.batch for seg in store.segments(lost_writer)]
    finally:
        console = finish(launcher, 400)
    assert launcher.returncode == 0, console[-4000:]
    # "this launch" counts what this launch committed, the lost node's commits included (its runner's counts are gone)
    assert re.search(rf"done: {units} samples .*; this launch: {units} samples, \d+ output tokens \(a lost node's "
                     rf"output tokens are not counted\)", console), console[-3000:]
    assert [seg.batch for seg in store.segments(lost_writer)][:len(kept)] == kept  # its commits stay
    assert_exact_in_store(seaweed, prefix, units)
    from pipegen.observe.run_status import gather

    cluster_line = gather(RunDir(head_scratch)).cluster
    assert cluster_line is not None and cluster_line.units_released > 0, cluster_line  # ran again elsewhere
    merged = pipegen("pipegen.status", f"s3://{BUCKET}/{prefix}", env=seaweed.env())
    assert f"{units}/{units} samples committed" in merged.stdout, merged.stdout


def test_the_head_counts_what_every_writer_commits_and_the_failures_of_this_launch_only(seaweed):  # noqa: F811
    """The head's view of the store (what leases and the end wait on): each writer's segments read once and
    incrementally, and a node's failed units settled only when listed for this launch and committed nowhere."""
    from pipegen.run.store import Segment, failed_key, segment_key
    from pipegen.transport.object_store import SegmentFollower
    from pipegen.run.stream import UnitKeys
    from pipegen.writer.store_head import failed_uncommitted

    store = store_of(seaweed, f"follow-{uuid.uuid4().hex[:6]}")

    def commit(writer: str, seq: int, units: list[list[int]]) -> None:
        seg = Segment(writer, seq, "life", f"writers/{writer}/life/batch_{seq:05d}.arrow", 1, "0" * 64, 1, units)
        assert store.create(segment_key(writer, seq), seg.to_bytes())

    follower = SegmentFollower(store, launch="this-launch")
    commit("node0-aaaaaa", 0, [[0, 4]])
    follower.refresh()
    assert follower.committed == set(range(4))
    commit("node0-aaaaaa", 1, [[4, 6]])
    commit("node1-bbbbbb", 0, [[6, 8]])
    store.put(failed_key("node1-bbbbbb"), b'{"launch": "this-launch", "units": {"4:0": "spent", "4:1": "spent"}}')
    store.put(failed_key("node0-aaaaaa"), b'{"launch": "an-earlier-launch", "units": {"5:0": "spent"}}')
    follower.refresh()
    assert follower.committed == set(range(8)) and len(follower.segments) == 3  # each segment once
    # unit 4:0 (key 8) failed and is committed nowhere; 4:1 (key 9) too; 5:0 was another launch's failure
    assert failed_uncommitted(follower, UnitKeys(2)) == {"4:0": "spent", "4:1": "spent"}
    commit("node0-aaaaaa", 2, [[8, 9]])  # 4:0 succeeded after all on another node: committed, no longer failed
    follower.refresh()
    assert failed_uncommitted(follower, UnitKeys(2)) == {"4:1": "spent"}


def test_this_launch_counts_what_the_store_got_from_it_when_a_node_was_lost(tmp_path):
    """The closing line's "this launch" on a cluster with a store: what the store holds that it did not at this
    launch's start, the lost node's commits included; its tokens are the runners' that stopped, and it says so."""
    from types import SimpleNamespace

    from pipegen.observe.console import run_counts
    from pipegen.observe.stats import StatsAppender
    from pipegen.run.stats_line import ClusterStats, NodeStats, WriterStats

    run = RunDir(tmp_path / "run")
    cluster = StatsAppender(run.stats, ClusterStats.ROLE)
    cluster.append(ClusterStats(final=True, nodes={"a": NodeStats(state="alive", completed=12, output_tokens=300),
                                                   "b": NodeStats(state="dead")}))
    head = StatsAppender(run.stats, WriterStats.ROLE)
    head.append(WriterStats(committed=8, committed_before=8, units_total=40))
    head.append(WriterStats(final=True, committed=40, committed_before=8, units_total=40))
    snap = SimpleNamespace(metrics={}, output_tokens=0)
    assert run_counts(run, snap, {}).endswith(
        "; this launch: 32 samples, 300 output tokens (a lost node's output tokens are not counted).")
