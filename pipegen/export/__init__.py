"""`python -m pipegen.export DIR --format parquet|jsonl`: a run's trajectories for tools that do not speak verl.

Owns: the export CLI (`__main__`) and the export row (`writers`). Must never: change the run it reads.
"""
