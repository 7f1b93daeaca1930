"""`python -m pipegen COMMAND [ARGS]`: the `pipegen` command (pipegen/command.py), for an environment without
its script on the PATH."""

import sys

from pipegen.command import main

sys.exit(main())
