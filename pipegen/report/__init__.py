"""`python -m pipegen.report DIR`: a run's report, `DIR/report.html` (self-contained: plots embedded, no
network) and `DIR/report.json` (the same numbers), for a finished run or one in progress. The launcher writes
it at the end of every run (generation.report=false turns that off).

- `numbers.py`: what the report says, read through the run's existing readers (with the best and worst answers,
  a dict reward's extra keys, and which reward scored the rows);
- `estimators.py`: the statistics (prompt-clustered bootstrap, unbiased pass@k, share at the limit, percentiles);
- `plots.py`: matplotlib figures as base64 PNG; `page.py`: the HTML page;
- `write.py`: `write_report(run)`, the command line (`main`) and the launcher's last step (`end_of_run`).

Owns: the run report. Must never: change the run it reports on (it writes report.html and report.json only),
or import a role.
"""

from pipegen.report.write import end_of_run, main, write_report

__all__ = ["end_of_run", "main", "write_report"]
