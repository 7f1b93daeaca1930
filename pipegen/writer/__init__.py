"""What the writer produces: checkpointed DataProto batches from the shards, merged into trajectories.pkl.

`commit` (the writer process and its commit protocol), `batches` (records -> verl's padded DataProto),
`merge` (batches -> trajectories.pkl and the artifact).
`python -m pipegen.writer output_dir=DIR` starts or restarts it, alone or under the launcher.
"""
