"""cluster=local: a run's generation on this node alone, its servers and actors as one NodeProcesses.

Each actor takes its own share of the pending units from the manifest, so there is nothing to hand out.
Owns: this node's plan (launch/world.py) put to work. Must never: start the writer (the launcher does), or
run as one of several nodes (torchrun's and Slurm's node variables are refused: several nodes run through
cluster=ray, which leases the units and re-leases a lost node's).
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from pipegen.launch.node_processes import NodeProcesses
from pipegen.launch.world import PlanError, WorldPlan, current_plan, node_info
from pipegen.run.layout import RunDir, actor_role


class LocalPlacement:
    def __init__(self, cfg: DictConfig, run: RunDir):
        node = node_info(os.environ)
        if node.world_size > 1:
            raise PlanError(f"this environment says node {node.rank} of {node.world_size} (WORLD_SIZE/RANK or "
                            f"SLURM_NNODES): several nodes run through a Ray cluster, started once on the head with "
                            f"cluster=ray (README: Several nodes); unset those variables to run on this node alone")
        self.cfg = cfg
        self.run = run
        self._plan: WorldPlan | None = None
        self.processes: NodeProcesses | None = None

    def plan(self) -> WorldPlan:
        self._plan = current_plan(OmegaConf.to_container(self.cfg.llm, resolve=True), self.cfg.actors.num_actors,
                                  self.cfg.trainer.n_gpus_per_node)
        return self._plan

    def place(self) -> None:
        plan = self._plan
        self.processes = NodeProcesses(self.cfg, self.run)
        self.processes.start_servers(plan)
        for rank in range(plan.num_actors):
            self.processes.start_actor(actor_role(rank), rank, plan.num_actors)

    def begin(self) -> None:
        pass  # each actor reads the manifest and takes its share

    def check(self) -> None:
        self.processes.sup.poll()
        self.processes.check_servers()

    def done(self) -> bool:
        return all(role.finished for name, role in self.processes.sup.roles.items() if name.startswith("actor_"))

    def stop(self) -> None:
        if self.processes is not None:
            self.processes.stop()
