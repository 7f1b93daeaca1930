"""The job's config, on the ground floor: what every key is and how the one config of a job is composed.

`schema` (every pipegen key: its one default, type, rule and help), `compose` (Hydra composition of the
checkout's top-level `conf/pipegen.yaml` with verl's groups and the command line, the one-line errors, the
`--help` listing), and `verl_keys` (what pipegen does with each verl key of the rollout, data and trainer groups).
`conf/` ships inside the wheel as `pipegen/conf/` (the package `pipegen.conf`). `launch/job.py` turns a command line into the one resolved config with
these; `run/config.py` saves it into the run directory and every process reads it back from there.
Nothing here imports any other part of pipegen (an import-linter contract in pyproject.toml), verl or torch.
"""
