"""`python -m pipegen.export DIR --format parquet|jsonl|atif` (`pipegen export`): a run's trajectories for tools
that do not speak verl.

Owns: the export CLI (`__main__`), the export row (`writers`), the Parquet file's dataset card (`card`) and the
ATIF documents (`atif`). Must never: change the run it reads.
"""
