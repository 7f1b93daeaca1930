"""Tasks: `tasks=[name, ...]` resolves each name to data and a reward through a manifest, offline.

`manifest` (what a manifest holds, the built-in ones in `builtin/*.yaml`, a user's manifest file, and a
task's defaults for pipegen's keys), `materialize` (a task's rows as a verl-layout parquet file in the run
directory, deterministic from the manifest: the launcher's train_files, so tasks use the same unit
manifest, fingerprint and resume as any dataset), `generators` (where generated rows come from:
reasoning-gym's procedural datasets, or a user's function), `reasoning_gym` (the reward of reasoning-gym
tasks: its own scorer). `python -m pipegen.tasks` lists the tasks.
"""
