"""The node runner (cluster=ray): one restartable Ray actor per generation node, placed by
launch/ray_placement.py. It runs that node's servers and actor processes with the one-node code
(launch/node_processes.py, which starts them through launch/servers.py and launch/supervise.py), writes the
node's own launch record (`conf/nodes/<node>.json`), and hands the units of its leases to its actors over a
loopback HTTP endpoint (the routes are run/lease_protocol.py's; the actors' side is actor/units.py), as
they free up.

Every start is a new incarnation (a short random id): it is in the names of the node's actors and
servers, so their shards, logs and stats never mix with a predecessor's, even one still running on a
partitioned node. The children watch the runner's pid and exit with it (observe/logs.watch_parent);
the servers' process groups are also in the node record, and the next incarnation on the same host
kills any left (an SGLang server does not watch its parent).

With a store (storage.url) there is no shared folder: each runner start makes a scratch folder of its own on its
node's disk (run/store.py's `node_scratch`), takes the run's conf files from the store (units.json as soon as the
launcher puts it there), and runs its node's writer there too (`writer=<node>-<incarnation>`), which commits this
node's batches to the store. The launcher asks it to `flush` (commit what the node's shards hold now) when its
units are all written, and `stop` ends that writer once what it committed is in the store.

Owns: this node's children, its node record, and the queue of units its actors pull from.
Must never: import ray at module level (a local run imports nothing of Ray), decide which units are pending
in the run (the Ray placement's lease book does), or write streams itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shlex
import signal
import socket
import threading
import time
import uuid
from collections import deque
from pathlib import Path

import orjson
from omegaconf import OmegaConf

from pipegen.run.atomic import atomic_write_bytes
from pipegen.run.handshake import FINISH_SIGNAL, FLUSH_SIGNAL
from pipegen.run.lease_protocol import DONE_PATH, NEXT_PATH
from pipegen.launch.leases import open_units
from pipegen.launch.node_processes import NodeProcesses
from pipegen.launch.run_writer import RunWriter
from pipegen.launch.world import current_plan
from pipegen.observe.stats import across_processes, aggregate, stats_history
from pipegen.run.config import load_run_config
from pipegen.run.layout import NodeRecord, RunDir, node_actor_role
from pipegen.run.store import CONF_FILES, conf_key, node_scratch
from pipegen.transport.object_store import Store

log = logging.getLogger("pipegen.node")

LONG_POLL_S = 5.0  # an actor asking for units waits this long for a lease before it asks again
# torchrun/Slurm's node variables: the runner is one node of a Ray cluster, never a rank of another scheme
NODE_RANK_VARS = ("WORLD_SIZE", "RANK", "SLURM_NNODES", "SLURM_NODEID")
# Extra flags for every server of one node, from that node's environment (set where its `ray start`
# runs): nodes that differ (another GPU, a slower disk) get their own server flags.
NODE_SERVER_ARGS_ENV = "PIPEGEN_NODE_SERVER_ARGS"


class NodeQueue:
    """The units of this node's leases not yet taken by an actor, and the leases not yet taken or done.

    Shared by the lease endpoint's thread (take, done) and the runner's Ray calls (add, and the waits)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._units: deque[tuple[int, int]] = deque()  # (lease id, unit key), in lease order
        self._untaken: dict[int, int] = {}  # lease id -> its units no actor has taken yet
        self._open: dict[int, set[int]] = {}  # lease id -> its units not reported done
        self._held: dict[str, set[int]] = {}  # actor -> units it took and has not reported done
        self.finished = False  # the launcher needs nothing more from this node

    def add(self, lease_id: int, units: list[int]) -> None:
        with self._lock:
            self._units.extend((lease_id, u) for u in units)
            self._untaken[lease_id] = len(units)
            self._open[lease_id] = set(units)

    def take(self, actor: str, want: int) -> list[int]:
        with self._lock:
            taken = [self._units.popleft() for _ in range(min(want, len(self._units)))]
            for lease_id, _ in taken:
                self._untaken[lease_id] -= 1
            units = [u for _, u in taken]
            self._held.setdefault(actor, set()).update(units)
            return units

    def held_by(self, actor: str) -> list[int]:
        with self._lock:
            return sorted(self._held.get(actor, ()))

    def give_back(self, actor: str, units: list[int]) -> None:
        """`actor` died holding `units` (still open: not in a shard): first in line for the others."""
        with self._lock:
            self._held.pop(actor, None)
            lease_of = {u: lease_id for lease_id, waiting in self._open.items() for u in waiting}
            back = [(lease_of[u], u) for u in units if u in lease_of]
            self._units.extendleft(reversed(back))

    def done(self, units: list[int]) -> None:
        if not units:
            return
        with self._lock:
            finished = set(units)
            for waiting in self._open.values():
                waiting -= finished
            for held in self._held.values():
                held -= finished

    def take_back(self) -> list[int]:
        """Every unit no actor has taken yet, out of the queue and out of its lease (the launcher gives
        them to a node that ran dry)."""
        with self._lock:
            back = list(self._units)
            self._units.clear()
            for lease_id, unit in back:
                self._untaken[lease_id] = 0
                self._open[lease_id].discard(unit)
            return [u for _, u in back]

    def is_taken(self, lease_id: int) -> bool:
        with self._lock:
            return self._untaken.get(lease_id, 0) <= 0

    def is_done(self, lease_id: int) -> bool:
        """Every unit of the lease reported done (False for a lease this queue has not been given yet)."""
        with self._lock:
            if lease_id not in self._open or self._open[lease_id]:
                return False
            del self._open[lease_id]
            self._untaken.pop(lease_id, None)
            return True


