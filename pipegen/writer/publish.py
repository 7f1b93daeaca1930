"""The writer's publisher: each batch the local commit protocol committed, committed again to the run's object
store (storage.url), exactly once, on a background thread.

For each batch file the local checkpoint lists, in order: PUT the batch object under a name that never collides
(`writers/<writer>/<life>/batch_<N>.arrow`), then create its segment `writers/<writer>/manifest/<seq>.json`
if absent (run/store.py names both): the batch counts from that moment. A restarted writer first reads its own
segments, and skips a local batch whose units its earlier lives published: nothing is published twice, whether
the kill came before the object, between the object and the segment (the object is garbage no segment names,
and goes up again under the new life's name), or after the segment. A segment number taken by other contents
means another process publishes as this writer (a zombie): the publisher stops and the writer exits saying so.
A store that does not answer is asked again with backoff for as long as it takes; meanwhile the actors keep
streaming and the writer keeps committing locally, and `DIR/publish.json` says what waits (`pipegen status`
shows it). At the end the writer hands over its outputs (the merged output, failed_units.json, the export),
which go up once every batch is published.

Under cluster=ray with a store, each node runner's writer publishes as that runner (`writer` given: its node and
incarnation), puts no conf file (the launcher put them) and keeps `writers/<writer>/failed.json` true: the units its
node saw fail in this launch, so the head counts them settled.

Owns: the store's copy of this writer's batches and segments, the conf files' copies and the outputs' uploads,
DIR/publish.json, and the kill tests' crash points around the store's PUTs (`PIPEGEN_WRITER_FAULT`).
Must never: publish a batch the local checkpoint does not list, create a segment before its object is stored,
overwrite a segment, or stop the local commit protocol while the store is away.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import orjson
from omegaconf import DictConfig

from pipegen.run.atomic import replace_unsynced
from pipegen.run.checkpoint import load_checkpoint
from pipegen.run.layout import RunDir
from pipegen.run.rows import batch_rows
from pipegen.run.store import (CONF_FILES, LATE_CONF_FILES, PublishState, Segment, SegmentTaken, batch_key, conf_key,
                               failed_key, key_ranges, output_key, segment_key, sha256)
from pipegen.run.stream import UnitKeys
from pipegen.transport.object_store import Store
from pipegen.writer.committer import FAULT_ENV, FaultInjector

log = logging.getLogger("pipegen.writer")

POLL_S = 0.5  # how often the publisher looks for newly committed local batches when no commit wakes it


def writer_id(cfg: DictConfig) -> str:
    """This node's stable name in the store: storage.writer_id, else the host name."""
    return str(cfg.storage.writer_id or socket.gethostname())


def run_outputs(run: RunDir, export_format: str | None) -> tuple[list[Path], list[str]]:
    """The outputs a finished writer uploads (paths under the run directory), and the objects of outputs that are no
    longer true (failed_units.json once the run is complete)."""
    outputs = [p for p in (run.trajectories, run.failed_units) if p.exists()]
    if run.output_index.exists():
        outputs += sorted(p for p in run.output_shards.iterdir() if p.is_file())
    if export_format and run.export_file(str(export_format)).exists():
        export = run.export_file(str(export_format))
        outputs += [export] + ([run.export_card(export)] if run.export_card(export).exists() else [])
    gone = [] if run.failed_units.exists() else [output_key(run.failed_units.relative_to(run.root))]
    return outputs, gone


