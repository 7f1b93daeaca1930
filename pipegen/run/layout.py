"""The run-directory contract: every path of a run, and the small files that describe it.

```
DIR/
  conf/config.yaml        the resolved config every process reads
  conf/fingerprint.json   what defines the data (the resume guard); its digest is the run key
  conf/units.json         the unit manifest: the dataset's indices in order (units = index x sample)
  conf/launch.json        the current launch: its id, the run key, the server URLs, the actor count
  conf/engines.json       what each of its servers reports of its numerics (version, dtype, deterministic mode)
  conf/streams.json       streams=redis: the run's Redis key prefix, made once (`pipegen:<run key>:<random>`)
  conf/nodes/<node>.json  with cluster=ray, one per node runner: the launch id, its incarnation, host, servers
  tasks/<name>-<digest>.parquet   tasks=[...]: each task's rows in verl's layout (pipegen/tasks/materialize.py)
  .launcher.lock          held by the one launcher of this directory (its pid and host inside)
  logs/<role>.log         one log per process; logs/<role>.cmd.sh restarts that role by hand
  streams/rollouts/actor_<k>/<seq>.jsonl   RolloutRecord lines (stream.py), one appender per file
  streams/failures/actor_<k>/<seq>.jsonl   FailureRecord lines
  streams/stats/<role>.jsonl               periodic metrics lines, one typed record per role (stats_line.py)
  streams/progress/<index>-<sample>.jsonl  a running unit's model calls and unfinished answer (unit_progress.py)
  checkpoint.json         the writer's commit record (checkpoint.py)
  publish.json            storage.url: what the writer published to the object store, what waits (store.py)
  batch_00000.arrow ...   padded DataProto batches (batchfile.py: Arrow IPC, nothing in one executes on load)
  trajectories.pkl        the merged DataProto; trajectories.zip, the artifact
  failed_units.json       the units whose tries were spent, each with its reason, while the output is partial (and
                          the units still pending when a writer alone merged it)
  trajectories/           the sharded output instead (part_00000.pkl ..., index.json), for runs larger than RAM
  trajectories.parquet    the export (or trajectories.jsonl), one row per trajectory; README.md, its dataset card
  trajectories.atif/      the ATIF export: one document per trajectory
  report.html, report.json   the run report (pipegen/report/)
```

Owns: every path above (no other module joins a name onto the run directory), the run key, and
reading/writing `launch.json` and `units.json`.
Must never: import verl or torch, or decide what goes into a file it names (each file's owner does).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from pipegen.run.atomic import atomic_write_bytes
from pipegen.run.integrity import DamagedFile, read_json_file, relaunch_advice
from pipegen.run.unit_progress import progress_file_name

SHARD_SUFFIX = ".jsonl"
BATCH_GLOB = "batch_*.arrow"
LEGACY_BATCH_GLOB = "batch_*.pkl"  # pickles, written by pipegen before the Arrow batch file: refused, or converted


def batch_file_name(number: int) -> str:
    return f"batch_{number:05d}.arrow"


def legacy_batch_file_name(number: int) -> str:
    return f"batch_{number:05d}.pkl"


ACTOR_ROLE_PREFIX = "actor_"


def actor_role(rank: int | str) -> str:
    """An actor's name: its log, its stats file and its shard folder under each topic."""
    return f"{ACTOR_ROLE_PREFIX}{rank}"


def is_actor_role(role: str) -> bool:
    return role.startswith(ACTOR_ROLE_PREFIX)


def node_actor_role(node: str, incarnation: str, k: int) -> str:
    """An actor of a cluster=ray node runner: the runner's incarnation is in the name, so a restarted
    runner never appends to its predecessor's shards (nor writes its log or stats file)."""
    return actor_role(f"{node}-{incarnation}-{k}")  # type: ignore[arg-type]  (any str after actor_)


def actor_shard_dir(topic_dir: Path, actor_rank: int | str) -> Path:
    return Path(topic_dir) / actor_role(actor_rank)


def shard_path(actor_dir: Path, seq: int) -> Path:
    """Sequence numbers are zero-padded, so an actor's shards sort by name in write order."""
    return Path(actor_dir) / f"{seq:06d}{SHARD_SUFFIX}"


def shard_key(path: Path) -> str:
    """A shard's name relative to its topic folder, `actor_<k>/<seq>.jsonl`: the checkpoint's key for it."""
    return f"{Path(path).parent.name}/{Path(path).name}"


