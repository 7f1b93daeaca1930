"""`python -m pipegen.status DIR [--json]`: a snapshot of any run (the code lives in pipegen.observe.status)."""

import sys

from pipegen.observe.status import main

if __name__ == "__main__":
    sys.exit(main())
