"""verl's own keys set the verl way: every key of verl's rollout, model and data groups, and of verl's trainer
section, is honoured (its effect checked in the config the launcher saves or in the servers' arguments)
or refused in one line that says what to set instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from pipegen.launch.servers import SERVER_COMMANDS
from pipegen.launch.world import plan_world
from pipegen.config.compose import compose, resolved, verl_config_dir
from pipegen.config.verl_keys import Read, Refused, Same, ToLlm, handling, translate

REPO = Path(__file__).resolve().parent.parent


def _leaves(node, prefix: str):
    for k in node.keys():
        child = node._get_node(k)
        if OmegaConf.is_dict(child):
            yield from _leaves(child, f"{prefix}{k}.")
        elif k != "_target_":  # verl's config-class marker, not a setting
            yield f"{prefix}{k}"


def _trainer_keys() -> list[str]:
    section = yaml.safe_load((Path(verl_config_dir()) / "ppo_trainer.yaml").read_text())["trainer"]

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from walk(v, f"{prefix}{k}.")
            elif k != "_target_":
                yield f"{prefix}{k}"
    return list(walk(section, "trainer."))


BASE = compose(["output_dir=/tmp/verl-keys"])
VERL_KEYS = [*_leaves(BASE.actor_rollout_ref.rollout, "actor_rollout_ref.rollout."),
             *_leaves(BASE.actor_rollout_ref.model, "actor_rollout_ref.model."), *_leaves(BASE.data, "data."),
             *_trainer_keys()]


def test_every_verl_key_is_classified() -> None:
    """A key verl adds later must be decided on here, not silently composed and ignored."""
    assert len(VERL_KEYS) > 150
    unclassified = [k for k in VERL_KEYS if handling(k) is None]
    assert not unclassified, unclassified


def _config(*overrides: str):
    return resolved(compose(["output_dir=/tmp/verl-keys", *translate(list(overrides))]))


@pytest.mark.parametrize("key", [k for k in VERL_KEYS if isinstance(handling(k), Refused)])
def test_refused_keys_say_what_to_set_in_one_line(key: str) -> None:
    with pytest.raises(ValueError) as refused:
        translate([f"{key}=7"])
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{key} is not used by pipegen: "), line
    assert len(line) > len(key) + 40, line  # the fix, not only the refusal


def test_refused_keys_let_through_what_pipegen_does_anyway() -> None:
    kept = ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.do_sample=True",
            "data.truncation=error", "trainer.nnodes=1", "data.trust_remote_code=false",
            "data.return_raw_input_ids=false"]
    assert translate(kept) == kept


def _shared_value(key: str):
    return {"n": 3, "temperature": 0.5, "max_prompt_length": 777, "max_response_length": 999, "seed": 5,
            "max_samples": 11, "train_files": "/data/mine.parquet", "actors.num_actors": 3,
            "model_path": "/models/mine", "output_dir": "/tmp/verl-keys/mine",
            "generation.partial_batch_quiet_s": 7.5, "generation.reproducible": True}[handling(key).key]


@pytest.mark.parametrize("key", [k for k in VERL_KEYS if isinstance(handling(k), Same)])
def test_verl_names_of_pipegen_keys_set_pipegen_and_verl_alike(key: str) -> None:
    value = _shared_value(key)
    cfg = _config(f"{key}={value}")
    pipegen_key = handling(key).key
    assert OmegaConf.select(cfg, pipegen_key) == value
    mirrors = {"n": ["actor_rollout_ref.rollout.n"], "temperature": ["actor_rollout_ref.rollout.temperature"],
               "max_prompt_length": ["actor_rollout_ref.rollout.prompt_length", "data.max_prompt_length"],
               "max_response_length": ["actor_rollout_ref.rollout.response_length", "data.max_response_length"],
               "max_samples": ["data.train_max_samples"], "seed": ["data.seed"], "train_files": ["data.train_files"],
               "actors.num_actors": [], "model_path": ["actor_rollout_ref.model.path"], "output_dir": [],
               "generation.partial_batch_quiet_s": [], "generation.reproducible": []}[pipegen_key]
    for verl_key in mirrors:  # what verl's code reads follows
        assert OmegaConf.select(cfg, verl_key) == value, verl_key
    with pytest.raises(ValueError, match="disagree|name two run folders"):
        translate([{"train_files": "train_files=demo", "generation.reproducible": "generation.reproducible=false"}.get(
            pipegen_key, f"{pipegen_key}=1"), f"{key}={value}"])


GPUS = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
# verl key -> (value, what the server command or plan of each kind shows for it)
ENGINE_SETTINGS = {
    "tensor_model_parallel_size": ("2", {"sglang": ["--tp-size", "2"], "vllm": ["--tensor-parallel-size", "2"]}),
    "data_parallel_size": ("2", {"sglang": ["--dp-size", "2"], "cpu": "2 servers"}),
    "gpu_memory_utilization": ("0.7", {"sglang": ["--mem-fraction-static", "0.7"],
                                       "vllm": ["--gpu-memory-utilization", "0.7"]}),
    "max_num_seqs": ("64", {"sglang": ["--max-running-requests", "64"], "vllm": ["--max-num-seqs", "64"],
                            "cpu": ["--max-batch", "64"], "external": "llm.max_running_requests"}),
    "max_model_len": ("2048", {"sglang": ["--context-length", "2048"], "vllm": ["--max-model-len", "2048"]}),
    "dtype": ("float32", {"vllm": ["--dtype", "float32"], "cpu": ["--dtype", "float32"]}),
}


@pytest.mark.parametrize("key", [k for k in VERL_KEYS if isinstance(handling(k), ToLlm)])
def test_engine_settings_reach_the_servers(key: str) -> None:
    name = key.rsplit(".", 1)[1]
    value, shown = ENGINE_SETTINGS[name]
    assert set(shown) == set(handling(key).keys), key
    for kind, expect in shown.items():
        extra = ["llm.urls=[http://127.0.0.1:1]"] if kind == "external" else []
        cfg = _config(f"llm={kind}", *extra, f"actor_rollout_ref.rollout.{name}={value}")
        llm = OmegaConf.to_container(cfg.llm, resolve=True)
        assert str(llm[handling(key).keys[kind]]).lower() == value, (key, kind)
        if kind == "external":
            continue  # pipegen starts no server: the actors read llm.max_running_requests
        plan = plan_world(llm, "auto", GPUS, count_devices=lambda: 4, pick_port=lambda host: 1)
        if expect == "2 servers":
            assert len(plan.servers) == 2
            continue
        argv, _ = SERVER_COMMANDS[kind](plan.servers[0], "/model", llm, 0)
        joined = " ".join(argv)
        assert " ".join(expect) in joined, (key, kind, joined)
    others = sorted({"cpu", "sglang", "vllm", "external"} - set(shown))
    for kind in others:
        with pytest.raises(ValueError, match=f"has no meaning for llm={kind}: it sets llm="):
            translate([f"llm={kind}", f"actor_rollout_ref.rollout.{name}={value}"])


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2 if value else 0.5
    if isinstance(value, dict):
        return {"enable_thinking": False}
    if isinstance(value, list):
        return ["console", "file"]  # trainer.logger: verl's Tracking backends
    return "mine"


def _shown(value) -> str:
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{str(v).lower()}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_keys_verl_reads_reach_the_saved_config_as_set() -> None:
    """Read keys: verl's RLHFDataset, agent loops and the actors' sampling read them from the saved config."""
    base = resolved(BASE)
    keys = [k for k in VERL_KEYS if isinstance(handling(k), Read)]
    assert len(keys) > 30
    wanted = {}
    for k in keys:
        value = OmegaConf.select(base, k)
        wanted[k] = 0 if k == "trainer.n_gpus_per_node" else _changed(
            OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)
    cfg = _config(*(f"{k}={_shown(v)}" for k, v in wanted.items()))
    for key, value in wanted.items():
        got = OmegaConf.select(cfg, key)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        assert got == value, (key, got, value)


def test_the_launcher_refuses_a_verl_key_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pipegen.launch", f"output_dir={tmp_path / 'run'}",
                             "trainer.total_epochs=3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == ("pipegen: error: trainer.total_epochs is not used by pipegen: each prompt is generated n "
                         "times: set n"), result.stderr
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_more_gpus_than_the_machine_has_are_refused_in_one_line(tmp_path: Path) -> None:
    """verl's trainer.n_gpus_per_node is honoured: asking for more GPUs than the node shows stops the launch in one
    line naming what it shows, before anything is written."""
    result = subprocess.run([sys.executable, "-m", "pipegen.launch", f"output_dir={tmp_path / 'run'}",
                             "trainer.n_gpus_per_node=8"], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "pipegen: error: trainer.n_gpus_per_node=8, but this node shows 0 GPU(s) (nvidia-smi -L, "
        "CUDA_VISIBLE_DEVICES): set trainer.n_gpus_per_node=0 or fewer"), result.stderr
    assert not (tmp_path / "run").exists()


def test_a_custom_chat_template_shapes_every_prompt(tiny_model: str) -> None:
    """verl's model.custom_chat_template replaces the model's template, for the dataset's prompts and the agent
    loops' alike (both use the tokenizer pipegen loads), as verl's agent loop worker does."""
    from pipegen.inputs.dataset import load_tokenizer

    cfg = _config(f"model_path={tiny_model}")
    chat = [{"role": "user", "content": "2+2?"}]
    assert "<<2+2?>>" not in load_tokenizer(cfg).apply_chat_template(chat, tokenize=False)
    cfg.actor_rollout_ref.model.custom_chat_template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    assert load_tokenizer(cfg).apply_chat_template(chat, tokenize=False) == "<<2+2?>>"
