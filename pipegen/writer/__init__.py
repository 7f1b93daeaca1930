"""What the writer produces: checkpointed DataProto batches from the shards, merged into trajectories.pkl.

`commit` (the writer process and its commit protocol), `committer` (the protocol's disk half, on a
background thread), `batches` (records -> verl's padded DataProto, and DataProto <-> batch file), `merge`
(the run's sorted rows -> trajectories.pkl or sorted parts, and the artifact), `rebuild` (the checkpoint
re-derived from the batch files), `tidy` (generation.keep_streams=false: a complete run's rollout shards
dropped once --verify passes), `convert` (an old run's pickle batch files -> Arrow, only with
--convert-pickle-batches), `alone` (whether a launcher or an actor of the run is alive: a writer left alone
commits what the shards hold, merges that partial output and exits).
`python -m pipegen.writer output_dir=DIR` starts or restarts it, alone or under the launcher; the export, when
configured, runs after the merge as `python -m pipegen.export`.
"""
