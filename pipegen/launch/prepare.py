"""Everything the launcher does before a process starts, in one function: `prepare(argv)`.

In order: --help; the job's one resolved config (launch/job.py: composed, type-checked, output_dir and the
inputs' short names resolved; nothing written); with storage.url, the store asked once (transport/object_store.py's
`refusal`: wrong credentials, a missing bucket, an unreachable endpoint); the placement chosen (torchrun's or Slurm's node variables
without cluster=ray are refused); the reward settings checked (the user's reward function loaded once); the
preflight (launch/preflight.py: the reward called once on the first row, the harness imported); then,
the first write, the one launcher of the directory locked; the stream medium checked (streams=redis: Redis
reachable, with AOF); the resume guard; the task files written; the run's small files checked; an external
server's reachability and the dataset's files checked; a run that is already complete found; this node's
plan made and the launch record written. Each refusal is one line naming
the fix, before anything is started, and a refused launch never changes a run that holds generated data.

Owns: DIR/conf/launch.json, the launcher lock and the moment the task files are written (DIR/conf/config.yaml
and fingerprint.json through launch/resume.py; DIR/conf/units.json through launch/unit_manifest.py, later).
Must never: start a process, write into the run directory before it holds the lock, or read the whole dataset
(that happens while the servers load).
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from dataclasses import dataclass

from omegaconf import DictConfig

from pipegen.config.compose import describe_config_error, help_text
from pipegen.config.invocation import command
from pipegen.inputs.dataset import check_files
from pipegen.launch.job import JobRefused, compose_job, resolve_job
from pipegen.launch.placement import Placement, placement_for
from pipegen.launch.preflight import preflight
from pipegen.launch.resume import check_run_files, guard_resume
from pipegen.launch.servers import ServerNotReady, check_reachable
from pipegen.launch.world import check_gpus_per_node
from pipegen.observe.console import refuse
from pipegen.observe.logs import setup_logging
from pipegen.observe.summary import print_plan
from pipegen.rewards.spec import resolve_reward_settings
from pipegen.run.checkpoint import load_checkpoint
from pipegen.run.layout import LaunchRecord, RunDir
from pipegen.run.medium import medium_refusal
from pipegen.run.ownership import DirectoryLock, LockHeld
from pipegen.tasks.materialize import write_task_files

USAGE = """\
usage: {run} output_dir=DIR [key=value ...]   (or: {other} ...; ./launch.sh output_dir=DIR ...)

Generates trajectories for every (prompt, sample) of a verl-format parquet dataset and writes
DIR/trajectories.pkl (a verl DataProto). Re-running the same command resumes an interrupted run.

