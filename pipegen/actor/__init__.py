"""What an actor does: run verl agent loops for its share of the units and append one record each.

`worker` (the process: pending units, concurrency, shards, stats), `rollout` (one unit: dataset row ->
verl agent loop -> RolloutRecord), `client` (SGLang's /generate over HTTP, as verl's server manager),
`protocol` (the /generate body and answer),
`pacing` (units in flight per server, fixed or following the servers' limits and load; each request's
stall deadline), `scoring` (verl's default_compute_score), `dataset` (verl's RLHFDataset, the unit
manifest's source).
`python -m pipegen.actor output_dir=DIR rank=K` runs one actor.
"""
