"""cluster=ray, the launcher's side (`RayPlacement`, a placement as launch/placement.py defines one): join the
Ray cluster, place one node runner per generation node, and hand out leases of units until the run needs
no more. The head itself runs no servers or actors: only the launcher and the writer.

What Ray owns here: placement (a placement group with one bundle per node that has
`cluster.node_resource`, no hard node affinity, so a runner whose node died comes back on a replacement
node), liveness (a runner's Ray errors say its node is gone), and carrying leases to runners. What the
run directory owns: everything that must survive. Lease state lives in this process's memory only; a
relaunch rebuilds it from the checkpoint and the shards (leases.open_units).

On a Ray infrastructure error for a lease (actor died or unavailable, node died, ...), its units that
are still open go back to the front of the queue at once and the runner is probed until it answers
again (restarted: a new incarnation, shown as "rejoined"). A node that joins the cluster with the
resource gets a runner of its own (a one-bundle placement group). Every `cluster.stats_interval_s` the
state goes to streams/stats/cluster.jsonl (nodes, leases out per node, units leased again after a
loss), which `pipegen.status` shows.

With a store (storage.url) the nodes share no folder: the launcher puts the run's conf files into the store before
the runners start (units.json once read), each runner runs its own writer, and what is committed is what the
store's segments say (transport/object_store.py's `SegmentFollower`), never another node's disk. A lease then stays out until
its units are committed in the store (or listed failed), so a node lost after writing them, before its writer
published them, has them leased again; once a node's leases are all written and the queue is empty, its runner is
asked to `flush` (its writer commits the partial batch), every FLUSH_EVERY_S until they are committed. A unit a
node thought lost committed late stays committed once: every reader applies the store's tie-break.

Owns: the Ray connection of the launcher (verl's `ray_kwargs.ray_init` passed to ray.init, Ray's timeline written
where `ray_kwargs.timeline_json_file` names it, `trainer.nnodes` nodes used), the placement groups, the runners'
handles and the lease book. (Its settings are `cluster.*`, config/schema.py's RayCluster.)
Must never: write under the run directory except its stats line (and the timeline file the user names), read a node's disk when the run has a store, start processes on the head itself,
or pin a runner to a node (a hard-pinned actor never comes back after its node dies, measured on ray 2.60).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipegen.launch.leases import LeaseBook, open_units
from pipegen.launch.world import NodeInfo, WorldPlan
from pipegen.observe.stats import StatsAppender
from pipegen.run.stats_line import ClusterStats, NodeStats, ReleaseStats
from pipegen.run.layout import RunDir

log = logging.getLogger("pipegen.launch")

CLUSTER_ROLE = ClusterStats.ROLE  # its stats file: streams/stats/cluster.jsonl
PROBE_RETRY_S = 1.0
DISCOVER_EVERY_S = 2.0
STORE_POLL_S = 1.0  # with a store: how often its new segments are read
FLUSH_EVERY_S = 2.0  # with a store: how often a node whose units are all written is asked to commit them


class ClusterError(RuntimeError):
    """The cluster cannot run this job, with a one-line fix."""


def infrastructure_errors() -> tuple[type[BaseException], ...]:
    """Ray's errors meaning "the node or runner is gone", not "the work failed": lease again."""
    from ray import exceptions as rx

    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "ActorUnschedulableError", "NodeDiedError",
             "WorkerCrashedError", "ObjectLostError", "OwnerDiedError", "GetTimeoutError", "RaySystemError")
    return tuple(getattr(rx, name) for name in names if hasattr(rx, name))


def ray_init_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """verl's ray_kwargs.ray_init, as ray.init takes it (keys left null are Ray's defaults, left out)."""
    def kept(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: kept(v) for k, v in value.items() if v is not None and kept(v) != {}}
        return value

    return kept(OmegaConf.to_container(cfg.ray_kwargs.ray_init, resolve=True) or {})


