"""Seeing a run: per-process logging, the stats stream, the launcher's console (progress bar, start-up line,
closing report), verl Tracking, status.

Everything here reads a run directory or appends to its own stats/log files, and nothing here imports verl
or torch at module import. One thing here is needed for correctness: `logs.watch_parent`, every child's
orphan guard (a child exits when the launcher or node runner that started it is gone).
"""