class LeaseEndpoint:
    """The loopback HTTP side of the lease protocol, on its own thread and event loop."""

    def __init__(self, queue: NodeQueue):
        self.queue = queue
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, name="lease-endpoint", daemon=True).start()

    def _serve(self) -> None:
        from aiohttp import web

        async def next_units(request: web.Request) -> web.Response:
            body = orjson.loads(await request.read())
            self.queue.done(body.get("done") or [])
            deadline = time.monotonic() + LONG_POLL_S
            while True:
                units = self.queue.take(body["actor"], int(body.get("want") or 1))
                if units or self.queue.finished or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            return web.Response(body=orjson.dumps({"units": units, "finished": self.queue.finished and not units}),
                                content_type="application/json")

        async def done(request: web.Request) -> web.Response:
            self.queue.done(orjson.loads(await request.read()).get("done") or [])
            return web.Response(body=b"{}", content_type="application/json")

        async def serve() -> None:
            app = web.Application()
            app.router.add_post(NEXT_PATH, next_units)
            app.router.add_post(DONE_PATH, done)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.SockSite(runner, self.sock).start()
            await asyncio.Event().wait()

        asyncio.run(serve())


class NodeRunner:
    """A Ray actor (made remote by ray_placement.py): this node's servers, actors and lease queue."""

    def __init__(self, output_dir: str, node: str, launch: str, store_url: str | None = None):
        self.node = node
        self.incarnation = uuid.uuid4().hex[:6]
        self.store_url = store_url
        self.run = RunDir(node_scratch(store_url, f"{node}-{self.incarnation}") if store_url else Path(output_dir))
        self.host = socket.gethostname()
        self.error: str | None = None
        self.writer: RunWriter | None = None
        if store_url:
            self._conf_from_store()
        self._log_to_run_dir()
        self._sweep_previous()
        for var in NODE_RANK_VARS:
            os.environ.pop(var, None)
        cfg = load_run_config(self.run)
        self.n = int(cfg.actor_rollout_ref.rollout.n)
        plan = current_plan(OmegaConf.to_container(cfg.llm, resolve=True), cfg.actors.num_actors,
                            cfg.trainer.n_gpus_per_node)
        name = f"{node}-{self.incarnation}"
        extra = shlex.split(os.environ.get(NODE_SERVER_ARGS_ENV, ""))
        if extra:
            given = list(cfg.llm.server_args or [])
            cfg.llm.server_args = [list(given[i] if i < len(given) else []) + extra for i in range(len(plan.servers))]
        plan.servers = [dataclasses.replace(s, name=f"server_{name}-{i}") for i, s in enumerate(plan.servers)]
        self.queue = NodeQueue()
        self.endpoint = LeaseEndpoint(self.queue)
        self.processes = NodeProcesses(cfg, self.run)
        self.processes.start_servers(plan)
        actors = [node_actor_role(node, self.incarnation, k) for k in range(plan.num_actors)]
        self.run.write_node(NodeRecord(
            launch=launch, run_key=self.run.run_key(), servers=plan.urls, num_actors=plan.num_actors, node=node,
            incarnation=self.incarnation, host=self.host,
            server_pgids=[r.proc.pid for r in self.processes.sup.roles.values() if r.proc is not None]))
        for role in actors:
            self.processes.start_actor(role, role.removeprefix("actor_"), plan.num_actors, node=node,
                                       leases=self.endpoint.url)
        if store_url:  # this node's batches go to the store from this node: its own writer
            self.writer = RunWriter(cfg, self.run, f"{node}-{self.incarnation}")
            self.writer.start()
        log.info("%s incarnation %s on %s (pid %d): servers %s, actors %s, leases at %s", node, self.incarnation,
                 self.host, os.getpid(), ", ".join(plan.urls), ", ".join(actors), self.endpoint.url)
        threading.Thread(target=self._supervise, name="supervise", daemon=True).start()

    def _conf_from_store(self) -> None:
        """The run's contract from the store into this start's scratch folder; units.json once the launcher put it."""
        store = Store(str(self.store_url), patience_s=None)
        for folder in (self.run.conf, self.run.logs):
            folder.mkdir(parents=True, exist_ok=True)
        for name in CONF_FILES:
            data = store.get(conf_key(name)) if name != self.run.units_file.name else None
            if data is not None:
                atomic_write_bytes(self.run.conf / name, data)

        def manifest() -> None:  # the actors and the writer wait for it (run/handshake.py)
            while (data := store.get(conf_key(self.run.units_file.name))) is None:
                time.sleep(0.5)
            atomic_write_bytes(self.run.units_file, data)

        threading.Thread(target=manifest, name="manifest", daemon=True).start()

    def _log_to_run_dir(self) -> None:
        handler = logging.FileHandler(self.run.role_log(f"runner_{self.node}"))
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [runner_{self.node}] %(name)s: %(message)s",
                                               "%Y-%m-%d %H:%M:%S"))
        root = logging.getLogger("pipegen")
        root.addHandler(handler)
        root.setLevel(logging.INFO)

    def _sweep_previous(self) -> None:
        """Kill the servers a predecessor on this host left (a runner killed hard cannot stop them)."""
        earlier = ([RunDir(p) for p in self.run.root.parent.glob(f"{self.node}-*") if p != self.run.root]
                   if self.store_url else [self.run])  # with a store, each start has a folder of its own
        for run in earlier:
            self._sweep(run.read_node(self.node))

    def _sweep(self, previous: NodeRecord | None) -> None:
        if previous is None or previous.host != self.host:
            return
        for pgid in previous.server_pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
                log.warning("killed process group %d, a server of %s incarnation %s", pgid, self.node,
                            previous.incarnation)
            except (ProcessLookupError, PermissionError):
                pass

    def _supervise(self) -> None:
        actors = {name: role for name, role in self.processes.sup.roles.items() if name.startswith("actor_")}
        seen = {name: role.proc.pid if role.proc else None for name, role in actors.items()}
        while self.error is None:
            try:
                self.processes.sup.poll()
                for name, role in actors.items():  # a crashed actor's units go to the others (and to its restart)
                    pid = role.proc.pid if role.proc else None
                    if pid != seen[name]:
                        seen[name] = pid
                        self._recover_units_of(name)
                self.processes.check_servers()
                if self.writer is not None:
                    self.writer.ended()  # restarts it after a crash; it ends when stop asks it to
            except Exception as e:  # CrashLoop, ServerNotReady: this node cannot work; the launcher hears it
                self.error = f"{self.node}: {e}"
                log.error("%s", self.error)
            time.sleep(0.2)

    def _recover_units_of(self, actor: str) -> None:
        """An actor exited: the units it took are done if their line is in a shard, else queued again."""
        held = self.queue.held_by(actor)
        if not held:
            return
        still_open = open_units(self.run, self.n, held)
        self.queue.done(sorted(set(held) - set(still_open)))
        self.queue.give_back(actor, still_open)
        log.warning("%s exited holding %d unit(s): %d queued again for this node's actors", actor, len(held),
                    len(still_open))

    # ---- called by the Ray placement through Ray (async: a wait holds no thread, so leases may pile up) ----
    async def ping(self) -> dict:
        import ray

        return {"node": self.node, "incarnation": self.incarnation, "host": self.host, "pid": os.getpid(),
                "ray_node": ray.get_runtime_context().get_node_id(), "error": self.error}

    async def offer(self, lease_id: int, units: list[int]) -> int:
        """Queue the lease for this node's actors; returns once they have taken every unit of it (time for
        the launcher to send the next)."""
        self.queue.add(lease_id, units)
        await self._until(lambda: self.queue.is_taken(lease_id))
        return lease_id

    async def lease_done(self, lease_id: int) -> int:
        """Returns once every unit of the lease is in a shard (or a failure record): the lease is done."""
        await self._until(lambda: self.queue.is_done(lease_id))
        return lease_id

    async def take_back(self) -> list[int]:
        return self.queue.take_back()

    async def flush(self) -> bool:
        """With a store: this node's writer commits what the node's shards hold now and publishes it. False while
        it cannot be asked yet (not started, or restarting); the launcher asks again."""
        return self._signal_writer(FLUSH_SIGNAL)

    def _signal_writer(self, signum: int) -> bool:
        proc = self.writer.role.proc if self.writer is not None else None
        # publish.json exists once the writer listens: the signal's default action would end it
        if proc is None or proc.poll() is not None or not self.run.publish_state.exists():
            return False
        os.kill(proc.pid, signum)
        return True

    async def _until(self, condition) -> None:
        while not condition():
            if self.error is not None:
                raise RuntimeError(self.error)
            await asyncio.sleep(0.05)

    async def stop(self, grace_s: float = 30.0) -> dict[str, int]:
        """The run needs nothing more: actors finish and exit, then every child is stopped. Returns what its actors
        did (`actor_counts`), for the launcher's closing line."""
        self.queue.finished = True
        deadline = time.monotonic() + grace_s
        actors = {name: r for name, r in self.processes.sup.roles.items() if name.startswith("actor_")}
        while any(r.alive for r in actors.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.writer is not None and self._signal_writer(FINISH_SIGNAL):  # what it committed goes to the store
            # the supervise thread still runs and drops role.proc once it reaps the writer: poll our own reference
            writer = self.writer.role.proc
            while writer is not None and writer.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        self.error = "stopped"  # ends the supervise thread: nothing is restarted any more
        if self.writer is not None:
            self.writer.stop()
        self.processes.stop()
        return self.actor_counts(set(actors))

    def actor_counts(self, actors: set[str]) -> dict[str, int]:
        """Units completed and output tokens of this start's actors, every process of each counted, from their stats
        lines in this runner's folder (with a store, a folder on this node that the launcher cannot read)."""
        try:
            history = stats_history(self.run.stats)
            counts = aggregate(across_processes({role: lines for role, lines in history.items() if role in actors}))
        except Exception as e:  # the counts are for the closing line; the run's output does not depend on them
            log.warning("%s: its actors' stats could not be read: %s", self.node, e)
            return {}
        return {"completed": int(counts["actors/completed"]), "output_tokens": int(counts["actors/output_tokens"])}
