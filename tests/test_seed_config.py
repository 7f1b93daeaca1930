"""Seed 000's own job, as its users write it: its generation.yaml (verl's ppo_trainer through
`pkg://verl.trainer.config`, plus the generation keys the seed sets) passed the Hydra way with
`--config-path/--config-name`, its two-key command line with `trainer.default_local_dir`, and
`pipegen.run_generation(cfg)` on the config `hydra.compose` gives. Each runs on the CPU with
`trainer.n_gpus_per_node=0` and leaves checkpoint.json, the batch files and trajectories.zip, every row once.
Around them, the seed's keys one at a time: each honoured, or refused in one line naming the fix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pipegen
from conftest import FAKE_ENGINE, FAST, REPO, assert_verified, load_trajectories
from pipegen.config.config_file import expand, overrides_of
from pipegen.config.verl_keys import translate_with_notes

# Seed 000's generation.yaml as it prints it, with the searchpath spelt for an installed verl.
SEED_YAML = """\
hydra:
  searchpath:
    - pkg://verl.trainer.config

defaults:
  - ppo_trainer
  - _self_

actor_rollout_ref:
  model:
    path: ???
  rollout:
    name: sglang
    mode: async
    n: 2
    temperature: 1.0
    prompt_length: 1024
    response_length: 4096
    tensor_model_parallel_size: 1
    data_parallel_size: 1
    pipeline_model_parallel_size: 1
    gpu_memory_utilization: 0.85

data:
  train_files: ???
  max_prompt_length: 1024
  max_response_length: 4096

reward_model:
  enable: false
  use_reward_loop: false
  enable_resource_pool: false

trainer:
  project_name: generation
  experiment_name: gen_${now:%Y%m%d_%H%M%S}
  default_local_dir: outputs/${trainer.project_name}/${trainer.experiment_name}
  nnodes: 1
  n_gpus_per_node: 8
  logger: [console]

ray_kwargs:
  ray_init:
    num_cpus: null
  timeline_json_file: null

generation:
  save_batch_size: 512
  pull_timeout: 60