def answers(address: str, timeout_s: float = 5.0) -> bool:
    """Something accepts TCP connections at a Ray address (`host:port`, optionally `ray://host:port`)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


@dataclass
class NodeSlot:
    """One runner: a bundle of a placement group, and what the launcher knows of it."""

    name: str
    handle: Any
    state: str = "starting"  # starting | alive | dead | failed
    incarnation: str = ""
    incarnations: int = 0  # starts seen; from the second on the node "rejoined"
    host: str = ""
    ray_node: str = ""
    error: str | None = None
    lost_at: float | None = None
    probe: Any = None  # the ObjectRef of a ping in flight
    probe_after: float = 0.0
    leased_units: int = 0
    leases_done: int = 0
    leases_lost: int = 0
    untaken: set[int] = field(default_factory=set)  # leases sent that its actors have not all taken yet
    takes: deque = field(default_factory=deque)  # (monotonic time, units) of leases its actors took
    taking_back: Any = None  # the ObjectRef of a take_back in flight
    units_taken_back: int = 0
    flushing: Any = None  # with a store: the ObjectRef of a flush in flight
    flushed_at: float = 0.0
    actor_counts: dict[str, int] = field(default_factory=dict)  # what its actors did, as its stop returned it

    def pace(self, window_s: float) -> float | None:
        """Units per second its actors took over the last `window_s` (None before they took any)."""
        now = time.monotonic()
        while self.takes and self.takes[0][0] < now - window_s:
            self.takes.popleft()
        if not self.takes:
            return None
        return sum(n for _, n in self.takes) / max(1.0, min(window_s, now - self.takes[0][0]))


@dataclass
class ClusterState:
    slots: dict[str, NodeSlot] = field(default_factory=dict)
    placement_groups: list = field(default_factory=list)
    bundles: int = 0


class RayPlacement:
    def __init__(self, cfg: DictConfig, run: RunDir):
        self.cfg = cfg
        self.run = run
        self.launch = ""  # the launch id, from the launch record once it is written
        self.ccfg = cfg.cluster
        self.n = int(cfg.actor_rollout_ref.rollout.n)
        self.resource = str(self.ccfg.node_resource)
        self.state = ClusterState()
        self.book: LeaseBook | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lease_refs: dict[Any, tuple[str, int, str]] = {}  # ObjectRef -> ("taken" | "done", lease id, node)
        self._infra: tuple[type[BaseException], ...] = ()
        self.stats: StatsAppender | None = None
        self.store_url = str(cfg.storage.url) if cfg.storage.url else None
        self.follower = None  # with a store: transport/object_store.py's SegmentFollower
        self._written: set[int] = set()  # with a store: leases whose units are all in a shard line, not yet committed
        self._polled = 0.0

    # ---- start ----
    def plan(self) -> WorldPlan:
        """The head runs the writer only; each node runner plans its own node."""
        return WorldPlan(NodeInfo(), num_actors=0)

    def place(self) -> None:
        """Join the cluster and place the runners; they start their nodes' servers and actors meanwhile."""
        self.launch = self.run.read_launch().launch
        self.stats = StatsAppender(self.run.stats, CLUSTER_ROLE)
        if self.store_url:  # the runners read the run's contract from the store: it is there before they start
            from pipegen.run.store import CONF_FILES, conf_key
            from pipegen.transport.object_store import SegmentFollower, Store

            store = Store(self.store_url, patience_s=None)
            for name in CONF_FILES:
                if (self.run.conf / name).exists():
                    store.put(conf_key(name), (self.run.conf / name).read_bytes())
            self.follower = SegmentFollower(store, self.launch)
        self.connect()
        self.place_runners()

    def connect(self) -> None:
        import ray

        address = str(self.ccfg.address)
        if address != "auto" and not answers(address):  # ray.init would retry an unreachable GCS for minutes
            raise ClusterError(f"cluster=ray: nothing answers at cluster.address={address}; start the cluster with "
                               f"`ray start --head` (README: Several nodes) or set cluster.address / RAY_ADDRESS")
        try:
            # verl's ray_kwargs.ray_init, then the connection pipegen's runners are found by (cluster.address, its
            # namespace), which a ray_init key cannot move
            ray.init(**{"logging_level": logging.WARNING, "log_to_driver": False, **ray_init_kwargs(self.cfg),
                        "address": address, "namespace": "pipegen"})
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ClusterError(f"cluster=ray: cannot join the Ray cluster at cluster.address={address} "
                               f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); start it with "
                               f"`ray start --head` (README: Several nodes) or set cluster.address") from None
        self._infra = infrastructure_errors()

    def generation_nodes(self) -> list[dict]:
        import ray

        return [n for n in ray.nodes() if n.get("Alive") and float(n.get("Resources", {}).get(self.resource, 0)) > 0]

    def place_runners(self) -> None:
        """One runner per node that has the node resource, in one STRICT_SPREAD placement group."""
        nodes = self.generation_nodes()
        if not nodes:
            raise ClusterError(f"cluster=ray: no node of the Ray cluster has the resource "
                               f"cluster.node_resource={self.resource}; start nodes with it (ray start "
                               f"--resources='{{\"{self.resource}\": 1}}') or name one they have")
        wanted = int(self.cfg.trainer.nnodes)
        if wanted > 1 and len(nodes) < wanted:
            raise ClusterError(f"trainer.nnodes={wanted}, but the Ray cluster has {len(nodes)} node(s) with "
                               f"cluster.node_resource={self.resource}: start more, or set trainer.nnodes={len(nodes)}")
        if wanted > 1:
            nodes = nodes[:wanted]
        self._add_runners([float(n["Resources"][self.resource]) for n in nodes])

    def _add_runners(self, amounts: list[float]) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pipegen.launch.node_runner import NodeRunner

        pg = placement_group([{self.resource: a} for a in amounts], strategy="STRICT_SPREAD",
                             name=f"pipegen-{self.launch[:8]}-{len(self.state.placement_groups)}")
        self.state.placement_groups.append(pg)
        remote = ray.remote(NodeRunner)
        for i, amount in enumerate(amounts):
            name = f"node{self.state.bundles}"
            self.state.bundles += 1
            need = {"num_gpus": amount} if self.resource == "GPU" else {"resources": {self.resource: amount}}
            handle = remote.options(
                num_cpus=0, **need, max_restarts=-1, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote(str(self.run.root), name, self.launch, self.store_url)
            self.state.slots[name] = NodeSlot(name, handle)
        log.info("placed %d node runner(s) (resource %s); %d in all", len(amounts), self.resource, self.state.bundles)

    def begin(self) -> None:
        """Lease the run's open units (rebuilt from the run directory) from a thread of this process."""
        if self.follower is not None:
            from pipegen.run.store import conf_key

            self.follower.store.put(conf_key(self.run.units_file.name), self.run.units_file.read_bytes())
        units = open_units(self.run, self.n, settled=self._settled())
        self.book = LeaseBook(units, int(self.ccfg.lease_min_units), int(self.ccfg.lease_max_units))
        log.info("%d units to lease across the cluster", len(units))
        self._thread = threading.Thread(target=self._loop_guarded, name="leases", daemon=True)
        self._thread.start()

    # ---- what the launcher asks while the run goes ----
    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return self.book is not None and self.book.done

    # ---- the lease loop ----
    def _loop_guarded(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the launcher's supervision raises it (check())
            self.error = e

    def _loop(self) -> None:
        import ray

        last_discover = last_stats = time.monotonic()
        while not self._stop.is_set():
            slots = self.state.slots.values()
            refs = (list(self._lease_refs) + [s.probe for s in slots if s.probe is not None]
                    + [s.taking_back for s in slots if s.taking_back is not None]
                    + [s.flushing for s in slots if s.flushing is not None])
            if refs:
                ready, rest = ray.wait(refs, num_returns=1, timeout=0.2)
                if ready and rest:
                    ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
            else:
                ready = []
                time.sleep(0.2)
            for ref in ready:
                if ref in self._lease_refs:
                    self._lease_returned(ref)
                elif any(s.taking_back == ref for s in slots):
                    self._taken_back(ref)
                elif any(s.flushing == ref for s in slots):
                    self._flushed(ref)
                else:
                    self._probe_returned(ref)
            self._probe_silent()
            self._hand_out()
            if self.follower is not None:
                self._follow_store()
            now = time.monotonic()
            if now - last_discover >= DISCOVER_EVERY_S:
                last_discover = now
                self._discover()
            if now - last_stats >= float(self.ccfg.stats_interval_s):
                last_stats = now
                self.write_stats()

    def _lease_returned(self, ref) -> None:
        import ray

        kind, lease_id, node = self._lease_refs.pop(ref)
        slot = self.state.slots[node]
        try:
            ray.get(ref)
        except self._infra as e:
            self._lose(slot, lease_id, f"{type(e).__name__}")
            return
        except Exception as e:  # the runner's own error: its servers or actors cannot run
            slot.state, slot.error = "failed", str(e).splitlines()[-1] if str(e) else type(e).__name__
            self._lose(slot, lease_id, slot.error)
            if all(s.state == "failed" for s in self.state.slots.values()):
                raise ClusterError(f"every node failed; last: {slot.error}") from None
            return
        if kind == "taken":
            if lease_id in slot.untaken:
                slot.untaken.discard(lease_id)
                lease = self.book.out.get(lease_id)
                slot.takes.append((time.monotonic(), len(lease.units) if lease else 0))
        elif self.follower is not None:  # written on that node's disk only: out until the store commits it
            if lease_id in self.book.out:
                self._written.add(lease_id)
        elif self.book.finish(lease_id) is not None:
            slot.leases_done += 1

    # ---- with a store: what is committed is what its segments say ----
    def _settled(self) -> set[int] | None:
        """With a store: the units its segments commit and those a node listed failed in this launch (read now)."""
        if self.follower is None:
            return None
        from pipegen.run.stream import parse_unit_label

        self.follower.refresh()
        self._polled = time.monotonic()
        return self.follower.committed | {self.n * i + s for i, s in map(parse_unit_label, self.follower.failed)}

    def _follow_store(self) -> None:
        """Leases whose units the store has settled are done; a node whose leases are all written while nothing
        is left to lease is asked to flush its writer."""
        if time.monotonic() - self._polled < STORE_POLL_S:
            return
        settled = self._settled()
        for lease_id in sorted(self._written):
            lease = self.book.out.get(lease_id)
            if lease is None or set(lease.units) <= settled:
                self._written.discard(lease_id)
                if lease is not None and self.book.finish(lease_id) is not None:
                    self.state.slots[lease.node].leases_done += 1
        if self.book.queue:
            return
        now = time.monotonic()
        for slot in self.state.slots.values():
            out = self.book.outstanding(slot.name)
            if (slot.state == "alive" and out and all(x.id in self._written for x in out) and slot.flushing is None
                    and now - slot.flushed_at >= FLUSH_EVERY_S):
                slot.flushed_at = now
                slot.flushing = slot.handle.flush.remote()

    def _flushed(self, ref) -> None:
        """A flush's answer; an infrastructure error means the node is gone: its leases go back to the queue."""
        import ray

        slot = next(s for s in self.state.slots.values() if s.flushing == ref)
        slot.flushing = None
        try:
            ray.get(ref)
        except self._infra as e:
            for lease in self.book.outstanding(slot.name):
                self._lose(slot, lease.id, type(e).__name__)

    def _lose(self, slot: NodeSlot, lease_id: int, why: str) -> None:
        self._written.discard(lease_id)
        settled = self._settled()
        release = self.book.lose(lease_id, lambda units: open_units(self.run, self.n, units, settled))
        if release is None:  # its other call already reported the loss
            return
        slot.leases_lost += 1
        slot.untaken.discard(lease_id)
        if slot.state != "failed":
            if slot.state != "dead":
                slot.lost_at = time.time()
                log.warning("%s (incarnation %s on %s) lost: %s; its open units are leased again", slot.name,
                            slot.incarnation, slot.host, why)
            slot.state = "dead"
            slot.untaken.clear()
            slot.takes.clear()
            slot.probe_after = time.monotonic() + PROBE_RETRY_S
        if release.units:
            log.info("%d unit(s) of %s's lease %d go back to the queue", release.units, slot.name, lease_id)
        if self.follower is not None:  # its written leases have no call in flight to report the loss: lost with it
            for lease in self.book.outstanding(slot.name):
                if lease.id in self._written:
                    self._lose(slot, lease.id, why)

    def _probe_silent(self) -> None:
        now = time.monotonic()
        for slot in self.state.slots.values():
            if slot.state in ("starting", "dead") and slot.probe is None and now >= slot.probe_after:
                slot.probe = slot.handle.ping.remote()

    def _answer(self, ref, call: str) -> tuple[NodeSlot, Any]:
        """The slot whose `call` ("probe" or "taking_back") returned `ref`, that call cleared, and its value:
        None after an infrastructure error (a lease's own calls report the loss)."""
        import ray

        slot = next(s for s in self.state.slots.values() if getattr(s, call) == ref)
        setattr(slot, call, None)
        try:
            return slot, ray.get(ref)
        except self._infra:
            return slot, None

    def _probe_returned(self, ref) -> None:
        slot, info = self._answer(ref, "probe")
        if info is None:
            slot.probe_after = time.monotonic() + PROBE_RETRY_S
            return
        if info["error"]:  # the runner's servers or actors cannot run (e.g. an engine that does not import)
            slot.state, slot.error = "failed", info["error"]
            slot.host, slot.ray_node = info["host"], info["ray_node"]  # its node stays taken: not placed again
            log.error("%s failed on %s: %s", slot.name, slot.host, slot.error)
            if all(s.state == "failed" for s in self.state.slots.values()):
                raise ClusterError(f"every node failed; last: {slot.error}")
            return
        if info["incarnation"] != slot.incarnation:
            slot.incarnations += 1
            if slot.incarnations > 1:
                log.info("%s rejoined: incarnation %s on %s, %.1fs after it was lost", slot.name,
                         info["incarnation"], info["host"], time.time() - (slot.lost_at or time.time()))
        slot.incarnation, slot.host, slot.ray_node = info["incarnation"], info["host"], info["ray_node"]
        slot.state = "alive"

    def _hand_out(self) -> None:
        """Keep `cluster.leases_per_node` leases waiting at every live node, each about
        `cluster.lease_seconds` of that node's recent pace (the smallest lease until it has one)."""
        alive = [s for s in self.state.slots.values() if s.state == "alive"]
        seconds = float(self.ccfg.lease_seconds)
        for slot in alive:
            while len(slot.untaken) < int(self.ccfg.leases_per_node):
                pace = slot.pace(2 * seconds)
                lease = self.book.issue(slot.name, len(alive), self.book.min_units if pace is None else pace * seconds)
                if lease is None:
                    self._balance_tail(alive)
                    return
                slot.leased_units += len(lease.units)
                slot.untaken.add(lease.id)
                self._lease_refs[slot.handle.offer.remote(lease.id, lease.units)] = ("taken", lease.id, slot.name)
                self._lease_refs[slot.handle.lease_done.remote(lease.id)] = ("done", lease.id, slot.name)

    def _balance_tail(self, alive: list[NodeSlot]) -> None:
        """The queue is empty: when a node has run dry while another still has units its actors have not
        started, take those back (they go to whichever node asks next). The backlog of a slow node would
        otherwise set the end of the run."""
        if not any(not s.untaken for s in alive) or any(s.taking_back is not None for s in alive):
            return
        # only leases that waited a while: a lease just handed out is not a backlog yet (and taking it back at
        # once would bounce units between two nodes on every turn of the loop)
        seconds, now = float(self.ccfg.lease_seconds), time.time()
        backlog = [s for s in alive if any(now - self.book.out[i].issued_at > seconds
                                           for i in s.untaken if i in self.book.out)]
        if backlog:
            def backlog_s(slot: NodeSlot) -> float:  # seconds of unstarted work at the node's recent pace
                units = sum(len(self.book.out[i].units) for i in slot.untaken if i in self.book.out)
                return units / (slot.pace(4 * seconds) or 1e-3)

            slot = max(backlog, key=backlog_s)
            slot.taking_back = slot.handle.take_back.remote()

    def _taken_back(self, ref) -> None:
        slot, units = self._answer(ref, "taking_back")
        if units:
            self.book.take_back(slot.name, units)
            slot.units_taken_back += len(units)

    def _discover(self) -> None:
        """A node that joined with the resource gets a runner of its own (a one-bundle placement group),
        unless a runner waiting to come back (dead, or not placed yet) will take it."""
        slots = self.state.slots.values()
        occupied = {s.ray_node for s in slots if s.state in ("alive", "failed")}
        free = [n for n in self.generation_nodes() if n["NodeID"] not in occupied]
        waiting = sum(1 for s in slots if s.state in ("dead", "starting"))
        if len(free) > waiting:
            self._add_runners([float(n["Resources"][self.resource]) for n in free[waiting:]])

    # ---- status ----
    def write_stats(self, final: bool = False) -> None:
        if self.stats is None:  # not placed
            return
        book = self.book
        self.stats.append(ClusterStats(
            final=final,
            nodes={s.name: NodeStats(state=s.state, rejoined=s.incarnations > 1 and s.state == "alive",
                                     host=s.host, incarnation=s.incarnation, incarnations=s.incarnations,
                                     leases_out=len(book.outstanding(s.name)) if book else 0,
                                     units_out=sum(len(x.units) for x in book.outstanding(s.name)) if book else 0,
                                     units_leased=s.leased_units, leases_done=s.leases_done,
                                     leases_lost=s.leases_lost, units_taken_back=s.units_taken_back,
                                     error=s.error, completed=s.actor_counts.get("completed"),
                                     output_tokens=s.actor_counts.get("output_tokens"))
                   for s in self.state.slots.values()},
            units_queued=len(book.queue) if book else 0,
            units_released=book.units_released() if book else 0,
            releases=[ReleaseStats(node=r.node, units=r.units, left=r.left, lost_at=r.lost_at,
                                   all_leased_again_after_s=(round(r.all_leased_at - r.lost_at, 2)
                                                             if r.all_leased_at is not None else None))
                      for r in (book.releases if book else [])][-20:],
        ))

    # ---- end ----
    def stop(self) -> None:
        """Stop the lease loop, let every runner stop its children, and give the bundles back."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        stops = {s.handle.stop.remote(): s for s in self.state.slots.values() if s.state == "alive"}
        if stops:
            done, _ = ray.wait(list(stops), num_returns=len(stops), timeout=45)
            for ref in done:
                try:
                    stops[ref].actor_counts = ray.get(ref) or {}
                except Exception as e:  # a runner that failed to stop cleanly: its counts stay unknown
                    log.warning("%s did not stop cleanly: %s", stops[ref].name, e)
        try:
            self.write_stats(final=True)  # with each stopped runner's counts
        except Exception as e:  # the end state is shown best-effort; stopping the runners matters more
            log.warning("cluster stats: %s", e)
        for pg in self.state.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception as e:  # the cluster may already be gone
                log.warning("removing a placement group: %s", e)
        timeline = self.cfg.ray_kwargs.timeline_json_file
        if timeline:  # verl's ray_kwargs.timeline_json_file: Ray's timeline of the run, as verl's trainer writes it
            try:
                ray.timeline(filename=str(timeline))
                log.info("Ray's timeline written to %s", timeline)
            except Exception as e:  # the timeline is a by-product: the run's end matters more
                log.warning("ray_kwargs.timeline_json_file=%s: %s", timeline, e)
        ray.shutdown()
