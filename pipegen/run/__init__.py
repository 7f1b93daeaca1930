"""The run contract: what every pipegen process shares through the run directory.

`layout` (every path, launch.json, units.json, the run key), `records` (what a stream line is),
`streams` (appending and tailing shards), `checkpoint` (the writer's commit record), `batchfile` (the
batch file's format: Arrow, never a pickle), `sorted_rows` (a run's rows in the output's order),
`fingerprint` (the resume guard), `config` (the one resolved config), `atomic` (crash-safe replacement).
Nothing here imports verl or torch: every role, the status command included, can afford it.
"""