Common overrides:
  model_path=PATH|smollm2-135m    model folder (default: the embedded SmolLM2-135M-Instruct)
  train_files=PATH|demo           verl parquet file(s) (default: pipegen's 96 demo arithmetic problems)
  n=4  max_samples=-1              samples per prompt; prompts to use (-1 = all)
  temperature=0.7 max_response_length=512 max_prompt_length=1024
  llm=sglang llm.tp=2              SGLang servers on this node's GPUs (./launch.sh sets SGLang up)
  llm=vllm                         vLLM servers on this node's GPUs, or its CPU (./launch.sh sets vLLM up)
  llm=external 'llm.urls=[http://127.0.0.1:30000]'
  actors.num_actors=2 actors.concurrency=64
  generation.save_batch_size=256 generation.show_progress=false
  actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent
  actor_rollout_ref.rollout.multi_turn.tool_config_path=conf/tools/calculator.yaml
  'trainer.logger=[console,wandb]'  log metrics (and upload the artifact) with verl's Tracking
  --config-path DIR --config-name generation   a config file of your own, the Hydra way (seed 000's generation.yaml
                                   on verl's ppo_trainer); trainer.default_local_dir=DIR names the run's folder too

pipegen's keys, with their current values (overrides given with --help are applied):
"""


def print_help(overrides: list[str]) -> None:
    try:
        run = command("run")
        print(USAGE.format(run=run, other="python -m pipegen.launch" if run.startswith("pipegen") else "pipegen run"))
        try:
            cfg = compose_job([o for o in overrides if o not in ("--help", "-h")] + ["output_dir=DIR"])  # as a launch
            print(help_text(cfg))
            print("\nEach key's one default, type and rule live in pipegen/config/schema.py.")
        except Exception as e:  # help must print even when an override is broken
            print(f"(could not compose the config: {describe_config_error(e)})")
        sys.stdout.flush()
    except BrokenPipeError:
        # `--help | head` closed the pipe: point stdout at /dev/null so the final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@dataclass
class Prepared:
    """What a run needs once prepare() has passed: its config (resolved, saved), its directory (locked), the
    placement chosen for it, and whether the run is complete already (then nothing starts)."""

    cfg: DictConfig
    run: RunDir
    placement: Placement
    n: int  # samples per prompt
    num_actors: int  # actor processes this launcher starts itself (0 when a cluster runs them)
    complete: bool
    lock: DirectoryLock  # held until this process exits (the kernel releases it even on SIGKILL)


def prepare(argv: list[str]) -> Prepared | int:
    """Every check and write before a process starts. Returns what the run needs, or the exit code of a launch
    that ends here: 0 after --help, 2 after a one-line refusal (printed)."""
    if "--help" in argv or "-h" in argv:
        print_help(argv)
        return 0
    setup_logging("launch")
    try:
        job = resolve_job(argv)  # the one resolved config, its engine chosen; nothing is written yet
    except JobRefused as e:
        return refuse(str(e))
    cfg, run = job.cfg, job.run
    if cfg.storage.url:  # wrong credentials, no bucket, no store at the endpoint: refused before anything runs
        from pipegen.transport.object_store import refusal

        problem = refusal(str(cfg.storage.url))
        if problem:
            return refuse(problem)
    try:
        placement = placement_for(cfg, run)  # node variables without cluster=ray
        if cfg.cluster.kind == "local":  # more GPUs than this machine has (a Ray node checks its own)
            check_gpus_per_node(cfg.trainer.n_gpus_per_node)
            if int(cfg.trainer.nnodes) > 1:
                raise ValueError(f"trainer.nnodes={cfg.trainer.nnodes}: several nodes run through a Ray cluster; "
                                 f"add cluster=ray (README: Several nodes), or set trainer.nnodes=1")
        resolve_reward_settings(cfg)  # the reward function's file made absolute, and loaded once as a check
        problem, checked = preflight(cfg)  # what would fail every unit, before any unit runs
        if problem:
            return refuse(problem)
    except (ValueError, RuntimeError) as e:
        return refuse(str(e))
    print_plan(cfg, run, job.engine_reason)  # the launch's first line: what will run, on which engine and why
    for note in job.notes:  # what verl's (or the seed's) keys were taken to mean
        print(f"  note: {note}", flush=True)
    if checked:
        print(checked, flush=True)
    run.root.mkdir(parents=True, exist_ok=True)
    lock = DirectoryLock(run.launcher_lock, role="launcher", name_host=True)
    try:
        lock.acquire()  # the first write into the run directory
    except LockHeld as e:
        return refuse(str(e))
    # medium_refusal before the guard saves this launch's config: an unreachable Redis, one without AOF, a switch of
    # medium that would strand the last launch's lines
    problem = medium_refusal(run, cfg) or guard_resume(cfg, run, job.pending) or check_run_files(run)
    if problem:
        return refuse(problem)
    write_task_files(job.tasks)  # after the guard: a refused launch writes no task file
    root_logger = logging.getLogger()  # the launcher's log lines also go to DIR/logs/launch.log
    file_handler = logging.FileHandler(run.role_log("launch"))
    file_handler.setFormatter(root_logger.handlers[0].formatter)
    root_logger.addHandler(file_handler)
    try:
        if cfg.llm.kind == "external":  # before the dataset: reading a big one takes minutes
            for url in cfg.llm.urls or []:
                check_reachable(str(url).rstrip("/"))
        if not run.units_file.exists():
            check_files(cfg)  # the parquet footers: seconds, before any process starts
        ckpt = load_checkpoint(run.checkpoint)
        n = int(cfg.actor_rollout_ref.rollout.n)
        complete = (run.units_file.exists() and ckpt.complete and not ckpt.failed
                    and (run.merged_output() is not None) == bool(cfg.generation.final_merge))
        if complete:
            return Prepared(cfg, run, placement, n, 0, True, lock)
        plan = placement.plan()
    except (ServerNotReady, ValueError) as e:  # PlanError is a ValueError
        return refuse(str(e))
    if plan.gpu_line(cfg.llm):
        print(f"  {plan.gpu_line(cfg.llm)}", flush=True)
    run.write_launch(LaunchRecord(launch=uuid.uuid4().hex, run_key=run.run_key(), servers=plan.urls,
                                  num_actors=plan.num_actors * plan.node.world_size))
    return Prepared(cfg, run, placement, n, plan.num_actors, False, lock)
