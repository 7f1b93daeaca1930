"""streams=redis: the run's lines through Redis streams, as PipelineRL's `streams=redis` offers (run/medium.py's
MEDIA names this medium; nothing imports it by name).

One stream per run and topic, `<namespace>:rollouts` and `<namespace>:failures` (the namespace is
`pipegen:<run key>:<random>`, made once per run directory: layout.RunDir.stream_namespace), so two runs on one
Redis never mix. Each entry holds one field, `line`: the exact bytes an actor would append to its shard
(run/stream.py's RolloutRecord / FailureRecord line, `\\n` included), so every reader parses it as a shard line.

- Actors XADD each finished unit's line (redis.asyncio). While Redis is unreachable (down, restarting, loading
  its AOF) the unit's line waits in memory and is sent again with backoff (capped at `MAX_BACKOFF_S`), and the
  actor's log says so; the unit counts as finished only once XADD returned. A retried XADD whose first try
  reached Redis leaves a second entry: the writer keeps the first complete record of a unit, as with shards.
- The writer reads as the consumer `WRITER` of the group `GROUP` (XREADGROUP): at its start the group is set to
  deliver from what the checkpoint covers (XGROUP SETID to `stream_ids`, 0 without one: a rebuilt checkpoint reads
  the stream again, as a shard is read from its checkpoint's offset), then it reads its own pending entries (ID 0:
  read by an earlier life of the writer and never acknowledged), then new ones (`>`). It XACKs entries
  only once the checkpoint covering them is durable (the checkpoint's `stream_ids` is the last entry ID it
  covers). A writer killed between reading and acknowledging reads those entries again at its next start and
  drops the units the checkpoint already holds (the writer's duplicate rule), so nothing is lost or doubled.
- Entries stay in the stream after their acknowledgement (the shards stay on disk too): the resume scan, status,
  --follow, verify and the report's outcomes read them with XRANGE, which never touches the group.
  generation.keep_streams=false deletes the rollout stream once the run is complete and verified.
- What survives a Redis restart is what its AOF holds: the launcher refuses a Redis with `appendonly no`
  (`refusal`), and warns when `appendfsync` is not `always` (everysec loses nothing when redis-server alone
  dies, up to a second of acknowledged entries when its machine does).

Owns: the Redis stream keys' contents, the consumer group, and every Redis call pipegen makes.
Must never: acknowledge an entry before the checkpoint covering it is durable, delete an entry a checkpoint has
not covered, or write a Redis password into a message.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from typing import Any, Callable, Iterator, Mapping
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipegen.run.checkpoint import Checkpoint
from pipegen.run.layout import RunDir
from pipegen.run.medium import ROLLOUTS, TOPICS, WAIT_S, StreamMedium
from pipegen.run.stream import TailStats

log = logging.getLogger("pipegen.streams")

FIELD = b"line"  # each entry's one field: the line's bytes
GROUP = "pipegen-writers"  # the writers' consumer group on every stream of the run
WRITER = "writer"  # the one writer of a run directory (its lock) is this consumer; its pending entries are its own
READ_COUNT = 512  # entries per XREADGROUP / XRANGE call
MAX_BACKOFF_S = 5.0  # the longest wait between two tries of an XADD while Redis is unreachable
OUTAGE_LINE_S = 30.0  # how often a role still waiting for Redis says so again
CONNECT_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 30.0
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)  # BusyLoadingError (AOF loading) is a ConnectionError
FIX = "start one with persistence (redis-server --appendonly yes --appendfsync always)"


def shown_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username + ':' if parts.username else ':'}***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class Outage:
    """One role's view of a Redis outage: a line when it starts, again every OUTAGE_LINE_S, one when it ends."""

    def __init__(self, url: str, waiting: str):
        self.url = shown_url(url)
        self.waiting = waiting  # what waits meanwhile, in words
        self.since: float | None = None
        self._said = 0.0

    def down(self, error: BaseException, held: int = 0) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if now - self._said >= OUTAGE_LINE_S or self._said < self.since:
            self._said = now
            log.warning("Redis at %s is unreachable for %.0f s (%s: %s); %s%s", self.url, now - self.since,
                        type(error).__name__, error, self.waiting, f" ({held} line(s) held in memory)" if held else "")

    def up(self) -> None:
        if self.since is not None:
            log.warning("Redis at %s answers again after %.1f s", self.url, time.monotonic() - self.since)
            self.since = None


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisMedium(StreamMedium):
    """streams=redis: `<namespace>:<topic>` streams on the Redis at `url`."""

    kind = "redis"

    def __init__(self, run: RunDir, url: str, wait_s: float = WAIT_S):
        self.run = run
        self.url = url
        self.wait_s = wait_s  # how long a read-only call waits for an unreachable Redis
        self._client: redis.Redis | None = None

    @classmethod
    def open(cls, run: RunDir, streams: Mapping[str, Any], wait_s: float) -> "RedisMedium":
        return cls(run, str(streams["redis_url"]), wait_s)

    @property
    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(self.url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                                socket_timeout=SOCKET_TIMEOUT_S)
        return self._client

    def key(self, topic: str) -> str:
        return self.run.stream_key(topic)

    def where(self, topic: str) -> str:
        return f"the Redis stream {self.key(topic)} at {shown_url(self.url)}"

    def refusal(self) -> str:
        """Refuses an unreachable Redis and one without AOF (a restart would lose acknowledged lines). A Redis that
        disallows CONFIG (a managed service) is accepted with a warning: its persistence is set where it is
        managed, and refusing would shut pipegen out of every such service."""
        where = f"streams=redis: the Redis at {shown_url(self.url)}"
        try:
            self.client.ping()
        except redis.AuthenticationError as e:
            return f"{where} refuses the password (set the right one in streams.redis_url or REDIS_URL): {e}"
        except UNREACHABLE as e:
            return (f"{where} cannot be reached ({type(e).__name__}: {e}): {FIX}, or point streams.redis_url "
                    f"(or REDIS_URL) at yours")
        except ResponseError as e:
            return f"{where} answers PING with an error ({e}): check streams.redis_url"
        try:
            settings = {**self.client.config_get("appendonly"), **self.client.config_get("maxmemory-policy"),
                        **self.client.config_get("appendfsync")}
        except ResponseError as e:
            log.warning("%s does not allow CONFIG GET (%s): make sure it runs with appendonly yes and appendfsync "
                        "always, or a Redis restart loses lines the actors were told are written", where, e)
            return ""
        if _text(settings.get("appendonly", "no")) != "yes":
            return (f"{where} runs with appendonly no: a restart would lose the lines it acknowledged; turn AOF on "
                    f"(redis-cli CONFIG SET appendonly yes, then CONFIG SET appendfsync always), or {FIX}")
        if _text(settings.get("maxmemory-policy", "noeviction")).startswith("allkeys-"):
            return (f"{where} evicts keys when full (maxmemory-policy {_text(settings['maxmemory-policy'])}): it "
                    f"could drop the run's stream; set maxmemory-policy noeviction")
        if _text(settings.get("appendfsync", "always")) != "always":
            log.warning("%s runs with appendfsync %s: a crash of its machine may lose up to a second of the lines "
                        "it acknowledged (appendfsync always loses none)", where, _text(settings["appendfsync"]))
        return ""

    def appender(self, topic: str, rank: int | str, ckpt: Checkpoint, max_bytes: int,
                 fsync_interval_s: float) -> "RedisAppender":
        return RedisAppender(self.url, self.key(topic), f"actor {rank}")

    def reader(self, topic: str, ckpt: Checkpoint) -> "RedisReader":
        return RedisReader(self, topic, ckpt.stream_ids.get(topic, "0"))

    def tail(self, topic: str, since: Checkpoint | None = None) -> "RedisTail":
        start = (since.stream_ids.get(topic) if since is not None else None)
        return RedisTail(self, self.key(topic), f"({start}" if start else "-")

    def holds_lines(self) -> bool:
        return any(self._patiently(lambda t=topic: self.client.xlen(self.key(t)), "read the streams' lengths")
                   for topic in TOPICS)

    def drop(self, topic: str) -> str:
        key = self.key(topic)
        entries = self.client.xlen(key)
        self.client.delete(key)
        return f"deleted the Redis stream {key} ({entries} entries)"

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def _patiently(self, call: Callable[[], Any], what: str) -> Any:
        """A read-only call, tried again while Redis is unreachable, for at most `wait_s`."""
        outage, delay, start = Outage(self.url, f"waiting to {what}"), 0.1, time.monotonic()
        while True:
            try:
                result = call()
                outage.up()
                return result
            except UNREACHABLE as e:
                if time.monotonic() - start >= self.wait_s:  # an OSError, as a shard that cannot be read
                    raise OSError(f"the Redis at {shown_url(self.url)} did not answer for {self.wait_s:.0f} s "
                                  f"({type(e).__name__}: {e}); start it again, or check streams.redis_url") from e
                outage.down(e)
                time.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)


