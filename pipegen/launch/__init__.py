"""Orchestration: prepare a launch, place its servers and actors, start the writer, supervise, report.

`launcher` (the CLI: the first look → prepare → place → supervise → report), `early` (what the command line
alone refuses, before the heavy imports), `job` (the command line → the job's one resolved config; with
`engine_choice`, which engine and why), `prepare` (every check and write before a process starts; `preflight`
and `resume` are its parts), `unit_manifest` (the unit manifest, read while the processes start), `placement`
(the interface, and the choice by cluster.kind: `local_placement`, `ray_placement` with `node_runner` and
`leases`), `run_writer` (the writer process), `node_processes` (one node's children), `world` (this node's plan,
a pure function; the visible GPUs), `supervise` (child processes, restarts, stop; `forks`, the roles forked with
verl imported), `servers` (server command lines; wait until a server answers).
`python -m pipegen.launch output_dir=DIR [overrides]` (`pipegen run`) runs a job.
"""