class Publisher:
    def __init__(self, cfg: DictConfig, run: RunDir, keys: UnitKeys, node_writer: str | None = None):
        self.run = run
        self.keys = keys
        self.node_writer = node_writer  # cluster=ray: this node runner's writer id (the launcher put the conf files)
        self.writer = node_writer or writer_id(cfg)
        self.life = uuid.uuid4().hex[:12]  # a fresh name space per process start: an object name never repeats
        self.state = PublishState(str(cfg.storage.url), self.writer, self.life, os.getpid())
        self.store = Store(str(cfg.storage.url), patience_s=None, on_wait=self._down)
        self.fault = FaultInjector(os.environ.get(FAULT_ENV))
        self.published: set[int] = set()
        self.next_seq = 0
        self.handled: set[int] = set()  # local batch numbers published or found published
        self._outputs: list[Path] | None = None
        self._gone: list[str] = []
        self._failed: bytes | None = None  # a node writer's failed.json to put, when it changed
        self._failed_put = b""
        self._wake = threading.Event()
        self.error = ""  # set when the publisher stopped for good
        self._thread = threading.Thread(target=self._main, name="pipegen-publish", daemon=True)

    def start(self) -> None:
        self._save()
        self._thread.start()

    def wake(self) -> None:
        """A batch was just committed locally: look at the checkpoint now rather than at the next poll."""
        self._wake.set()

    def finish(self, outputs: list[Path], gone: list[str]) -> str:
        """Wait until every committed batch is published, then upload `outputs` (paths under the run directory)
        and delete the objects `gone` names (an earlier partial output's list, say). Returns '' or why not."""
        self._outputs, self._gone = outputs, gone
        self._wake.set()
        while self._thread.is_alive():
            self._thread.join(timeout=POLL_S)
        return self.error

    def failed_now(self, launch: str, failed: dict[str, str]) -> None:
        """A node writer's failed units of this launch (label -> reason): put as its failed.json before the next
        batch, and before finish returns."""
        data = orjson.dumps({"launch": launch, "units": failed}, option=orjson.OPT_SORT_KEYS)
        if data != self._failed_put and (failed or self._failed_put):
            self._failed = data
            self._wake.set()

    # ---- the thread ----
    def _main(self) -> None:
        try:
            for name in CONF_FILES if self.node_writer is None else ():
                path = self.run.conf / name
                if path.exists():
                    self.store.put(conf_key(name), path.read_bytes())
            self._learn()
            while True:
                outputs = self._outputs  # read before the checkpoint: the last commit is on disk by then
                ckpt = load_checkpoint(self.run.checkpoint)
                todo = [n for n in ckpt.batches.numbers() if n not in self.handled]
                self.state.waiting = len(todo)
                self._save()
                self._put_failed()
                for number in todo:
                    self._publish(number)
                    self.state.waiting -= 1
                    self._save()
                if outputs is not None and not todo:
                    self._put_failed()
                    for name in LATE_CONF_FILES if self.node_writer is None else ():
                        if (path := self.run.conf / name).exists():
                            self.store.put(conf_key(name), path.read_bytes())
                    self._upload_outputs(outputs)
                    return
                if not todo:  # after work, look again at once: more may have committed meanwhile, or the end come
                    self._wake.wait(POLL_S)
                    self._wake.clear()
        except SegmentTaken as e:
            self.error = str(e)
        except Exception as e:  # never silent: the writer exits with it, and a restart publishes what is missing
            self.error = f"publishing to {self.state.url} failed: {type(e).__name__}: {e}"
        self.state.stopped = self.error
        self._save()

    def _learn(self) -> None:
        """What earlier lives of this writer published (their segments), so nothing goes up twice."""
        segments = self.store.segments(self.writer)
        for seg in segments:
            self.published.update(seg.unit_keys())
        self.next_seq = segments[-1].seq + 1 if segments else 0
        self.state.published = len(segments)
        if segments:
            log.info("store %s: %d segment(s) of writer %s committed %d unit(s) already", self.state.url,
                     len(segments), self.writer, len(self.published))

    def _publish(self, number: int) -> None:
        path = self.run.batch_file(number)
        rows = batch_rows(path)
        units = sorted(set(rows.unit_keys(self.keys).tolist()))
        if units and set(units) <= self.published:
            self.handled.add(number)  # an earlier life published it
            return
        data = path.read_bytes()
        self.fault.reached("before_object_put")
        key = batch_key(self.writer, self.life, number)
        self.store.put(key, data)
        self._up()
        self.fault.reached("after_object_put")  # an object no segment names: garbage, never counted
        seg = Segment(self.writer, self.next_seq, self.life, key, len(data), sha256(data), len(rows.index),
                      key_ranges(units))
        if not self.store.create(segment_key(self.writer, seg.seq), seg.to_bytes()):
            raise SegmentTaken(f"{self.state.url}: segment {seg.seq} of writer {self.writer} was committed by another "
                               f"process publishing as {self.writer} (a writer thought gone that came back, or two "
                               "nodes with one storage.writer_id): this one stops; give each node its own "
                               "storage.writer_id")
        self._up()
        self.fault.reached("after_segment_put")
        self.published.update(units)
        self.next_seq += 1
        self.handled.add(number)
        self.state.published += 1

    def _put_failed(self) -> None:
        data = self._failed
        if data is not None:
            self.store.put(failed_key(self.writer), data)
            self._failed_put = data
            if self._failed is data:
                self._failed = None

    def _upload_outputs(self, outputs: list[Path]) -> None:
        for path in outputs:
            self.store.put_file(output_key(path.relative_to(self.run.root)), path)
        for key in self._gone:
            self.store.delete(key)
        self._up()
        self.state.outputs_published = True
        self._save()
        log.info("store %s: %d batch(es) published by writer %s; outputs uploaded: %s", self.state.url,
                 self.state.published, self.writer, ", ".join(str(p.relative_to(self.run.root)) for p in outputs))

    # ---- what status reads ----
    def _down(self, seconds: float, error: str) -> None:
        if self.state.down_since is None:
            self.state.down_since = time.time() - seconds
            log.warning("store %s does not answer (%s): retrying with backoff; the run goes on locally",
                        self.state.url, error)
        self.state.error = error
        self._save()

    def _up(self) -> None:
        if self.state.down_since is not None:
            log.info("store %s answers again after %.0f s", self.state.url, time.time() - self.state.down_since)
            self.state.down_since, self.state.error = None, ""
            self._save()

    def _save(self) -> None:
        self.state.updated = time.time()
        # a status report rewritten at every batch: two fsyncs each cost the serial publisher more than a PUT, and
        # nothing needs it after a power cut (the next life rewrites it from the store's segments)
        replace_unsynced(self.run.publish_state, orjson.dumps(asdict(self.state), option=orjson.OPT_INDENT_2))


def merge_from_store(url: str, cache: Path | None = None) -> int:
    """`python -m pipegen.writer output_dir=s3://bucket/prefix`: the run's merged output made from the store alone
    (every node's scratch may be gone; laid out in `cache`, default the read cache) and uploaded there. Returns the
    exit code; one line on failure."""
    from pipegen.run.config import load_run_config
    from pipegen.run.store import StoreError
    from pipegen.transport.store_read import StoreRun
    from pipegen.writer.merge import merge_run

    read = StoreRun(url, cache)
    try:
        with read as run:
            ckpt = load_checkpoint(run.checkpoint)
            if not len(ckpt.batches):
                print(f"pipegen.writer: {url} has no committed batch yet: nothing to merge", file=sys.stderr)
                return 2
            merge_run(load_run_config(run), run, ckpt)
            outputs, _ = run_outputs(run, None)
            read.put_back(*(p for p in outputs if p != run.failed_units))
    except StoreError as e:
        print(f"pipegen.writer: {e}", file=sys.stderr)
        return 2
    print(f"pipegen.writer: merged {ckpt.num_committed} unit(s) of {url} from the store alone: {', '.join(read.keys)}")
    return 0
