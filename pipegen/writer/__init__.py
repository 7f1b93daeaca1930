"""What the writer produces: checkpointed DataProto batches from the run's stream medium, merged into trajectories.pkl.

`process` (the writer process: its refusals, and the one job it runs), `commit` (the commit loop and its protocol;
`Mode`, the interface of a job), `modes` (the launcher's writer, the writer alone, a node runner's writer),
`store_head` (cluster=ray with a store: the head's writer follows the store), `committer` (the protocol's disk half,
on a background thread), `batches` (records -> verl's padded DataProto, and DataProto <-> batch file), `merge` (the
run's sorted rows -> trajectories.pkl or sorted parts, the artifact, the export), `publish` (storage.url: each
batch committed again to the object store), `rebuild` (the checkpoint re-derived from the batch files; the writer's
recovery at its start), `tidy` (generation.keep_streams=false: a complete run's rollout shards dropped once
--verify passes), `convert` (an old run's pickle batch files -> Arrow, only with --convert-pickle-batches), `alone`
(whether a launcher or an actor of the run is alive).
`python -m pipegen.writer output_dir=DIR` starts or restarts it, alone or under the launcher; the export, when
configured, runs after the merge as `python -m pipegen.export`.
"""
