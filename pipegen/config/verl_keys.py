"""verl's own keys, set the verl way on pipegen's command line: each one honoured, or refused in one line.

A verl user sets `actor_rollout_ref.rollout.tensor_model_parallel_size=2`, `data.train_max_samples=100` or
`trainer.nnodes=2`. pipegen composes verl's rollout and data groups in verl's layout, so such a key is
accepted by Hydra; without this module most would then change nothing (pipegen starts its servers from
`llm.*`, its actors from `actors.*`). `translate` reads the overrides before Hydra composes them and, per
key of `VERL_KEYS`:
- `Same`: the key is one of pipegen's keys under verl's (or seed 000's) name (`rollout.n` is `n`,
  `trainer.default_local_dir` is `output_dir`, `generation.pull_timeout` is `generation.partial_batch_quiet_s`):
  the override is rewritten to pipegen's key, which conf/pipegen.yaml interpolates back into verl's key; a
  `note` says so under the plan line where the two names do not mean quite the same;
- `ToLlm`: an engine setting: pipegen's `llm.*` key of the chosen `llm=` kind is set too (refused for a
  kind that has no such setting, except a value that asks nothing of it, and GPU settings with
  trainer.n_gpus_per_node=0, which are noted as unused);
- `Read`: code pipegen runs reads it (verl's RLHFDataset and agent loops, the sampling params, the world plan's
  trainer.n_gpus_per_node, cluster=ray's ray_kwargs and trainer.nnodes);
- `Refused`: pipegen cannot honour it; one line naming pipegen's key (or that there is nothing to set). A value
  it `accepted` (what pipegen does anyway) goes on where pipegen's composition holds the key, and is left out
  where it does not (reward_model.enable=false).
`translate_with_notes` also gives the run its folder when neither output_dir nor trainer.default_local_dir is
set (verl's outputs/<project_name>/<experiment_name>) and says what `${now:...}` in it does. A `+key` is left
to config/compose.py's refuse_new_keys.

Owns: the table of verl keys under `actor_rollout_ref.rollout`, `actor_rollout_ref.model`, `data`, `trainer`,
`ray_kwargs` and `reward_model` and seed 000's own, what pipegen does with each (docs/configuration.md's "What
pipegen does with verl's keys" lists it), and the rewrite of the overrides.
Must never: import verl or Hydra (it runs before the config is composed), or let a listed key through
that pipegen would then ignore.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Union

from pipegen.config.overrides import parse
from pipegen.config.schema import DEFAULT_LLM, schema_keys

ROLLOUT = "actor_rollout_ref.rollout."


@dataclass(frozen=True)
class Same:
    """pipegen's own key under verl's (or the seed's) name; `note`: a line for the plan where the two names do not
    mean quite the same, `values`: a value spelt the other way ("null" -> "[]")."""

    key: str
    note: str = ""
    values: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ToLlm:
    """An engine setting: `llm.<key>` for each llm kind that has one. `noop`: values that ask for nothing a kind
    without the key does not do anyway (one GPU per server)."""

    keys: Mapping[str, str]  # llm kind -> key under llm.
    noop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Read:
    """Read by verl's own code that pipegen runs, as verl's trainer reads it."""

    by: str


@dataclass(frozen=True)
class Refused:
    """Not honoured: `fix` names what to set instead. `accepted`: values that are what pipegen does anyway."""

    fix: str
    accepted: tuple[str, ...] = ()


Handling = Union[Same, ToLlm, Read, Refused]

ENGINE_FLAG = Refused("pass the engine's own flag to the servers pipegen starts with llm.extra_args "
                      "(e.g. 'llm.extra_args=[--enforce-eager]')")
TRAINING_ONLY = Refused("a training-time setting (weight sync, log-prob recompute, checkpoints, profiling): "
                        "pipegen only generates; drop it")
VALIDATION = Refused("pipegen generates for train_files: run the validation file in its own output_dir with "
                     "train_files=PATH (and e.g. n=1 temperature=0)")
DATASET = Read("verl's RLHFDataset")
AGENT_LOOP = Read("verl's agent loops")
SAMPLING = Read("the actors' sampling params")

# Keys ending in "." cover every key under them. The longest entry that matches a key decides.
VERL_KEYS: dict[str, Handling] = {
    # ---- actor_rollout_ref.rollout ----
    f"{ROLLOUT}name": Read("the launcher's engine choice (launch/engine_choice.py): sglang or vllm, when llm= "
                           "is not given; checked against llm= when it is"),
    f"{ROLLOUT}mode": Refused("pipegen's servers are always HTTP servers its actors call (async)", accepted=("async",)),
    f"{ROLLOUT}n": Same("n"),
    f"{ROLLOUT}temperature": Same("temperature"),
    f"{ROLLOUT}prompt_length": Same("max_prompt_length"),
    f"{ROLLOUT}response_length": Same("max_response_length"),
    f"{ROLLOUT}seed": Same("seed"),
    f"{ROLLOUT}top_p": SAMPLING,
    f"{ROLLOUT}top_k": SAMPLING,
    f"{ROLLOUT}calculate_log_probs": SAMPLING,
    f"{ROLLOUT}do_sample": Refused("pipegen always samples: set temperature=0 for greedy decoding", accepted=("true",)),
    f"{ROLLOUT}ignore_eos": Refused("pipegen stops at the model's end of sequence; max_response_length bounds a "
                                    "response", accepted=("false",)),
    f"{ROLLOUT}val_kwargs.": VALIDATION,
    f"{ROLLOUT}tensor_model_parallel_size": ToLlm({"sglang": "tp", "vllm": "tp"}, noop=("1",)),
    f"{ROLLOUT}data_parallel_size": ToLlm({"sglang": "dp", "cpu": "num_servers"}, noop=("1",)),
    f"{ROLLOUT}gpu_memory_utilization": ToLlm({"sglang": "mem_fraction_static", "vllm": "gpu_memory_utilization"}),
    f"{ROLLOUT}max_num_seqs": ToLlm({"sglang": "max_running_requests", "vllm": "max_running_requests",
                                     "external": "max_running_requests", "cpu": "max_batch"}),
    f"{ROLLOUT}max_model_len": ToLlm({"sglang": "context_length", "vllm": "context_length"}),
    f"{ROLLOUT}dtype": ToLlm({"vllm": "dtype", "cpu": "dtype"}),
    f"{ROLLOUT}full_determinism": Same("generation.reproducible"),
    f"{ROLLOUT}nnodes": Refused("several nodes run through a Ray cluster: cluster=ray (README: Several nodes)",
                                accepted=("0", "1")),
    f"{ROLLOUT}n_gpus_per_node": Refused("pipegen's servers use trainer.n_gpus_per_node GPUs per node (every visible "
                                         "one by default), llm.tp per server"),
    f"{ROLLOUT}pipeline_model_parallel_size": Refused(
        "pipegen gives each server tensor_model_parallel_size x data_parallel_size GPUs and starts it without "
        "pipeline stages (SGLang's --pp-size, vLLM's --pipeline-parallel-size); for a model too large for one "
        "node's tensor parallelism, start the servers yourself and use llm=external", accepted=("1",)),
    f"{ROLLOUT}load_format": Refused("pipegen's servers load the weights of model_path", accepted=("auto",)),
    f"{ROLLOUT}logprobs_mode": Refused("pipegen asks for log-probs after temperature, as verl recomputes them",
                                       accepted=("processed_logprobs",)),
    f"{ROLLOUT}skip_tokenizer_init": Refused("pipegen's servers take token ids (always true)", accepted=("true",)),
    **{f"{ROLLOUT}{k}": ENGINE_FLAG for k in (
        "enforce_eager", "cudagraph_capture_sizes", "expert_parallel_size",
        "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching", "scheduling_policy",
        "disable_log_stats", "engine_kwargs.", "quantization", "quantization_config_file")},
    **{f"{ROLLOUT}{k}": TRAINING_ONLY for k in (
        "free_cache_engine", "layered_summon", "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu",
        "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu", "over_sample_rate", "multi_stage_wake_up",
        "checkpoint_engine.", "profiler.", "prometheus.", "router_config_path", "disaggregation.", "mtp", "qat",
        "enable_rollout_routing_replay", "moe_load_balance_metrics_interval", "update_weights_bucket_megabytes")},
    f"{ROLLOUT}trace.": Refused("every trajectory is in the run's streams already: python -m pipegen.status DIR "
                                "--follow (docs/outputs.md: Watch a run live)"),
    f"{ROLLOUT}multi_turn.": AGENT_LOOP,
    f"{ROLLOUT}agent.default_agent_loop": AGENT_LOOP,
    f"{ROLLOUT}agent.agent_loop_config_path": AGENT_LOOP,
    f"{ROLLOUT}agent.num_workers": Same("actors.num_actors"),
    f"{ROLLOUT}agent.custom_async_server.": Refused("pipegen calls the servers it starts, or yours with llm=external "
                                                    "'llm.urls=[http://HOST:PORT]'"),
    # ---- actor_rollout_ref.model ----
    "actor_rollout_ref.model.path": Same("model_path"),
    "actor_rollout_ref.model.tokenizer_path": Read("pipegen's tokenizer (inputs/dataset.py), as verl's trainer "
                                                   "loads it"),
    "actor_rollout_ref.model.trust_remote_code": Read("pipegen's tokenizer, processor and model config loading"),
    "actor_rollout_ref.model.custom_chat_template": Read("pipegen's tokenizer and processor, as verl's agent loop "
                                                         "worker sets them"),
    "actor_rollout_ref.model.hf_config_path": Refused("pipegen's servers read the model's config from model_path",
                                                      accepted=("null",)),
    "actor_rollout_ref.model.use_shm": Refused("pipegen's servers load model_path from where it is",
                                               accepted=("false",)),
    "actor_rollout_ref.model.external_lib": Refused("pipegen's servers load model_path as transformers or the "
                                                    "engine does: a model they cannot load needs the engine's own "
                                                    "plugin (llm.extra_args)", accepted=("null",)),
    "actor_rollout_ref.model.override_config": Refused("pipegen's servers use the model's config as saved: edit "
                                                       "config.json in a copy of the model", accepted=("{}",)),
    **{f"actor_rollout_ref.model.{k}": Refused(
        "pipegen generates with model_path's weights as they are: merge the adapter into the model first (peft's "
        "merge_and_unload) and pass that folder", accepted=accepted) for k, accepted in (
        ("lora_rank", ("0",)), ("lora_alpha", ()), ("target_modules", ()), ("exclude_modules", ()),
        ("lora_adapter_path", ("null",)), ("lora.", ()))},
    "actor_rollout_ref.model.mtp.": ENGINE_FLAG,
    **{f"actor_rollout_ref.model.{k}": TRAINING_ONLY for k in (
        "enable_gradient_checkpointing", "enable_activation_offload", "use_remove_padding", "use_liger",
        "use_fused_kernels", "fused_kernel_options.", "tiled_mlp.")},
    # ---- data ----
    "data.train_files": Same("train_files"),
    "data.train_max_samples": Same("max_samples"),
    "data.max_prompt_length": Same("max_prompt_length"),
    "data.max_response_length": Same("max_response_length"),
    "data.seed": Same("seed"),
    **{f"data.{k}": DATASET for k in (
        "tokenizer", "use_shm", "prompt_key", "return_full_prompt", "shuffle",
        "image_patch_size", "filter_overlong_prompts", "filter_overlong_prompts_workers", "image_key", "video_key",
        "audio_key", "custom_cls.", "return_multi_modal_inputs", "apply_chat_template_kwargs",
        "mm_processor_kwargs", "tool_config_path", "function_tool_path")},
    # accepted and ignored before: pipegen loads the tokenizer and processor with the model's setting, and keeps
    # no raw_prompt_ids column
    "data.trust_remote_code": Refused("pipegen loads the tokenizer and processor with the model's setting: set "
                                      "actor_rollout_ref.model.trust_remote_code", accepted=("false",)),
    "data.return_raw_input_ids": Refused("the output holds each prompt's token ids already (prompts, "
                                         "raw_prompt_ids are not kept)", accepted=("false",)),
    "data.return_raw_chat": Refused("pipegen's agent loops read each row's chat messages (always true)",
                                    accepted=("true",)),
    "data.truncation": Refused("pipegen never cuts a prompt: raise max_prompt_length, or set "
                               "data.filter_overlong_prompts=true to skip longer prompts", accepted=("error",)),
    "data.reward_fn_key": Refused("pipegen scores each row by its data_source column", accepted=("data_source",)),
    "data.dataloader_num_workers": Refused("each actor reads the dataset itself: actors.num_actors",
                                           accepted=("0",)),
    "data.train_batch_size": Refused("pipegen streams every prompt without step batches; rows per batch file: "
                                     "generation.save_batch_size"),
    "data.gen_batch_size": Refused("pipegen streams every prompt without step batches; rows per batch file: "
                                   "generation.save_batch_size"),
    **{f"data.{k}": VALIDATION for k in ("val_files", "val_max_samples", "val_batch_size", "validation_shuffle")},
    # ---- trainer (pipegen's trainer group holds verl's tracking keys; the rest is verl's training loop) ----
    "trainer.project_name": Read("pipegen's tracking (verl's Tracking)"),
    "trainer.experiment_name": Read("pipegen's tracking (verl's Tracking)"),
    "trainer.logger": Read("pipegen's tracking (verl's Tracking)"),
    "trainer.nnodes": Read("the placement: more than 1 needs cluster=ray, which uses that many nodes"),
    "trainer.n_gpus_per_node": Read("the world plan (launch/world.py): that many of each node's GPUs, 0 = none"),
    "trainer.device": Refused("llm=cpu | sglang | vllm chooses where generation runs"),
    "trainer.total_epochs": Refused("each prompt is generated n times: set n", accepted=("1",)),
    "trainer.total_training_steps": Refused("pipegen generates every prompt once, n samples each: set n and "
                                            "max_samples"),
    "trainer.default_local_dir": Same("output_dir"),
    "trainer.rollout_data_dir": Refused("output_dir=DIR holds every file of the run (streams/ as it runs)"),
    "trainer.validation_data_dir": Refused("output_dir=DIR holds every file of the run"),
    "trainer.resume_mode": Refused("the same command resumes its output_dir; resume_with_changes=true continues a "
                                   "changed setup"),
    "trainer.resume_from_path": Refused("the same command resumes its output_dir"),
    **{f"trainer.{k}": TRAINING_ONLY for k in (
        "balance_batch", "log_val_generations", "save_freq", "esi_redundant_time", "checkpoint_callback_class",
        "val_before_train", "val_only", "test_freq", "critic_warmup", "default_hdfs_dir", "del_local_ckpt_after_load",
        "max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep", "ray_wait_register_center_timeout", "use_v1", "v1.")},
    # ---- ray_kwargs (pipegen's ray_kwargs group, read by cluster=ray's launcher) ----
    "ray_kwargs.ray_init": Read("cluster=ray's launcher: its ray.init"),
    "ray_kwargs.timeline_json_file": Read("cluster=ray's launcher: ray.timeline when the run stops"),
    # ---- reward_model: verl's reward-model workers; pipegen scores in its actors ----
    **{f"reward_model.{k}": Refused(
        "pipegen scores every trajectory in its actors with custom_reward_function.path (verl's way) or "
        "reward.verifier_url (a reward model served over HTTP); it starts no reward-model workers",
        accepted=("false", "null")) for k in ("enable", "use_reward_loop", "enable_resource_pool")},
    # ---- the seed's own keys (seed 000's generation.yaml) ----
    "generation.pull_timeout": Same("generation.partial_batch_quiet_s", note=(
        "generation.pull_timeout is pipegen's generation.partial_batch_quiet_s: seconds without a new sample "
        "before a partial batch file is written")),
    "tasks": Same("tasks", values={"null": "[]"}),
}

# Keys that only the Ray launcher reads: a local run accepts them with a note.
RAY_ONLY = ("ray_kwargs.",)


def handling(key: str) -> Handling | None:
    """What pipegen does with verl key `key` (None: not one of the groups this module covers)."""
    best = None
    for entry in VERL_KEYS:
        if (key == entry or (entry.endswith(".") and key.startswith(entry))) and (best is None or len(entry) > len(best)):
            best = entry
    return VERL_KEYS[best] if best is not None else None


def _split(override: str) -> tuple[str, str, str] | None:
    """(prefix, key, value) of `[+|++|~]key=value`; None for anything else (a group choice, a flag)."""
    parsed = parse(override)
    if parsed is None or "=" not in override:
        return None
    return parsed.prefix, parsed.key, parsed.text


def _plain(value: str) -> str:
    """An override value as compared with `Refused.accepted` (Hydra reads True and true alike)."""
    return value.strip().strip("'\"").lower()


def _composed(key: str) -> bool:
    """Whether pipegen's composition holds `key` (its schema's keys, or verl's groups): an accepted value of a key
    it does not hold is what pipegen does anyway, and is left out rather than composed into nothing."""
    root = key.split(".", 1)[0]
    return root in ("actor_rollout_ref", "data", "distillation") or key in _schema_paths() or any(
        key.startswith(p + ".") for p in _schema_paths())


_SCHEMA_PATHS: set[str] = set()


def _schema_paths() -> set[str]:
    if not _SCHEMA_PATHS:
        _SCHEMA_PATHS.update(info.path for info in schema_keys())
    return _SCHEMA_PATHS


def _folder(value: str) -> str:
    """A run folder as given, compared the way the launch resolves it (relative to the working directory)."""
    text = value.strip().strip("'\"")
    return text if "://" in text else os.path.abspath(os.path.expanduser(text))


DEFAULT_OUTPUT_DIR = "outputs/${trainer.project_name}/${trainer.experiment_name}"  # the seed's (verl's layout)


def translate(overrides: list[str]) -> list[str]:
    """The overrides with verl's keys turned into pipegen's (see the module's header); ValueError, one line,
    for a verl key pipegen cannot honour or two settings of one key that disagree."""
    return translate_with_notes(overrides, default_folder=False)[0]


def translate_with_notes(overrides: list[str], default_folder: bool = True) -> tuple[list[str], list[str]]:
    """`translate`, and the lines the plan shows about what was translated (a key accepted with a meaning of
    its own, the run folder's default). `default_folder`: without output_dir or trainer.default_local_dir, the
    run's folder is the seed's (verl's) default, outputs/<project_name>/<experiment_name>."""
    parsed = [_split(o) for o in overrides]
    given = {p[1]: p[2] for p in parsed if p is not None}
    llm_kind = given.get("llm", DEFAULT_LLM)
    cluster = _plain(given.get("cluster", "local"))
    out: list[str] = []
    notes: list[str] = []
    added: dict[str, tuple[str, str]] = {}  # pipegen key -> (value, the verl key that set it)
    for override, part in zip(overrides, parsed):
        rule = handling(part[1]) if part is not None else None
        if part is not None and cluster != "ray" and any(part[1].startswith(p) for p in RAY_ONLY) \
                and _plain(part[2]) not in ("null", "{}", ""):
            notes.append(f"{part[1]} applies with cluster=ray; this local run starts no Ray")
        if rule is None or isinstance(rule, Read) or part[0] in ("+", "++"):
            out.append(override)  # a `+key` of verl's: compose.refuse_new_keys says why it would be ignored
            continue
        _, key, value = part
        if isinstance(rule, Refused):
            if _plain(value) in rule.accepted:
                if _composed(key):
                    out.append(override)
                continue
            raise ValueError(f"{key} is not used by pipegen: {rule.fix}")
        if isinstance(rule, ToLlm):
            if llm_kind not in rule.keys and _plain(value) in rule.noop:
                out.append(override)
                continue
            if llm_kind not in rule.keys and llm_kind == "cpu" and _plain(given.get("trainer.n_gpus_per_node", "")) == "0":
                notes.append(f"{key}={value}: a GPU setting, unused with trainer.n_gpus_per_node=0 (pipegen's CPU "
                             f"server)")
                out.append(override)
                continue
            if llm_kind not in rule.keys:
                kinds = ", ".join(f"llm={k} (llm.{v})" for k, v in rule.keys.items())
                raise ValueError(f"{key} has no meaning for llm={llm_kind}: it sets {kinds}")
            target = f"llm.{rule.keys[llm_kind]}"
            out.append(override)  # verl's key keeps the user's value too
        else:
            target = rule.key
            value = rule.values.get(_plain(value), value)
            if rule.note:
                notes.append(rule.note)
            if target == key:  # the same key, only spelt another way
                out.append(f"{part[0]}{key}={value}")
                continue
        for other_key, other in ((target, given.get(target)), added.get(target, (None, None))[::-1]):
            if other is not None and target == "output_dir" and _folder(other) != _folder(value):
                raise ValueError(f"{key}={value} and {other_key}={other} name two run folders: give one of them "
                                 f"(each names the folder that holds every file of the run)")
            if other is not None and target != "output_dir" and _plain(other) != _plain(value):
                raise ValueError(f"{key}={value} and {other_key}={other} disagree: set {target} once")
        if target not in given and target not in added:
            out.append(f"{target}={value}")
        added[target] = (value, key)
    folder = given["output_dir"] if "output_dir" in given else added.get("output_dir", (None,))[0]
    if folder is None and default_folder:
        out.append(f"output_dir={DEFAULT_OUTPUT_DIR}")
        notes.append("output_dir: outputs/<trainer.project_name>/<trainer.experiment_name> (no output_dir or "
                     "trainer.default_local_dir given; the seed's default)")
    text = folder or DEFAULT_OUTPUT_DIR
    if "${now:" in text or any(f"${{{k}}}" in text and "${now:" in given.get(k, "")
                               for k in ("trainer.project_name", "trainer.experiment_name")):
        notes.append("the run's folder name holds ${now:...}: each launch makes a new folder, so running this "
                     "command again starts a new run instead of resuming; name the folder to resume it")
    return out, notes
