"""Orchestration: prepare a launch, place its servers and actors, start the writer, supervise, report.

`launcher` (the CLI: prepare → place → supervise → report), `prepare` (every check and write before a process
starts; `resume` and `manifest` are its parts), `placement` (the interface, and the choice by cluster.kind:
`local_placement`, `ray_placement` with `node_runner` and `leases`), `run_writer` (the writer process),
`node_processes` (one node's children), `world` (this node's plan, a pure function), `supervise` (child
processes, restarts, stop), `servers` (server command lines; wait until a server answers).
`python -m pipegen.launch output_dir=DIR [overrides]` runs a job.
"""
