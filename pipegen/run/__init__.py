"""The run contract: what every pipegen process shares through the run directory.

`layout` (every path, launch.json, units.json, the run key), `stream` (the line on disk: what a stream
line is, the unit key, appending and tailing shards), `checkpoint` (the writer's commit record),
`batchfile` (the batch on disk: Arrow, never a pickle), `rows` (a run's rows read back in the output's
order), `stats_line` (each role's stats line), `schema` and `config` (every key, and the one resolved config), `fingerprint` (the resume guard),
`atomic` (crash-safe replacement), `ownership` and `handshake` (locks, pids, exit codes, the manifest
wait), `integrity` and `diskfull` (damaged files, a full disk), `lease_protocol` (cluster leases).
Nothing here imports verl or torch or a role: every role, the status command included, can afford it.
"""
