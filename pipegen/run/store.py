"""A run's storage in an S3-compatible object store: every object name, the segment that commits a batch, and
the tie-break every reader applies. The client every store call goes through is transport/object_store.py.

```
s3://bucket/prefix/
  conf/config.yaml, conf/fingerprint.json, conf/units.json, conf/launch.json   the run's contract (copies)
  writers/<writer>/<life>/batch_<N>.arrow        a committed local batch file, uploaded whole (an unfinished
                                                 multipart upload is invisible to readers)
  writers/<writer>/manifest/<seq:08d>.json       a Segment, written create-if-absent (If-None-Match: *): the commit
  writers/<writer>/failed.json                   cluster=ray: the units that writer's node saw fail in a launch
  trajectories.pkl | trajectories/..., failed_units.json, trajectories.parquet, report.*   the outputs
```

Under cluster=ray each node runner's writer publishes as `<node>-<incarnation>` (a fresh id per runner start, so two
runners never share one), from a scratch folder of its own on its node (`node_scratch`); the head follows every
writer's segments (transport/object_store.py's `SegmentFollower`) to see what is committed, never another node's
disk.

`<writer>` is the node's stable writer id (`storage.writer_id`, the host name by default); `<life>` is fresh per
writer process start, so a batch object's name never collides, even when a node lost its scratch folder. A batch
counts only once its segment exists; a zombie writer's late segment gets 412 (`SegmentTaken`).

**The tie-break** (a unit in two committed segments: a node thought lost came back, or a writer lost its
scratch): the copy in the segment that sorts first by (writer, seq) is kept; `resolve` is the one function every
reader applies.

Owns: every object name of a run in the store, the store URL, the Segment, the tie-break, the store's errors and a
writer's publish.json.
Must never: import a store client (obstore) or anything of pipegen but config/, or put credentials into a
message, a file or a log line.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable
from urllib.parse import urlparse

import orjson

SCHEMES = ("s3",)
WRITERS = "writers"
MANIFEST = "manifest"
CONF_FILES = ("config.yaml", "fingerprint.json", "units.json", "launch.json")
# conf files the launch writes while it runs (what its servers reported of themselves), put beside the outputs
LATE_CONF_FILES = ("engines.json",)
FAILED = "failed.json"
# cluster=ray with a store: the folder under which each node runner makes its scratch folder (set where that node's
# `ray start` runs); unset: ~/.cache/pipegen/nodes/<bucket>/<prefix>
NODE_SCRATCH_ENV = "PIPEGEN_NODE_SCRATCH"


class StoreError(Exception):
    """A store call that failed: one line, never credentials."""


class StoreRefused(StoreError):
    """The store cannot serve this run as configured (wrong credentials, no bucket, unreachable, a bad URL):
    one line naming the fix."""


class SegmentTaken(StoreError):
    """A segment's number is committed already with other contents: another life of this writer id wrote it."""


def is_store_url(value: str | os.PathLike) -> bool:
    """Whether output_dir (or a command's argument) names an object store rather than a folder."""
    return "://" in str(value)


@dataclass(frozen=True)
class StoreUrl:
    bucket: str
    prefix: str  # no leading or trailing slash; may be empty

    @classmethod
    def parse(cls, url: str) -> "StoreUrl":
        parsed = urlparse(str(url))
        if parsed.scheme not in SCHEMES:
            raise StoreRefused(f"storage url {url}: pipegen speaks {', '.join(s + '://' for s in SCHEMES)} "
                               f"(an S3-compatible store; set AWS_ENDPOINT_URL for one that is not AWS), not "
                               f"{parsed.scheme}://")
        if not parsed.netloc:
            raise StoreRefused(f"storage url {url} names no bucket: use s3://BUCKET/PREFIX")
        return cls(parsed.netloc, parsed.path.strip("/"))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


def default_scratch(url: str) -> Path:
    """This node's scratch folder for a run whose output_dir is a store URL and storage.scratch_dir is unset."""
    parsed = StoreUrl.parse(url)
    return Path("~/.cache/pipegen/scratch").expanduser() / parsed.bucket / (parsed.prefix or "_")


