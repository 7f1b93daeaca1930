"""`python -m pipegen.rescore DIR ...`: the same command as `pipegen rescore` (command.py)."""

import sys

from pipegen.rescore.rescore_run import main

if __name__ == "__main__":
    sys.exit(main())
