"""Seeing a run: per-process logging, the stats stream, the launcher's progress bar, verl Tracking, status.

Everything here reads a run directory or appends to its own stats/log files; nothing here is needed
for correctness, and nothing here imports verl or torch at module import.
"""
