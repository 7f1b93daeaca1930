"""Child processes on one node: its servers (each with a readiness watch), its actors, and the writer.

The local placement, a node runner (each node under cluster=ray) and the launcher's writer each hold one, so
none of them imports another.
Owns: a Supervisor, the servers' command lines put to work, their readiness watches, an actor's command line
(built here alone), and the stop of every child. Must never: decide which units run (each actor's share, or
the lease book), or outlive a stop with a child still running.
"""

from __future__ import annotations

import logging
import sys
import time

import orjson

from omegaconf import DictConfig, OmegaConf

from pipegen.config.schema import is_reproducible
from pipegen.launch.servers import ServerWatch, check_server_python, server_launches, server_python
from pipegen.launch.supervise import Role, Supervisor
from pipegen.launch.world import WorldPlan
from pipegen.run.layout import RunDir

# the engine each llm kind starts, as the log names it once a server answers (the protocol is SGLang's for two)
SERVING = {"cpu": "pipegen's CPU server, SGLang's protocol", "sglang": "SGLang", "vllm": "vLLM"}

log = logging.getLogger("pipegen.launch")


class NodeProcesses:
    def __init__(self, cfg: DictConfig, run: RunDir):
        self.cfg = cfg
        self.run = run
        self.sup = Supervisor(run)
        self.watches: list[ServerWatch] = []  # one per server URL
        self.launch_started = run.read_launch().started  # the origin of every start-up phase

    def role(self, name: str, argv: list[str], env: dict[str, str] | None = None, restartable: bool = True) -> Role:
        gen = self.cfg.generation
        return self.sup.add(Role(name, argv, env or {}, self.run.role_log(name), restartable,
                                 int(gen.restart_limit), float(gen.restart_window_s)))

    def start_actor(self, name: str, rank: int | str, num_actors: int, node: str | None = None,
                    leases: str | None = None) -> None:
        """Start one actor process; under cluster=ray it names its node and its runner's lease endpoint."""
        argv = [sys.executable, "-m", "pipegen.actor", f"output_dir={self.run.root}", f"rank={rank}",
                f"num_actors={num_actors}"]
        argv += [f"node={node}"] if node is not None else []
        argv += [f"leases={leases}"] if leases is not None else []
        self.sup.start(self.role(name, argv))

    def start_servers(self, plan: WorldPlan) -> None:
        """Start this node's servers and a watch on every URL; returns at once (servers load meanwhile)."""
        llm = OmegaConf.to_container(self.cfg.llm, resolve=True)
        llm["reproducible"] = is_reproducible(self.cfg)
        if llm["kind"] != "cpu" and plan.servers:
            problem = check_server_python(llm["kind"], server_python(llm))
            if problem:
                raise ValueError(problem)
        roles = []
        launches = server_launches(plan.servers, self.cfg.actor_rollout_ref.model.path, llm, int(self.cfg.seed))
        for server, (argv, env) in zip(plan.servers, launches):
            role = self.role(server.name, argv, env)
            role.group = "servers"  # one server crash-looping must not end a run the others can finish
            self.sup.start(role)
            roles.append((server, role))
        timeout = float(llm["ready_timeout_s"])
        protocol = str(llm["protocol"])
        serving = SERVING[llm["kind"]] if llm["kind"] in SERVING else llm["kind"]
        self.watches = [ServerWatch(server.name, server.url, timeout, role, protocol, serving).start()
                        for server, role in roles]
        self.watches += [ServerWatch("external server", url, timeout, None, protocol).start()
                         for url in plan.external_urls]
        log.info("waiting for %d server(s) to answer; actors and writer start meanwhile", len(self.watches))

    def check_servers(self) -> None:
        """Log each server once it answers. A server that dies or misses llm.ready_timeout_s ends the run
        (ServerNotReady, quoting its log) when no other server answers; else the others carry on."""
        ready = [w for w in self.watches if w.ready_after_s is not None]
        for watch in self.watches:
            if watch.logged:
                continue
            if watch.ready_after_s is not None:
                watch.logged = True
                log.info("%s ready at %s (%s): answered %.1fs after the launch started%s", watch.name,
                         watch.url, watch.serving or f"speaks {watch.protocol}'s protocol",
                         watch.ready_at - self.launch_started,
                         f"; it reports {orjson.dumps(watch.facts).decode()}" if watch.facts else "")
                if watch.facts:
                    self.run.record_engine(watch.url, watch.facts)
            elif watch.error is not None and ready:
                watch.logged = True
                log.error("%s did not become ready; %d other server(s) carry on: %s", watch.name, len(ready),
                          watch.error)
        if self.watches and not ready and all(w.error is not None for w in self.watches):
            raise self.watches[0].error

    def stop(self) -> None:
        """Stop every child. A server stopped here logs the SIGTERM in its own way (SGLang: "Subprocess
        scheduler_0 ... crashed with exit code -15"), so its log gets a line first saying it is this stop."""
        servers = [r for r in self.sup.roles.values() if r.group == "servers" and r.alive]
        for role in servers:
            try:
                with open(role.log_path, "ab") as f:  # O_APPEND: safe beside the server's own writes
                    f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} pipegen stops {role.name} (SIGTERM): "
                            f"exit codes -15 reported below are this stop, not a crash =====\n".encode())
            except OSError:
                pass
        self.sup.stop_all()
        if servers:
            log.info("stopped %s (SIGTERM, a normal stop)", ", ".join(r.name for r in servers))