class RedisAppender:
    """An actor's XADD of one topic's lines; a line waits in memory while Redis is unreachable."""

    def __init__(self, url: str, key: str, who: str):
        self.key = key
        self.client = redis.asyncio.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                                   socket_timeout=SOCKET_TIMEOUT_S)
        self.outage = Outage(url, f"{who} holds its finished units' lines and sends them when it answers")
        self.held = 0  # lines waiting for Redis now

    async def append(self, line: bytes) -> None:
        delay, holding = 0.1, False
        try:
            while True:
                try:
                    await self.client.xadd(self.key, {FIELD: line})
                    self.outage.up()
                    return
                except UNREACHABLE as e:
                    if not holding:
                        holding, self.held = True, self.held + 1
                    self.outage.down(e, self.held)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, MAX_BACKOFF_S)
        finally:
            if holding:
                self.held -= 1

    def sync(self) -> None:
        pass  # an XADD that returned is in Redis (its AOF): nothing waits

    def close(self) -> None:
        pass  # the connections close with the process; redis.asyncio's close needs the loop that is ending


class RedisTail:
    """A read-only cursor (XRANGE) over one stream: the group and its acknowledgements are left alone."""

    def __init__(self, medium: RedisMedium, key: str, start: str):
        self.medium = medium
        self.key = key
        self._next = start  # XRANGE's min: "-", or "(ID" (exclusive) after the last entry yielded
        self.stats = TailStats()

    def lines(self) -> Iterator[tuple[str, int, bytes]]:
        client = self.medium.client
        while True:
            entries = self.medium._patiently(
                lambda: client.xrange(self.key, min=self._next, max="+", count=READ_COUNT), f"read {self.key}")
            if not entries:
                return
            for entry_id, fields in entries:
                entry = _text(entry_id)
                self._next = f"({entry}"
                line = (fields or {}).get(FIELD)
                if not line or not line.endswith(b"\n"):
                    self.stats.torn_lines += 1
                    continue
                self.stats.lines += 1
                yield entry, 0, line