def node_scratch(url: str, runner: str) -> Path:
    """cluster=ray: the scratch folder of one node runner's start (`runner` = node-incarnation) on this node's disk."""
    parsed = StoreUrl.parse(url)
    root = os.environ.get(NODE_SCRATCH_ENV)
    base = Path(root).expanduser() if root else Path("~/.cache/pipegen/nodes").expanduser() / parsed.bucket
    return base / (parsed.prefix or "_") / runner


def read_cache(url: str) -> Path:
    """Where a reader (status, verify, export, report, the merge) lays out a store run as a run directory."""
    parsed = StoreUrl.parse(url)
    return Path("~/.cache/pipegen/store").expanduser() / parsed.bucket / (parsed.prefix or "_")


# ---- names (each defined once) ----
def conf_key(name: str) -> str:
    return f"conf/{name}"


def writer_prefix(writer: str) -> str:
    return f"{WRITERS}/{writer}"


def batch_key(writer: str, life: str, number: int) -> str:
    return f"{writer_prefix(writer)}/{life}/batch_{number:05d}.arrow"


def segments_prefix(writer: str) -> str:
    return f"{writer_prefix(writer)}/{MANIFEST}"


def segment_key(writer: str, seq: int) -> str:
    return f"{segments_prefix(writer)}/{seq:08d}.json"


def failed_key(writer: str) -> str:
    return f"{writer_prefix(writer)}/{FAILED}"


def is_segment_key(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 4 and parts[0] == WRITERS and parts[2] == MANIFEST and parts[3].endswith(".json")


def output_key(relative: str | Path) -> str:
    """An output's object name: its path relative to the run directory (trajectories.pkl, report.html, ...)."""
    return Path(relative).as_posix()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Segment:
    """One commit in the store: the batch object it names, its size and sha256, its rows, its units as ranges
    of unit keys (index * n + sample)."""

    writer: str
    seq: int
    life: str
    batch: str  # the batch object's name
    size: int
    sha256: str
    rows: int
    units: list[list[int]] = field(default_factory=list)  # [[start, end), ...], sorted

    def unit_keys(self) -> Iterable[int]:
        for start, end in self.units:
            yield from range(start, end)

    @property
    def num_units(self) -> int:
        return sum(end - start for start, end in self.units)

    def to_bytes(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> "Segment":
        d = orjson.loads(data)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def key_ranges(sorted_keys: Iterable[int]) -> list[list[int]]:
    """Sorted distinct keys as half-open ranges."""
    out: list[list[int]] = []
    for k in sorted_keys:
        if out and out[-1][1] == k:
            out[-1][1] = k + 1
        else:
            out.append([k, k + 1])
    return out


def resolve(segments: list[Segment]) -> list[tuple[Segment, set[int]]]:
    """The tie-break every reader applies: segments in (writer, seq) order, each with the unit keys it holds
    that an earlier segment holds too (dropped from it: the first copy is kept)."""
    seen: set[int] = set()
    out = []
    for seg in sorted(segments, key=lambda s: (s.writer, s.seq)):
        keys = set(seg.unit_keys())
        out.append((seg, keys & seen))
        seen |= keys
    return out


@dataclass
class PublishState:
    """DIR/publish.json (RunDir.publish_state): what a writer's publisher has done and what it waits on (read by
    `pipegen status`)."""

    url: str
    writer: str
    life: str
    pid: int
    published: int = 0  # batches this writer's segments commit, every life counted
    waiting: int = 0  # local batches committed and not yet published
    down_since: float | None = None  # wall clock of the first failed call of the current outage
    error: str = ""  # the store's last error while down
    outputs_published: bool = False
    stopped: str = ""  # why the publisher stopped for good (a zombie's segment)
    updated: float = 0.0


def read_publish_state(path: Path) -> PublishState | None:
    """A writer's publish.json, or None when there is none or it cannot be read (status shows nothing then)."""
    try:
        data = orjson.loads(Path(path).read_bytes())
        return PublishState(**{k: v for k, v in data.items() if k in PublishState.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None