def shard_seq(path: Path) -> int:
    return int(Path(path).stem)


def list_shards(topic_dir: Path) -> dict[str, list[Path]]:
    """Shards per actor folder (`actor_<k>`), oldest first."""
    out: dict[str, list[Path]] = {}
    topic_dir = Path(topic_dir)
    if not topic_dir.is_dir():
        return out
    for sub in sorted(topic_dir.iterdir()):
        if sub.is_dir():
            out[sub.name] = sorted(sub.glob(f"*{SHARD_SUFFIX}"))
    return out


def role_logs(logs_dir: Path) -> list[Path]:
    """Every role's log (`<role>.log`), by role name."""
    return sorted(Path(logs_dir).glob("*.log"))


def stats_file(stats_dir: Path, role: str) -> Path:
    return Path(stats_dir) / f"{role}.jsonl"


def stats_files(stats_dir: Path) -> list[Path]:
    """Every role's stats file, by role name."""
    return sorted(Path(stats_dir).glob("*.jsonl"))


@dataclass(frozen=True)
class RunDir:
    """Every path pipegen reads or writes under output_dir."""

    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "conf"

    @property
    def config_file(self) -> Path:
        return self.conf / "config.yaml"

    @property
    def units_file(self) -> Path:
        return self.conf / "units.json"

    @property
    def fingerprint_file(self) -> Path:
        return self.conf / "fingerprint.json"

    @property
    def launch_file(self) -> Path:
        return self.conf / "launch.json"

    @property
    def engines_file(self) -> Path:
        """What each server of the latest launch reported of its numerics (version, dtype, deterministic mode)."""
        return self.conf / "engines.json"

    def record_engine(self, url: str, facts: dict) -> None:
        """Add one server's report to conf/engines.json (the launcher's, as each server answers)."""
        try:
            known = orjson.loads(self.engines_file.read_bytes())
        except (OSError, ValueError):
            known = {}
        known[url] = facts
        atomic_write_bytes(self.engines_file, orjson.dumps(known, option=orjson.OPT_INDENT_2))

    def engine_facts(self) -> dict:
        """conf/engines.json's first server's report ({} where none was recorded)."""
        try:
            known = orjson.loads(self.engines_file.read_bytes())
        except (OSError, ValueError):
            return {}
        return next(iter(known.values()), {}) if isinstance(known, dict) else {}

    @property
    def streams_file(self) -> Path:
        """streams=redis: the run's stream namespace, fixed at its first use (stream_namespace)."""
        return self.conf / "streams.json"

    def stream_namespace(self) -> str:
        """streams=redis: the prefix of the run's Redis stream keys, `pipegen:<run key>:<8 random hex>`. Made once
        by the first process that asks and kept in conf/streams.json, so it outlives a changed run key
        (resume_with_changes, rescore) and two runs of one setup in two directories never share a stream."""
        try:
            return orjson.loads(self.streams_file.read_bytes())["namespace"]
        except FileNotFoundError:
            pass
        self.conf.mkdir(parents=True, exist_ok=True)
        namespace = f"pipegen:{self.run_key() or 'new'}:{os.urandom(4).hex()}"
        tmp = self.conf / f".streams.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        tmp.write_bytes(orjson.dumps({"namespace": namespace}))
        try:
            os.link(tmp, self.streams_file)  # create-if-absent: the first process to get here names the run
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        return orjson.loads(self.streams_file.read_bytes())["namespace"]

    def stream_key(self, topic: str) -> str:
        """streams=redis: the Redis stream that holds a topic's lines (rollouts, failures)."""
        return f"{self.stream_namespace()}:{topic}"

    @property
    def nodes(self) -> Path:
        """cluster=ray: one launch record per node runner (`NodeRecord`)."""
        return self.conf / "nodes"

    def node_file(self, node: str) -> Path:
        return self.nodes / f"{node}.json"

    def task_file(self, name: str, digest: str) -> Path:
        """A task's rows, named by their content's digest (a changed task is a new file, never a rewrite)."""
        return self.root / "tasks" / f"{name}-{digest}.parquet"

    @property
    def launcher_lock(self) -> Path:
        return self.root / ".launcher.lock"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def role_log(self, role: str) -> Path:
        return self.logs / f"{role}.log"

    def log_files(self) -> list[Path]:
        """Role logs, then verl's per-launch metrics files."""
        return role_logs(self.logs) + sorted(self.logs.glob("metrics-*.jsonl"))

    def role_command(self, role: str) -> Path:
        """The role's command line and environment, runnable by hand."""
        return self.logs / f"{role}.cmd.sh"

    def metrics_log(self, launch_id: str) -> Path:
        """verl's `file` Tracking backend, one file per launch."""
        return self.logs / f"metrics-{launch_id}.jsonl"

    @property
    def streams(self) -> Path:
        return self.root / "streams"

    @property
    def rollouts(self) -> Path:
        return self.streams / "rollouts"

    @property
    def failures(self) -> Path:
        return self.streams / "failures"

    @property
    def stats(self) -> Path:
        return self.streams / "stats"

    @property
    def progress(self) -> Path:
        return self.streams / "progress"

    def progress_file(self, index: int, sample: int) -> Path:
        return self.progress / progress_file_name(index, sample)

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint.json"

    @property
    def writer_lock(self) -> Path:
        return self.root / ".writer.lock"

    @property
    def publish_state(self) -> Path:
        """storage.url: what the writer's publisher has published to the store and what it waits on."""
        return self.root / "publish.json"

    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories.pkl"

    @property
    def artifact(self) -> Path:
        return self.root / "trajectories.zip"

    @property
    def failed_units(self) -> Path:
        """The units left out of a partial output, with their reasons (the writer's; gone once complete)."""
        return self.root / "failed_units.json"

    @property
    def output_shards(self) -> Path:
        """The sharded output's folder (generation.merge_output=sharded)."""
        return self.root / "trajectories"

    @property
    def output_index(self) -> Path:
        return self.output_shards / "index.json"

    def output_shard(self, number: int) -> Path:
        return self.output_shards / f"part_{number:05d}.pkl"

    def merged_output(self) -> Path | None:
        """The merged output that exists: trajectories.pkl, or the sharded output's index; None before the merge."""
        for path in (self.trajectories, self.output_index):
            if path.exists():
                return path
        return None

    def export_file(self, fmt: str) -> Path:
        """The export in ``fmt`` (parquet or jsonl)."""
        return self.root / f"trajectories.{fmt}"

    def export_card(self, export: Path) -> Path:
        """The Hugging Face dataset card beside an export file (README.md in its folder)."""
        return Path(export).parent / "README.md"

    @property
    def atif_dir(self) -> Path:
        """The ATIF export: one `<index>-<sample>-<trajectory>.json` document per trajectory."""
        return self.root / "trajectories.atif"

    @property
    def report_html(self) -> Path:
        return self.root / "report.html"

    @property
    def report_json(self) -> Path:
        return self.root / "report.json"

    def batch_file(self, number: int) -> Path:
        return self.root / batch_file_name(number)

    def batch_files_on_disk(self) -> list[Path]:
        return sorted(self.root.glob(BATCH_GLOB))

    def legacy_batch_file(self, number: int) -> Path:
        return self.root / legacy_batch_file_name(number)

    def legacy_batch_files(self) -> list[Path]:
        """Batch files in pipegen's old pickle format: a run that has them is refused until they are converted."""
        return sorted(self.root.glob(LEGACY_BATCH_GLOB))

    # ---- the small files every role reads ----
    def run_key(self) -> str:
        """Stable across launches of one run and equal for identical setups: the fingerprint's digest, or the run key
        it keeps (`"run_key"`: a run that had samples added keeps its prompts' uids). Empty before the launcher has
        saved a fingerprint."""
        path = self.fingerprint_file  # fingerprint.run_key_of gives the same key before the file is saved
        if not path.exists():
            return ""
        data = path.read_bytes()
        try:
            kept = orjson.loads(data).get("run_key")
        except (orjson.JSONDecodeError, AttributeError):
            kept = None
        return kept if isinstance(kept, str) and kept else hashlib.sha256(data).hexdigest()[:16]

    def write_manifest(self, indices: list[int], dataset: "DatasetFacts | None" = None) -> None:
        body = {"indices": indices, **({"dataset": asdict(dataset)} if dataset is not None else {})}
        atomic_write_bytes(self.units_file, orjson.dumps(body))

    def read_dataset_facts(self) -> "DatasetFacts | None":
        """How the manifest's prompts were chosen from the dataset (None: not recorded, or unreadable)."""
        try:
            facts = orjson.loads(self.units_file.read_bytes()).get("dataset")
            return DatasetFacts(**facts) if isinstance(facts, dict) else None
        except (OSError, ValueError, TypeError):
            return None

    def read_manifest(self) -> list[int]:
        """The unit manifest's indices; a DamagedFile when it is missing or damaged (the launcher
        reads the dataset again for it)."""
        try:
            return read_json_file(self.units_file, _manifest_indices, "unit manifest")
        except DamagedFile as e:
            raise e.with_advice("the checkpoint, batch files and shards (the manifest is only the dataset's "
                                "indices)", relaunch_advice(self.root)) from None

    def total_units(self, n: int) -> int:
        """Units of the run (prompts x n); 0 while the launcher has not written the manifest."""
        return len(self.read_manifest()) * n if self.units_file.exists() else 0

    def write_launch(self, launch: "LaunchRecord") -> None:
        atomic_write_bytes(self.launch_file, orjson.dumps(asdict(launch), option=orjson.OPT_INDENT_2))
        self.engines_file.unlink(missing_ok=True)  # a new launch's servers report again

    def read_launch(self) -> "LaunchRecord":
        """The current launch, or an empty record when no launcher has started this run yet; a
        DamagedFile when the file is there but damaged (the next launch writes it again)."""
        try:
            record = read_json_file(self.launch_file, LaunchRecord.from_dict, "launch record", missing_ok=True)
        except DamagedFile as e:
            raise e.with_advice("the checkpoint, batch files and shards", relaunch_advice(self.root)) from None
        return LaunchRecord(launch="", run_key="") if record is None else record

    def write_node(self, record: "NodeRecord") -> None:
        self.nodes.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.node_file(record.node), orjson.dumps(asdict(record), option=orjson.OPT_INDENT_2))

    def read_node(self, node: str) -> "NodeRecord | None":
        try:
            data = orjson.loads(self.node_file(node).read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None
        known = NodeRecord.__dataclass_fields__
        return NodeRecord(**{k: v for k, v in data.items() if k in known})


@dataclass
class DatasetFacts:
    """In the unit manifest beside its indices: the dataset's rows, and the prompts left out of the run."""

    rows: int | None  # rows in train_files (None: json files, whose rows are not counted before verl reads them)
    skipped_by_max_samples: int
    skipped_too_long: int  # data.filter_overlong_prompts=true dropped them


@dataclass
class LaunchRecord:
    """`conf/launch.json`: written by the launcher before it starts any role, read by every role."""

    launch: str  # a fresh id per launch: failures of an older launch are retried
    run_key: str  # RunDir.run_key(): seeds each prompt's uid
    servers: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    num_actors: int = 0  # actor processes in the whole run (0: a record from before pipegen wrote it)

    @classmethod
    def from_dict(cls, data: dict) -> "LaunchRecord":
        known = cls.__dataclass_fields__
        record = cls(**{k: v for k, v in data.items() if k in known})
        if not isinstance(record.launch, str) or not isinstance(record.servers, list):
            raise ValueError("launch is not an id or servers is not a list")
        return record


def _manifest_indices(data: dict) -> list[int]:
    indices = data["indices"]
    if not isinstance(indices, list) or not indices or not all(isinstance(i, int) for i in indices):
        raise ValueError("indices is not a non-empty list of integers")
    return indices


@dataclass
class NodeRecord(LaunchRecord):
    """`conf/nodes/<node>.json` (cluster=ray): one node runner's own launch record. `launch` and `run_key`
    are the launcher's (one launch id for the whole run, so the writer settles failures of every node);
    `servers` are this node's only, which its actors read and nothing else does."""

    node: str = ""
    incarnation: str = ""  # a fresh id per runner start; in every actor name of that start
    host: str = ""
    server_pgids: list[int] = field(default_factory=list)  # swept by the next incarnation on the same host


def arg_value(argv: list[str], key: str, default: str | None = None) -> str | None:
    """The value of a role's `key=VALUE` argument (the first one), else `default`: output_dir=, rank=, writer=, ..."""
    for arg in argv:
        if arg.startswith(f"{key}="):
            return arg.split("=", 1)[1]
    return default


def output_dir_from_args(args: list[str]) -> Path:
    """The output_dir=... override from a child's argv (children get only that and their identity)."""
    value = arg_value(args, "output_dir")
    if value is None:
        raise SystemExit("missing output_dir=DIR (the run directory)")
    return Path(value).expanduser().resolve()