class RedisReader:
    """The writer's consumer-group cursor over one stream: its own pending entries first, then new ones. An entry
    is acknowledged only after the checkpoint covering it is durable: `save` hands the IDs over, the committer
    reports that checkpoint durable (`queue`), and the next `lines` (the main thread) sends their XACK."""

    def __init__(self, medium: RedisMedium, topic: str, covered: str):
        self.medium = medium
        self.topic = topic
        self.covered = covered  # the last entry ID the checkpoint covers ("0": none)
        self.key = medium.key(topic)
        self.stats = TailStats()
        self._cursor = "0"  # "0": this consumer's pending entries (an earlier life's); then ">": new entries
        self._group = False
        self._read: list[str] = []  # IDs yielded since the last save
        self._durable: queue.SimpleQueue[list[str]] = queue.SimpleQueue()  # covered by a durable checkpoint
        self._unacked: list[str] = []  # durable, XACK not yet sent (Redis was unreachable)
        self.outage = Outage(medium.url, "the writer waits for it (nothing is lost: the actors hold their lines)")

    def lines(self) -> Iterator[tuple[str, int, bytes]]:
        client = self.medium.client
        try:
            self._acknowledge()
            if not self._group:
                try:
                    client.xgroup_create(self.key, GROUP, id="0", mkstream=True)
                except ResponseError as e:
                    if "BUSYGROUP" not in str(e):
                        raise
                # the group delivers from what the checkpoint covers, as a shard is read from its offset: a rebuilt
                # or lost checkpoint has its entries delivered again (the committed ones are dropped as duplicates)
                client.xgroup_setid(self.key, GROUP, id=self.covered)
                self._group = True
                pending = int(client.xpending(self.key, GROUP)["pending"])
                if pending:  # an earlier life read them and died before its XACK: read again, committed ones dropped
                    log.warning("%s: %d entr(ies) read by an earlier writer and never acknowledged (XPENDING): reading "
                                "them again; the units the checkpoint holds are dropped as duplicates", self.key,
                                pending)
            while True:
                try:
                    reply = client.xreadgroup(GROUP, WRITER, {self.key: self._cursor}, count=READ_COUNT)
                except ResponseError as e:
                    if "NOGROUP" not in str(e):
                        raise
                    log.error("the consumer group of %s is gone (Redis lost its data?): making it again", self.key)
                    self._group, self._cursor = False, "0"
                    return
                entries = reply[0][1] if reply else []
                if not entries:
                    if self._cursor == ">":
                        break
                    self._cursor = ">"  # every pending entry read again: new ones from here
                    continue
                for entry_id, fields in entries:
                    entry = _text(entry_id)
                    if self._cursor != ">":
                        self._cursor = entry
                    self._read.append(entry)
                    line = (fields or {}).get(FIELD)
                    if not line or not line.endswith(b"\n"):  # an entry of another shape: nothing to commit
                        self.stats.torn_lines += 1
                        continue
                    self.stats.lines += 1
                    yield entry, 0, line
        except UNREACHABLE as e:
            self.outage.down(e)
            return
        self.outage.up()

    def save(self, ckpt: Checkpoint) -> Callable[[], None] | None:
        if not self._read:
            return None
        last = max(self._read, key=_id_tuple)
        known = ckpt.stream_ids.get(self.topic)
        if known is None or _id_tuple(last) > _id_tuple(known):
            ckpt.stream_ids[self.topic] = last
        ids, self._read = self._read, []
        return lambda: self._durable.put(ids)  # may run on the committer's thread: the XACK waits for lines()

    def settle(self) -> None:
        try:
            self._acknowledge()
        except UNREACHABLE as e:
            log.warning("could not acknowledge %d entr(ies) of %s (%s): the next writer start reads them again and "
                        "drops them as committed", len(self._unacked), self.key, e)

    def _acknowledge(self) -> None:
        while True:
            try:
                self._unacked += self._durable.get_nowait()
            except queue.Empty:
                break
        while self._unacked:
            chunk = self._unacked[:READ_COUNT * 4]
            self.medium.client.xack(self.key, GROUP, *chunk)
            del self._unacked[:len(chunk)]


def pending_count(medium: RedisMedium, topic: str = ROLLOUTS) -> int:
    """Entries of a topic delivered to a writer and not acknowledged (XPENDING): what a writer's next start reads
    again. 0 when the group does not exist yet."""
    try:
        return int(medium.client.xpending(medium.key(topic), GROUP)["pending"])
    except ResponseError:
        return 0
