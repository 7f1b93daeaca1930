"""The one client every call to a run's object store goes through (obstore), and what follows a store's segments.

`Store`: put, put a file (multipart, invisible until complete), create-if-absent (If-None-Match: *), get, list,
delete; every call retried with backoff while the store is down (up to `patience_s`; None: forever), saying what
it waits on. The lost-acknowledgement rule: a create-if-absent PUT that errs on the network is re-read and its
bytes compared before it is called failed. `SegmentFollower`: every writer's segments and failed lists, each
segment read once (what the head of a cluster counts as committed). `refusal`: the launch's one-line check that
the store serves this run. Object names, the Segment and the tie-break are run/store.py's.

Credentials and the endpoint come only from the standard AWS environment (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_REGION, ...): nothing here writes them anywhere.
An http:// endpoint (a store on loopback) is allowed without a setting.

Owns: every call pipegen makes to an object store, its retries and refusals.
Must never: rename or overwrite a segment, or put credentials into a message, a file or a log line.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import orjson

from pipegen.run.store import (WRITERS, Segment, StoreError, StoreRefused, StoreUrl, conf_key, failed_key,
                               is_segment_key, segments_prefix)

BACKOFF_FIRST_S = 1.0
BACKOFF_CAP_S = 5.0  # a store down for minutes is asked again at least this often, so the run goes on within
# 5 s of its return (a HEAD or PUT every 5 s costs a store nothing)


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
