"""The stream layer's line rules: complete lines only, torn tails of sealed shards skipped, rotation."""

from pathlib import Path

import orjson

from pipegen.run.stream import encode_record, read_head, scan_units, ShardAppender, ShardTailer


def _append_raw(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def test_record_line_starts_with_index_and_sample_and_round_trips():
    line = encode_record(12, 3, {"x": [1, 2]})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert read_head(line) == (12, 3)
    assert orjson.loads(line) == {"index": 12, "sample": 3, "x": [1, 2]}


def test_partial_line_in_live_shard_is_waited_for_then_used_once(tmp_path):
    app = ShardAppender(tmp_path, 0, max_bytes=1 << 20, fsync_interval_s=60)
    app.append(encode_record(0, 0, {}))
    full = encode_record(1, 0, {"payload": "y" * 100})
    _append_raw(app.path, full[:40])  # a writer caught mid-line
    tailer = ShardTailer(tmp_path)
    assert [read_head(l) for _, _, l in tailer.lines()] == [(0, 0)]
    assert list(tailer.lines()) == []  # still partial: nothing, and nothing skipped
    assert tailer.stats.torn_lines == 0
    _append_raw(app.path, full[40:])
    assert [read_head(l) for _, _, l in tailer.lines()] == [(1, 0)]
    assert list(tailer.lines()) == []  # used exactly once


def test_torn_last_line_of_sealed_shard_is_skipped_and_counted(tmp_path):
    first = ShardAppender(tmp_path, 0, max_bytes=1 << 20, fsync_interval_s=60)
    first.append(encode_record(0, 0, {}))
    _append_raw(first.path, encode_record(1, 0, {})[:10])  # crash mid-write
    # the actor restarts: a new shard seals the old one
    second = ShardAppender(tmp_path, 0, max_bytes=1 << 20, fsync_interval_s=60)
    second.append(encode_record(1, 0, {}))
    assert first.path != second.path
    tailer = ShardTailer(tmp_path)
    heads = [read_head(l) for _, _, l in tailer.lines()]
    assert heads == [(0, 0), (1, 0)]
    assert tailer.stats.torn_lines == 1
    assert list(tailer.lines()) == []


def test_offsets_resume_exactly_where_consumed(tmp_path):
    app = ShardAppender(tmp_path, 0, max_bytes=1 << 20, fsync_interval_s=60)
    for i in range(5):
        app.append(encode_record(i, 0, {}))
    tailer = ShardTailer(tmp_path)
    seen = []
    for _, _, line in tailer.lines():
        seen.append(read_head(line)[0])
        if len(seen) == 2:
            break
    resumed = ShardTailer(tmp_path, dict(tailer.offsets))
    assert [read_head(l)[0] for _, _, l in resumed.lines()] == [2, 3, 4]


def test_rotation_by_size_keeps_every_record_once(tmp_path):
    app = ShardAppender(tmp_path, 3, max_bytes=300, fsync_interval_s=0)
    for i in range(40):
        app.append(encode_record(i, 1, {"pad": "z" * 30}))
    app.close()
    shards = sorted((tmp_path / "actor_3").glob("*.jsonl"))
    assert len(shards) > 3
    assert scan_units(tmp_path, {}) == {(i, 1) for i in range(40)}


def test_long_line_bigger_than_a_read_chunk(tmp_path):
    app = ShardAppender(tmp_path, 0, max_bytes=1 << 24, fsync_interval_s=60)
    app.append(encode_record(7, 0, {"big": "q" * 50000}))
    tailer = ShardTailer(tmp_path, chunk_bytes=1024)
    lines = [l for _, _, l in tailer.lines()]
    assert len(lines) == 1 and orjson.loads(lines[0])["big"] == "q" * 50000
