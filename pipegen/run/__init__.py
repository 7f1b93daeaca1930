"""The run contract: what every pipegen process shares through the run directory, and nothing else.

`layout` (every path, launch.json, units.json, the run key), `config` (DIR/conf/config.yaml: the resolved
config saved and read back), `fingerprint` (the resume guard), `stream` (the line on disk: what a stream line
is, the unit key, appending and tailing shards), `pictures` (a picture in a stream line, to an engine and in a batch file),
`checkpoint` (the writer's commit record), `batchfile` (the batch on disk: Arrow, never a pickle), `rows` (a
run's rows read back in the output's order), `provenance` (which reward scored a row; the columns `pipegen
rescore` writes), `stats_line` (each role's stats line), `atomic` (crash-safe
replacement), `ownership` and `handshake` (locks, pids, exit codes, the manifest wait), `integrity` and
`diskfull` (damaged files, a full disk), `lease_protocol` (cluster leases), `precision` (the CPU server's
dtype rule), `unit_progress` (progress inside a sample: a running unit's calls and its answer's pieces).
Nothing here imports verl or torch, a role, or any part of pipegen but the config's schema (pipegen/config/):
every role, the status command included, can afford it. Composing a config is not here (config/ does it).
"""
