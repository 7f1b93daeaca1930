"""`python -m pipegen.tasks [MANIFEST.yaml ...]`: the tasks `tasks=[...]` can name (the built-in ones, and
any manifest files given), one line each: name, data, size, reward, defaults, description.

Owns: the listing. Must never: generate or write data.
"""

from __future__ import annotations

import sys

from pipegen.tasks.manifest import TaskError, TaskManifest, builtin_manifests, read_manifest


def describe(task: TaskManifest) -> str:
    data = task.data
    source = f"{data.generator}:{data.dataset}" if data.generator else f"{len(data.files or [])} parquet file(s)"
    size = f"{data.size} rows, seed {data.seed}" if data.generator else "rows of the files"
    reward = "verl's default_compute_score" if task.reward is None else task.reward.describe()
    defaults = " ".join(f"{k}={v}" for k, v in task.defaults.items()) or "-"
    return (f"  {task.name:<18} {task.description}\n"
            f"  {'':<18} data {source} ({size}); reward {reward}; defaults {defaults}; from {task.source}")


def main(argv: list[str] | None = None) -> int:
    from pathlib import Path

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__.split("\n\n")[0])
        return 0
    try:
        extra = [read_manifest(Path(a)) for a in argv]
    except TaskError as e:
        print(f"pipegen: error: {e}", file=sys.stderr)
        return 2
    print("Tasks (run one with: python -m pipegen.launch output_dir=DIR tasks=[NAME,...]; a manifest file of "
          "your own: tasks=[./my_task.yaml]):")
    for task in [*builtin_manifests().values(), *extra]:
        print(describe(task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
