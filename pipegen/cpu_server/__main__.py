"""``python -m pipegen.cpu_server``: run the CPU reference server (flags: ``--help``)."""

import sys

from pipegen.cpu_server.cli import main

sys.exit(main())
