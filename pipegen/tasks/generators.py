"""Where a task's generated rows come from: reasoning-gym's procedural datasets (installed with pipegen,
offline), or a user's function named in the manifest.

A generator gives `size` entries, the same ones for the same seed, each a dict with "question" and
"answer" (reasoning-gym's own entry shape; "metadata" and any other key are kept for the reward).

Owns: calling the generator and checking what it gave.
Must never: download anything.
"""

from __future__ import annotations

from typing import Any

from pipegen.tasks.manifest import TaskError, TaskManifest

REASONING_GYM = "reasoning_gym"


def generate(task: TaskManifest) -> list[dict[str, Any]]:
    data = task.data
    if data.generator == REASONING_GYM:
        import reasoning_gym

        if not data.dataset:
            raise TaskError(f"task {task.name}: generator: reasoning_gym needs data.dataset (one of reasoning-gym's "
                            "datasets, e.g. gsm_symbolic)")
        try:
            dataset = reasoning_gym.create_dataset(data.dataset, size=data.size, seed=data.seed, **data.config)
        except (KeyError, ValueError, TypeError, AssertionError) as e:
            raise TaskError(f"task {task.name}: reasoning_gym cannot make {data.dataset} with {dict(data.config)}: "
                            f"{e}") from None
        entries = [dict(entry) for entry in dataset]
    else:
        from verl.utils.import_utils import load_extern_object

        path, _, name = str(data.generator).rpartition(":")
        if not path or not name:
            raise TaskError(f"task {task.name}: data.generator={data.generator}: use reasoning_gym, "
                            "path/to/file.py:function or pkg://module:function")
        try:
            make = load_extern_object(path, name)
        except (FileNotFoundError, AttributeError, RuntimeError, ImportError) as e:
            raise TaskError(f"task {task.name}: cannot load data.generator={data.generator}: {e}") from None
        entries = [dict(entry) for entry in make(size=data.size, seed=data.seed, **data.config)]
    if len(entries) != data.size:
        raise TaskError(f"task {task.name}: the generator gave {len(entries)} entries for size {data.size}")
    for i, entry in enumerate(entries):
        if "question" not in entry or "answer" not in entry:
            raise TaskError(f"task {task.name}: generated entry {i} has no 'question' or 'answer' "
                            f"(keys: {sorted(entry)[:8]})")
    return entries
