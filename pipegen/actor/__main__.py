"""`python -m pipegen.actor output_dir=DIR rank=K`: one actor process (started by the launcher)."""

import sys

from pipegen.actor.worker import main

sys.exit(main())
