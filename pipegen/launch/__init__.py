"""Orchestration: plan this node's servers and actors, start and supervise every role, show the run.

`launcher` (the CLI: config, resume guard, manifest, start, progress, summary), `world` (placement as a
pure function), `supervise` (child processes, restarts, stop), `servers` (server command lines, and
starting a server and waiting until it answers).
`python -m pipegen.launch output_dir=DIR [overrides]` runs a job.
"""
