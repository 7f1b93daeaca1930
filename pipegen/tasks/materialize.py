"""A run's tasks as verl-layout parquet files in its directory: what `tasks=[...]` hands the launcher as
`data.train_files`, so tasks reach verl's RLHFDataset, the unit manifest, the fingerprint and resume exactly
as a user's own files do.

Each generated entry becomes one row: `data_source` (the task's), `prompt` (the manifest's system message,
then its template filled with the question), `reward_model.ground_truth` (the answer),
`extra_info.index` (the row's unit index: tasks are numbered one after the other in the order named),
`extra_info.task`, and `extra_info.entry` (the whole entry as JSON, for the task's reward). Rows of a
task's parquet files keep their prompt and data_source (unless the manifest sets data_source); their old
index moves to `extra_info.source_index`.

The file is named by a digest of its bytes, so the same manifest and seed give the same file, and a task
that changed (a new reasoning-gym, a new seed) gives a new file beside the old: the fingerprint then
names the change, and nothing a run already used is rewritten.

Owns: the rows of a task and their file in the run directory; which task scores which data_source.
Must never: write outside `RunDir.task_file`, write a file before the launcher holds the run's lock
(`task_data` only computes; `write_task_files` writes), or let two tasks with different rewards share a
data_source.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pipegen.run.atomic import atomic_write_bytes
from pipegen.run.layout import RunDir
from pipegen.config.schema import RewardSpec
from pipegen.tasks.manifest import TaskError, TaskManifest, find_tasks

DATA_SOURCE = "data_source"


@dataclass(frozen=True)
class TaskData:
    task: TaskManifest
    path: Path  # RunDir.task_file: named by a digest of `data`
    rows: int
    data: bytes = field(repr=False)  # the parquet file's bytes


def generated_rows(task: TaskManifest, offset: int) -> list[dict[str, Any]]:
    from pipegen.tasks.generators import generate

    prompt = task.prompt
    rows = []
    for i, entry in enumerate(generate(task)):
        messages = [{"role": "system", "content": prompt.system}] if prompt and prompt.system else []
        template = prompt.template if prompt else "{question}"
        try:
            content = template.format(**entry)
        except (KeyError, IndexError, ValueError) as e:
            raise TaskError(f"task {task.name}: prompt.template {template!r} cannot be filled from an entry "
                            f"(keys {sorted(entry)[:8]}): {e}") from None
        messages.append({"role": "user", "content": content})
        rows.append({
            DATA_SOURCE: task.row_source,
            "prompt": messages,
            "ability": "reasoning",
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            "extra_info": {"index": offset + i, "task": task.name,
                           "entry": orjson.dumps(entry, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_SORT_KEYS,
                                                 default=str).decode()},
        })
    return rows


def file_rows(task: TaskManifest, offset: int) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    rows = []
    for f in task.data.files or []:
        if not Path(f).is_file():
            raise TaskError(f"task {task.name}: data.files: no such file {f}")
        try:
            rows += pq.read_table(f).to_pylist()
        except Exception as e:  # pyarrow's ArrowInvalid / OSError: the file is not parquet
            raise TaskError(f"task {task.name}: {f} is not a readable parquet file ({str(e).splitlines()[0]})") \
                from None
    for i, row in enumerate(rows):
        extra = dict(row.get("extra_info") or {})
        if "index" in extra:
            extra["source_index"] = extra["index"]
        extra.update(index=offset + i, task=task.name)
        row["extra_info"] = extra
        if task.data_source:
            row[DATA_SOURCE] = task.data_source
    if not rows:
        raise TaskError(f"task {task.name}: data.files hold no rows")
    return rows


def parquet_bytes(rows: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    return buffer.getvalue()


def quotas(sizes: list[int], limit: int | None) -> list[int]:
    """How many rows each task gives to a run of `limit` prompts: one from each task in turn (all: no limit)."""
    if limit is None or limit <= 0 or limit >= sum(sizes):
        return list(sizes)
    taken = [0] * len(sizes)
    left = limit
    while left:
        for i, size in enumerate(sizes):
            if left and taken[i] < size:
                taken[i] += 1
                left -= 1
    return taken


def task_data(items: list[str], run: RunDir, max_samples: int | None = None) -> list[TaskData]:
    """Each named task's rows as the bytes of its parquet file in the run, and that file's path; nothing is
    written (the launcher writes them with `write_task_files` once it holds the run's lock and its resume
    guard has passed). With `max_samples` (data.train_max_samples), the tasks give their first rows in turn,
    one each, up to it, so `tasks=[a,b] max_samples=4` runs two of each, not four of a."""
    tasks = find_tasks(items)
    every = [generated_rows(task, 0) if task.data.generator else file_rows(task, 0) for task in tasks]
    out, offset = [], 0
    sources: dict[str, TaskManifest] = {}
    for task, all_rows, quota in zip(tasks, every, quotas([len(r) for r in every], max_samples)):
        rows = all_rows[:quota]
        for i, row in enumerate(rows):  # a row's index in the run: after the rows of the tasks before it
            row["extra_info"]["index"] = offset + i
        for source in {row.get(DATA_SOURCE) for row in rows}:
            other = sources.setdefault(str(source), task)
            if other is not task and other.reward != task.reward:
                raise TaskError(f"tasks {other.name} and {task.name} both have rows of data_source={source} but "
                                "different rewards; set data_source: in one manifest")
        data = parquet_bytes(rows)
        out.append(TaskData(task, run.task_file(task.name, hashlib.sha256(data).hexdigest()[:12]), len(rows), data))
        offset += len(rows)
    return out


def write_task_files(tasks: list[TaskData]) -> None:
    """The tasks' files, each written only when not there already (its name is its bytes' digest)."""
    for t in tasks:
        if not t.path.exists():
            t.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(t.path, t.data)


def task_rewards(items: list[str], files: list[str]) -> dict[str, RewardSpec | None]:
    """data_source -> its task's reward (None: verl's default), read from the run's task files (the
    same order as the tasks); what an actor routes each row by."""
    import pyarrow.parquet as pq

    routes: dict[str, RewardSpec | None] = {}
    for task, path in zip(find_tasks(items), files):
        for source in set(pq.read_table(path, columns=[DATA_SOURCE]).column(DATA_SOURCE).to_pylist()):
            routes[str(source)] = task.reward
    return routes


def task_files(cfg) -> list[TaskData]:
    """What `tasks=[...]` hands the launcher as data.train_files: every task's file in this run, in order, with
    its bytes (not yet written). A run names its data one way: tasks, or train_files (a manifest's data.files
    adds your parquet to tasks)."""
    from pipegen.inputs.demo import DEMO_NAME

    given = cfg.train_files
    if not (isinstance(given, str) and given == DEMO_NAME):
        raise TaskError(f"tasks={list(cfg.tasks)} and train_files={given} are both set: use one (a task manifest's "
                        "data.files takes your parquet files alongside tasks)")
    limit = cfg.data.get("train_max_samples")
    return task_data(list(cfg.tasks), RunDir(Path(str(cfg.output_dir))), int(limit) if limit is not None else None)