tasks: null
"""

# small and fast: the CPU server's deterministic double, six demo prompts, short answers, small batch files
SMALL = [FAKE_ENGINE, *[o for o in FAST if not o.startswith(("n=", "generation.partial_batch_quiet_s"))],
         "generation.pull_timeout=0.3"]


@pytest.fixture()
def seed_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "seed"
    folder.mkdir()
    (folder / "generation.yaml").write_text(SEED_YAML)
    return folder


def _launch(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipegen.launch", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def _assert_every_row_once(out: Path, prompts: int, n: int) -> None:
    assert (out / "checkpoint.json").is_file() and (out / "trajectories.zip").is_file()
    assert sorted(out.glob("batch_*.arrow")), "no batch files"
    assert_verified(out)
    data = load_trajectories(out / "trajectories.pkl")
    units = list(zip(data.non_tensor_batch["index"].tolist(), data.non_tensor_batch["sample"].tolist()))
    assert len(units) == len(set(units)) == prompts * n


def test_the_seeds_generation_yaml_runs_unchanged_on_the_cpu(seed_dir: Path, tmp_path: Path, tiny_model: str) -> None:
    out = tmp_path / "run"
    result = _launch("--config-path", str(seed_dir), "--config-name", "generation",
                     f"actor_rollout_ref.model.path={tiny_model}", "data.train_files=[demo]",
                     f"trainer.default_local_dir={out}", "trainer.n_gpus_per_node=0", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_every_row_once(out, prompts=6, n=2)  # the file's rollout.n=2
    lines = result.stdout.splitlines()
    assert ("llm=cpu: trainer.n_gpus_per_node=0, so actor_rollout_ref.rollout.name=sglang is served by pipegen's "
            "CPU server, which speaks SGLang's protocol") in lines[0], lines[0]
    assert ("  note: generation.pull_timeout is pipegen's generation.partial_batch_quiet_s: seconds without a new "
            "sample before a partial batch file is written") in lines
    assert any(line.startswith("  note: actor_rollout_ref.rollout.gpu_memory_utilization=0.85: a GPU setting, "
                               "unused") for line in lines)
    # the closing line's rates are its own counts over its own time
    closing = re.search(r"this launch: (\d+) samples, (\d+) output tokens in ([\d.]+)s \(([\d.]+) samples/s, "
                        r"([\d.]+) output tok/s\)", result.stdout)
    assert closing, result.stdout
    samples, tokens, seconds, per_s, tok_per_s = (float(g) for g in closing.groups())
    assert samples == 12  # each rate within the rounding of the numbers shown (seconds to 0.1, rates to 0.1)
    assert samples / (seconds + 0.05) - 0.05 <= per_s <= samples / (seconds - 0.05) + 0.05, closing[0]
    assert tokens / (seconds + 0.05) - 0.51 <= tok_per_s <= tokens / (seconds - 0.05) + 0.51, closing[0]  # >= 100: whole

    # the seed resumes by running the same command again: the run is found complete, and nothing is generated
    again = _launch("--config-path", str(seed_dir), "--config-name", "generation",
                    f"actor_rollout_ref.model.path={tiny_model}", "data.train_files=[demo]",
                    f"trainer.default_local_dir={out}", "trainer.n_gpus_per_node=0", *SMALL)
    assert again.returncode == 0 and "already complete" in again.stdout, again.stderr[-3000:]
    assert "pipegen: done: 12 samples (12 trajectories)" in again.stdout
    assert "; this launch generated nothing (the run was complete)." in again.stdout, again.stdout


def test_run_generation_takes_the_composed_config_and_a_runs_own(seed_dir: Path, tmp_path: Path,
                                                                 tiny_model: str) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    out = tmp_path / "api"
    with initialize_config_dir(config_dir=str(seed_dir), version_base=None):
        cfg = compose(config_name="generation", overrides=[
            f"actor_rollout_ref.model.path={tiny_model}", "data.train_files=[demo]", f"trainer.default_local_dir={out}",
            "trainer.n_gpus_per_node=0", "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.rollout.response_length=24",
            "data.max_response_length=24", "data.train_max_samples=4"])
    OmegaConf.set_struct(cfg, False)
    cfg.generation.pull_timeout = 0.3
    cfg.llm = {"engine": FAKE_ENGINE.split("=", 1)[1]}
    result = pipegen.run_generation(cfg, quiet=True)
    assert result.run_dir == out.resolve() and result.summary.complete
    _assert_every_row_once(out, prompts=4, n=1)

    # the run's own saved config, as a user reloads it: the same run, found complete
    saved = OmegaConf.load(out / "conf" / "config.yaml")
    assert "actor_rollout_ref.model.enable_gradient_checkpointing" not in " ".join(overrides_of(saved))
    again = pipegen.run_generation(saved, quiet=True)
    assert again.summary == result.summary


def test_the_seeds_two_key_command_line_writes_to_default_local_dir(tmp_path: Path, tiny_model: str) -> None:
    out = tmp_path / "two-keys"
    result = _launch(f"actor_rollout_ref.model.path={tiny_model}", "data.train_files=[demo]",
                     f"trainer.default_local_dir={out}", "trainer.n_gpus_per_node=0", *SMALL, "n=1")
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_every_row_once(out, prompts=6, n=1)


def test_the_file_becomes_overrides_the_command_line_wins(seed_dir: Path) -> None:
    argv = expand(["--config-path", str(seed_dir), "--config-name", "generation", "actor_rollout_ref.model.path=M",
                   "max_response_length=64", "trainer.n_gpus_per_node=0"])
    assert "actor_rollout_ref.model.path=M" in argv and "actor_rollout_ref.model.path=???" not in " ".join(argv)
    assert not any(a.startswith(("data.max_response_length=", "actor_rollout_ref.rollout.response_length=",
                                 "trainer.n_gpus_per_node=8")) for a in argv)  # the command line sets them
    assert "trainer.experiment_name='gen_${now:%Y%m%d_%H%M%S}'" in argv  # resolved by pipegen, as written
    assert not any(a.startswith(("++ray_kwargs.ray_init", "ray_kwargs.ray_init", "defaults", "hydra")) for a in argv)
    out, notes = translate_with_notes(argv)
    assert "output_dir='outputs/${trainer.project_name}/${trainer.experiment_name}'" in out
    assert "tasks=[]" in out and "generation.partial_batch_quiet_s=60" in out
    assert not any(o.startswith("reward_model.") for o in out)  # false: what pipegen does anyway
    assert any("${now:...}: each launch makes a new folder" in n for n in notes), notes


def test_without_a_folder_the_run_goes_where_the_seeds_went(tmp_path: Path, monkeypatch) -> None:
    """Neither output_dir nor trainer.default_local_dir: outputs/<project_name>/<experiment_name>, said so."""
    from pipegen.launch.job import resolve_job

    monkeypatch.chdir(tmp_path)
    job = resolve_job(["trainer.project_name=p", "trainer.experiment_name=e", "trainer.n_gpus_per_node=0"])
    assert job.run.root == (tmp_path / "outputs" / "p" / "e").resolve()
    assert any(n.startswith("output_dir: outputs/<trainer.project_name>/<trainer.experiment_name>") for n in job.notes)


@pytest.mark.parametrize(("argv", "line"), [
    (["output_dir=/tmp/a", "trainer.default_local_dir=/tmp/b"],
     "trainer.default_local_dir=/tmp/b and output_dir=/tmp/a name two run folders: give one of them (each names the "
     "folder that holds every file of the run)"),
    (["reward_model.enable=true"],
     "reward_model.enable is not used by pipegen: pipegen scores every trajectory in its actors with "
     "custom_reward_function.path (verl's way) or reward.verifier_url (a reward model served over HTTP); it starts "
     "no reward-model workers"),
    (["+reward_model.enable=false"],
     "+reward_model.enable: pipegen has no such key, and a new one would be ignored; (a leading + adds a key only "
     "to a kwargs group, as in +custom_reward_function.reward_kwargs.NAME=VALUE)"),
    (["+ray_kwargs.timeline=x"],
     "+ray_kwargs.timeline: pipegen has no such key, and a new one would be ignored; (a leading + adds a key only to a kwargs group, as in "
     "+custom_reward_function.reward_kwargs.NAME=VALUE)"),
    (["+actor_rollout_ref.rollout.my_knob=1"],
     "+actor_rollout_ref.rollout.my_knob: verl's code pipegen runs reads no such key, and a new one would be "
     "ignored; (a leading + adds a key only to a kwargs group, as in "
     "+custom_reward_function.reward_kwargs.NAME=VALUE)"),
    (["actor_rollout_ref.rollout.pipeline_model_parallel_size=2"],
     "actor_rollout_ref.rollout.pipeline_model_parallel_size is not used by pipegen: pipegen gives each server "
     "tensor_model_parallel_size x data_parallel_size GPUs and starts it without pipeline stages (SGLang's "
     "--pp-size, vLLM's --pipeline-parallel-size); for a model too large for one node's tensor parallelism, start "
     "the servers yourself and use llm=external"),
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=0"],
     "trainer.nnodes=2: several nodes run through a Ray cluster; add cluster=ray (README: Several nodes), or set "
     "trainer.nnodes=1"),
    (["llm=sglang", "trainer.n_gpus_per_node=0"],
     "llm=sglang runs on GPUs and trainer.n_gpus_per_node=0 asks for none: drop one (llm=cpu is pipegen's CPU "
     "server, which speaks SGLang's protocol)"),
])
def test_the_seeds_keys_refused_in_one_line(tmp_path: Path, argv: list[str], line: str) -> None:
    result = _launch(*[a.replace("/tmp/", f"{tmp_path}/") for a in argv], cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-2000:]
    assert result.stderr.strip().splitlines()[-1] == "pipegen: error: " + line.replace("/tmp/", f"{tmp_path}/")


def test_the_seeds_accepted_keys_compose(seed_dir: Path) -> None:
    """pipeline_model_parallel_size=1, reward_model.*=false, tasks=null, trainer.nnodes=1, ray_kwargs and
    generation.pull_timeout: each composes into a config that means what the seed meant."""
    from pipegen.launch.job import compose_job

    cfg = compose_job(["output_dir=/tmp/x", "actor_rollout_ref.rollout.pipeline_model_parallel_size=1",
                       "reward_model.enable=false", "reward_model.use_reward_loop=false",
                       "reward_model.enable_resource_pool=false", "tasks=null", "trainer.nnodes=1",
                       "generation.pull_timeout=12", "+ray_kwargs.ray_init.num_cpus=4",
                       "ray_kwargs.timeline_json_file=/tmp/t.json"])
    assert list(cfg.tasks) == [] and cfg.generation.partial_batch_quiet_s == 12 and cfg.trainer.nnodes == 1
    assert dict(cfg.ray_kwargs.ray_init) == {"num_cpus": 4} and cfg.ray_kwargs.timeline_json_file == "/tmp/t.json"
    from pipegen.launch.ray_placement import ray_init_kwargs

    assert ray_init_kwargs(cfg) == {"num_cpus": 4}
