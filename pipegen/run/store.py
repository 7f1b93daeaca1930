"""A run's storage in an S3-compatible object store: every object name, the segment that commits a batch, and
the one client every store call goes through.

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
writer's segments (`SegmentFollower`) to see what is committed, never another node's disk.

`<writer>` is the node's stable writer id (`storage.writer_id`, the host name by default); `<life>` is fresh per
writer process start, so a batch object's name never collides, even when a node lost its scratch folder. A batch
counts only once its segment exists; a zombie writer's late segment gets 412 (`SegmentTaken`).

**The tie-break** (a unit in two committed segments: a node thought lost came back, or a writer lost its
scratch): the copy in the segment that sorts first by (writer, seq) is kept; `resolve` is the one function every
reader applies.

Credentials and the endpoint come only from the standard AWS environment (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_REGION, ...): nothing here writes them anywhere.
An http:// endpoint (a store on loopback) is allowed without a setting.

Owns: every object name of a run in the store, the Segment, the tie-break, put / create-if-absent / get / list
with retries, and the lost-acknowledgement rule (a create-if-absent PUT that errs on the network is re-read and
its bytes compared before it is called failed).
Must never: import anything of pipegen but config/, rename or overwrite a segment, or put credentials into a
message, a file or a log line.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import urlparse

import orjson

SCHEMES = ("s3",)
WRITERS = "writers"
MANIFEST = "manifest"
CONF_FILES = ("config.yaml", "fingerprint.json", "units.json", "launch.json")
BACKOFF_FIRST_S = 1.0
BACKOFF_CAP_S = 5.0  # a store down for minutes is asked again at least this often, so the run goes on within
# 5 s of its return (a HEAD or PUT every 5 s costs a store nothing)
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


def _describe(error: BaseException) -> str:
    """An obstore error on one line, without its debug dump (which never holds a secret, but is long)."""
    text = str(error).split("\n\nDebug source:")[0]
    return " ".join(text.split())[:300]


class Store:
    """The run's store: every call pipegen makes to it. Calls retry transient errors with backoff up to
    `patience_s` (None: forever), calling `on_wait(seconds_down, error)` while they wait."""

    def __init__(self, url: str, patience_s: float | None = 60.0,
                 on_wait: Callable[[float, str], None] | None = None, request_timeout_s: float = 30.0):
        from obstore.store import S3Store

        self.url = StoreUrl.parse(url)
        self.patience_s = patience_s
        self.on_wait = on_wait
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
        client = {"timeout": timedelta(seconds=request_timeout_s), "connect_timeout": timedelta(seconds=5)}
        if endpoint.startswith("http://"):
            client["allow_http"] = True  # a store on loopback or a private network speaks plain HTTP
        config = {} if os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") else {"region": "us-east-1"}
        # obstore's own retries kept short: this class's loop says what it waits on and for how long
        retry = {"max_retries": 2, "retry_timeout": timedelta(seconds=request_timeout_s),
                 "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2)}}
        self._store = S3Store(self.url.bucket, prefix=self.url.prefix or None, client_options=client,
                              retry_config=retry, **config)

    # ---- the calls ----
    def put(self, key: str, data: bytes) -> None:
        import obstore

        self._retry(lambda: obstore.put(self._store, key, data))

    def put_file(self, key: str, path: Path) -> None:
        """A local file as one object; big files go up in parts, which stay invisible until the upload completes."""
        import obstore

        self._retry(lambda: obstore.put(self._store, key, Path(path)))

    def create(self, key: str, data: bytes) -> bool:
        """Create-if-absent (If-None-Match: *). True when this call created it, or when a create whose answer was
        lost had created it (the key holds these very bytes); False when the key holds other bytes."""
        import obstore
        from obstore.exceptions import AlreadyExistsError

        def attempt() -> bool:
            try:
                obstore.put(self._store, key, data, mode="create")
                return True
            except AlreadyExistsError:
                return self.get(key) == data  # our own earlier attempt, whose acknowledgement was lost
            except Exception:
                if self.get_now(key) == data:  # the lost-acknowledgement rule: re-read before calling it failed
                    return True
                raise

        return self._retry(attempt)

    def get(self, key: str) -> bytes | None:
        return self._retry(lambda: self.get_now(key))

    def get_now(self, key: str) -> bytes | None:
        """One GET, no retry: the bytes, or None when the key does not exist."""
        import obstore

        try:
            return bytes(obstore.get(self._store, key).bytes())
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        """Whether the key exists (a HEAD: nothing is downloaded)."""
        import obstore

        def attempt() -> bool:
            try:
                obstore.head(self._store, key)
                return True
            except FileNotFoundError:
                return False

        return self._retry(attempt)

    def list(self, prefix: str, after: str | None = None) -> list[str]:
        return self._retry(lambda: self.list_now(prefix, after))

    def list_now(self, prefix: str, after: str | None = None) -> list[str]:
        """One listing, no retry: every object name under prefix (those sorting after `after` only), sorted."""
        import obstore

        listing = obstore.list(self._store, prefix=prefix, offset=after)
        return sorted(m["path"] for batch in listing for m in batch)

    def folders(self, prefix: str) -> list[str]:
        """The names one level below prefix (a listing with a delimiter: no object under them is read)."""
        import obstore

        found = self._retry(lambda: obstore.list_with_delimiter(self._store, prefix=prefix.rstrip("/") + "/"))
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"])

    def delete(self, key: str) -> None:
        import obstore

        self._retry(lambda: obstore.delete(self._store, key))

    def _retry(self, call: Callable):
        from obstore.exceptions import AlreadyExistsError

        started, wait = time.monotonic(), BACKOFF_FIRST_S
        while True:
            try:
                return call()
            except (AlreadyExistsError, StoreError):
                raise
            except Exception as e:  # obstore's: a network error, a 5xx, a throttle, or a refusal
                down = time.monotonic() - started
                if self.patience_s is not None and down >= self.patience_s:
                    raise StoreError(f"{self.url}: {_describe(e)}") from None
                if self.on_wait is not None:
                    self.on_wait(down, _describe(e))
                time.sleep(wait)
                wait = min(BACKOFF_CAP_S, wait * 2)

    # ---- segments ----
    def segments(self, writer: str | None = None) -> list[Segment]:
        """Every committed segment (of one writer, or of every writer), in (writer, seq) order."""
        keys = self.list(segments_prefix(writer) if writer else WRITERS)
        out = []
        for key in keys:
            if is_segment_key(key):
                data = self.get(key)
                if data is not None:
                    out.append(Segment.from_bytes(data))
        return sorted(out, key=lambda s: (s.writer, s.seq))


class SegmentFollower:
    """What the store says of a run, read incrementally (each segment fetched once): every writer's committed
    segments, the units they commit (resolve's rule decides which copy a reader keeps; the set is the same), and the
    units a writer listed as failed in launch `launch` (its failed.json) that no segment commits."""

    def __init__(self, store: Store, launch: str):
        self.store = store
        self.launch = launch
        self.segments: list[Segment] = []
        self.committed: set[int] = set()
        self.failed: dict[str, str] = {}  # unit label -> reason
        self._last: dict[str, str] = {}  # writer -> its last segment key read

    def refresh(self) -> None:
        failed: dict[str, str] = {}
        for writer in self.store.folders(WRITERS):
            for key in self.store.list(segments_prefix(writer), self._last.get(writer)):
                data = self.store.get(key) if is_segment_key(key) else None
                if data is not None:
                    seg = Segment.from_bytes(data)
                    self.segments.append(seg)
                    self.committed.update(seg.unit_keys())
                    self._last[writer] = key
            listed = self.store.get(failed_key(writer))
            if listed is not None:
                record = orjson.loads(listed)
                if record.get("launch") == self.launch:
                    failed.update(record.get("units", {}))
        self.failed = failed


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


def refusal(url: str) -> str:
    """'' when the store answers for this run's prefix; else one line naming the fix (wrong credentials, a
    missing bucket, an unreachable endpoint, a URL pipegen does not speak). Quick: no retries."""
    try:
        store = Store(url, patience_s=0, request_timeout_s=10)
        store._retry(lambda: store.list_now(conf_key("")))  # a missing bucket answers a list, not a get, with 404
    except StoreRefused as e:
        return str(e)
    except StoreError as e:
        text = str(e)
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or "AWS's endpoint"
        if "NoSuchBucket" in text:
            return (f"storage url {url}: the bucket {StoreUrl.parse(url).bucket} does not exist at {endpoint}: "
                    "create it, or name another bucket")
        if any(word in text for word in ("403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied")):
            return (f"storage url {url}: the store at {endpoint} refused the credentials: set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY to a key that may read and write this bucket")
        if any(word in text.lower() for word in ("connect", "dns", "timed out", "timeout", "refused")):
            return (f"storage url {url}: cannot reach the store at {endpoint} ({text.rsplit(' - ', 1)[-1]}): check "
                    "AWS_ENDPOINT_URL and that the store is up")
        return f"storage url {url}: the store answered {text[-200:]}: check AWS_ENDPOINT_URL and the credentials"
    except Exception as e:  # obstore refused its configuration (a malformed endpoint, an unknown key)
        return f"storage url {url}: {_describe(e)}: check AWS_ENDPOINT_URL, AWS_REGION and the credentials"
    return ""
