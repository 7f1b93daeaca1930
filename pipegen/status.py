"""`python -m pipegen.status DIR [--json | --verify | --follow]` (`pipegen status`, `pipegen verify`): a snapshot of
any run (the code lives in pipegen.observe.run_status)."""

import sys

from pipegen.observe.run_status import main

if __name__ == "__main__":
    sys.exit(main())
