"""`python -m pipegen.status DIR [--json]`: a snapshot of any run (the code lives in pipegen.observe.run_status)."""

import sys

from pipegen.observe.run_status import main

if __name__ == "__main__":
    sys.exit(main())
