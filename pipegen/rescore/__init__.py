"""`pipegen rescore DIR [--only-unscored] [reward overrides]` (`python -m pipegen.rescore`): a run's rows scored
again with the current reward, generating nothing.

Users iterate on rewards: after a fix, the rows a run already generated are scored with the reward as it is
now (the run's saved reward keys, its file as it is on disk, or reward overrides given here), exactly as an
actor scores a row (actor/scoring.py's `Scorer`, the one definition of a row's reward call). Every committed
row is rescored (`--only-unscored`: the rows without a score), and the units whose reward failed, whose samples
the failures stream keeps, are scored and committed. Each rescored row keeps its old score beside the new one,
and every row names the reward that scored it (run/provenance.py's columns: the reward's description and
fingerprint, which the report and the dataset card read too).

`rescore_run.py` (the CLI: its checks, the locks, the order below), `batch_file.py` (one batch file rescored and
replaced whole).
The order: every batch file the checkpoint lists is rewritten as a new file renamed over the old (each file
whole, old or new, after any crash; a rerun skips rows the current reward already scored), the failed units'
kept samples are scored and appended to a shard of their own, the run's config and fingerprint then name the
current reward, and the writer (`python -m pipegen.writer`, a process) commits the new lines and merges.

Owns: that command. Must never: generate (it starts no server), give a row a score its reward did not return
(a row whose reward fails again keeps its old score and is listed), edit a file in place, or run beside a
launcher or a writer of the same directory.
"""
